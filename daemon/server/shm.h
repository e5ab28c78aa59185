/*
 * shm.h - a connection's shared-memory region (docs/protocol.md "Shared
 * memory"): a memfd the client passes once with SCM_RIGHTS, checked and
 * mapped here, and the output area a scan or grad names in it.  Loop
 * thread, except shm_place (pool thread, touches only its arguments).
 */
#ifndef TORCHLOOP_SHM_H
#define TORCHLOOP_SHM_H

#include "daemon.h"

/*
 * Checks fd (a memfd: regular, sealable, F_SEAL_SHRINK set, no write seal,
 * not hugetlb, open read-write, at least size bytes) and the daemon's caps,
 * then maps size bytes shared into out.  Always closes fd.  Returns 0, or
 * -1 with err (SHM_BAD_FD, SHM_NOT_SEALED, SHM_UNDERSIZED, SHM_TOO_LARGE,
 * INVALID_ARGUMENT).
 */
int shm_attach(struct daemon *d, int fd, int64_t size, struct tree_region *out,
               struct proto_err *err);
void shm_detach(struct daemon *d, struct tree_region *r);

/*
 * Reads the optional `out` field of req: needs a region, an aligned offset,
 * offset + size within the region, and no overlap with any tensor of the
 * request's trees that lies in the region.  Returns 0 or -1 with err.
 */
int shm_out_decode(struct request *req, struct shm_out *out, struct proto_err *err);

#endif

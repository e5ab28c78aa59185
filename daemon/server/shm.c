/*
 * shm.c - shared-memory regions of connections.  A region is the client's
 * own memfd: the client can only pass memory it holds, and only read-write
 * memfds sealed against shrinking are mapped, so a client cannot make the
 * daemon fault (SIGBUS) by truncating it.  A region belongs to exactly one
 * connection; references of another connection never resolve into it.
 */
#include "shm.h"

#include "log.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#ifndef HUGETLBFS_MAGIC
#define HUGETLBFS_MAGIC 0x958458f6
#endif
#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

static const char *fd_kind(mode_t m)
{
	return S_ISSOCK(m)   ? "a socket"
	       : S_ISFIFO(m) ? "a pipe"
	       : S_ISDIR(m)  ? "a directory"
	       : S_ISCHR(m)  ? "a character device"
	                     : "not a regular file";
}

static int check_fd(int fd, uint64_t size, struct proto_err *err)
{
	struct stat st;
	struct statfs sf;
	char link[64], target[256];
	ssize_t n;
	int seals, fl;

	if (fstat(fd, &st) != 0)
		return proto_fail(err, PROTO_E_SHM_BAD_FD, NULL, "fstat: %s", strerror(errno));
	if (!S_ISREG(st.st_mode))
		return proto_fail(err, PROTO_E_SHM_BAD_FD, NULL,
		                  "the descriptor is %s; attach takes a memfd (memfd_create)",
		                  fd_kind(st.st_mode));
	/* a file on disk or on tmpfs is not private memory: only memfds */
	snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
	n = readlink(link, target, sizeof target - 1);
	target[n > 0 ? n : 0] = '\0';
	if (strncmp(target, "/memfd:", 7) != 0)
		return proto_fail(err, PROTO_E_SHM_BAD_FD, NULL,
		                  "the descriptor is a file (%.200s), not a memfd; create the "
		                  "region with memfd_create(MFD_ALLOW_SEALING)",
		                  n > 0 ? target : "?");
	seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0)
		return proto_fail(err, PROTO_E_SHM_BAD_FD, NULL,
		                  "the memfd takes no seals (%s); create it with "
		                  "MFD_ALLOW_SEALING",
		                  strerror(errno));
	if (fstatfs(fd, &sf) == 0 && (unsigned long)sf.f_type == HUGETLBFS_MAGIC)
		return proto_fail(err, PROTO_E_SHM_BAD_FD, NULL,
		                  "hugetlb memfds are refused (a fault past the pool would "
		                  "SIGBUS the daemon)");
	if (!(seals & F_SEAL_SHRINK))
		return proto_fail(err, PROTO_E_SHM_NOT_SEALED, NULL,
		                  "the memfd is not sealed with F_SEAL_SHRINK (seals 0x%x): it "
		                  "could be truncated under the daemon",
		                  (unsigned)seals);
	if (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE))
		return proto_fail(err, PROTO_E_SHM_BAD_FD, NULL,
		                  "the memfd is sealed against writes (seals 0x%x); the daemon "
		                  "writes results into it",
		                  (unsigned)seals);
	fl = fcntl(fd, F_GETFL);
	if (fl < 0 || (fl & O_ACCMODE) != O_RDWR)
		return proto_fail(err, PROTO_E_SHM_BAD_FD, NULL,
		                  "the descriptor is not open read-write");
	if ((uint64_t)st.st_size < size)
		return proto_fail(err, PROTO_E_SHM_UNDERSIZED, NULL,
		                  "the memfd has %lld bytes, attach asks for %llu",
		                  (long long)st.st_size, (unsigned long long)size);
	return 0;
}

int shm_attach(struct daemon *d, int fd, int64_t size, struct tree_region *out,
               struct proto_err *err)
{
	void *p;
	int rc = -1;

	if (size <= 0)
		proto_fail(err, PROTO_E_INVALID_ARGUMENT, "size", "size must be positive");
	else if (size > d->cfg.max_shm)
		proto_fail(err, PROTO_E_SHM_TOO_LARGE, "size",
		           "a region of %lld bytes is over max-shm=%lld", (long long)size,
		           d->cfg.max_shm);
	else if (d->shm_bytes + (uint64_t)size > (uint64_t)d->cfg.max_shm_total)
		proto_fail(err, PROTO_E_SHM_TOO_LARGE, "size",
		           "%llu bytes are attached already; %lld more is over max-shm-total=%lld",
		           (unsigned long long)d->shm_bytes, (long long)size, d->cfg.max_shm_total);
	else if (check_fd(fd, (uint64_t)size, err) == 0) {
		p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (p == MAP_FAILED) {
			proto_fail(err, PROTO_E_SHM_BAD_FD, NULL, "mmap: %s", strerror(errno));
		} else {
			out->base = p;
			out->size = (uint64_t)size;
			d->shm_bytes += (uint64_t)size;
			d->shm_regions++;
			d->stats.shm_attaches++;
			rc = 0;
		}
	}
	close(fd);
	return rc;
}

void shm_detach(struct daemon *d, struct tree_region *r)
{
	if (r->base == NULL)
		return;
	munmap(r->base, r->size);
	d->shm_bytes -= r->size;
	d->shm_regions--;
	r->base = NULL;
	r->size = 0;
}

/* ---- the output area ---------------------------------------------------- */

/* Finds the first tensor of the request that lies in [lo, hi) of the region. */
struct overlap_find {
	const struct tree_region *r;
	uint64_t lo, hi;
	char path[PROTO_PATH_MAX];
};

static int overlap_visit(const struct tree_node *leaf, const char *path, void *arg)
{
	struct overlap_find *f = arg;
	const uint8_t *p = leaf->tensor.data;
	uint64_t lo;

	if (leaf->tensor.nbytes == 0 || p < f->r->base || p >= f->r->base + f->r->size)
		return 0;
	lo = (uint64_t)(p - f->r->base);
	if (!(lo < f->hi && f->lo < lo + leaf->tensor.nbytes))
		return 0;
	tree_path_root(f->path, sizeof f->path, path);
	return 1;
}

static int get_u64(const msgpack_object *map, const char *key, bool required, uint64_t *v,
                   struct proto_err *err)
{
	int64_t x;
	int rc = msg_get_i64(map, key, &x, err);
	char path[32];

	if (rc < 0)
		return -1;
	snprintf(path, sizeof path, "out.%s", key);
	if (rc > 0)
		return required ? proto_fail(err, PROTO_E_INVALID_ARGUMENT, path,
		                             "out needs %s (bytes)", key)
		                : 0;
	if (x < 0)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, path, "%s must be >= 0", path);
	*v = (uint64_t)x;
	return 0;
}

int shm_out_decode(struct request *req, struct shm_out *out, struct proto_err *err)
{
	const msgpack_object *o = msg_field(&req->msg, "out");
	const struct tree_region *r = &req->conn->region;
	const struct tree_node *trees[] = {&req->carry, &req->inputs, &req->cot_carry,
	                                   &req->cot_outputs, &req->saved};
	struct overlap_find f;

	memset(out, 0, sizeof *out);
	if (o == NULL || o->type == MSGPACK_OBJECT_NIL)
		return 0;
	if (o->type != MSGPACK_OBJECT_MAP)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "out",
		                  "out must be a map {offset, size, min_bytes}");
	if (get_u64(o, "offset", true, &out->offset, err) != 0 ||
	    get_u64(o, "size", true, &out->size, err) != 0 ||
	    get_u64(o, "min_bytes", false, &out->min_bytes, err) != 0)
		return -1;
	if (r->base == NULL)
		return proto_fail(err, PROTO_E_SHM_NOT_ATTACHED, "out",
		                  "out names an area in shared memory, but no region is attached "
		                  "to this connection");
	if (out->offset > r->size || out->size > r->size - out->offset)
		return proto_fail(err, PROTO_E_SHM_OUT_OF_BOUNDS, "out",
		                  "out area [%llu, +%llu) lies outside the region of %llu bytes",
		                  (unsigned long long)out->offset, (unsigned long long)out->size,
		                  (unsigned long long)r->size);
	if (out->offset % PROTO_TENSOR_ALIGN != 0)
		return proto_fail(err, PROTO_E_SHM_MISALIGNED, "out",
		                  "out offset %llu is not a multiple of 64",
		                  (unsigned long long)out->offset);
	f.r = r;
	f.lo = out->offset;
	f.hi = out->offset + out->size;
	for (size_t i = 0; i < sizeof trees / sizeof trees[0]; i++) {
		static const char *const roots[] = {"carry", "inputs", "cot_carry", "cot_outputs",
		                                    "saved"};
		if (out->size && tree_visit(trees[i], roots[i], 0, overlap_visit, &f) != 0)
			return proto_fail(err, PROTO_E_SHM_OVERLAP, f.path,
			                  "out area [%llu, +%llu) overlaps %s, which the request "
			                  "reads from the region",
			                  (unsigned long long)out->offset,
			                  (unsigned long long)out->size, f.path);
	}
	out->set = true;
	out->base = r->base + out->offset;
	return 0;
}

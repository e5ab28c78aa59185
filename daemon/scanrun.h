/*
 * scanrun.h - validation, execution and replies shared by the scan, grad
 * and compile ops (scanrun.c).  Loop thread, except the pool work inside.
 */
#ifndef TORCHLOOP_SCANRUN_H
#define TORCHLOOP_SCANRUN_H

#include "daemon.h"

/*
 * Checks carry and inputs against the adapter's bounds and DESIGN.md's
 * contract; fills args (dtype, steps).  Errors name the leaf path.
 */
int scan_validate(const struct adapter *a, const struct tree_node *carry,
                  const struct tree_node *inputs, struct scan_args *args, struct proto_err *err);

/* Reads `adapter`, `carry` and `inputs`; sets req->adapter (a reference). */
int scan_decode(struct request *req, struct adapter **a, struct tree_node *carry,
                struct tree_node *inputs, struct proto_err *err);

/*
 * A run of a READY specialization for req; inputs are added in graph order.
 * NULL with err: out of memory, or (symbolic batch) stacked outputs over
 * max_elements at the request's batch size.
 */
struct run_job;
struct run_job *run_job_new(struct request *req, struct specialization *sp, struct proto_err *err);
void run_job_add(struct run_job *j, const struct tree_node *tree);
struct engine_tensor *run_job_slots(struct run_job *j, size_t *n);
/* Hands the job a buffer to free with it (zero cotangents). */
void run_job_own(struct run_job *j, void *buf);
void run_job_set_count(struct run_job *j, size_t n);
void run_job_start(struct run_job *j);
/* Fails the request and frees the job (nothing ran). */
void run_job_abort(struct run_job *j, const struct proto_err *err);

#endif

/*
 * op_scan.h - validation, execution and replies the scan, grad and compile
 * ops share (op_scan.c).  Loop thread, except the pool work inside.
 */
#ifndef TORCHLOOP_OP_SCAN_H
#define TORCHLOOP_OP_SCAN_H

#include "daemon.h"
#include "graphs.h"

/*
 * Checks carry and inputs against the adapter's bounds and DESIGN.md's
 * contract; fills args (dtype, steps).  Errors name the leaf path; with
 * params, carry is the pair (carry, params) and paths say which.
 */
int op_scan_validate(const struct adapter *a, const struct tree_node *carry, bool params,
                     const struct tree_node *inputs, struct scan_args *args, struct proto_err *err);

/* Reads `adapter`, `carry`, `inputs` and `params` (optional: then carry is
 * the pair (carry, params) and req->params is set); sets req->adapter (a
 * reference). */
int op_scan_decode(struct request *req, struct adapter **a, struct tree_node *carry,
                   struct tree_node *inputs, struct proto_err *err);

/* A saved kind (scan's save, grad's saved) is the unrolled loop's at static
 * shapes: INVALID_ARGUMENT at path for an adapter of another strategy or
 * dynamic = batch. */
int op_scan_saving(const struct adapter *a, enum spec_kind kind, const char *path,
                   struct proto_err *err);

/* `wrt` (optional, saved kinds only): one '0' or '1' per tensor leaf of the
 * graph's carry (with params) then inputs; a gradient marked '0' is not
 * computed (zeros come back).  Sets args->wrt (NULL: every leaf). */
int op_scan_wrt(struct request *req, struct scan_args *args, struct proto_err *err);

/* first becomes the tuple (first, second), its nodes in req's zone. */
int op_scan_pair(struct request *req, struct tree_node *first, const struct tree_node *second,
                 struct proto_err *err);

/*
 * strategy = chunk: a scan (not a grad) of T > PROTO_CHUNK_STEPS steps, T a
 * multiple of it, asks for the graph of PROTO_CHUNK_STEPS steps instead
 * (args now say so) and runs it T / PROTO_CHUNK_STEPS times (req->chunks).
 * Anything else is left as it is.
 */
int op_scan_chunk(struct request *req, const struct adapter *a, struct scan_args *args,
                  struct proto_err *err);

/*
 * A run of a READY specialization for req, at its batch size, its results
 * into its shared-memory area if it named one.  NULL with err: out of memory,
 * or (symbolic batch) stacked outputs over max_elements at that batch size.
 * The request's carry and inputs are its first inputs; more (a grad's cotangents)
 * are added with run_add / run_slots (graphs.h); op_scan_start submits
 * it and replies to req with its results or its error; a job that cannot be
 * started is freed with run_free.
 */
struct run_job *op_scan_new(struct request *req, struct specialization *sp, struct proto_err *err);
void op_scan_start(struct run_job *j, struct request *req);

#endif

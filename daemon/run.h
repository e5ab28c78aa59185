/*
 * run.h - the graph layer's runs: one READY specialization run on its inputs,
 * on the thread pool (or, for µs-scale graphs, right on the loop), its
 * results handed to a callback.  Nothing here knows which request or
 * connection asked.  See run.c.  Loop thread, except the run itself.
 */
#ifndef TORCHLOOP_RUN_H
#define TORCHLOOP_RUN_H

#include "engine.h"
#include "protocol.h"
#include "tree.h"

#include <stddef.h>
#include <stdint.h>

struct daemon;
struct specialization;
struct run_job;

/* Memory the results may be written into (a client's shared-memory area);
 * base NULL: the engine allocates them. */
struct run_area {
	uint8_t *base;
	uint64_t size;
};

/* On the loop, once the run is over.  The job is freed when it returns: keep
 * the results with run_take_result. */
typedef void run_done_fn(struct run_job *j, void *arg);

/*
 * A run of sp (referenced until the job is freed) at this batch size (a
 * symbolic-batch graph; 0 otherwise).  NULL with err: out of memory, or
 * stacked outputs over max_elements at that batch size.
 */
struct run_job *run_new(struct daemon *d, struct specialization *sp, int64_t batch,
                        const struct run_area *area, struct proto_err *err);
/* strategy = chunk: the scan is `chunks` runs of sp's graph, its inputs
 * chunks * sp's steps long (checked against max_elements here). */
int run_set_chunks(struct run_job *j, int64_t chunks, struct proto_err *err);
/* Inputs, in graph order: a tree's leaves, or slots filled by the caller. */
void run_add(struct run_job *j, const struct tree_node *tree);
struct engine_tensor *run_slots(struct run_job *j, size_t *n);
void run_set_count(struct run_job *j, size_t n);
/* Hands the job a buffer to free with it (zero cotangents). */
void run_own(struct run_job *j, void *buf);
/* Starts it; done runs exactly once (maybe before this returns). */
void run_submit(struct run_job *j, run_done_fn *done, void *arg);
/* A job that was never submitted. */
void run_free(struct run_job *j);

/* In done: NULL when the graph ran, else why not. */
const struct proto_err *run_error(const struct run_job *j);
struct specialization *run_spec(const struct run_job *j);
const struct engine_result *run_result(const struct run_job *j);
/* Each result's offset in the area, or NULL when they were not written
 * there; *needed: the bytes the area would need for all of them. */
const uint64_t *run_placed(const struct run_job *j, uint64_t *needed);
/* The results, now the caller's (free with run_result_free). */
struct engine_result *run_take_result(struct run_job *j);
void run_result_free(void *res);

#endif

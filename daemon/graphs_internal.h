/*
 * graphs_internal.h - what the graph layer's own files share (graphs.c: a
 * specialization's lookup, compile and load; upgrade.c: the quick tier's
 * upgrade; graphs_index.c: the warm-start index).  Nothing outside the
 * layer includes it: its callers see graphs.h.
 */
#ifndef TORCHLOOP_GRAPHS_INTERNAL_H
#define TORCHLOOP_GRAPHS_INTERNAL_H

#include "graphs.h"

/* A lookup of one key in the cache, then its compile and load when missing. */
struct load_job {
	uv_work_t work;
	struct graphs *g;
	struct specialization *sp;
	bool need_compile, hit, lock_busy;
	double lock_wait_started, compile_seconds;
	bool prewarm; /* load only; a miss is not compiled */
	void (*prewarmed)(struct graphs *g);
	bool quick;                  /* for the quick tier's key (the scan op's graph) */
	bool upgrade;                /* builds the upgrade of a READY quick specialization */
	char key[CACHE_KEY_HEX];     /* the key this job looks up and commits */
	char strategy[24];           /* the worker's strategy for it ("" : the adapter's) */
	struct engine_graph *graph;  /* upgrade: loaded here, swapped in on the loop */
	char lowered[16], note[256]; /* the cache entry's or compile's, published on the loop */
	uint32_t step_ops;           /* likewise */
	int quarantined;
	int rc;
	struct proto_err err;
	struct compile_result res; /* after a compile: owned copy of the y spec */
	struct compile_job job;
	/* the first request's own inputs (signature_sample), for the parity check
	 * of this job's compile and of its upgrade; NULL: random inputs */
	uint8_t *sample;
	size_t sample_len;
};

/* graphs.c */
/* Looks key (NULL: sp's own) up on the pool; j's owner is then after_load. */
void start_lookup(struct graphs *g, struct specialization *sp, struct load_job *j, const char *key);
void key_for(struct graphs *g, const struct specialization *sp, const char *strategy,
             char key[CACHE_KEY_HEX]);
int prepare_compile(struct load_job *j, struct proto_err *err);
void free_job(struct load_job *j);
void spec_unlock(struct specialization *sp);
struct specialization *spec_new(struct graphs *g, struct adapter *a, const struct scan_args *args,
                                const char *sig);

/* upgrade.c: the policy, which never calls back here (tests/python/test_layers.py) */
/* The unrolled graph is worth a quick tier: long, not cached, one batch size. */
bool tier_applies(const struct graphs *g, const struct specialization *sp);
/* sp's quick graph serves: fills sp->upgrade's plan; false when there is no upgrade. */
bool upgrade_plan(const struct graphs *g, struct specialization *sp);
/* The upgrade j loaded serves from now on, on trial beside the quick graph. */
void upgrade_take_over(struct load_job *j);
/* The upgrade failed: logged, and in sp's note. */
void upgrade_failed(struct specialization *sp, const struct proto_err *err);

/* graphs_index.c: the warm-start index, which never calls back here */
/* One specialization the index lists. */
struct prewarm_rec {
	enum spec_kind kind;
	enum proto_dtype dtype;
	struct tree_node carry, inputs;
};
/* Pool: appends sp to its adapter's index. */
void index_append(struct graphs *g, struct specialization *sp);
/* Reads a's index at start-up: at most max records (shapes in zone). */
int index_read(struct graphs *g, struct adapter *a, msgpack_zone *zone, struct prewarm_rec *recs,
               int max);

#endif

/*
 * graphs_internal.h - what the graph layer's own files share (graphs.c:
 * specializations created; specs.c: their life; coldpath.c and
 * coldpath_pool.c: the cold path's state machine; upgrade.c: the quick
 * tier's upgrade policy; graphs_index.c: the warm-start index).  Nothing outside the
 * layer includes it: its callers see graphs.h.
 */
#ifndef TORCHLOOP_GRAPHS_INTERNAL_H
#define TORCHLOOP_GRAPHS_INTERNAL_H

#include "graphs.h"

/* The cold path's stages (coldpath.c's table; docs/architecture.md). */
enum load_stage {
	STAGE_LOOKUP,     /* pool: cache lookup, flock tried, dlopen on a hit */
	STAGE_LOCK_WAIT,  /* loop timer: another holder compiles this key */
	STAGE_REMOTE,     /* loop: the remote tier's blob of the key (--remote-cache) */
	STAGE_LEASE,      /* loop: the remote tier's compile lease of the key */
	STAGE_LEASE_WAIT, /* loop timer: another node compiles this key */
	STAGE_COMPILE,    /* the worker builds it */
	STAGE_COMMIT,     /* pool: commit to the cache (a fetched blob verified first), dlopen */
	STAGES
};

/* What a job is for. */
enum load_purpose {
	LOAD_REQUEST, /* requests wait on the specialization */
	LOAD_PREWARM, /* start-up: load only; a miss is not compiled unless requests joined */
	LOAD_UPGRADE, /* builds the upgrade of a READY quick specialization */
};

/* A lookup of one key in the cache, then its compile and load when missing. */
struct load_job {
	uv_work_t work;
	struct graphs *g;
	struct specialization *sp;
	enum load_stage stage;
	enum load_purpose purpose;
	bool quick;          /* for the quick tier's key (the scan op's graph) */
	bool hit, lock_busy; /* what LOOKUP found (neither: a miss) */
	double lock_wait_started, compile_seconds;
	void (*prewarmed)(struct graphs *g); /* LOAD_PREWARM: called once, when it is over */
	char key[CACHE_KEY_HEX];             /* the key this job looks up and commits */
	char strategy[24];                   /* the worker's strategy for it ("" : the adapter's) */
	struct engine_graph *graph;          /* upgrade: loaded here, swapped in on the loop */
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
	/* the remote tier: a fetched blob (COMMIT verifies it; refusal says why
	 * not), the sealed blob to publish after a compile's COMMIT, the lease */
	uint8_t *blob, *publish;
	size_t blob_len, publish_len;
	enum remote_refusal refusal;
	bool publish_skipped, leased;
	struct remote_keeper *renewal; /* while the lease is ours and the worker builds */
	double lease_wait_started;
	char strategy_done[16]; /* a fetched blob's strategy, for the cache metadata */
};

/* coldpath.c: the state machine */
/* Starts j at LOOKUP of key (NULL: sp's own); j is coldpath.c's from then on. */
void start_lookup(struct graphs *g, struct specialization *sp, struct load_job *j, const char *key);

/* coldpath_pool.c: the stages' pool work, which never calls back into coldpath.c */
void lookup_work(uv_work_t *w);
void commit_work(uv_work_t *w);

/* specs.c: a specialization's life, below the cold path and graphs.c */
struct specialization *spec_new(struct graphs *g, struct adapter *a, const struct scan_args *args,
                                const char *sig);
/* The cache key of sp's graph lowered with this strategy. */
void spec_key(struct graphs *g, const struct specialization *sp, const char *strategy,
              char key[CACHE_KEY_HEX]);
/* Lets go of (and removes) the key's lock file, if sp holds it. */
void spec_unlock(struct specialization *sp);
/* Counts against the adapter's recompilation budget (not FAILED). */
bool spec_counts(const struct specialization *sp);
/* Off its adapter's list (and the budget), one reference dropped. */
void spec_unlist(struct specialization *sp);
void spec_add_waiter(struct specialization *sp, struct graph_waiter *w);
/* A compile starts: tell every waiter, then every 2 s. */
void spec_start_progress(struct graphs *g, struct specialization *sp);
/* The ends: the waiters get the graph, or the error (remembered unless transient). */
void spec_ready(struct graphs *g, struct specialization *sp);
/* Moves sp to state s, asserting the move is one of specs.c's SPEC_NEXT. */
void spec_set_state(struct specialization *sp, enum spec_state s);
void spec_failed(struct graphs *g, struct specialization *sp, const struct proto_err *err);
/* The largest batch size whose leaves stay within max_elements (sizes at 1). */
int64_t spec_max_batch(const struct specialization *sp);
/* The worker died compiling a's body: the second time, err is the refusal
 * remembered against the adapter until it is registered again. */
void spec_note_worker_crash(struct adapter *a, struct proto_err *err);
/* Stacked outputs over max_elements at batch size 1 (err filled). */
bool spec_outputs_too_large(struct specialization *sp, struct proto_err *err);

/* upgrade.c: the policy, which never calls back here (tests/python/test_layers.py) */
/* The unrolled graph is worth a quick tier: long, not cached, one batch size. */
bool tier_applies(const struct graphs *g, const struct specialization *sp);
/* A quick tier's compile failed in a way the unrolled loop may not. */
bool tier_lowering_failed(const struct proto_err *e);
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
	const char *wrt; /* in the zone, or NULL */
};
/* Pool: appends sp to its adapter's index. */
void index_append(struct graphs *g, struct specialization *sp);
/* Reads a's index at start-up: at most max records (shapes in zone). */
int index_read(struct graphs *g, struct adapter *a, msgpack_zone *zone, struct prewarm_rec *recs,
               int max);

#endif

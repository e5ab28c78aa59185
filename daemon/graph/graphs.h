/*
 * graphs.h - the graph layer, its one header: adapters (adapter.c), their
 * specializations (signature -> compiled graph, found or built once: single
 * flight, budget, cache, warm-start index; graphs.c) and runs of them
 * (run.c).  It knows its callers only by callbacks: a request of the server
 * layer, the start-up probe or a unit test wait and run the same way, and
 * nothing here sees a connection, a request or the daemon (the .c files
 * poison those names).  What it needs from around it is in struct graphs.
 *
 * Threads: the loop thread, except the pool jobs, which touch only their own
 * job and the fields documented at each.  Lifetimes are reference counts: an
 * adapter lives while the registry or a specialization holds it; a
 * specialization while its adapter lists it or a caller waits on or runs it.
 */
#ifndef TORCHLOOP_GRAPHS_H
#define TORCHLOOP_GRAPHS_H

#include "cache.h"
#include "compiler.h"
#include "remote.h"
#include "config.h"
#include "engine.h"
#include "protocol.h"
#include "runner.h"
#include "team.h"
#include "tree.h"

#include <assert.h>
#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

/* index_checks=flag: kernels' index checks set the artifact's fault flag
 * instead of throwing (worker index_guard.py); older artifacts are rebuilt */
#define AOTI_OPTIONS "use_consts_asm_build=0;package_constants_in_so=1;index_checks=flag"
#define LATENCY_RING 1024

#define ADAPTER_NAME_MAX 64

/* Where an adapter came from: a client's register, an --adapters file, or a
 * registration persisted in --state-dir and restored at start (persist.c). */
enum adapter_origin { ADAPTER_REGISTERED, ADAPTER_FILE, ADAPTER_RESTORED };

/*
 * The fields that define an adapter, in one table: registering a name again
 * with any of them different replaces the adapter (adapter_same_def), and a
 * captured graph's name hashes every one of them in this order
 * (adapter_graph_name; the Python package's _graph.IDENTITY_FIELDS mirrors
 * the wire keys, tests/python/test_limits.py compares them), so that nobody
 * can register another definition under the name of someone else's graph.
 * X(member of struct adapter_def, wire key, kind: STR, I64 or BOOL).
 */
#define ADAPTER_FIELDS(X)                                                                          \
	X(source, "body", STR)                                                                     \
	X(graph, "graph", BOOL)                                                                    \
	X(entry, "entry", STR)                                                                     \
	X(max_steps, "max_steps", I64)                                                             \
	X(max_elements, "max_elements", I64)                                                       \
	X(budget, "recompile_budget", I64)                                                         \
	X(strategy, "strategy", STR)                                                               \
	X(dynamic, "dynamic", STR)

/* A captured graph's name: "g." + 40 hex digits (adapter_graph_name). */
#define ADAPTER_GRAPH_NAME_LEN (2 + 40)

struct adapter_def {
	char name[ADAPTER_NAME_MAX + 1];
	char *source; /* owned */
	char body_file[512];
	char entry[128];
	char strategy[16];
	char dynamic[8]; /* "none", or "batch": one graph serves every batch size */
	int64_t max_steps, max_elements, budget;
	enum adapter_origin origin;
	bool graph;  /* source is a captured step graph (graph_loader.py), not Python */
	uid_t owner; /* who registered it (graphs: the per-uid cap counts these) */
};

struct adapter_stats {
	uint64_t requests, errors, compiles, cache_hits, cache_misses, runs;
	uint64_t failed_evictions; /* failed specializations forgotten (LRU) */
	/* runs clients made in their own processes (op_report.c), and the last
	 * report's run-time percentiles */
	uint64_t local_runs;
	double local_p50_us, local_p99_us;
	double compile_seconds;
	/* quick tiers' upgrades: built, skipped (upgrade.c: over the budget, or
	 * a lost trial of their kind), and their trials' verdicts */
	uint64_t upgrades_started, upgrades_skipped, upgrades_kept, upgrades_reverted;
	double latency_us[LATENCY_RING];
	uint64_t latency_n;
};

enum spec_state { SPEC_LOADING, SPEC_COMPILING, SPEC_READY, SPEC_FAILED };

/*
 * What a specialization's graph computes.  Everything that names, keys or
 * tells a kind apart reads spec_kinds (graphs.c).
 */
enum spec_kind {
	SPEC_SCAN,
	SPEC_GRAD,
	SPEC_GRAD_CHECKPOINT,
	SPEC_SCAN_SAVE,
	SPEC_GRAD_SAVED,
	SPEC_KINDS
};

/*
 * A graph's data inputs are the carry's and the inputs' leaves, then saved
 * (saved && grad), then the cotangents (grad: the final carry's, the stacked
 * outputs'); its results the final carry and the stacked outputs (results),
 * then saved (saved && !grad), then the gradients (grad: the carry's, the
 * inputs').  saved: one 1-D tensor of the request's dtype, of the
 * specialization's `saved` elements, that the forward of the pair keeps
 * for the backward (worker saved.py).
 */
struct spec_kind_info {
	const char *name; /* protocol (describe, compile's kind, the index): "scan", ... */
	const char *job;  /* the worker's job kind and the cache key's part: "forward", ... */
	bool grad;        /* a VJP graph: cotangents in, gradients out */
	bool results;     /* returns the final carry and the stacked outputs */
	bool saved;       /* one of the pair that hands saved from forward to backward */
	bool tiered;      /* the quick tier may serve it while the unrolled graph builds */
	bool blocks;      /* its upgrade may be blocks of unrolled steps (upgrade.c) */
	/* counts against the adapter's recompile budget: a saved pair's backward
	 * counts with its forward, as torch.compile's backward with its frame */
	bool budgeted;
};

extern const struct spec_kind_info spec_kinds[SPEC_KINDS];

/* The kind whose protocol name is s[0..n), or -1. */
int spec_kind_parse(const char *s, size_t n);

/*
 * A quick tier's upgrade (upgrade.c): what is built behind the scan op's
 * graph, within --upgrade-budget by estimate, and whether it stays -- the
 * two graphs take turns on the next runs and the upgrade is kept only when
 * it is faster by a margin.  Loop thread only.
 */
enum upgrade_verdict { UPGRADE_PENDING, UPGRADE_TRIAL, UPGRADE_KEPT, UPGRADE_REVERTED };
#define UPGRADE_TRIAL_RUNS 16

struct upgrade {
	bool planned;      /* the quick graph served and a plan was made */
	char plan[24];     /* "unroll", "block<K>", or "" (none: over the budget) */
	uint32_t step_ops; /* the quick graph's ATen calls a step (0: unknown) */
	double estimate_s; /* the plan's compile seconds, estimated (the unrolled one's if none) */
	enum upgrade_verdict verdict;
	double keep_ratio;             /* --upgrade-keep-percent / 100, when planned */
	char quick_key[CACHE_KEY_HEX]; /* the scan op's graph's cache key */
	double quick_seconds;          /* and its compile seconds */
	unsigned n[2];                 /* trial runs: [0] the quick graph's, [1] the upgrade's */
	double us[2][UPGRADE_TRIAL_RUNS];
	double median_us[2];
};

struct specialization {
	struct adapter *adapter; /* holds a reference */
	struct specialization *next;
	int refs;
	enum spec_state state;
	enum spec_kind kind;
	bool batch; /* one graph for every batch size: shapes hold SHAPES_BATCH */
	char key[CACHE_KEY_HEX];
	char *signature; /* in zone */
	msgpack_zone *zone;
	struct tree_node carry, inputs, y; /* specs (no data) */
	enum proto_dtype dtype;
	int64_t steps;
	/* a saved kind's saved tensor (the worker's, with y): its spec, and the
	 * key shared by the pair's two graphs, which a grad's saved_key names */
	struct tree_node saved;
	char pair_key[CACHE_KEY_HEX];
	const char *wrt; /* args' wrt: the end of signature (";wrt=" before it), or NULL */
	size_t n_in, n_out;
	struct engine_tensor *expected;     /* n_in, the compiled input signature */
	struct engine_tensor *expected_out; /* n_out, what the graph must return */
	uint64_t last_used;                 /* registry tick of the last lookup (LRU) */
	struct engine_graph *graph;
	/* whose recompile budget it spends (the uid whose request made it;
	 * SPEC_NO_UID: loaded at start-up from the warm-start index, nobody's) */
	uid_t uid;
	/*
	 * Quick tier (--quick-tier-steps): an unrolled graph not in the cache is
	 * served first by the scan op's graph (compiled in seconds, whatever T),
	 * while the unrolled one compiles in the background; then it takes over.
	 * Runs hold the graph they started with (run.c), so the replaced one is
	 * kept (retired) until the specialization goes.
	 */
	char graph_key[CACHE_KEY_HEX]; /* the cache key of graph */
	bool quick;                    /* graph is the quick tier's (the scan op) */
	bool upgrading;                /* the unrolled graph is being built */
	struct engine_graph *retired;
	struct upgrade upgrade;
	double compile_seconds;
	double compile_phases[COMPILE_PHASES]; /* this run's compile only (not from the cache) */
	char lowered[16], note[256];           /* compile_result's (or the cache entry's) */
	bool from_cache;
	uint64_t runs;           /* completed runs (loop thread only) */
	double run_ema_us;       /* their engine time, exponential moving average */
	struct team_choice team; /* OpenMP team for its runs (team.h); loop thread only */
	struct proto_err error;  /* SPEC_FAILED */
	struct graph_waiter *waiters;
	uv_timer_t *progress;
	double wait_started;
	int lock_fd;               /* the cache lock of key while it is built */
	const struct cache *cache; /* where that lock is */
};

/* A VJP graph: cotangents in, gradients out. */
static inline bool spec_grad(const struct specialization *sp)
{
	return spec_kinds[sp->kind].grad;
}

/* The uid of nobody's specializations (graphs_prewarm's). */
#define SPEC_NO_UID ((uid_t)-1)

/*
 * One uid's share of an adapter's recompile budget: each uid may hold up to
 * recompile_budget specializations of an adapter (those its requests made;
 * one another uid made is free to use), so no uid can spend another's.  At
 * most --max-uids-per-adapter uids besides the owner hold a share.
 */
struct budget_share {
	uid_t uid;
	unsigned used;
};

struct adapter {
	struct adapter_def def;
	char body_sha[CACHE_KEY_HEX];
	int refs;
	bool live; /* still the registered adapter of its name */
	struct adapter *next;
	struct specialization *specs;
	unsigned held; /* specializations counted against the budget, every uid's */
	/* held's split by uid (SPEC_NO_UID's not listed); used > 0 each */
	struct budget_share shares[CONFIG_MAX_UIDS_PER_ADAPTER + 1];
	unsigned n_shares;
	unsigned failed; /* FAILED specializations remembered (bounded, LRU) */
	/* compiles of this definition during which the worker died; at 2 the
	 * definition is refused (crash_err) until it is re-registered */
	unsigned worker_crashes;
	struct proto_err crash_err;
	struct adapter_stats stats;
	/* the last lost trial of an upgrade of each kind ([0] unroll, [1] blocks;
	 * "" none since one was kept): upgrade.c builds no more of that kind */
	char upgrade_lost[2][128];
	uint64_t generation;
	uint64_t last_found; /* registry tick of the last adapter_find (graph eviction) */
};

struct registry {
	struct adapter *head;
	unsigned count;
	uint64_t generation;
	uint64_t tick; /* specialization lookups, for LRU */
};

/*
 * The graph layer's surroundings, set by its owner (daemon.c, or a unit
 * test) before the first call; the pointers outlive the layer.
 */
struct graphs {
	uv_loop_t *loop;
	const struct config *cfg;
	struct cache *cache;
	struct compiler *compiler;
	struct remote *remote;        /* the remote tier (--remote-cache), or NULL */
	const char *worker_sha, *isa; /* parts of every cache key */
	struct registry reg;
	bool stopping; /* shutdown began: a busy key's lock is no longer waited for */
	/* counters for `stats` */
	uint64_t failed_evictions, inline_runs, runner_runs, contended_runs;
	/* runs with an OpenMP team (runner.h); not started: they go to the pool */
	struct runner runner;
};

/* ---- adapters (adapter.c) ----------------------------------------------- */

/* The reference adapter's checks and messages. */
int adapter_def_validate(struct adapter_def *def, struct proto_err *err);
void adapter_def_defaults(struct adapter_def *def);
/* Registers or replaces (taking def->source); *replaced: an old adapter was
 * dropped; *unchanged: the same definition was registered already. */
struct adapter *adapter_register(struct registry *r, struct adapter_def *def, bool *replaced,
                                 bool *unchanged);
/* The adapter named so (inline: every request looks one up). */
static inline struct adapter *adapter_find(struct registry *r, const char *name, size_t len)
{
	for (struct adapter *a = r->head; a; a = a->next)
		if (strlen(a->def.name) == len && memcmp(a->def.name, name, len) == 0) {
			a->last_found = ++r->tick;
			return a;
		}
	return NULL;
}
int adapter_unregister(struct registry *r, const char *name, size_t len);
/* Captured-graph adapters of owner; *lru: the least recently found one. */
unsigned adapter_count_graphs(struct registry *r, uid_t owner, struct adapter **lru);
void adapter_clear(struct registry *r);
/* Every ADAPTER_FIELDS field equal (registering it changes nothing). */
bool adapter_same_def(const struct adapter *a, const struct adapter_def *def);
/* Field i of ADAPTER_FIELDS of def as text (num: room for a number), or NULL
 * past the last field. */
const char *adapter_def_field(const struct adapter_def *def, int i, char num[24]);
/* The only name a non-admin may register def (a captured graph) under: "g."
 * + 40 hex digits of SHA-256 over its ADAPTER_FIELDS' texts joined by "\n"
 * (the source first; the others hold no "\n", so the join is unambiguous). */
void adapter_graph_name(const struct adapter_def *def, char out[ADAPTER_GRAPH_NAME_LEN + 1]);

/* dynamic = batch: one graph per signature serves every batch size. */
static inline bool adapter_batched(const struct adapter *a)
{
	return strcmp(a->def.dynamic, "batch") == 0;
}

/* (inline: graphs.c holds adapters and adapter.c drops graphs; neither file
 * calls the other back) */
static inline void adapter_ref(struct adapter *a)
{
	a->refs++;
}

static inline void adapter_unref(struct adapter *a)
{
	assert(a->refs > 0);
	if (--a->refs > 0)
		return;
	free(a->def.source);
	free(a);
}
/* uid's share of a's budget: the specializations it holds (0: none). */
unsigned adapter_budget_used(const struct adapter *a, uid_t uid);
void adapter_record_latency(struct adapter *a, double us);
double adapter_latency_percentile(const struct adapter *a, double p);

/* ---- specializations (graphs.c) ----------------------------------------- */

/* What a request asks to run: its trees, dtype, T, batch and kind. */
struct scan_args {
	const struct tree_node *carry, *inputs;
	enum proto_dtype dtype;
	int64_t steps;
	int64_t batch; /* dynamic = batch adapters: the request's batch size (>= 1); else 0 */
	enum spec_kind kind;
	/* a saved kind's `wrt`: '1' per leaf (carry's, params', inputs') whose
	 * gradient the graph computes, '0' where it is zero; NULL: every leaf */
	const char *wrt;
	/* who asks: a new specialization spends this uid's share of the budget */
	uid_t uid;
};

/*
 * One caller of graphs_acquire.  The caller owns it and keeps it alive until
 * done has been called (exactly once).  done gets the READY specialization
 * (referenced for the call) or, with sp NULL, why there is none.  event, if
 * set, hears "compiling" when a compile starts and "progress" every 2 s.
 */
struct graph_waiter {
	struct graph_waiter *next; /* the specialization's list (graphs.c) */
	void (*done)(struct graph_waiter *w, struct specialization *sp,
	             const struct proto_err *err);
	void (*event)(struct graph_waiter *w, const char *event, const struct specialization *sp,
	              double elapsed);
};

/* The layer's parts that are not adapters: the loop, the configuration, the
 * cache, the parts of every key; starts the OpenMP runner (its failure is
 * logged: runs then go to the pool).  The compiler is set when it starts. */
int graphs_open(struct graphs *g, uv_loop_t *loop, const struct config *cfg, struct cache *cache,
                const char *worker_sha, const char *isa);
/* At shutdown: no more runs with an OpenMP team (those in flight finish). */
void graphs_stop_runs(struct graphs *g);
/* Drops every adapter (and, with their last references, their graphs). */
void graphs_close(struct graphs *g);
/* Finds or starts the specialization of args for a; w->done runs when it can
 * run (maybe before this returns) or cannot. */
void graphs_acquire(struct graphs *g, struct adapter *a, const struct scan_args *args,
                    struct graph_waiter *w);
/* Frees a specialization its last reference let go (specs.c). */
void spec_free(struct specialization *sp);
/* (inline: a warm scan holds and lets go of its specialization) */
static inline void graphs_ref(struct specialization *sp)
{
	sp->refs++;
}

static inline void graphs_unref(struct specialization *sp)
{
	assert(sp->refs > 0);
	if (--sp->refs == 0)
		spec_free(sp);
}
void graphs_drop_all(struct adapter *a);
/*
 * Stacked outputs within max_elements at this batch size (the specialization's
 * own for a static one); -1 with TOO_MANY_ELEMENTS and the leaf's path.
 */
int graphs_check_outputs(const struct specialization *sp, int64_t batch, struct proto_err *err);
/* A READY graph proved wrong (outputs off its signature): drop it and
 * quarantine its cache entry, so the next request rebuilds it. */
void graphs_invalidate(struct graphs *g, struct specialization *sp, const char *why);
/* Loads a's specializations listed in the cache's index; done(g) per load. */
unsigned graphs_prewarm(struct graphs *g, struct adapter *a, void (*done)(struct graphs *g));
unsigned graphs_loaded(const struct graphs *g);
/* The warm-start index file of a's identity (name, body, bounds, strategy). */
void graphs_index_path(const struct graphs *g, const struct adapter *a, char *out, size_t size);

/* ---- a quick tier's upgrade (upgrade.c) --------------------------------- */

/* The graph a new run of sp uses: during the upgrade's trial, the quick and
 * the upgraded graph in turn (*arm 0 or 1); else sp's graph (*arm -1). */
struct engine_graph *upgrade_run_graph(struct specialization *sp, int *arm);
/* A run of arm took us (settled OpenMP team: trial < 0): the trial's data. */
void upgrade_run_measured(struct specialization *sp, int arm, int team_trial, double us);
const char *upgrade_verdict_name(enum upgrade_verdict v);

/* ---- runs (run.c) ---------------------------------------------------- */

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
struct run_job *run_new(struct graphs *g, struct specialization *sp, int64_t batch,
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

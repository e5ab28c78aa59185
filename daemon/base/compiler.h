/*
 * compiler.h - the compile service: Python compile workers in three lanes.
 *
 *   check       register-time checks (a body's import, a captured graph's
 *               validation): milliseconds to seconds.  One worker of its
 *               own, started on demand; an idle foreground worker takes a
 *               check first, so a registration never queues behind a compile.
 *   foreground  compiles a request waits for (first scans, grads, `compile`):
 *               --compile-workers of them (0: one per core, at most one per
 *               1.5 GiB of memory), the first started with the daemon, the
 *               others on demand.
 *   background  compiles nobody waits for (a quick tier's upgrade): one
 *               worker at nice +10, stopped (SIGSTOP to its whole process
 *               tree, its timeout paused) while any check or foreground job
 *               runs, continued when none does.
 *
 * Tenants: a job compiles one tenant's code -- 0, trusted (source bodies,
 * adapter files, what root or the daemon's uid registered), or the uid that
 * registered a captured graph -- and a worker runs the jobs of the one
 * tenant it was started for: a worker a hostile graph subverted never
 * touches another user's compile.  Each tenant's workers write an Inductor
 * cache of its own (<cache>/tenants/<uid>/inductor; the trusted ones the
 * daemon's) and read none of the others'.  A job whose tenant has no idle
 * worker takes a free slot, else replaces an idle worker of another tenant.
 *
 * Each lane is FIFO per tenant; a job goes to an idle worker of its lane and
 * tenant.  A worker
 * other than the first that stays idle for COMPILER_IDLE_S is retired (one
 * is ~1 GB).  Each job has a timeout that kills its worker's whole process
 * tree (proctree.c); a crash or timeout fails that job (WORKER_CRASHED /
 * COMPILE_TIMEOUT) and a new worker starts for the next one.  The timeout
 * runs from when the job's worker is ready (it has imported the compile
 * path: its "ready" event, after its hello or at its first job), never
 * while it imports; until then the start timeout bounds it (a job that came
 * to a worker not ready fails with WORKER_CRASHED, a worker with no hello is
 * a start failure).  A worker that dies before it says hello is restarted
 * with exponential backoff (0.25 s doubling to 30 s); while the first
 * worker cannot start, queued and new jobs fail at once with WORKER_CRASHED
 * and compiler_alive() is false (health: not ready).  Loop thread only.
 *
 * Workers get an allow-listed environment (compiler.c: PATH, HOME, locale,
 * TORCH*, OMP* and friends), never a client socket (everything is
 * close-on-exec), and die with the daemon (PR_SET_PDEATHSIG, set by the
 * worker itself against TORCHLOOPD_PID).  One process: wproc.c.
 */
#ifndef TORCHLOOP_COMPILER_H
#define TORCHLOOP_COMPILER_H

#include "protocol.h"
#include "sandbox.h"
#include "tree.h"

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#define COMPILE_PHASES 5
/* The worker's phase names, in order (torchloop_worker/compile.py compile_job). */
extern const char *const COMPILE_PHASE_NAMES[COMPILE_PHASES];

struct compile_result {
	char so_path[1024];
	uint8_t *y_spec; /* msgpack of the worker's output spec; owned by the result */
	size_t y_spec_len;
	uint32_t n_inputs, n_outputs;
	double compile_seconds;
	/* where the compile went (the worker's "phases"), seconds; 0 when unknown */
	double phases[COMPILE_PHASES];
	/* how the loop was lowered ("unroll", "scan"), and why it is not what the
	 * adapter's strategy asked for ("" when it is) */
	char lowered[16];
	char note[256];
	/* the step's ATen calls (a quick tier's upgrade plan estimates from it); 0: unknown */
	uint32_t step_ops;
};

struct compile_job;
typedef void (*compile_done_cb)(struct compile_job *job, const struct compile_result *res,
                                const struct proto_err *err);

struct compile_job {
	/* set by the submitter; borrowed until done runs */
	uint32_t tenant; /* whose code it compiles: 0 (trusted) or a uid (compiler_tenant) */
	bool check_only; /* register-time import check: body_source/file/entry only */
	bool background; /* queued behind every other job (a quick tier's upgrade) */
	bool graph;      /* body_source holds a captured graph: sent as body_graph */
	const char *body_source, *body_file, *entry, *strategy, *kind;
	const struct tree_node *carry, *inputs;
	enum proto_dtype dtype;
	int64_t steps;
	int64_t max_batch; /* dynamic = batch: the largest batch size (shapes mark it -1); else 0 */
	const char *wrt;   /* a saved kind's gradient mask (graphs.h scan_args), or NULL */
	/* the requesting scan's own inputs (signature_sample) for the parity
	 * check, or NULL: random ones */
	const uint8_t *sample;
	size_t sample_len;
	char output[1024];
	const char *key; /* the cache key it builds (compiler_promote), or NULL */
	compile_done_cb done;
	void *data;
	/* private */
	char staged[1024]; /* output, in the scratch of the worker that runs it */
	uint64_t id;
	struct compile_job *next;
	unsigned lane;
};

enum compiler_lane { LANE_CHECK, LANE_FOREGROUND, LANE_BACKGROUND, COMPILER_LANES };
extern const char *const COMPILER_LANE_NAMES[COMPILER_LANES];
#define COMPILER_IDLE_S          60
#define COMPILER_START_TIMEOUT_S 300

struct lane_stats {
	unsigned workers;   /* running (started or starting) */
	unsigned busy;      /* running a job */
	unsigned queued;    /* waiting for a worker */
	unsigned max;       /* workers it may have */
	bool paused;        /* background: stopped while foreground work runs */
	uint64_t jobs;      /* finished, either way */
	uint64_t preempted; /* background: times it was stopped */
	uint64_t promoted;  /* background: jobs a waiting request took over */
};

/* The worker protocol's version (daemon/worker/torchloop_worker/__init__.py
 * PROTOCOL): a worker that says another at hello fails the daemon's start. */
#define WORKER_PROTOCOL 1

struct worker_info {
	int64_t protocol; /* what the worker said at hello (0: nothing) */
	char torch[64];
	char torch_git[64];
	char isa[128]; /* what Inductor targets there (vector ISA, -march) */
	bool cxx11_abi;
	bool torch_ok;
};

struct compiler;

typedef void (*compiler_ready_cb)(struct compiler *c, const struct proto_err *err);

/*
 * Spawns the worker and says hello; ready runs once with err NULL when the
 * worker answered (info filled) or with the start-up error.
 */
struct compiler_opts {
	const char *python, *script;
	double timeout_seconds;
	unsigned foreground_workers; /* 0: compiler_default_workers() */
	/* extra NAME=value entries for the worker (target ISA), NULL-terminated */
	const char *const *env_extra;
	/* the workers' sandbox (sandbox.h), their scratch directories' parent
	 * (<cache>/tmp) and Inductor's cache directory (they may write there) */
	enum sandbox_mode sandbox;
	const char *scratch_root, *inductor_dir;
	/* what workers may not read (the daemon's cache, state, secrets, home;
	 * NULL-terminated, borrowed for the compiler's life); beneath them they
	 * still read the interpreter's prefix and the worker's package */
	const char *const *hide;
	/* seconds for a worker's hello, and for its readiness once it has a
	 * job (0: COMPILER_START_TIMEOUT_S) */
	double start_timeout_seconds;
};

struct compiler *compiler_start(uv_loop_t *loop, const struct compiler_opts *opts,
                                compiler_ready_cb ready, void *data);
void *compiler_data(const struct compiler *c);
const struct worker_info *compiler_info(const struct compiler *c);
bool compiler_alive(const struct compiler *c);
/* Jobs queued or running, every lane. */
unsigned compiler_queue_length(const struct compiler *c);
void compiler_lane_stats(const struct compiler *c, enum compiler_lane lane, struct lane_stats *out);
/* One per core, at most one per 1.5 GiB of (cgroup-constrained) memory, 1..16. */
unsigned compiler_default_workers(void);
uint64_t compiler_restarts(const struct compiler *c);
/* "ok", "starting" or "backoff" (the worker keeps dying before its hello). */
const char *compiler_state(const struct compiler *c);
/* Consecutive start failures (0 once a worker said hello). */
unsigned compiler_start_failures(const struct compiler *c);
/* Descendants killed because they outlived their worker or its timeout. */
uint64_t compiler_orphans_killed(const struct compiler *c);
/* Workers replaced after loading RECYCLE_AFTER artifacts (daemon/worker/compile_worker.py). */
uint64_t compiler_recycled(const struct compiler *c);
/* "landlock+seccomp", or "off (why)": health's and stats' "sandbox". */
const char *compiler_sandbox(const struct compiler *c);
/* The first foreground worker's pid (0 when none). */
pid_t compiler_pid(const struct compiler *c);

/* The tenant of code registered by uid: 0 for root and the daemon's own uid. */
uint32_t compiler_tenant(uid_t uid);
/* Queues a job in its lane (check_only, background, else foreground); its
 * done callback always runs exactly once (on the loop). */
void compiler_submit(struct compiler *c, struct compile_job *job);
/*
 * A request waits for key, which a background job builds (its cache lock is
 * held): the job moves to the foreground lane if queued, or if running is
 * no longer stopped for foreground work.  True if such a job was found.
 */
bool compiler_promote(struct compiler *c, const char *key);
/* Kills the worker and fails every job (SHUTTING_DOWN); frees after close. */
void compiler_stop(struct compiler *c);

#endif

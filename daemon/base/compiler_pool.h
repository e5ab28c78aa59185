/*
 * compiler_pool.h - the compile service's insides, shared by compiler.c
 * (lanes, dispatch, replies) and compiler_workers.c (starting, restarting,
 * retiring and stopping worker processes).  Nothing else includes it.
 */
#ifndef TORCHLOOP_COMPILER_POOL_H
#define TORCHLOOP_COMPILER_POOL_H

#include "compiler.h"
#include "sandbox.h"
#include "wproc.h"

#define BACKOFF_FIRST_MS 250
#define BACKOFF_MAX_MS   30000
#define REAP_POLL_MS     100
#define REAP_MAX         64
#define IDLE_POLL_MS     5000
#define LANE_SLOTS       16
#define LIVE_MAX         64
#define BACKGROUND_NICE  10

struct compiler;

struct slot {
	struct compiler *c;
	unsigned lane, index;
	struct wproc *p; /* its live worker, or NULL */
	uint32_t tenant; /* whose jobs it runs (compiler.h "Tenants"), set before pool_spawn */
	bool hello, paused;
	bool ready; /* its worker has imported the compile path ("ready" event) */
	struct compile_job *current;
	/* runs while its worker starts (no hello yet) or has a job: the start
	 * timeout until the worker is ready, then the job's compile timeout */
	uv_timer_t timer;
	uint64_t left_ms;    /* of that timeout, while paused */
	uint64_t idle_since; /* loop time of its last job's end */
	pid_t retired;       /* a worker retired for idleness: its exit is no restart */
	bool promoted;       /* its background job is waited for (compiler_promote) */
};

struct lane {
	struct compile_job *head, *tail;
	unsigned max;
	uint64_t jobs, preempted, promoted;
	struct slot slots[LANE_SLOTS];
};

/* The upper layer (compiler.c) as the lower one (compiler_workers.c)
 * reaches it: no call goes up by name, so the two files form no cycle. */
struct pool_hooks {
	void (*pump)(struct compiler *c);
	void (*reply)(struct wproc *p, const struct msg *m);
	void (*broken)(struct wproc *p, const char *why);
};

struct compiler {
	uv_loop_t *loop;
	struct pool_hooks hooks;
	struct lane lanes[COMPILER_LANES];
	uv_timer_t restart, reaper, idle;
	struct wproc_opts wopts;
	char python[1024], script[1024];
	char launcher[1024], scratch_root[1024], inductor_dir[1024];
	const char *write[2]; /* what workers may write besides their scratch */
	/* what they may not read, and what beneath it they may (sandbox_paths) */
	const char *hide[SANDBOX_MAX_PATHS / 2 + 1], *keep[5];
	char kept[4][1024];
	char sandbox[160];  /* compiler_sandbox */
	unsigned scratches; /* scratch directories made so far (their names) */
	double timeout, start_timeout;
	compiler_ready_cb ready;
	void *data;
	struct worker_info info;
	bool stopping;
	int open_handles;
	uint64_t next_id, restarts, orphans_killed, recycled;
	unsigned start_failures; /* workers in a row that died before their hello */
	char last_exit[160];     /* how the last of them ended, for error messages */
	pid_t orphans[REAP_MAX], live[LIVE_MAX];
	size_t n_orphans, n_live;
};

#define PRIMARY(c) (&(c)->lanes[LANE_FOREGROUND].slots[0])

/* what a tenant's worker gets instead of the trusted ones' (pool_tenant_opts) */
struct pool_tenant {
	char dir[1200], env[1240];
	const char *write[2], *hide[SANDBOX_MAX_PATHS / 2 + 2];
};

/* the sandbox and the tenants (compiler_sandbox.c) */
/* Whether workers run in the sandbox, their paths; -1: required but not to be had. */
int pool_sandbox_init(struct compiler *c, const struct compiler_opts *opts);
/* o for a worker of tenant (its Inductor cache made, in t); -1 (errno) if it cannot be. */
int pool_tenant_opts(struct compiler *c, uint32_t tenant, struct wproc_opts *o,
                     struct pool_tenant *t);

/* workers and slots (compiler_workers.c); nothing there calls compiler.c */
int pool_init(struct compiler *c, const struct compiler_opts *opts);
void pool_spawn(struct slot *s);
void pool_release(struct compiler *c);
void pool_fail_current(struct slot *s, enum proto_code code, unsigned flags, const char *why);
void pool_fail_queues(struct compiler *c, const struct proto_err *err);
void pool_start_failure_err(const struct compiler *c, struct proto_err *err);
/* Kills the slot's worker's whole tree and detaches it. */
void pool_kill_slot(struct slot *s);
/* The same for an idle worker no longer wanted: its exit is no restart. */
void pool_retire(struct slot *s);
/*
 * The slot's timer (struct slot): runs for ms, or, while the slot's worker is
 * paused, keeps ms for when it is continued.  It kills the worker; a worker
 * that had said hello fails its job (COMPILE_TIMEOUT once it was ready).
 */
void pool_arm(struct slot *s, uint64_t ms);
void pool_disarm(struct slot *s);
/* Milliseconds of the start timeout and of the compile timeout. */
uint64_t pool_start_ms(const struct compiler *c);
uint64_t pool_compile_ms(const struct compiler *c);

#endif

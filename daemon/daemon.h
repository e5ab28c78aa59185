/*
 * daemon.h - the daemon's shared types: the daemon itself, connections,
 * requests, adapters and their specializations, and the op table.
 *
 * Threads: everything here is touched on the loop thread only, except the
 * fields a thread-pool job owns while it runs (documented at each job).
 * Lifetimes are reference counts: a connection lives while its handle is
 * open or a request/write needs it; an adapter while the registry or a
 * specialization holds it; a specialization while its adapter lists it or a
 * request waits on or runs it.
 */
#ifndef TORCHLOOP_DAEMON_H
#define TORCHLOOP_DAEMON_H

#include "cache.h"
#include "compiler.h"
#include "config.h"
#include "engine.h"
#include "frame.h"
#include "graphs.h"
#include "msg.h"
#include "sigthread.h"
#include "tree.h"
#include "writer.h"

#include <stdbool.h>
#include <sys/types.h>
#include <uv.h>

#define AOTI_OPTIONS "use_consts_asm_build=0;package_constants_in_so=1"
#define LATENCY_RING 1024

/* ---- adapters --------------------------------------------------------- */

#define ADAPTER_NAME_MAX 64

/* Where an adapter came from: a client's register, an --adapters file, or a
 * registration persisted in --state-dir and restored at start (persist.c). */
enum adapter_origin { ADAPTER_REGISTERED, ADAPTER_FILE, ADAPTER_RESTORED };

struct adapter_def {
	char name[ADAPTER_NAME_MAX + 1];
	char *source; /* owned */
	char body_file[512];
	char entry[128];
	char strategy[16];
	char dynamic[8]; /* "none", or "batch": one graph serves every batch size */
	int64_t max_steps, max_elements, budget;
	enum adapter_origin origin;
};

struct adapter_stats {
	uint64_t requests, errors, compiles, cache_hits, cache_misses, runs;
	uint64_t failed_evictions; /* failed specializations forgotten (LRU) */
	double compile_seconds;
	double latency_us[LATENCY_RING];
	uint64_t latency_n;
};

enum spec_state { SPEC_LOADING, SPEC_COMPILING, SPEC_READY, SPEC_FAILED };

struct specialization {
	struct adapter *adapter; /* holds a reference */
	struct specialization *next;
	int refs;
	enum spec_state state;
	bool grad;  /* kind: forward ("scan") or vjp ("grad") */
	bool batch; /* one graph for every batch size: shapes hold SHAPES_BATCH */
	char key[CACHE_KEY_HEX];
	char *signature; /* in zone */
	msgpack_zone *zone;
	struct tree_node carry, inputs, y; /* specs (no data) */
	enum proto_dtype dtype;
	int64_t steps;
	size_t n_in, n_out;
	struct engine_tensor *expected;     /* n_in, the compiled input signature */
	struct engine_tensor *expected_out; /* n_out, what the graph must return */
	uint64_t last_used;                 /* registry tick of the last lookup (LRU) */
	struct engine_graph *graph;
	double compile_seconds;
	double compile_phases[COMPILE_PHASES]; /* this run's compile only (not from the cache) */
	char lowered[16], note[256];           /* compile_result's (or the cache entry's) */
	bool from_cache;
	uint64_t runs;     /* completed runs (loop thread only) */
	double run_ema_us; /* their engine time, exponential moving average */
	/* OpenMP team for its runs (scanrun.c): tried both ways on the first runs,
	 * then the faster kept; loop thread only */
	int omp_team; /* 0 while trying */
	unsigned omp_tries;
	double omp_best_us[2];  /* fastest run with a one-core share / all cores */
	struct proto_err error; /* SPEC_FAILED */
	struct graph_waiter *waiters;
	uv_timer_t *progress;
	double wait_started;
	int lock_fd;
};

struct adapter {
	struct adapter_def def;
	char body_sha[CACHE_KEY_HEX];
	int refs;
	bool live; /* still the registered adapter of its name */
	struct adapter *next;
	struct specialization *specs;
	unsigned held;   /* specializations counted against the budget */
	unsigned failed; /* FAILED specializations remembered (bounded, LRU) */
	/* compiles of this definition during which the worker died; at 2 the
	 * definition is refused (crash_err) until it is re-registered */
	unsigned worker_crashes;
	struct proto_err crash_err;
	struct adapter_stats stats;
	uint64_t generation;
};

struct registry {
	struct adapter *head;
	unsigned count;
	uint64_t generation;
	uint64_t tick; /* specialization lookups, for LRU */
};

/* ---- connections and requests ----------------------------------------- */

/* One read(2) takes a header and a small body (or several pipelined frames);
 * bodies larger than this are read in place, without a copy. */
#define CONN_STAGE 16384

struct conn {
	uv_pipe_t handle;
	struct daemon *d;
	struct frame_reader reader;
	uint8_t stage[CONN_STAGE];     /* small frames arrive here, several per read */
	uint32_t stage_off, stage_len; /* bytes not yet fed (left when reads paused) */
	int refs;
	bool closing, reading, paused;
	bool pause_pending; /* over a memory limit mid-frame: pause once it is whole */
	/* memory this connection holds (conn.c), also summed in d->queued_bytes */
	uint64_t mem_partial, mem_requests, mem_replies;
	double last_read, write_since, last_activity; /* for the sweep's timeouts */
	unsigned inflight;
	uid_t uid;
	gid_t gid;
	pid_t pid;
	uint64_t serial;
	/* shared memory (shm.c): a descriptor received but not yet attached, and
	 * the mapped region; unmapped with the last reference to the connection */
	int pending_fd;
	struct tree_region region;
	struct conn *next, *prev;
};

/* The output area a scan or grad names in the connection's region (`out`,
 * shm.c): result tensors of at least min_bytes are written there. */
struct shm_out {
	bool set;
	uint64_t offset, size, min_bytes;
	uint8_t *base; /* region base + offset */
};

struct request {
	struct conn *conn; /* holds a reference */
	struct daemon *d;
	uint8_t *body; /* owned frame body; trees point into it */
	uint32_t len;
	struct msg msg;
	bool has_id;
	uint64_t id;
	int op;
	double started;
	struct adapter *adapter; /* set by ops that run on one; holds a reference */
	/* waiting for a specialization (request_acquire): ready runs when it can */
	struct graph_waiter waiter;
	void (*ready)(struct request *req, struct specialization *sp);
	struct tree_node carry, inputs, cot_carry, cot_outputs; /* views into body */
	int64_t batch;  /* its batch size, for a dynamic = batch adapter (request_acquire) */
	int64_t chunks; /* strategy = chunk: runs of the graph this scan takes (0: not split) */
	struct tree_node chunk_inputs; /* the inputs' shapes for one chunk (in the body's zone) */
	struct shm_out out;
	void *state; /* op-specific, owned by the op */
	void (*state_free)(void *state);
};

/* An outgoing frame and what must outlive its write. */
struct outmsg {
	uv_write_t req;
	struct writer w;
	bool writer_gone;   /* flattened into `flat`: the writer is destroyed */
	uint8_t *flat;      /* a queued small frame's remaining bytes, owned */
	uint64_t mem;       /* accounted to the connection while queued */
	uint32_t body_size; /* the request body it keeps, for the accounting */
	struct conn *conn;
	void (*cleanup)(void *arg);
	void *cleanup_arg;
	uint8_t *keep_body; /* the request's frame body, which outputs may alias */
	bool close_after;
};

/* ---- ops -------------------------------------------------------------- */

enum op_flags {
	OP_ADMIN = 1,         /* the daemon's uid, root and --admin-group only */
	OP_WHILE_STOPPING = 2 /* still answered after shutdown began */
};

struct op_desc {
	const char *name;
	void (*handler)(struct request *req);
	unsigned flags;
};

extern const struct op_desc *const OP_TABLE[PROTO_OP__COUNT];

/* ---- the daemon ------------------------------------------------------- */

struct daemon_stats {
	uint64_t connections, requests, errors, frame_errors, limit_breaches, busy, inline_runs;
	uint64_t pool_stalls, idle_closed, stalled_frames_closed, memory_pauses, failed_evictions;
	uint64_t shm_attaches, shm_stray_fds;
	uint64_t error_codes[PROTO_E__COUNT];
};

struct daemon {
	uv_loop_t *loop;
	struct config cfg;
	uv_pipe_t server;
	bool server_open, own_socket;
	struct conn *conns;
	unsigned n_conns;
	struct registry reg;
	struct compiler *compiler;
	struct cache cache;
	struct daemon_stats stats;
	bool ready, shutting_down, worker_ok;
	int exit_code;
	uv_timer_t conn_sweep; /* conn.c: frame/write stalls and idle connections */
	uv_idle_t resume_idle; /* conn.c: resumes paused connections at a safe point */
	unsigned n_paused;     /* connections whose reads are paused */
	struct sigthread sig;  /* SIGTERM, SIGINT, SIGHUP (+ SIGUSR2 in the test build) */
	uv_timer_t drain_timer, watchdog, exit_timer;
	/* the thread pool's canary (daemon.c): a no-op job queued every second */
	uv_timer_t pool_timer;
	uv_work_t canary;
	bool canary_out, pool_stalled;
	double canary_sent;
	/* memory held by connections: replies queued + frames being read (conn.c) */
	uint64_t queued_bytes;
	/* shared memory mapped for connections (shm.c) */
	uint64_t shm_bytes;
	unsigned shm_regions;
	unsigned inflight;
	double started;
	char worker_sha[CACHE_KEY_HEX];
	char isa[256];
	unsigned pending_loads;       /* preloads not yet READY */
	bool reloading, reload_again; /* SIGHUP: a directory load in flight, another asked */
	void (*on_ready)(struct daemon *d);
	/* the compile worker said hello (err NULL) or cannot start (daemon.c) */
	void (*worker_up)(struct daemon *d, const struct proto_err *err);
};

double now_seconds(void);

/* request.c */
void request_reply(struct request *req, struct outmsg *out);
void request_fail(struct request *req, const struct proto_err *err);
void request_fail_code(struct request *req, enum proto_code code, const char *path, const char *fmt,
                       ...) __attribute__((format(printf, 4, 5)));
/* Begins a reply frame {id, result: {nfields...}}; returns NULL when out of memory. */
struct outmsg *request_begin_result(struct request *req, uint32_t nfields);
void request_free(struct request *req);
bool request_is_admin(const struct request *req);
/* graphs_acquire for the request: ready(req, sp) when sp can run (sp is
 * referenced for the call); otherwise the request fails with the reason.
 * Compile events reach the client as notifications. */
void request_acquire(struct request *req, struct adapter *a, const struct scan_args *args,
                     void (*ready)(struct request *req, struct specialization *sp));
/* Reads the `name` field; on error fails the request (INVALID_NAME) and returns -1. */
int request_name(struct request *req, const char **name, uint32_t *len);

/* conn.c */
int server_listen(struct daemon *d, struct proto_err *err);
/* Starts accepting on d->server (bound here, or inherited from systemd). */
void server_start_listening(struct daemon *d, int *rc);
void server_close(struct daemon *d);
void conn_send(struct conn *c, struct outmsg *out);
void conn_ref(struct conn *c);
void conn_unref(struct conn *c);
void conns_close_all(struct daemon *d);
/* The 1 s sweep over connections (timeouts); stopped by conns_close_all. */
void conns_start_sweep(struct daemon *d);
/* Memory accounting of request bodies (request.c): + when read, - when freed. */
void conn_account_request(struct conn *c, int64_t delta);
struct outmsg *outmsg_new(struct conn *c);
void outmsg_free(struct outmsg *out);

/* registry.c */
int adapter_def_validate(struct adapter_def *def, struct proto_err *err);
/* Registers or replaces; *replaced tells whether an old adapter was dropped. */
struct adapter *registry_register(struct daemon *d, struct adapter_def *def, bool *replaced,
                                  bool *unchanged);
struct adapter *registry_find(struct daemon *d, const char *name, size_t len);
/* dynamic = batch: one graph per signature serves every batch size. */
bool adapter_batched(const struct adapter *a);
/* Same body, entry, bounds, budget and strategy (registering it changes nothing). */
bool adapter_same_def(const struct adapter *a, const struct adapter_def *def);
int registry_unregister(struct daemon *d, const char *name, size_t len);
void adapter_ref(struct adapter *a);
void adapter_unref(struct adapter *a);
void adapter_record_latency(struct adapter *a, double us);
double adapter_latency_percentile(const struct adapter *a, double p);
void registry_clear(struct daemon *d);
/* Reads dir's *.adapter files off the loop, registers them, then done(d, failed). */
/* As registry_load_dir, the adapters registered with the given origin. */
int registry_load_from(struct daemon *d, const char *dir, enum adapter_origin origin, bool reload,
                       void (*done)(struct daemon *d, int failed));
/* persist.c: registrations kept in --state-dir (no-ops without one). */
int registry_persist(struct daemon *d, const struct adapter_def *def, struct proto_err *err);
void registry_forget(struct daemon *d, const char *name, size_t len);
/* Registers the persisted registrations, then calls done(d, failed). */
int registry_restore(struct daemon *d, void (*done)(struct daemon *d, int failed));
int registry_load_dir(struct daemon *d, const char *dir, bool reload,
                      void (*done)(struct daemon *d, int failed));
void adapter_def_defaults(struct adapter_def *def);

/* daemon.c */
/* main(): before any thread exists (every thread inherits the blocked set). */
int daemon_block_signals(struct daemon *d);
int daemon_start(struct daemon *d);
/* What the graph layer needs around it, without a socket (the unit tests use
 * these too): the ISA and worker hash of the cache keys, the cache. */
int daemon_graphs_open(struct daemon *d);
/* Starts the compile worker; up(d, err) once it said hello (its target is
 * then part of d->isa) or cannot start. */
int daemon_graphs_start_worker(struct daemon *d,
                               void (*up)(struct daemon *d, const struct proto_err *err));
void daemon_begin_shutdown(struct daemon *d, const char *why);
/* Seconds the oldest pool canary has waited (0 when none is waiting). */
double daemon_pool_wait(const struct daemon *d);
void daemon_request_done(struct daemon *d);

#endif

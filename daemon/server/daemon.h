/*
 * daemon.h - the server layer, its one header: the daemon itself,
 * connections, requests, the op table, and what the server-layer files
 * export to each other.  The graph layer (adapters, specializations, runs)
 * is graphs.h, which knows nothing of this one.
 *
 * Threads: everything here is touched on the loop thread only, except the
 * fields a thread-pool job owns while it runs (documented at each job).
 * Lifetimes are reference counts: a connection lives while its handle is
 * open or a request/write needs it; a request holds its connection and, for
 * ops on an adapter, the adapter.
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
	bool doomed;        /* an error frame that closes it is on its way (conn_frame_error) */
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
	/* which frames pending_fd may belong to: those that began in the read it
	 * came with, numbered fd_first..fd_last (conn.c conn_take_fd) */
	uint64_t frames_begun, frames_done, fd_first, fd_last;
	bool fd_window_open;
	/* the frame being received: when its first byte came, and whether its
	 * announced body was admitted under the memory caps (conn.c admit) */
	double frame_started;
	bool admitted;
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

/* Where a request is between its frame and its one reply (request.c's
 * REQ_NEXT, asserted): replied exactly once, then freed exactly once. */
enum request_state {
	REQ_OPEN,     /* with its op (or held for the start-up) */
	REQ_REPLYING, /* request_begin_result: its result frame is being built */
	REQ_REPLIED,  /* request_reply sent the result */
	REQ_FAILED,   /* request_fail sent an error */
	REQ_DROPPED,  /* request_drop: held, and its client closed; no reply */
	REQ_FREED,    /* request_free ran (the memory is gone) */
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
	enum request_state reply_state; /* request.c REQ_NEXT */
	double started;
	struct adapter *adapter; /* set by ops that run on one; holds a reference */
	/* waiting for a specialization (request_acquire): ready runs when it can */
	struct graph_waiter waiter;
	void (*ready)(struct request *req, struct specialization *sp);
	struct tree_node carry, inputs, cot_carry, cot_outputs; /* views into body */
	struct tree_node saved; /* a grad's `saved` (TREE_NONE: none) */
	const char *saved_key;  /* and its `saved_key` (saved_key_len bytes, in body) */
	uint32_t saved_key_len;
	bool params;    /* the request named `params`: carry is the pair (carry, params) inside */
	int64_t batch;  /* its batch size, for a dynamic = batch adapter (request_acquire) */
	int64_t chunks; /* strategy = chunk: runs of the graph this scan takes (0: not split) */
	struct tree_node chunk_inputs; /* the inputs' shapes for one chunk (in the body's zone) */
	struct shm_out out;
	void *state; /* op-specific, owned by the op */
	void (*state_free)(void *state);
	struct request *held_next; /* waiting for the start-up (ops.c ops_release_held) */
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
/* The frame handler of connections (struct daemon's dispatch). */
void ops_dispatch(struct conn *c, uint8_t *body, uint32_t len);
/* Hands the requests held for the start-up (d->restored, d->adapters_open)
 * to their ops, or holds them again; shutting down, they are refused. */
void ops_release_held(struct daemon *d);

/* ---- the daemon ------------------------------------------------------- */

struct daemon_stats {
	uint64_t connections, requests, errors, frame_errors, limit_breaches, busy;
	uint64_t pool_stalls, idle_closed, stalled_frames_closed, memory_pauses;
	uint64_t shm_attaches, shm_stray_fds;
	uint64_t graphs_evicted; /* captured graphs dropped by --max-graphs-per-uid */
	uint64_t busy_polled;    /* requests the loop found while polling (daemon_run) */
	uint64_t error_codes[PROTO_E__COUNT];
};

struct daemon {
	uv_loop_t *loop;
	struct config cfg;
	uv_pipe_t server;
	bool server_open, own_socket;
	struct conn *conns;
	unsigned n_conns;
	struct graphs graphs; /* the graph layer: adapters, graphs, runs */
	struct compiler *compiler;
	struct cache cache;
	struct daemon_stats stats;
	bool ready, shutting_down, worker_ok;
	/* start-up (daemon.c): the registrations of --state-dir and --adapters
	 * are registered (restored), the first worker said hello and the probe
	 * passed (probed), and adapters take requests (adapters_open: cache keys
	 * hold the worker's target); until then requests that need them wait in
	 * held (ops.c), never NOT_FOUND */
	bool restored, probed, adapters_open;
	struct request *held, *held_last;
	unsigned held_n;     /* waiting now */
	uint64_t held_total; /* requests that waited, since the start */
	int exit_code;
	uv_timer_t conn_sweep; /* conn.c: frame/write stalls and idle connections */
	uv_idle_t resume_idle; /* conn.c: resumes paused connections at a safe point */
	unsigned n_paused;     /* connections whose reads are paused */
	struct sigthread sig;  /* SIGTERM, SIGINT, SIGHUP (+ SIGUSR1/2 in the test build) */
	uv_timer_t drain_timer, watchdog, exit_timer;
	/* the thread pool's canary (daemon.c): a no-op job queued every second */
	uv_timer_t pool_timer;
	uv_work_t canary;
	bool canary_out, pool_stalled;
	double canary_sent;
	/* and one to the graph runner (runner.h), whose stall is the pool's too */
	struct runner_item runner_canary;
	bool runner_canary_out;
	double runner_canary_sent;
	/* memory held by connections: replies queued + frames being read (conn.c) */
	uint64_t queued_bytes;
	/* shared memory mapped for connections (shm.c) */
	uint64_t shm_bytes;
	unsigned shm_regions;
	unsigned inflight;
	double started;
	char worker_sha[CACHE_KEY_HEX];
	char isa[256];
	/* what the compile workers' environment adds (daemon.c worker_env) */
	const char *worker_env[4];
	/* what the compile workers may not read (worker_target.c worker_target_hidden) */
	const char *worker_hidden[8];
	char inductor_dir_env[sizeof(((struct config *)0)->cache_dir) + 40];
	unsigned pending_loads;       /* preloads not yet READY */
	bool reloading, reload_again; /* SIGHUP: a directory load in flight, another asked */
	void (*on_ready)(struct daemon *d);
	/* each whole frame a connection reads (ops_dispatch, set by main.c) */
	void (*dispatch)(struct conn *c, uint8_t *body, uint32_t len);
	/* hands on the requests held for the start-up (ops_release_held, set by
	 * main.c; the server layer calls no op) */
	void (*release_held)(struct daemon *d);
	/* the compile worker said hello (err NULL) or cannot start (daemon.c) */
	void (*worker_up)(struct daemon *d, const struct proto_err *err);
};

/* request.c: every request ends in exactly one of request_reply (after
 * request_begin_result), request_fail(_code) or request_drop, which free it;
 * any other sequence aborts (the state machine at the top of request.c). */
void request_reply(struct request *req, struct outmsg *out);
void request_fail(struct request *req, const struct proto_err *err);
void request_fail_code(struct request *req, enum proto_code code, const char *path, const char *fmt,
                       ...) __attribute__((format(printf, 4, 5)));
/* Begins a reply frame {id, result: {nfields...}}; out of memory, it fails the
 * request (INTERNAL) and returns NULL: the caller just returns. */
struct outmsg *request_begin_result(struct request *req, uint32_t nfields);
/* A request of c for a whole frame (owned from here); NULL when out of memory. */
struct request *request_new(struct conn *c, uint8_t *body, uint32_t len);
/* Frees a request that was never answered: only one held for the start-up
 * whose connection closed meanwhile (asserted: c->closing). */
void request_drop(struct request *req);
bool request_is_admin(const struct request *req);
/* graphs_acquire for the request: ready(req, sp) when sp can run (sp is
 * referenced for the call); otherwise the request fails with the reason.
 * Compile events reach the client as notifications. */
void request_acquire(struct request *req, struct adapter *a, const struct scan_args *args,
                     void (*ready)(struct request *req, struct specialization *sp));
/* Reads the `name` field; on error fails the request (INVALID_NAME) and returns -1. */
int request_name(struct request *req, const char **name, uint32_t *len);
/* Reads the integer field key; missing, it fails the request
 * (INVALID_ARGUMENT, the message `need`), and on any error returns -1. */
int request_i64(struct request *req, const char *key, int64_t *v, const char *need);
/* The adapter the `adapter` field names (INVALID_ARGUMENT, NOT_FOUND in err
 * otherwise, and -1): referenced as req->adapter, its request counted. */
int request_adapter(struct request *req, struct adapter **a, struct proto_err *err);

/* listen.c: the socket file (bound, stale one replaced, removed at the end) */
int listen_open(struct daemon *d, struct proto_err *err);
void listen_close(struct daemon *d);

/* conn.c */
/* Starts accepting on d->server (bound by listen.c, or inherited from systemd). */
/* listen.c: accepting on the bound socket; conn.c: a connection accepted,
 * then read once admitted. */
void listen_start(struct daemon *d, int *rc);
struct conn *conn_accept(struct daemon *d, uv_stream_t *server);
void conn_start_reading(struct conn *c);
void conn_send(struct conn *c, struct outmsg *out);
void conn_ref(struct conn *c);
void conn_unref(struct conn *c);
void conns_close_all(struct daemon *d);
/* The 1 s sweep over connections (timeouts); stopped by conns_close_all. */
void conns_start_sweep(struct daemon *d);
/* Memory accounting of request bodies (request.c): + when read, - when freed. */
void conn_account_request(struct conn *c, int64_t delta);
/* The descriptor that came with the frame being dispatched, or -1 (taken:
 * the caller closes it).  A descriptor that came with another frame is
 * closed, never handed to a later one. */
int conn_take_fd(struct conn *c);
/* conn_fds.c: takes what libuv holds for c (at the top of each read), closes
 * the window of frames a descriptor may belong to (the read is fed), drops a
 * descriptor whose frames all went without an attach. */
void conn_take_fds(struct conn *c);
void conn_close_fd_window(struct conn *c);
void conn_drop_stray_fd(struct conn *c);
/* conn.c, for conn_sweep.c: an error frame (then a close, if asked); a close. */
void conn_frame_error(struct conn *c, const struct proto_err *err, bool close_after);
void conn_close(struct conn *c);
struct outmsg *conn_outmsg_new(struct conn *c);
void conn_outmsg_free(struct outmsg *out);

/* registry.c: adapter definition files */
/* Reads dir's *.adapter files off the loop, registers them, then done(d, failed). */
/* As registry_load_dir, the adapters registered with the given origin. */
int registry_load_from(struct daemon *d, const char *dir, enum adapter_origin origin, bool reload,
                       void (*done)(struct daemon *d, int failed));
/* persist.c: registrations kept in --state-dir (no-ops without one). */
int persist_save(struct daemon *d, const struct adapter_def *def, struct proto_err *err);
void persist_forget(struct daemon *d, const char *name, size_t len);
/* Registers the persisted registrations, then calls done(d, failed). */
int persist_restore(struct daemon *d, void (*done)(struct daemon *d, int failed));
int registry_load_dir(struct daemon *d, const char *dir, bool reload,
                      void (*done)(struct daemon *d, int failed));

/* daemon.c */
/* main(): before any thread exists (every thread inherits the blocked set). */
int daemon_block_signals(struct daemon *d);
int daemon_start(struct daemon *d);
/* Runs the loop until nothing is left on it, polling for requests before it
 * sleeps (--busy-poll-us, proto/busypoll.h). */
void daemon_run(struct daemon *d);
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
/* The pool timer's tick (canary.c): sends the canaries, marks a stall. */
void daemon_pool_canary(uv_timer_t *t);
void daemon_request_done(struct daemon *d);

/* worker_target.c: the ISA and worker digest of every cache key (-1: the
 * target needs what this CPU lacks, or the worker cannot be read), and the
 * workers' environment beyond the allow-list (Inductor's target and cache). */
int worker_target_open(struct daemon *d);
const char *const *worker_target_env(struct daemon *d);
/* What the compile workers' sandbox hides from them (NULL-terminated). */
const char *const *worker_target_hidden(struct daemon *d);

#endif

/*
 * torchloop.h - libtorchloop, the C client of torchloopd.
 *
 * Solver processes use the daemon through this header alone: connect, send
 * requests whose tensor trees point at the caller's own buffers (nothing is
 * copied before the socket write), and read replies whose trees are views
 * into the reply frame (valid until tl_reply_free).
 *
 * Thread-safety: a struct tl_client carries one request at a time and is
 * not safe to share between threads without a lock; use one client per
 * thread (connections are cheap).  Builders and replies are independent
 * objects and may be used from any one thread each.
 *
 * Errors: every call returns 0 on success or -1 with struct tl_error
 * filled: code (the protocol's symbolic code, e.g. "TOO_MANY_STEPS"), the
 * message and the offending leaf path (e.g. inputs["f"][1]), or
 * TL_E_CONNECT/TL_E_IO for transport failures.
 */
#ifndef TORCHLOOP_H
#define TORCHLOOP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TL_PROTOCOL 1

enum tl_dtype { TL_FLOAT32 = 1, TL_FLOAT64 = 2 };
enum tl_kind { TL_NONE, TL_TENSOR, TL_TUPLE, TL_LIST, TL_DICT };

struct tl_error {
	char code[48]; /* "OK", a protocol code, "CONNECT" or "IO" */
	char message[1024];
	char path[512];
};

struct tl_client;
struct tl_builder;
struct tl_tree;
struct tl_reply;

/* ---- connection ---- */
/* path NULL: $TORCHLOOP_SOCKET, else the daemon's default. timeout_ms <= 0: 5000. */
int tl_connect(const char *path, int timeout_ms, struct tl_client **out, struct tl_error *err);
void tl_close(struct tl_client *c);
/* Replies may wait for a compile: 0 (default) waits forever. */
void tl_set_timeout(struct tl_client *c, int timeout_ms);
/* Busy polling: after a request, poll the socket for up to us microseconds
 * (adaptive, proto/busypoll.h) before sleeping in read(2); a reply that lands
 * within it costs no wake-up.  Default: $TORCHLOOP_BUSY_POLL_US, else 50;
 * at most 1000; 0 turns it off; off when the process may use one CPU only. */
#define TL_BUSY_POLL_US_DEFAULT 50
void tl_set_busy_poll(struct tl_client *c, int us);
/* Reads of a reply that busy polling served, since the connection opened:
 * replies to requests of 256 KiB of tensors or more are never polled for
 * (their graphs may use every core; proto/busypoll.h). */
uint64_t tl_polled_reads(const struct tl_client *c);
/* Opt-in: a request whose connection broke before any byte of its reply
 * arrived (the daemon restarted; progress events are not its reply, e.g. a
 * scan waiting on a compile), or that a stopping daemon refused unrun
 * (SHUTTING_DOWN), is sent again, once, on a new connection made within
 * wait_ms -- hello, health, list, describe, stats, register,
 * compile, scan and grad, which give the same result run twice (the new
 * connection answers a hello first: one made into a killed daemon's
 * listening socket before it closed is not the one used); never
 * unregister or shutdown, never a request that may have run (part of its
 * reply read, or a timeout), never with shared memory attached (its
 * descriptor went to the old daemon).  Adapters the daemon forgot are the
 * caller's to register again (NOT_FOUND).  0 (the default): never. */
void tl_set_reconnect(struct tl_client *c, int wait_ms);
/* Requests sent again since the client was made. */
uint64_t tl_resent(const struct tl_client *c);
/* Called for each progress event (a compile the request waits on). */
typedef void (*tl_progress_fn)(const char *event, const char *adapter, const char *signature,
                               double elapsed_seconds, void *user);
void tl_set_progress(struct tl_client *c, tl_progress_fn fn, void *user);

/* ---- building trees over caller-owned buffers ---- */
struct tl_builder *tl_builder_new(void);
void tl_builder_free(struct tl_builder *b);
/* data must stay valid and unchanged until the request using it returns. */
struct tl_tree *tl_tensor(struct tl_builder *b, enum tl_dtype dtype, int ndim, const int64_t *shape,
                          const void *data);
struct tl_tree *tl_none(struct tl_builder *b);
struct tl_tree *tl_tuple(struct tl_builder *b, size_t n, struct tl_tree *const *items);
struct tl_tree *tl_list(struct tl_builder *b, size_t n, struct tl_tree *const *items);
struct tl_tree *tl_dict(struct tl_builder *b, size_t n, const char *const *keys,
                        struct tl_tree *const *items);

/* ---- reading trees (built or received) ---- */
enum tl_kind tl_tree_kind(const struct tl_tree *t);
size_t tl_tree_len(const struct tl_tree *t);
const struct tl_tree *tl_tree_item(const struct tl_tree *t, size_t i);
/* The i-th key of a dict (not NUL-terminated; *len bytes). */
const char *tl_tree_key(const struct tl_tree *t, size_t i, size_t *len);
const struct tl_tree *tl_tree_get(const struct tl_tree *t, const char *key);
enum tl_dtype tl_tree_dtype(const struct tl_tree *t);
int tl_tree_ndim(const struct tl_tree *t);
const int64_t *tl_tree_shape(const struct tl_tree *t);
const void *tl_tree_data(const struct tl_tree *t);
size_t tl_tree_nbytes(const struct tl_tree *t);

/* ---- requests ---- */
int tl_hello(struct tl_client *c, struct tl_error *err);
/* ready: 1 when the daemon is ready; live is implied by any answer. */
int tl_health(struct tl_client *c, int *ready, struct tl_error *err);

struct tl_adapter_def {
	const char *name;
	const char *body_source;  /* Python source text */
	const char *body_file;    /* shown in errors; may be NULL */
	const char *entry;        /* NULL: "body" */
	const char *strategy;     /* NULL: "unroll"; or "scan", "chunk" */
	int64_t max_steps;        /* 0: the default 128 */
	int64_t max_elements;     /* 0: 65536 */
	int64_t recompile_budget; /* 0: 8 */
	const char *dynamic;      /* NULL: "none"; or "batch" (one graph for every batch size) */
};
int tl_register(struct tl_client *c, const struct tl_adapter_def *def, struct tl_error *err);
int tl_unregister(struct tl_client *c, const char *name, struct tl_error *err);

/* Reply keys: "carry" and "outputs". */
int tl_scan(struct tl_client *c, const char *adapter, const struct tl_tree *carry,
            const struct tl_tree *inputs, struct tl_reply **out, struct tl_error *err);
/* Cotangent trees may be NULL (zeros). Adds "grad_carry" and "grad_inputs". */
int tl_grad(struct tl_client *c, const char *adapter, const struct tl_tree *carry,
            const struct tl_tree *inputs, const struct tl_tree *cot_carry,
            const struct tl_tree *cot_outputs, struct tl_reply **out, struct tl_error *err);
/* tl_grad by the checkpointed VJP (a graph of its own, kind grad_checkpoint):
 * only the carry entering each step is kept, the step is recomputed in the
 * reverse loop (docs/protocol.md, grad's checkpoint). */
int tl_grad_checkpoint(struct tl_client *c, const char *adapter, const struct tl_tree *carry,
                       const struct tl_tree *inputs, const struct tl_tree *cot_carry,
                       const struct tl_tree *cot_outputs, struct tl_reply **out,
                       struct tl_error *err);
/* The saved pair (docs/protocol.md "The saved pair"): tl_scan that also
 * keeps what the backward needs; the reply adds "saved" (a tensor) and the
 * string saved_key (kind scan_save). */
int tl_scan_save(struct tl_client *c, const char *adapter, const struct tl_tree *carry,
                 const struct tl_tree *inputs, struct tl_reply **out, struct tl_error *err);
/* The backward of fwd (a tl_scan_save reply of the same carry and inputs)
 * without running the forward again (kind grad_saved): "grad_carry" and
 * "grad_inputs" only.  fwd stays the caller's. */
int tl_grad_saved(struct tl_client *c, const char *adapter, const struct tl_tree *carry,
                  const struct tl_tree *inputs, const struct tl_reply *fwd,
                  const struct tl_tree *cot_carry, const struct tl_tree *cot_outputs,
                  struct tl_reply **out, struct tl_error *err);
/* What tl_compile warms. */
enum tl_graph_kind {
	TL_GRAPH_SCAN,
	TL_GRAPH_GRAD,
	TL_GRAPH_GRAD_CHECKPOINT,
	TL_GRAPH_SCAN_SAVE, /* the saved pair (tl_scan_save, tl_grad_saved) */
	TL_GRAPH_GRAD_SAVED
};
/* Warms a specialization: shape-only trees (tensors' data may be NULL). */
int tl_compile(struct tl_client *c, const char *adapter, const struct tl_tree *carry,
               const struct tl_tree *inputs, enum tl_dtype dtype, enum tl_graph_kind kind,
               struct tl_reply **out, struct tl_error *err);

/* list, describe (name), stats, shutdown: the result as JSON text. */
int tl_call_json(struct tl_client *c, const char *op, const char *name, char **json,
                 struct tl_error *err);

/*
 * ---- shared memory (docs/protocol.md "Shared memory") ----
 * tl_shm_attach creates a sealed memfd of `bytes` (rounded up to a page) and
 * passes it to the daemon, once per client.  From then on tensors of at
 * least the threshold (tl_shm_set_threshold; default 8 KiB, measured in
 * docs/performance.md) travel by reference instead of through the socket:
 * a buffer from tl_shm_alloc is used in place, any other is copied into
 * the region for the request; result tensors of that size are written by
 * the daemon into the region and stay valid until tl_reply_free (the
 * region outlives tl_close while replies hold it).  When the region is
 * full, tensors travel inline as before.
 */
int tl_shm_attach(struct tl_client *c, size_t bytes, struct tl_error *err);
size_t tl_shm_size(const struct tl_client *c);
void tl_shm_set_threshold(struct tl_client *c, size_t bytes);
/* A 64-byte aligned buffer in the region (NULL when none or full). */
void *tl_shm_alloc(struct tl_client *c, size_t nbytes);
void tl_shm_free(struct tl_client *c, void *p);

const struct tl_tree *tl_reply_tree(const struct tl_reply *r, const char *key);
/* A string field of the result (not NUL-terminated: *len bytes), or NULL. */
const char *tl_reply_string(const struct tl_reply *r, const char *key, size_t *len);
/* A number or bool field of the result (NaN when absent). */
double tl_reply_number(const struct tl_reply *r, const char *key);
void tl_reply_free(struct tl_reply *r);

#ifdef __cplusplus
}
#endif
#endif

/*
 * harness.h - end-to-end test support: a real torchloopd on a private
 * socket per test (sharing one compile cache per test run, so each
 * specialization compiles once), libtorchloop clients, deterministic inputs,
 * and the eager PyTorch reference (tests/helpers/eager_ref.py).
 */
#ifndef TORCHLOOP_HARNESS_H
#define TORCHLOOP_HARNESS_H

#include "msg.h"
#include "npy.h"
#include "torchloop.h"
#include "treejson.h"

#include <criterion/criterion.h>
#include <stdbool.h>
#include <sys/types.h>

struct hd {
	pid_t pid;
	char dir[256];
	char sock[320];
	char log[320];
	char cache[512];
};

/* Root of the source tree (tests run from there). */
const char *h_root(void);
/* The build under test: TORCHLOOP_TEST_BUILD (build, or build-san for make sanitize). */
const char *h_build(void);
/* The compile cache shared by the whole test run. */
const char *h_shared_cache(void);
/*
 * src with a comment no other test process writes appended, into out: a
 * definition whose register check the cache cannot remember (checks passed
 * are, daemon/base/cache_checked.c), for tests whose point is that check
 * job.  The adapter's artifacts are new too (its text is in their key).
 */
void h_unchecked_src(char *out, size_t size, const char *src);
/* A fresh private directory under the run's scratch space. */
void h_tmpdir(char *out, size_t size, const char *tag);

/* Starts build/torchloopd; extra args NULL-terminated.  cache NULL: shared. */
void hd_start(struct hd *d, const char *cache, const char *const *extra);
/* Waits until health says ready (asserts within timeout). */
void hd_wait_ready(struct hd *d, int timeout_s);
/* SIGTERM and wait; returns the exit status (asserting a normal exit). */
int hd_stop(struct hd *d);
struct tl_client *hd_connect(struct hd *d);
/* Registers examples/bodies/FILE's ENTRY under NAME; asserts success. */
void hd_register(struct tl_client *c, const char *name, const char *body_file, const char *entry,
                 int64_t max_steps, int64_t max_elements, int64_t budget);
/* The same with a compile strategy ("unroll", "scan"; NULL: the default). */
void hd_register_strategy(struct tl_client *c, const char *name, const char *body_file,
                          const char *entry, const char *strategy, int64_t max_steps,
                          int64_t max_elements, int64_t budget);
/* An op's JSON result (tl_call_json), parsed; name may be NULL.  Asserts success. */
json_t *h_call_json(struct tl_client *c, const char *op, const char *name);
/* A top-level number of the stats op. */
uint64_t h_stat(struct tl_client *c, const char *key);
/* VmRSS of pid in KiB (-1 if unreadable). */
long h_rss_kib(pid_t pid);
/* A "<field>: N kB" line of /proc/PID/status (VmRSS, VmHWM, ...), -1 if unreadable. */
long h_status_kib(pid_t pid, const char *field);
/* A counter of the adapter's describe output (e.g. "compiles"). */
double hd_counter(struct tl_client *c, const char *adapter, const char *counter);

/* Waits (describe, every 50 ms) until a specialization of adapter is in state
 * ("compiling", "ready", ...); asserts within timeout_s. */
void h_wait_spec_state(struct tl_client *c, const char *adapter, const char *state, int timeout_s);

/* A file's whole text, NUL-terminated (asserts it can be read); free it. */
char *h_slurp(const char *path);
/* Writes a file (created or truncated) from a printf format; asserts. */
void h_write_file(const char *path, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/*
 * A check this machine or build cannot make, and what the test checks
 * instead: one line "NOT CHECKED: <what>" on stderr, which
 * scripts/run-tests.sh counts into the suite's summary (not cr_log_warn:
 * Criterion exits 1 when a test warns).  Python tests warn the same words.
 */
void h_not_checked(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Deterministic pseudo-random fill in [-1, 1). */
void h_fill(void *data, enum tl_dtype dtype, size_t n, uint64_t seed);

/* float64 buffers a test builds trees on, freed together (h_bufs_free). */
struct h_bufs {
	void *p[64];
	int n;
};
/* A float64 tensor leaf of that shape over a fresh 64-byte-aligned buffer
 * filled by h_fill(seed), kept in bb. */
struct tl_tree *h_rand_tensor(struct tl_builder *b, struct h_bufs *bb, int ndim,
                              const int64_t *shape, uint64_t seed);
void h_bufs_free(struct h_bufs *bb);

/* What most e2e tests hold: a daemon, one client, and a builder (with its
 * buffers) for the trees they send.  Declared as
 * `struct h_session s = {.b = tl_builder_new()};` (trees may be built before
 * the daemon starts). */
struct h_session {
	struct hd d;
	struct tl_client *c;
	struct tl_builder *b;
	struct h_bufs bb;
};
/* hd_start (cache and args as there), hd_wait_ready, hd_connect. */
void hs_open(struct h_session *s, const char *cache, const char *const *args);
/* Frees the trees, closes the client, asserts the daemon stops cleanly. */
void hs_close(struct h_session *s);

/*
 * Writes carry/inputs (and cotangents when non-NULL) to dir/in.json and
 * runs the eager reference; returns the reference trees loaded in tj.
 */
void h_reference(const char *dir, const char *body_file, const char *entry,
                 const struct tl_tree *carry, const struct tl_tree *inputs,
                 const struct tl_tree *cot_carry, const struct tl_tree *cot_outputs, bool grad,
                 bool fd);
const struct tl_tree *h_load_ref(struct treejson *tj, const char *dir, const char *key);

/*
 * A grad reply r against the eager reference of body_file:entry at the same
 * carry, inputs and cotangents (scratch under a tmpdir named tag): carry and
 * outputs, grad_carry and grad_inputs against autograd (rtol 1e-10), and the
 * gradients against central finite differences (norm-wise 1e-6).  b must be
 * the builder the trees came from.
 */
void h_assert_grad_matches_reference(struct tl_reply *r, struct tl_builder *b, const char *tag,
                                     const char *body_file, const char *entry,
                                     const struct tl_tree *carry, const struct tl_tree *inputs,
                                     const struct tl_tree *cot_carry,
                                     const struct tl_tree *cot_outputs);
/* The same with carry and outputs read from fwd, the gradients from r (the
 * saved pair: tl_scan_save, then tl_grad_saved). */
void h_assert_pair_matches_reference(const struct tl_reply *fwd, const struct tl_reply *r,
                                     struct tl_builder *b, const char *tag, const char *body_file,
                                     const char *entry, const struct tl_tree *carry,
                                     const struct tl_tree *inputs, const struct tl_tree *cot_carry,
                                     const struct tl_tree *cot_outputs);

/*
 * A scan reply r's carry and outputs against the eager reference of
 * body_file:entry at carry/inputs (rtol 1e-10, atol 1e-12; scratch under a
 * tmpdir named tag), then frees r.  b must be the builder the trees came from.
 */
void h_assert_reply_matches_reference(struct tl_reply *r, const char *body_file, const char *entry,
                                      struct tl_tree *carry, struct tl_tree *inputs,
                                      struct tl_builder *b, const char *tag);
/* Scans carry/inputs on adapter, then h_assert_reply_matches_reference. */
void h_assert_scan_matches_reference(struct tl_client *c, const char *adapter,
                                     const char *body_file, const char *entry,
                                     struct tl_tree *carry, struct tl_tree *inputs,
                                     struct tl_builder *b, const char *tag);

/* Same structure, shapes and dtypes, values within rtol/atol. */
void h_assert_close(const struct tl_tree *got, const struct tl_tree *want, double rtol, double atol,
                    const char *what);
/* Largest |got-want| / max(|want|, floor) over all leaves. */
double h_max_rel_error(const struct tl_tree *got, const struct tl_tree *want, double floor);

/* Norm-wise relative error: max |got - want| / max |want| over all leaves. */
double h_normwise_error(const struct tl_tree *got, const struct tl_tree *want);

/* A process whose parent is `parent` (e.g. a daemon's compile worker), or 0. */
pid_t h_child_of(pid_t parent);

/* Runs a command, returns its exit status; output appended to log (may be NULL). */
int h_run(const char *const *argv, const char *log);

#endif

/* Raw wire access for hostile frames: returns a connected fd. */
int raw_connect(const char *sock);
void raw_send(int fd, const void *bytes, size_t n);
/* Sends body with a correct length prefix. */
void raw_send_frame(int fd, const void *body, size_t n);
/*
 * Reads one reply frame; fills code ("" for a result), id (-1 when nil) and
 * message.  Returns 0, or -1 when the daemon closed the connection.
 */
int raw_recv(int fd, char *code, size_t code_size, long long *id, char *message, size_t msg_size);
/* Reads the next non-event frame into a parsed message over *body (the
 * caller frees both: msg_destroy, frame_free).  -1 when the daemon closed. */
int raw_recv_msg(int fd, uint8_t **body, struct msg *m);

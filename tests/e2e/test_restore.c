/*
 * test_restore.c - restarts no client sees (issue 56): a daemon killed
 * (SIGKILL) mid-stream of scans and mid-compile, started again on the same
 * socket with the same --state-dir (or --adapters directory), answers every
 * request its clients send again, right, never NOT_FOUND: the registrations
 * on disk are registered before any request on them is answered, and
 * requests that need the compile worker wait for it.
 *
 * The window between the new daemon's listen and its worker's hello is held
 * open by the test (tests/helpers/gated_worker.py: TORCHLOOP_TEST_HELLO_GATE)
 * until the retried requests are seen waiting (stats start_waiting), so the
 * retries land in it on every machine.  The compile in flight at the kill
 * waits, in its body, for a gate file the test creates after the kill.
 * Every wait is on a state: a reply, a counter, a specialization's state.
 */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

TestSuite(restore, .timeout = 900);

#define N 4 /* carry [N], inputs [T, N] */
#define T 3
/* scans of the stream answered by the new daemon before it stops */
#define AFTER_RESTART 40

static const char SUM_SRC[] = "def body(c, x):\n    c = c + x\n    return c, c\n";
/* a compile that cannot end before the test creates GATE (traced at compile) */
static const char HELD_FMT[] = "import os\nimport time\n\nGATE = \"%s\"\n\n\n"
                               "def body(c, x):\n"
                               "    while not os.path.exists(GATE):\n"
                               "        time.sleep(0.05)\n"
                               "    c = 2.0 * c + x\n"
                               "    return c, c\n";

/* One test's paths: a socket, state and adapters directories, gates. */
struct paths {
	char dir[512], sock[600], state[600], adapters[600], held_gate[600], hello_gate[600];
	char held_src[2048];
};

static void make_paths(struct paths *p, const char *tag)
{
	h_tmpdir(p->dir, sizeof p->dir, tag);
	snprintf(p->sock, sizeof p->sock, "%s/sock", p->dir);
	snprintf(p->state, sizeof p->state, "%s/state", p->dir);
	snprintf(p->adapters, sizeof p->adapters, "%s/adapters", p->dir);
	snprintf(p->held_gate, sizeof p->held_gate, "%s/compile-gate", p->dir);
	snprintf(p->hello_gate, sizeof p->hello_gate, "%s/hello-gate", p->dir);
	/* the gate's path makes the body new to the shared cache: it compiles */
	snprintf(p->held_src, sizeof p->held_src, HELD_FMT, p->held_gate);
}

static void touch(const char *path)
{
	int fd = open(path, O_CREAT | O_WRONLY, 0644);

	cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
	close(fd);
}

/*
 * A daemon on p->sock with the gated worker (both daemons: its artifacts'
 * keys differ from the real worker's); hello_gated: its worker says hello
 * only once p->hello_gate exists.  from_file: the adapters are p->adapters'
 * files, else registrations kept in p->state.
 */
static void start_daemon(struct hd *d, const struct paths *p, bool from_file, bool hello_gated)
{
	char worker[600];
	const char *args[] = {"--no-probe",
	                      "--socket",
	                      p->sock,
	                      "--worker",
	                      worker,
	                      from_file ? "--adapters" : "--state-dir",
	                      from_file ? p->adapters : p->state,
	                      NULL};

	snprintf(worker, sizeof worker, "%s/tests/helpers/gated_worker.py", h_root());
	if (hello_gated)
		setenv("TORCHLOOP_TEST_HELLO_GATE", p->hello_gate, 1);
	else
		unsetenv("TORCHLOOP_TEST_HELLO_GATE");
	hd_start(d, NULL, args);
	snprintf(d->sock, sizeof d->sock, "%s", p->sock);
}

/* What carry and outputs must be: c = c + x (doubled: 2 c + x) per step. */
static void expect(bool doubled, const double *c0, const double *xs, double *carry, double *ys)
{
	memcpy(carry, c0, N * sizeof *carry);
	for (int t = 0; t < T; t++)
		for (int i = 0; i < N; i++) {
			carry[i] = (doubled ? 2.0 * carry[i] : carry[i]) + xs[t * N + i];
			ys[t * N + i] = carry[i];
		}
}

/* Small integers: every sum is exact. */
static void inputs_for(int seed, double *c0, double *xs)
{
	for (int i = 0; i < N; i++)
		c0[i] = (double)(i + 1 + seed % 5);
	for (int k = 0; k < T * N; k++)
		xs[k] = (double)((k * 7 + seed) % 11) - 5.0;
}

static bool equal(const struct tl_tree *got, const double *want, size_t n)
{
	const double *v;

	if (got == NULL || tl_tree_kind(got) != TL_TENSOR || tl_tree_dtype(got) != TL_FLOAT64 ||
	    tl_tree_nbytes(got) != n * sizeof(double))
		return false;
	v = tl_tree_data(got);
	for (size_t i = 0; i < n; i++)
		if (fabs(v[i] - want[i]) > 1e-12 * (1.0 + fabs(want[i])))
			return false;
	return true;
}

/* One scan of adapter checked by hand: 0, -1 (err says why) or -2 (wrong values). */
static int scan_check(struct tl_client *c, const char *adapter, bool doubled, int seed,
                      struct tl_error *err)
{
	double c0[N], xs[T * N], carry[N], ys[T * N];
	int64_t cs[] = {N}, xsh[] = {T, N};
	struct tl_builder *b = tl_builder_new();
	struct tl_reply *r = NULL;
	int rc;

	inputs_for(seed, c0, xs);
	expect(doubled, c0, xs, carry, ys);
	rc = tl_scan(c, adapter, tl_tensor(b, TL_FLOAT64, 1, cs, c0),
	             tl_tensor(b, TL_FLOAT64, 2, xsh, xs), &r, err);
	if (rc == 0 && (!equal(tl_reply_tree(r, "carry"), carry, N) ||
	                !equal(tl_reply_tree(r, "outputs"), ys, T * N)))
		rc = -2;
	tl_reply_free(r);
	tl_builder_free(b);
	return rc;
}

/* A client that sends a request again across a restart (tl_set_reconnect). */
static struct tl_client *retrying_client(const char *sock, struct tl_error *err)
{
	struct tl_client *c = NULL;

	if (tl_connect(sock, 5000, &c, err) != 0)
		return NULL;
	tl_set_reconnect(c, 600000); /* a bound for a failing start, not a pass condition */
	return c;
}

/* A stream of scans of "st.sum" until told to stop, or the first failure. */
struct stream {
	const char *sock;
	atomic_int done, after_restart;
	atomic_bool stop, finished;
	int rc, failed_at;
	struct tl_error err;
	uint64_t resent;
	pthread_t th;
};

static void *stream_run(void *arg)
{
	struct stream *s = arg;
	struct tl_client *c = retrying_client(s->sock, &s->err);

	s->rc = c ? 0 : -1;
	for (int i = 0; c && !atomic_load(&s->stop); i++) {
		s->rc = scan_check(c, "st.sum", false, i, &s->err);
		if (s->rc != 0) {
			s->failed_at = i;
			break;
		}
		atomic_fetch_add(&s->done, 1);
		if (tl_resent(c) > 0) /* this scan, or one before, went to the new daemon */
			atomic_fetch_add(&s->after_restart, 1);
	}
	if (c) {
		s->resent = tl_resent(c);
		tl_close(c);
	}
	atomic_store(&s->finished, true);
	return NULL;
}

/* One scan of "st.held" that waits on its compile across the restart. */
struct held_scan {
	const char *sock;
	atomic_bool finished;
	int rc;
	struct tl_error err;
	uint64_t resent;
	pthread_t th;
};

static void *held_run(void *arg)
{
	struct held_scan *h = arg;
	struct tl_client *c = retrying_client(h->sock, &h->err);

	h->rc = c ? scan_check(c, "st.held", true, 5, &h->err) : -1;
	if (c) {
		h->resent = tl_resent(c);
		tl_close(c);
	}
	atomic_store(&h->finished, true);
	return NULL;
}

/* Waits until *v >= n, or s finished (failed: the caller's asserts say how). */
static void await_count(atomic_int *v, int n, const struct stream *s)
{
	while (atomic_load(v) < n && !atomic_load(&s->finished))
		usleep(10 * 1000);
}

/* build/torchloop run in a thread (cli_run). */
struct cli_run {
	const char *argv[16];
	char log[700];
	int rc;
	atomic_bool finished;
	pthread_t th;
};

/*
 * Waits until the new daemon answers, and has n requests waiting for its
 * start-up (stats start_waiting): the worker has not said hello yet (the
 * gate is closed), so nothing else could answer them.  A client whose
 * request must be among them (gone: it ended before) fails the test.
 * Returns a client.
 */
static struct tl_client *await_held(struct hd *d, unsigned n, const struct stream *s,
                                    const struct held_scan *h, const struct cli_run *r)
{
	struct tl_client *c = NULL;
	struct tl_error err;
	int status;

	for (;;) {
		cr_assert_neq(waitpid(d->pid, &status, WNOHANG), d->pid,
		              "the new daemon exited; log %s", d->log);
		cr_assert(!(s && atomic_load(&s->finished)), "the stream ended: %d %s %s", s->rc,
		          s->err.code, s->err.message);
		cr_assert(!(h && atomic_load(&h->finished)), "the held scan ended: %d %s %s", h->rc,
		          h->err.code, h->err.message);
		cr_assert(!(r && atomic_load(&r->finished)), "the CLI ended: exit %d; see %s",
		          r->rc, r->log);
		if (c == NULL && tl_connect(d->sock, 1000, &c, &err) != 0)
			c = NULL;
		if (c && h_stat(c, "start_waiting") >= n)
			break;
		usleep(20 * 1000);
	}
	cr_assert_eq(h_stat(c, "start_waiting"), n, "only the retried requests wait");
	return c;
}

static void write_adapter_files(const struct paths *p)
{
	char path[700];

	cr_assert_eq(mkdir(p->adapters, 0755), 0, "%s", strerror(errno));
	snprintf(path, sizeof path, "%s/sum.py", p->adapters);
	h_write_file(path, "%s", SUM_SRC);
	snprintf(path, sizeof path, "%s/held.py", p->adapters);
	h_write_file(path, "%s", p->held_src);
	snprintf(path, sizeof path, "%s/st.sum.adapter", p->adapters);
	h_write_file(path, "name = st.sum\nbody = sum.py\nmax_steps = 8\nmax_elements = 64\n");
	snprintf(path, sizeof path, "%s/st.held.adapter", p->adapters);
	h_write_file(path, "name = st.held\nbody = held.py\nmax_steps = 8\nmax_elements = 64\n");
}

static void register_both(struct tl_client *c, const struct paths *p)
{
	struct tl_adapter_def sum = {"st.sum", SUM_SRC, NULL, "body", NULL, 8, 64, 4, NULL};
	struct tl_adapter_def held = {"st.held", p->held_src, NULL, "body", NULL, 8, 64, 4, NULL};
	struct tl_error err;

	cr_assert_eq(tl_register(c, &sum, &err), 0, "%s %s", err.code, err.message);
	cr_assert_eq(tl_register(c, &held, &err), 0, "%s %s", err.code, err.message);
}

/* Kills the first daemon while the stream runs and st.held compiles. */
static void kill_mid_stream_and_compile(struct hd *d, struct stream *s, struct held_scan *h)
{
	struct tl_client *c = hd_connect(d);
	int status;

	pthread_create(&s->th, NULL, stream_run, s);
	pthread_create(&h->th, NULL, held_run, h);
	await_count(&s->done, 20, s);
	cr_assert(!atomic_load(&s->finished), "the stream before the kill: %s %s", s->err.code,
	          s->err.message);
	h_wait_spec_state(c, "st.held", "compiling", 600);
	tl_close(c);
	kill(d->pid, SIGKILL);
	cr_assert_eq(waitpid(d->pid, &status, 0), d->pid);
	cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "status %d", status);
	d->pid = 0;
}

/* The new daemon knows both adapters before its worker is up. */
static void assert_known_before_the_worker(struct tl_client *c)
{
	struct tl_error err;
	int ready = 1;
	json_t *j;

	cr_assert_eq(tl_health(c, &ready, &err), 0, "%s", err.message);
	cr_assert_eq(ready, 0, "the worker has not said hello");
	for (int i = 0; i < 2; i++) {
		j = h_call_json(c, "describe", i ? "st.held" : "st.sum");
		json_decref(j);
	}
}

static void restart_mid_stream_and_compile(bool from_file)
{
	struct paths p;
	struct hd d;
	struct stream s = {.failed_at = -1};
	struct held_scan h = {0};
	struct tl_client *c;
	struct tl_error err;
	json_t *stats;

	make_paths(&p, from_file ? "rf" : "rs");
	if (from_file)
		write_adapter_files(&p);
	start_daemon(&d, &p, from_file, false);
	hd_wait_ready(&d, 300);
	c = hd_connect(&d);
	if (!from_file)
		register_both(c, &p);
	cr_assert_eq(scan_check(c, "st.sum", false, 0, &err), 0, "%s %s", err.code, err.message);
	tl_close(c);
	s.sock = h.sock = p.sock;
	kill_mid_stream_and_compile(&d, &s, &h);

	start_daemon(&d, &p, from_file, true);
	c = await_held(&d, 2, &s, &h, NULL); /* the stream's scan and the held scan, sent again */
	assert_known_before_the_worker(c);
	touch(p.held_gate);
	touch(p.hello_gate);
	pthread_join(h.th, NULL);
	await_count(&s.after_restart, AFTER_RESTART, &s);
	atomic_store(&s.stop, true);
	pthread_join(s.th, NULL);

	cr_assert_eq(h.rc, 0, "the scan waiting on the compile: %d %s %s", h.rc, h.err.code,
	             h.err.message);
	cr_assert_eq(h.resent, 1, "the scan waiting on the compile was sent again");
	cr_assert_eq(s.rc, 0, "stream scan %d: %d %s %s", s.failed_at, s.rc, s.err.code,
	             s.err.message);
	cr_assert_eq(s.resent, 1, "one scan of the stream was sent again");
	cr_assert_geq(atomic_load(&s.after_restart), AFTER_RESTART);
	cr_assert_eq(h_stat(c, "start_waited"), 2);
	stats = h_call_json(c, "stats", NULL);
	cr_assert_null(json_object_get(json_object_get(stats, "error_codes"), "NOT_FOUND"));
	json_decref(stats);
	tl_close(c);
	unsetenv("TORCHLOOP_TEST_HELLO_GATE");
	cr_assert_eq(hd_stop(&d), 0, "clean exit; log %s", d.log);
}

/* Registered with `register`, kept in --state-dir. */
Test(restore, a_state_dir_adapter_answers_every_request_across_a_kill)
{
	restart_mid_stream_and_compile(false);
}

/* Defined by files in --adapters. */
Test(restore, an_adapters_file_adapter_answers_every_request_across_a_kill)
{
	restart_mid_stream_and_compile(true);
}

/* ---- the CLI --------------------------------------------------------------------- */

/* build/torchloop with argv, output in log: its exit code (no asserts: a thread). */
static void *cli_run(void *arg)
{
	struct cli_run *r = arg;
	pid_t pid = fork();
	int status;

	if (pid == 0) {
		int fd = open(r->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
		dup2(fd, 1);
		dup2(fd, 2);
		execv(r->argv[0], (char *const *)r->argv);
		_exit(127);
	}
	r->rc = pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status)
	            ? WEXITSTATUS(status)
	            : -1;
	atomic_store(&r->finished, true);
	return NULL;
}

static void save_npy(const char *dir, const char *name, int ndim, const int64_t *shape,
                     const double *v)
{
	char path[700], msg[256];

	snprintf(path, sizeof path, "%s/%s", dir, name);
	cr_assert_eq(npy_write(path, TL_FLOAT64, ndim, shape, v, msg, sizeof msg), 0, "%s", msg);
}

/* The CLI's output tree (out/tree.json) against the hand-computed scan. */
static void assert_cli_out(const char *out, const double *carry, const double *ys)
{
	struct tl_builder *b = tl_builder_new();
	struct treejson tj;
	char path[700], msg[256];
	json_t *doc;

	snprintf(path, sizeof path, "%s/tree.json", out);
	doc = json_load_file(path, JSON_PRESERVE_ORDER, NULL);
	cr_assert_not_null(doc, "%s", path);
	treejson_init(&tj, b, NULL);
	tj.base = out;
	cr_assert(
	    equal(treejson_load(&tj, json_object_get(doc, "carry"), msg, sizeof msg), carry, N),
	    "carry");
	cr_assert(
	    equal(treejson_load(&tj, json_object_get(doc, "outputs"), msg, sizeof msg), ys, T * N),
	    "outputs");
	json_decref(doc);
	treejson_free(&tj);
	tl_builder_free(b);
}

/*
 * `torchloop scan` started the moment a killed daemon's successor listens,
 * before its worker is up: answered once it is, right, not NOT_FOUND.
 */
Test(restore, a_cli_scan_right_after_a_restart_is_answered)
{
	double c0[N], xs[T * N], carry[N], ys[T * N];
	int64_t cs[] = {N}, xsh[] = {T, N};
	char bin[1100], cpath[700], xpath[700], out[700];
	struct tl_adapter_def sum = {"st.sum", SUM_SRC, NULL, "body", NULL, 8, 64, 4, NULL};
	struct cli_run r = {0};
	struct tl_client *c;
	struct tl_error err;
	struct paths p;
	struct hd d;
	int status;

	make_paths(&p, "rc");
	start_daemon(&d, &p, false, false);
	hd_wait_ready(&d, 300);
	c = hd_connect(&d);
	cr_assert_eq(tl_register(c, &sum, &err), 0, "%s %s", err.code, err.message);
	cr_assert_eq(scan_check(c, "st.sum", false, 3, &err), 0, "%s %s", err.code, err.message);
	tl_close(c);
	kill(d.pid, SIGKILL);
	cr_assert_eq(waitpid(d.pid, &status, 0), d.pid);
	d.pid = 0;

	inputs_for(3, c0, xs);
	expect(false, c0, xs, carry, ys);
	save_npy(p.dir, "c.npy", 1, cs, c0);
	save_npy(p.dir, "x.npy", 2, xsh, xs);
	snprintf(cpath, sizeof cpath, "%s/c.npy", p.dir);
	snprintf(xpath, sizeof xpath, "%s/x.npy", p.dir);
	snprintf(out, sizeof out, "%s/out", p.dir);
	snprintf(bin, sizeof bin, "%s/%s/torchloop", h_root(), h_build());
	snprintf(r.log, sizeof r.log, "%s/cli.log", p.dir);
	memcpy(r.argv,
	       (const char *[]){bin, "--socket", p.sock, "scan", "st.sum", "--carry", cpath,
	                        "--inputs", xpath, "--out", out, NULL},
	       12 * sizeof(char *));

	start_daemon(&d, &p, false, true);
	c = await_held(&d, 0, NULL, NULL, NULL); /* listening */
	pthread_create(&r.th, NULL, cli_run, &r);
	tl_close(c);
	c = await_held(&d, 1, NULL, NULL, &r); /* the CLI's scan waits for the worker */
	touch(p.hello_gate);
	pthread_join(r.th, NULL);
	cr_assert_eq(r.rc, 0, "torchloop scan: exit %d; see %s", r.rc, r.log);
	assert_cli_out(out, carry, ys);
	tl_close(c);
	unsetenv("TORCHLOOP_TEST_HELLO_GATE");
	cr_assert_eq(hd_stop(&d), 0, "clean exit; log %s", d.log);
}

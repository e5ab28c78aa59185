/*
 * test_worker_ready.c - a job's compile timeout runs from when its worker is
 * ready (issue 56): a worker that gets its first job while it still imports
 * the compile path (torch.export, dynamo, Inductor: seconds, far more on a
 * busy machine) does not have that import counted against the job's
 * --compile-timeout; --worker-start-timeout bounds the import instead, and
 * the hello before it.
 *
 * The worker is tests/helpers/gated_worker.py: TORCHLOOP_TEST_READY_GATE
 * holds its import until the test creates the gate file, and
 * TORCHLOOP_TEST_HELLO_GATE its hello.  Every wait is on an event: a reply,
 * a line in the daemon's log, the daemon's exit.
 */
#include "harness.h"

#include "frame.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

TestSuite(worker_ready, .timeout = 600);

#define SUM_SRC  "def body(carry, x):\n    carry = carry + x\n    return carry, carry\n"
#define SLOW_SRC "import time\n\ndef body(c, x):\n    time.sleep(600)\n    return c + x, c\n"

/* A registration on a connection of its own, in a thread. */
struct bg_register {
	const char *sock, *name, *src;
	int rc;
	struct tl_error err;
	pthread_t th;
};

static int register_src(struct tl_client *c, const char *name, const char *src,
                        struct tl_error *err)
{
	struct tl_adapter_def def = {name, src, NULL, "body", NULL, 16, 4096, 8, NULL};

	return tl_register(c, &def, err);
}

static void *bg_register_run(void *arg)
{
	struct bg_register *r = arg;
	struct tl_client *c;

	r->rc = tl_connect(r->sock, 5000, &c, &r->err);
	if (r->rc == 0) {
		r->rc = register_src(c, r->name, r->src, &r->err);
		tl_close(c);
	}
	return NULL;
}

/*
 * Starts the daemon with the gated worker and flags; the gate file (in a
 * directory of its own, not created) goes to the worker as env's value.
 */
static void start_gated(struct hd *d, const char *env, char *gate, size_t size,
                        const char *const *flags)
{
	char worker[600], dir[512];
	const char *args[16] = {"--no-probe", "--worker", worker};
	size_t n = 3;

	h_tmpdir(dir, sizeof dir, "gate");
	snprintf(gate, size, "%s/open", dir);
	setenv(env, gate, 1); /* the daemon passes TORCH* variables to its workers */
	/* the import at the first job, so the gate is reached once a job came */
	setenv("TORCHLOOP_WORKER_PRELOAD", "0", 1);
	snprintf(worker, sizeof worker, "%s/tests/helpers/gated_worker.py", h_root());
	while (*flags && n < 15)
		args[n++] = *flags++;
	args[n] = NULL;
	hd_start(d, NULL, args);
}

static void open_gate(const char *path)
{
	int fd = open(path, O_CREAT | O_WRONLY, 0644);

	cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
	close(fd);
}

/* Waits until the daemon's log has needle (the log only grows). */
static void await_log(const struct hd *d, const char *needle)
{
	for (;;) {
		char *text = h_slurp(d->log);
		bool seen = text && strstr(text, needle);
		free(text);
		if (seen)
			return;
		usleep(50 * 1000);
	}
}

/* How many times the daemon's log has needle (once a line, for the needles here). */
static int log_lines(const struct hd *d, const char *needle)
{
	char *text = h_slurp(d->log);
	int n = 0;

	for (const char *at = text; at && (at = strstr(at, needle)) != NULL; at += strlen(needle))
		n++;
	free(text);
	return n;
}

/*
 * A clock made of the daemon's own timers: a connection that sends part of
 * a frame and stops is answered FRAME_TIMEOUT no sooner than --frame-timeout
 * seconds later.  Returns once that reply came.
 */
static void await_frame_timeout(const struct hd *d)
{
	uint8_t head[4], part[8] = {0};
	char code[64], msg[512];
	long long id;
	int fd = raw_connect(d->sock);

	frame_put_header(head, 64);
	raw_send(fd, head, sizeof head);
	raw_send(fd, part, sizeof part);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0, "an error frame");
	cr_assert_str_eq(code, "FRAME_TIMEOUT", "%s", msg);
	close(fd);
}

static int scan_once(struct tl_client *c, const char *name, struct tl_error *err)
{
	struct tl_builder *b = tl_builder_new();
	double carry[4], xs[3 * 4];
	int64_t cs[] = {4}, xsh[] = {3, 4};
	struct tl_reply *r = NULL;
	int rc;

	h_fill(carry, TL_FLOAT64, 4, 11);
	h_fill(xs, TL_FLOAT64, 12, 12);
	rc = tl_scan(c, name, tl_tensor(b, TL_FLOAT64, 1, cs, carry),
	             tl_tensor(b, TL_FLOAT64, 2, xsh, xs), &r, err);
	if (r)
		tl_reply_free(r);
	tl_builder_free(b);
	return rc;
}

/*
 * The register's check is the worker's first job (a text no run has had
 * checked, so not remembered; TORCHLOOP_WORKER_PRELOAD=0;
 * with preload the import runs after hello and a job waits for it the same
 * way, but the gate would be reached before any job came).  Its import is
 * held past --compile-timeout (2 s): until a FRAME_TIMEOUT of 3 s, asked for
 * after the job reached the worker, has come back.  The check still succeeds
 * once the worker is ready.  A compile that outruns the timeout after that
 * still gets COMPILE_TIMEOUT, and the worker started after it takes a
 * registration, its own import not counted either.
 */
Test(worker_ready, an_import_longer_than_the_compile_timeout_does_not_fail_the_job)
{
	const char *flags[] = {"--compile-timeout", "2", "--frame-timeout", "3", NULL};
	char gate[600];
	struct hd d;
	struct tl_client *c;
	struct tl_error err;
	struct bg_register reg;
	char src[256];

	start_gated(&d, "TORCHLOOP_TEST_READY_GATE", gate, sizeof gate, flags);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);

	h_unchecked_src(src, sizeof src, SUM_SRC); /* a check job, not a remembered one */
	reg = (struct bg_register){.sock = d.sock, .name = "ready.sum", .src = src};
	pthread_create(&reg.th, NULL, bg_register_run, &reg);
	await_log(&d, "ready gate: waiting for");
	await_frame_timeout(&d);
	cr_assert_eq(log_lines(&d, "ready gate: open"), 0, "the import is still held");
	open_gate(gate);
	pthread_join(reg.th, NULL);
	cr_assert_eq(reg.rc, 0, "the check after a long import: %s %s", reg.err.code,
	             reg.err.message);
	cr_assert_eq(log_lines(&d, "FRAME_TIMEOUT"), 1, "one line for the stalled connection");

	cr_assert_eq(register_src(c, "ready.slow", SLOW_SRC, &err), 0, "%s", err.message);
	cr_assert_eq(scan_once(c, "ready.slow", &err), -1, "a compile that sleeps 600 s");
	cr_assert_str_eq(err.code, "COMPILE_TIMEOUT", "%s", err.message);
	h_unchecked_src(src, sizeof src, SUM_SRC);
	cr_assert_eq(register_src(c, "ready.after", src, &err), 0, "on the next worker: %s %s",
	             err.code, err.message);
	cr_assert_eq(h_stat(c, "worker_restarts"), 1, "one new worker, for the timeout");
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0, "clean exit; log %s", d.log);
}

/*
 * A worker that never finishes its import fails the job it was given with
 * WORKER_CRASHED once --worker-start-timeout has passed (the compile timeout,
 * 600 s here, never started), and is replaced.  10 s: the same bound holds
 * the workers' hello, which must not miss it on a busy machine; whether the
 * next worker's real import fits is not checked here.
 */
Test(worker_ready, a_worker_that_never_gets_ready_fails_its_job_after_the_start_timeout)
{
	const char *flags[] = {"--worker-start-timeout", "10", NULL};
	char gate[600];
	struct hd d;
	struct tl_client *c;
	struct tl_error err;
	char src[256];

	start_gated(&d, "TORCHLOOP_TEST_READY_GATE", gate, sizeof gate, flags);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	h_unchecked_src(src, sizeof src, SUM_SRC); /* a check job, not a remembered one */
	cr_assert_eq(register_src(c, "ready.stuck", src, &err), -1,
	             "the worker never got ready");
	cr_assert_str_eq(err.code, "WORKER_CRASHED", "%s", err.message);
	cr_assert_not_null(strstr(err.message, "--worker-start-timeout=10"), "%s", err.message);
	hd_wait_ready(&d, 120); /* the next worker said hello: the stuck one is gone */
	cr_assert_eq(h_stat(c, "worker_restarts"), 1);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0, "clean exit; log %s", d.log);
}

/*
 * A first worker that never answers hello is killed after
 * --worker-start-timeout, and the daemon's start fails saying so (before,
 * the daemon waited for it for ever).
 */
Test(worker_ready, a_worker_that_never_says_hello_fails_the_start_after_the_start_timeout)
{
	const char *flags[] = {"--worker-start-timeout", "1", NULL};
	char gate[600];
	struct hd d;
	int status;

	start_gated(&d, "TORCHLOOP_TEST_HELLO_GATE", gate, sizeof gate, flags);
	cr_assert_eq(waitpid(d.pid, &status, 0), d.pid); /* its own exit, however long */
	d.pid = 0;
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 1, "status %d; log %s", status,
	          d.log);
	cr_assert_eq(log_lines(&d, "no hello within 1 s (--worker-start-timeout)"), 1, "log %s",
	             d.log);
	cr_assert_geq(log_lines(&d, "killed after --worker-start-timeout=1 s without a hello"), 1,
	              "log %s", d.log);
}

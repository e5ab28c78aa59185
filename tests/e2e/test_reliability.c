/*
 * test_reliability.c - the faults found by trying to break the daemon
 * (issue 12), one test each: a timed-out compile and the jobs behind it, a
 * compile lock never waited on by the pool, a pool that stays busy, memory
 * a client can pin (pipelining without reading, a frame that stops
 * arriving, idle connections), an untrusted or tampered cache, SIGPIPE in
 * the client, a full disk, the adapters directory read off the loop, spec
 * trees with duplicate keys, bounded failed specializations, a worker that
 * cannot start or that a body kills, a worker's leftover processes, the
 * worker's environment, proxy-executor artifacts, register-time import
 * checks, descriptor limits and per-uid connection limits.
 *
 * Every test checks the specific error code and that the daemon still
 * serves the next request.  Bodies that must misbehave are inline sources.
 */
#include "harness.h"

#include "frame.h"
#include "tree.h"
#include "writer.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

TestSuite(reliability, .timeout = 900);

#define CUMSUM_SRC "def body(carry, x):\n    carry = carry + x\n    return carry, carry\n"
#define SLOW_SRC   "import time\n\ndef body(c, x):\n    time.sleep(600)\n    return c + x, c\n"

static int reg_src(struct tl_client *c, const char *name, const char *src, struct tl_error *err)
{
	struct tl_adapter_def def = {name, src, NULL, "body", NULL, 16, 1048576, 8};

	return tl_register(c, &def, err);
}

static void reg_ok(struct tl_client *c, const char *name, const char *src)
{
	struct tl_error err;

	cr_assert_eq(reg_src(c, name, src, &err), 0, "register %s: %s %s", name, err.code,
	             err.message);
}

/*
 * Scans carry [4] over inputs [T, 4] (a cumulative sum when the adapter is
 * CUMSUM_SRC) and checks the numbers by hand when it succeeds.
 */
static int scan_sum(struct tl_client *c, const char *name, int T, struct tl_error *err)
{
	struct tl_builder *b = tl_builder_new();
	double carry[4], xs[4 * 16];
	int64_t cs[] = {4}, xsh[] = {T, 4};
	struct tl_reply *r;
	int rc;

	h_fill(carry, TL_FLOAT64, 4, 5);
	h_fill(xs, TL_FLOAT64, 4 * (size_t)T, 6);
	rc = tl_scan(c, name, tl_tensor(b, TL_FLOAT64, 1, cs, carry),
	             tl_tensor(b, TL_FLOAT64, 2, xsh, xs), &r, err);
	if (rc == 0) {
		const double *fin = tl_tree_data(tl_reply_tree(r, "carry"));
		for (int k = 0; k < 4; k++) {
			double acc = carry[k];
			for (int s = 0; s < T; s++)
				acc += xs[4 * s + k];
			cr_assert_float_eq(fin[k], acc, 1e-12, "carry[%d]", k);
		}
		tl_reply_free(r);
	}
	tl_builder_free(b);
	return rc;
}

static void scan_sum_ok(struct tl_client *c, const char *name, int T)
{
	struct tl_error err;

	cr_assert_eq(scan_sum(c, name, T, &err), 0, "scan %s T=%d: %s %s", name, T, err.code,
	             err.message);
}

static void expect_code(int rc, const struct tl_error *err, const char *code)
{
	cr_assert_eq(rc, -1, "expected %s, got success", code);
	cr_assert_str_eq(err->code, code, "%s", err->message);
}

/* The daemon answers health, and says ready, within timeout_s. */
static void still_serves(struct hd *d)
{
	hd_wait_ready(d, 60);
}

/* A daemon (shared cache when cache is NULL), ready, and a client of it. */
static struct tl_client *up(struct hd *d, const char *cache, const char *const *args)
{
	hd_start(d, cache, args);
	hd_wait_ready(d, 120);
	return hd_connect(d);
}

/* Closes the client and stops the daemon, which must exit 0. */
static void down(struct hd *d, struct tl_client *c)
{
	tl_close(c);
	cr_assert_eq(hd_stop(d), 0, "clean exit; log %s", d->log);
}

static json_t *health(struct tl_client *c)
{
	return h_call_json(c, "health", NULL);
}

static const char *jstr(json_t *j, const char *key)
{
	const char *s = json_string_value(json_object_get(j, key));

	return s ? s : "";
}

/* How many lines of the daemon's log contain needle. */
static int log_count(const struct hd *d, const char *needle)
{
	FILE *f = fopen(d->log, "r");
	char line[4096];
	int seen = 0;

	while (f && fgets(line, sizeof line, f))
		seen += strstr(line, needle) != NULL;
	if (f)
		fclose(f);
	return seen;
}

/* The log contains needle (after waiting up to timeout_s for it). */
static bool log_has(const struct hd *d, const char *needle, int timeout_s)
{
	for (int k = 0; k <= timeout_s * 10; k++) {
		if (log_count(d, needle) > 0)
			return true;
		usleep(100000);
	}
	return false;
}

/* Waits for the daemon to exit on its own; returns its exit status. */
static int hd_exit_status(struct hd *d, int timeout_s)
{
	int status;

	for (int k = 0; k < timeout_s * 10; k++) {
		if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
			d->pid = 0;
			return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
		}
		usleep(100000);
	}
	cr_assert_fail("torchloopd did not exit within %d s; log %s", timeout_s, d->log);
	return -1;
}

static bool pid_gone(pid_t pid, int timeout_s)
{
	char path[64];

	snprintf(path, sizeof path, "/proc/%d", (int)pid);
	for (int k = 0; k <= timeout_s * 10; k++) {
		if (access(path, F_OK) != 0)
			return true;
		usleep(100000);
	}
	return false;
}

/* Waits until the stats op's key is at most max; 120 s is only a failure guard. */
static void await_stat_at_most(struct tl_client *c, const char *key, uint64_t max, const char *what)
{
	uint64_t v = h_stat(c, key);

	for (int k = 0; k < 1200 && v > max; k++) {
		usleep(100000);
		v = h_stat(c, key);
	}
	cr_assert_leq(v, max, "%s: stats' %s still %llu after 120 s", what, key,
	              (unsigned long long)v);
}

/* Waits until describe's counter of adapter is at least min (120 s: a failure guard). */
static void await_counter(struct tl_client *c, const char *adapter, const char *counter, double min,
                          const char *what)
{
	double v = hd_counter(c, adapter, counter);

	for (int k = 0; k < 1200 && v < min; k++) {
		usleep(100000);
		v = hd_counter(c, adapter, counter);
	}
	cr_assert_geq(v, min, "%s: %s's %s still %g after 120 s", what, adapter, counter, v);
}

/* A scan in a thread of its own (its own connection). */
struct bg {
	const char *sock, *adapter;
	int T, rc;
	struct tl_error err;
	pthread_t th;
};

static void *bg_scan(void *arg)
{
	struct bg *s = arg;
	struct tl_client *c;

	s->rc = tl_connect(s->sock, 5000, &c, &s->err);
	if (s->rc == 0) {
		s->rc = scan_sum(c, s->adapter, s->T, &s->err);
		tl_close(c);
	}
	return NULL;
}

static void bg_start(struct bg *s, struct hd *d, const char *adapter, int T)
{
	*s = (struct bg){.sock = d->sock, .adapter = adapter, .T = T};
	pthread_create(&s->th, NULL, bg_scan, s);
}

/* A source that differs per test run: its graphs are compiled afresh here. */
static void unique_src(char *out, size_t size, const char *src)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	snprintf(out, size, "%s# run %ld.%09ld pid %d\n", src, (long)ts.tv_sec, ts.tv_nsec,
	         (int)getpid());
}

/* ---- the compile worker ------------------------------------------------------------ */

struct hammer {
	const char *sock;
	_Atomic int stop, ok, failed;
	char last[512];
};

/* Waits (up to 120 s) until more than n registrations went through. */
static void hammer_wait_beyond(struct hammer *h, int n)
{
	for (int i = 0; i < 1200 && h->ok <= n && h->failed == 0; i++)
		usleep(100000);
	cr_assert_eq(h->failed, 0, "%d registrations failed; last: %s", (int)h->failed, h->last);
	cr_assert_gt(h->ok, n, "a registration went through on the new worker");
}

/* Registers new definitions (each a "check" job for the worker) until told to stop. */
static void *hammer_register(void *arg)
{
	struct hammer *h = arg;
	struct tl_client *c;
	struct tl_error err;

	cr_assert_eq(tl_connect(h->sock, 5000, &c, &err), 0);
	for (int n = 0; !h->stop; n++) {
		char src[256], name[64];
		h_unchecked_src(src, sizeof src, CUMSUM_SRC); /* a check job each */
		snprintf(name, sizeof name, "hammer.%d", n % 4);
		if (reg_src(c, name, src, &err) == 0) {
			h->ok++;
		} else {
			h->failed++;
			snprintf(h->last, sizeof h->last, "%s: %s", err.code, err.message);
		}
		usleep(20000);
	}
	tl_close(c);
	return NULL;
}

/*
 * A compile that times out kills its worker; jobs that arrive while that
 * worker is being reaped must go to the next worker, and no job's timer may
 * kill the fresh one (before the fix every later compile timed out).
 */
Test(reliability, jobs_behind_a_timed_out_compile_run_on_a_fresh_worker)
{
	const char *args[] = {"--no-probe", "--compile-timeout", "4", "--threads", "0", NULL};
	struct hd d;
	struct tl_client *c;
	struct hammer h = {0};
	pthread_t th;
	struct bg slow;

	c = up(&d, NULL, args);
	reg_ok(c, "rel.slow", SLOW_SRC);
	h.sock = d.sock;
	pthread_create(&th, NULL, hammer_register, &h);
	/*
	 * Registrations go on across each kill and the new worker's start: one is
	 * always waiting.  Each timeout is followed by a wait for one to go through
	 * on the fresh worker (how long its start takes is the machine's business).
	 */
	for (int T = 1; T <= 2; T++) {
		int ok;
		bg_start(&slow, &d, "rel.slow", T);
		pthread_join(slow.th, NULL);
		expect_code(slow.rc, &slow.err, "COMPILE_TIMEOUT");
		ok = h.ok;
		hammer_wait_beyond(&h, ok);
	}
	h.stop = 1;
	pthread_join(th, NULL);
	cr_assert_eq(h.failed, 0, "%d registrations failed; last: %s", (int)h.failed, h.last);
	{
		long long restarts = (long long)h_stat(c, "worker_restarts");
		char *log = restarts == 2 ? NULL : h_slurp(d.log);
		cr_assert_eq(restarts, 2,
		             "one new worker per timeout, not %lld; the daemon's log:\n%s",
		             restarts, log ? log : "");
		free(log);
	}
	still_serves(&d);
	reg_ok(c, "rel.after", CUMSUM_SRC);
	down(&d, c);
}

/*
 * Unregister + register the same definition and scan, 4 times, while the
 * first compile of that key holds its lock: no pool thread may block on the
 * lock (before the fix they all did, and warm scans and SIGTERM hung).  The
 * waiting lookups find the first compile's artifact.
 */
Test(reliability, re_registering_mid_compile_never_blocks_a_pool_thread)
{
	const char *args[] = {"--no-probe", "--threads", "1", NULL};
	struct hd d;
	struct tl_client *c;
	struct tl_error err;
	struct bg scans[5];
	char src[512];

	unique_src(src, sizeof src, CUMSUM_SRC);
	c = up(&d, NULL, args);
	reg_ok(c, "rel.warm", CUMSUM_SRC);
	scan_sum_ok(c, "rel.warm", 3); /* a warm graph to scan meanwhile */
	reg_ok(c, "rel.wedge", src);
	bg_start(&scans[0], &d, "rel.wedge", 3);
	h_wait_spec_state(c, "rel.wedge", "compiling", 60);
	for (int k = 1; k < 5; k++) {
		cr_assert_eq(tl_unregister(c, "rel.wedge", &err), 0, "%s", err.message);
		reg_ok(c, "rel.wedge", src);
		bg_start(&scans[k], &d, "rel.wedge", 3);
		/* the scan found this registration (before the next unregister) */
		await_counter(c, "rel.wedge", "requests", 1, "the scan after a re-registration");
	}
	for (int k = 0; k < 20; k++) /* the pool still runs graphs */
		scan_sum_ok(c, "rel.warm", 3);
	for (int k = 0; k < 5; k++) {
		pthread_join(scans[k].th, NULL);
		cr_assert_eq(scans[k].rc, 0, "scan %d: %s %s", k, scans[k].err.code,
		             scans[k].err.message);
	}
	cr_assert_eq(hd_counter(c, "rel.wedge", "compiles"), 0,
	             "the last registration found the first compile's artifact");
	scan_sum_ok(c, "rel.wedge", 3);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0, "SIGTERM still stops it");
}

static bool pool_stalled(struct tl_client *c, bool *ready)
{
	json_t *j = health(c);
	bool stalled = strcmp(jstr(j, "pool"), "stalled") == 0;

	*ready = json_is_true(json_object_get(j, "ready"));
	json_decref(j);
	return stalled;
}

/*
 * The graph runner and a pool thread busy for 4 s (the test build's SIGUSR1:
 * what a graph run of seconds does, but as long on every machine): the
 * canaries wait past --pool-stall-timeout, health says so ("pool":
 * "stalled", not ready), a scan sent meanwhile waits and is served, and
 * health says ready again once the pool is free.
 */
Test(reliability, health_reports_a_thread_pool_that_takes_no_work)
{
	const char *args[] = {"--no-probe", "--threads", "1", "--pool-stall-timeout", "1", NULL};
	struct hd d;
	struct tl_client *c;
	struct bg queued;
	bool stalled = false, ready = false;

	setenv("TORCHLOOPD_TEST_HOOKS", "1", 1);
	c = up(&d, NULL, args);
	unsetenv("TORCHLOOPD_TEST_HOOKS");
	reg_ok(c, "rel.warm", CUMSUM_SRC);
	scan_sum_ok(c, "rel.warm", 3);
	cr_assert_not(pool_stalled(c, &ready), "an idle pool is not stalled");
	cr_assert(ready);
	kill(d.pid, SIGUSR1);
	/* the hook has queued its work once it says so: the scan comes after it */
	cr_assert(log_has(&d, "test hook: stalling the graph runner", 60), "log %s", d.log);
	bg_start(&queued, &d, "rel.warm", 3); /* behind the busy runner */
	for (int k = 0; k < 35 && !stalled; k++) {
		stalled = pool_stalled(c, &ready);
		cr_assert(!stalled || !ready, "stalled is not ready");
		usleep(100000);
	}
	cr_assert(stalled, "health never reported the busy pool; log %s", d.log);
	pthread_join(queued.th, NULL);
	cr_assert_eq(queued.rc, 0, "%s %s", queued.err.code, queued.err.message);
	for (int k = 0; k < 50 && (stalled || !ready); k++) {
		usleep(100000);
		stalled = pool_stalled(c, &ready);
	}
	cr_assert(!stalled && ready, "health says ready again once the pool is free");
	cr_assert_eq(h_stat(c, "pool_stalls"), 1);
	scan_sum_ok(c, "rel.warm", 3);
	down(&d, c);
}

/* Keeps sending scan frames for t4 (T=3) until n are out; the daemon may pause us. */
struct pipeline {
	int fd, n;
	uint8_t *frame;
	size_t len;
	pthread_t th;
};

static void *send_all(void *arg)
{
	struct pipeline *p = arg;

	for (int k = 0; k < p->n; k++)
		raw_send(p->fd, p->frame, p->len);
	return NULL;
}

static uint8_t *scan_frame(const char *adapter, size_t *len)
{
	static double carry[4] = {1, 2, 3, 4}, xs[12] = {1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
	struct tree_node cn = {.kind = TREE_TENSOR}, xn = {.kind = TREE_TENSOR};
	struct writer w;
	size_t n;
	struct proto_err err;
	uint8_t *out;

	cn.tensor = (struct tree_tensor){PROTO_DTYPE_F64, 1, {4}, 0, 0, carry};
	xn.tensor = (struct tree_tensor){PROTO_DTYPE_F64, 2, {3, 4}, 0, 0, xs};
	cr_assert_eq(tree_tensor_sizes(&cn.tensor), 0);
	cr_assert_eq(tree_tensor_sizes(&xn.tensor), 0);
	cr_assert_eq(writer_init(&w), 0);
	msg_begin_request(&w, 7, "scan", 3);
	writer_key_str(&w, "adapter", adapter);
	writer_str(&w, "carry");
	tree_encode(&w, &cn);
	writer_str(&w, "inputs");
	tree_encode(&w, &xn);
	out = writer_flatten(&w, &n, PROTO_FRAME_MAX, &err);
	cr_assert_not_null(out, "%s", err.message);
	writer_destroy(&w);
	*len = n;
	return out;
}

/*
 * 100 000 scans pipelined by a client that does not read: the daemon holds
 * their replies as bytes (not ~8 KiB of writer chunks each, 850 MB before
 * the fix), stops reading that client once all clients together hold
 * --max-queued-memory, and every reply arrives, with the right numbers,
 * once the client reads.
 */
Test(reliability, a_client_that_never_reads_holds_only_its_reply_bytes)
{
	const char *args[] = {"--no-probe", "--max-queued-memory", "16777216", "--write-queue-cap",
	                      "1073741824", "--max-inflight",      "4096",     NULL};
	struct hd d;
	struct tl_client *c;
	struct pipeline p = {.n = 100000};
	long before, after;
	uint64_t queued = 0;
	int got = 0;

	c = up(&d, NULL, args);
	reg_ok(c, "rel.pipe", CUMSUM_SRC);
	scan_sum_ok(c, "rel.pipe", 3);
	for (int k = 0; k < 5; k++)
		scan_sum_ok(c, "rel.pipe", 3); /* runs inline from now on */
	before = h_rss_kib(d.pid);
	p.frame = scan_frame("rel.pipe", &p.len);
	p.fd = raw_connect(d.sock);
	pthread_create(&p.th, NULL, send_all, &p);
	for (int k = 0; k < 600 && h_stat(c, "memory_pauses") == 0; k++)
		usleep(100000);
	cr_assert_geq(h_stat(c, "memory_pauses"), 1, "the non-reading client was paused");
	/* what it holds is final once every request it sent is answered: in
	 * flight is only this stats */
	await_stat_at_most(c, "inflight", 1, "the paused client's requests");
	queued = h_stat(c, "queued_bytes");
	after = h_rss_kib(d.pid);
	cr_log_info("paused after %llu requests: RSS +%ld KiB holding %llu accounted bytes",
	            (unsigned long long)h_stat(c, "requests"), after - before,
	            (unsigned long long)queued);
	cr_assert_leq(queued, (16u << 20) + (1u << 20), "held %llu bytes",
	              (unsigned long long)queued);
	if (getenv("TORCHLOOP_TEST_SAN"))
		/* ASan keeps freed memory in its quarantine (256 MB) and pads every
		 * block: RSS says nothing about the daemon's own use there */
		h_not_checked("reliability: the RSS bound under the sanitizers (RSS +%ld KiB)",
		              after - before);
	else
		cr_assert_lt(after - before, 100 * 1024,
		             "RSS grew %ld KiB holding %llu reply bytes", after - before,
		             (unsigned long long)queued);
	scan_sum_ok(c, "rel.pipe", 3); /* others: served */
	while (got < p.n) {
		char code[64], msg[256];
		long long id;
		cr_assert_eq(raw_recv(p.fd, code, sizeof code, &id, msg, sizeof msg), 0,
		             "reply %d of %d missing", got, p.n);
		cr_assert_str_eq(code, "", "%s", msg);
		got++;
	}
	pthread_join(p.th, NULL);
	close(p.fd);
	free(p.frame);
	cr_assert_lt(h_stat(c, "queued_bytes"), 1u << 20, "memory released");
	down(&d, c);
}

/* 1 MiB of a 60 MiB frame, then silence: FRAME_TIMEOUT and a close. */
Test(reliability, a_frame_that_stops_arriving_is_closed_after_the_frame_timeout)
{
	const char *args[] = {"--no-probe", "--frame-timeout", "2", NULL};
	struct hd d;
	struct tl_client *c;
	char code[64], msg[512];
	long long id;
	uint8_t head[4];
	uint8_t *chunk = calloc(1, 1 << 20);
	int fd;

	c = up(&d, NULL, args);
	fd = raw_connect(d.sock);
	frame_put_header(head, 60u << 20);
	raw_send(fd, head, 4);
	raw_send(fd, chunk, 1 << 20);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0, "an error frame");
	cr_assert_str_eq(code, "FRAME_TIMEOUT", "%s", msg);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), -1, "then a close");
	close(fd);
	cr_assert_geq(h_stat(c, "stalled_closed"), 1);
	cr_assert_lt(h_stat(c, "queued_bytes"), 1u << 20, "its frame's memory was released");
	still_serves(&d);
	free(chunk);
	down(&d, c);
}

/* Like send_all, but stops at the first error (the daemon closes on it). */
static void *send_until_closed(void *arg)
{
	struct pipeline *p = arg;

	for (int k = 0; k < p->n; k++)
		if (send(p->fd, p->frame, p->len, MSG_NOSIGNAL) != (ssize_t)p->len)
			break;
	return NULL;
}

/* Reads to EOF; returns the number of whole frames (the last may be cut). */
static int count_frames_to_eof(int fd)
{
	size_t cap = 1 << 20, len = 0, at = 0;
	uint8_t *buf = malloc(cap);
	ssize_t k;
	int n = 0;

	while ((k = recv(fd, buf + len, cap - len, 0)) > 0) {
		len += (size_t)k;
		if (len == cap)
			buf = realloc(buf, cap *= 2);
	}
	while (at + 4 <= len) {
		uint32_t body = (uint32_t)buf[at] << 24 | (uint32_t)buf[at + 1] << 16 |
		                (uint32_t)buf[at + 2] << 8 | buf[at + 3];
		if (at + 4 + body > len)
			break;
		at += 4 + body;
		n++;
	}
	free(buf);
	return n;
}

/* Replies that stop leaving (the client reads nothing) close the connection too. */
static double mono_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Sends what the socket takes now (the daemon may not be reading). */
static size_t send_some(int fd, const uint8_t *p, size_t n)
{
	size_t sent = 0;

	while (sent < n) {
		ssize_t k = send(fd, p + sent, n - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (k <= 0)
			break;
		sent += (size_t)k;
	}
	return sent;
}

struct trickle {
	int fd[10];
	_Atomic int stop, rounds;
};

/* One byte per connection every 0.5 s: never silent long enough for the
 * stall timeout, far too slow for the frame's deadline. */
static void *trickle(void *arg)
{
	struct trickle *t = arg;
	uint8_t b = 0;

	while (!t->stop) {
		for (int i = 0; i < 10; i++)
			send_some(t->fd[i], &b, 1);
		t->rounds++;
		usleep(500 * 1000);
	}
	return NULL;
}

/*
 * True when the daemon closed fd before `until` (monotonic seconds), having
 * sent FRAME_TIMEOUT if anything: a close with unread bytes in its receive
 * buffer resets the connection, which may drop that last frame.  A recv that
 * times out is not a close.
 */
static bool closed_with_frame_timeout(int fd, double until)
{
	char code[64], msg[512], b;
	long long id;
	double left = until - mono_s();
	struct timeval tv = {left > 1 ? (time_t)left : 1, 0};

	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	errno = 0;
	if (raw_recv(fd, code, sizeof code, &id, msg, sizeof msg) == 0) {
		cr_assert_str_eq(code, "FRAME_TIMEOUT", "%s", msg);
		errno = 0;
		ssize_t k = recv(fd, &b, 1, 0);
		return k == 0 || (k < 0 && errno == ECONNRESET);
	}
	return errno == 0 || errno == ECONNRESET;
}

/*
 * Ten connections announce 6 MiB frames, send 5 MiB each and then one byte
 * every half second (issue 31: before, 20 of them held 1.2 GiB for as long as
 * they kept trickling, and kept every other connection of their uid out).
 * Now a body is admitted only within the caps (16 MiB here: the rest wait
 * before their body, holding nothing), every frame has a deadline
 * (frame-timeout + 1 s per MiB: 8 s), and a client of the same uid gets a
 * connection once the first trickler is closed.
 */
Test(reliability, trickled_frames_are_held_to_the_caps_and_closed_by_their_deadline)
{
	const char *args[] = {"--no-probe", "--frame-timeout",
	                      "2",          "--max-queued-memory",
	                      "16777216",   "--write-queue-cap",
	                      "8388608",    "--max-connections-per-uid",
	                      "11",         NULL};
	uint8_t head[4], *chunk = calloc(1, 5u << 20);
	struct trickle t = {{0}, 0, 0};
	size_t sent[10] = {0};
	int admitted = 0;
	struct hd d;
	struct tl_client *c, *other = NULL;
	struct tl_error err;
	pthread_t th;
	long base, rss;
	double t0;
	int closed = 0;

	c = up(&d, NULL, args);
	base = h_rss_kib(d.pid);
	frame_put_header(head, 6u << 20);
	for (int i = 0; i < 10; i++) {
		t.fd[i] = raw_connect(d.sock);
		raw_send(t.fd[i], head, 4);
	}
	t0 = mono_s();
	while (mono_s() - t0 < 3) /* 5 MiB each, as far as the daemon takes them */
		for (int i = 0; i < 10; i++)
			sent[i] += send_some(t.fd[i], chunk + sent[i], (5u << 20) - sent[i]);
	for (int i = 0; i < 10; i++)
		admitted += sent[i] == 5u << 20;
	cr_assert_geq(admitted, 1, "some bodies were taken");
	cr_assert_lt(admitted, 10, "not all: they would be 50 MiB");
	pthread_create(&th, NULL, trickle, &t);
	/* measured while they trickle: every connection has had 6 more bytes */
	for (int k = 0; k < 1200 && t.rounds < 6; k++)
		usleep(100 * 1000);
	cr_assert_geq(t.rounds, 6, "the trickle thread made no 6 rounds within 120 s");
	rss = h_rss_kib(d.pid);
	cr_assert_leq(h_stat(c, "queued_bytes"), 16u << 20, "within --max-queued-memory");
	cr_assert_lt(rss - base, 24 * 1024, "RSS grew %ld KiB (caps: 16 MiB)", rss - base);
	cr_assert_geq(h_stat(c, "memory_pauses"), 1, "the rest wait before their body");
	/* the uid is at its cap: another of its clients gets in once one closes */
	while (other == NULL && mono_s() - t0 < 30)
		if (tl_connect(d.sock, 5000, &other, &err) != 0)
			usleep(100 * 1000);
	cr_assert_not_null(other, "no connection for the uid within 30 s: %s", err.message);
	cr_assert_lt(mono_s() - t0, 2 * 8.0 + 3, "in %.1f s (deadline 8 s)", mono_s() - t0);
	tl_close(other);
	for (int i = 0; i < 10; i++) /* each in turn: admitted when memory frees, then timed out */
		closed += closed_with_frame_timeout(t.fd[i], t0 + 90);
	cr_assert_eq(closed, 10, "every trickler was closed");
	t.stop = 1;
	pthread_join(th, NULL);
	for (int i = 0; i < 10; i++)
		close(t.fd[i]);
	cr_assert_lt(h_stat(c, "queued_bytes"), 1u << 20, "their memory was released");
	still_serves(&d);
	free(chunk);
	down(&d, c);
}

Test(reliability, a_client_whose_replies_stop_moving_is_closed)
{
	const char *args[] = {"--no-probe", "--frame-timeout", "2", NULL};
	struct hd d;
	struct tl_client *c;
	struct pipeline p = {.n = 20000};
	int got;

	c = up(&d, NULL, args);
	reg_ok(c, "rel.pipe", CUMSUM_SRC);
	scan_sum_ok(c, "rel.pipe", 3);
	p.frame = scan_frame("rel.pipe", &p.len);
	p.fd = raw_connect(d.sock);
	pthread_create(&p.th, NULL, send_until_closed, &p);
	for (int k = 0; k < 300 && h_stat(c, "stalled_closed") == 0; k++)
		usleep(100000);
	cr_assert_geq(h_stat(c, "stalled_closed"), 1, "the connection was closed");
	pthread_join(p.th, NULL);
	got = count_frames_to_eof(p.fd);
	cr_assert_lt(got, p.n, "the daemon gave up on it before sending everything (%d)", got);
	close(p.fd);
	free(p.frame);
	scan_sum_ok(c, "rel.pipe", 3);
	down(&d, c);
}

Test(reliability, idle_connections_are_closed_and_busy_ones_are_not)
{
	const char *args[] = {"--no-probe", "--idle-timeout", "2", NULL};
	struct hd d;
	struct tl_client *c;
	struct tl_error err;
	char code[64], msg[256];
	long long id;
	int fd, ready;

	c = up(&d, NULL, args);
	fd = raw_connect(d.sock);
	/* a request every 0.5 s on c, opened before fd, until fd was closed for
	 * its 2 idle seconds: c outlived them busy (the bound only ends a hang) */
	for (int k = 0; k < 600 && h_stat(c, "idle_closed") == 0; k++) {
		cr_assert_eq(tl_health(c, &ready, &err), 0, "the busy connection: %s", err.message);
		usleep(500000);
	}
	cr_assert_eq(tl_health(c, &ready, &err), 0, "the busy connection: %s", err.message);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), -1,
	             "the idle connection was closed");
	close(fd);
	cr_assert_geq(h_stat(c, "idle_closed"), 1);
	down(&d, c);
}

/* ---- the cache -------------------------------------------------------------------- */

Test(reliability, a_cache_directory_others_can_write_to_is_refused)
{
	char cache[512], objects[600];
	struct hd d;

	h_tmpdir(cache, sizeof cache, "opencache");
	chmod(cache, 0777);
	hd_start(&d, cache, (const char *const[]){"--no-probe", NULL});
	cr_assert_eq(hd_exit_status(&d, 60), 1);
	cr_assert(log_has(&d, "world-writable", 0), "log %s", d.log);
	chmod(cache, 0700);
	snprintf(objects, sizeof objects, "%s/objects", cache);
	mkdir(objects, 0700);
	cr_assert_eq(chown(objects, 65534, 65534), 0);
	hd_start(&d, cache, (const char *const[]){"--no-probe", NULL});
	cr_assert_eq(hd_exit_status(&d, 60), 1);
	cr_assert(log_has(&d, "owned by uid 65534", 0), "log %s", d.log);
}

/* The cache key of adapter's specialization whose signature contains sig. */
static void spec_key(struct tl_client *c, const char *adapter, const char *sig, char key[65])
{
	json_t *j = h_call_json(c, "describe", adapter), *sp;
	size_t i;

	key[0] = '\0';
	json_array_foreach(json_object_get(j, "specializations"), i, sp)
	{
		if (strstr(jstr(sp, "signature"), sig))
			snprintf(key, 65, "%s", jstr(sp, "key"));
	}
	json_decref(j);
	cr_assert_eq(strlen(key), 64, "no specialization %s", sig);
}

static void run_py(const char *code, const char *a1, const char *a2, const char *a3)
{
	char py[1100];
	const char *argv[] = {py, "-c", code, a1, a2, a3, NULL};

	snprintf(py, sizeof py, "%s/.venv/bin/python", h_root());
	cr_assert_eq(h_run(argv, NULL), 0, "python helper failed");
}

/* Moves objects/A.* and objects/B.* into each other's names. */
static const char SWAP_PY[] =
    "import os, sys\n"
    "o, a, b = sys.argv[1:4]\n"
    "for ext in ('so', 'meta'):\n"
    "    pa, pb = f'{o}/{a}.{ext}', f'{o}/{b}.{ext}'\n"
    "    os.rename(pa, pa + '.x'); os.rename(pb, pa); os.rename(pa + '.x', pb)\n";

/* Makes entry A B's artifact with metadata that checks out (sha, size, A's key). */
static const char FORGE_PY[] =
    "import msgpack, os, shutil, sys\n"
    "o, a, b = sys.argv[1:4]\n"
    "m = msgpack.unpackb(open(f'{o}/{b}.meta', 'rb').read())\n"
    "m['key'] = a\n"
    "os.unlink(f'{o}/{a}.so'); shutil.copy(f'{o}/{b}.so', f'{o}/{a}.so')\n"
    "open(f'{o}/{a}.meta', 'wb').write(msgpack.packb(m))\n";

static void restart(struct hd *d, const char *cache, struct tl_client **c)
{
	tl_close(*c);
	cr_assert_eq(hd_stop(d), 0);
	hd_start(d, cache, (const char *const[]){"--no-probe", NULL});
	hd_wait_ready(d, 120);
	*c = hd_connect(d);
	reg_ok(*c, "rel.cache", CUMSUM_SRC);
}

/*
 * Tampered entries: a swapped .so + .meta pair (each .meta names its key),
 * an artifact whose metadata checks out but whose outputs are another
 * graph's (checked against the signature before any data is returned:
 * ARTIFACT_CORRUPT, then rebuilt), and a FIFO in place of a .meta (refused,
 * never opened for a blocking read).
 */
Test(reliability, tampered_cache_entries_are_refused_and_rebuilt)
{
	char cache[512], objects[600], k3[65], k5[65], path[800];
	struct hd d;
	struct tl_client *c;
	struct tl_error err;
	json_t *j;

	h_tmpdir(cache, sizeof cache, "tamper");
	snprintf(objects, sizeof objects, "%s/objects", cache);
	c = up(&d, cache, (const char *const[]){"--no-probe", NULL});
	reg_ok(c, "rel.cache", CUMSUM_SRC);
	scan_sum_ok(c, "rel.cache", 3);
	scan_sum_ok(c, "rel.cache", 5);
	spec_key(c, "rel.cache", "T=3 ", k3);
	spec_key(c, "rel.cache", "T=5 ", k5);

	restart(&d, cache, &c); /* forged: T=5's entry holds T=3's graph */
	run_py(FORGE_PY, objects, k5, k3);
	expect_code(scan_sum(c, "rel.cache", 5, &err), &err, "ARTIFACT_CORRUPT");
	scan_sum_ok(c, "rel.cache", 5); /* dropped, quarantined, rebuilt */
	scan_sum_ok(c, "rel.cache", 3);
	cr_assert_eq(hd_counter(c, "rel.cache", "compiles"), 1);

	restart(&d, cache, &c); /* swapped pair */
	run_py(SWAP_PY, objects, k3, k5);
	scan_sum_ok(c, "rel.cache", 3);
	scan_sum_ok(c, "rel.cache", 5);
	cr_assert_eq(hd_counter(c, "rel.cache", "compiles"), 2, "both entries were rebuilt");

	restart(&d, cache, &c); /* a FIFO where the .meta was */
	snprintf(path, sizeof path, "%s/%s.meta", objects, k3);
	cr_assert_eq(unlink(path), 0);
	cr_assert_eq(mkfifo(path, 0600), 0);
	scan_sum_ok(c, "rel.cache", 3);
	cr_assert_eq(hd_counter(c, "rel.cache", "compiles"), 1);
	scan_sum_ok(c, "rel.cache", 5);
	cr_assert_eq(hd_counter(c, "rel.cache", "cache_hits"), 1);
	/* a graph loaded from the cache shows the compile time its .meta recorded */
	j = h_call_json(c, "describe", "rel.cache");
	{
		json_t *sp;
		size_t i;
		json_array_foreach(json_object_get(j, "specializations"), i, sp)
		{
			if (strstr(jstr(sp, "signature"), "T=5 ")) {
				cr_assert(json_is_true(json_object_get(sp, "from_cache")));
				cr_assert_gt(
				    json_number_value(json_object_get(sp, "compile_seconds")), 0);
			}
		}
	}
	json_decref(j);
	down(&d, c);
}

/* A record that does not parse in the warm-start index is skipped, not used. */
Test(reliability, a_corrupt_warm_start_index_record_is_skipped)
{
	char cache[512], dir[512], idx[600], path[1200];
	const char *args[] = {"--no-probe", "--adapters", dir, NULL};
	static const uint8_t garbage[] = {0,    0, 0, 5, 0xc1, 0xc1, 0xc1, 0xc1,
	                                  0xc1, 0, 0, 0, 3,    0x81, 0xa1, 'x'};
	struct hd d;
	struct tl_client *c;
	json_t *j;
	FILE *f;
	DIR *dd;
	struct dirent *e;

	h_tmpdir(cache, sizeof cache, "idx");
	h_tmpdir(dir, sizeof dir, "idxdir");
	snprintf(path, sizeof path, "%s/rel.cache.adapter", dir);
	h_write_file(path,
	             "name = rel.cache\nbody = %s/examples/bodies/cumsum.py\nmax_steps = 16\n",
	             h_root());
	c = up(&d, cache, args);
	scan_sum_ok(c, "rel.cache", 3);
	down(&d, c);
	snprintf(idx, sizeof idx, "%s/index", cache);
	dd = opendir(idx);
	while ((e = readdir(dd)) != NULL) {
		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof path, "%s/%s", idx, e->d_name);
		f = fopen(path, "a");
		fwrite(garbage, 1, sizeof garbage, f);
		fclose(f);
	}
	closedir(dd);
	c = up(&d, cache, args);
	j = h_call_json(c, "describe", "rel.cache");
	cr_assert_eq(json_array_size(json_object_get(j, "specializations")), 1,
	             "the good record, loaded; nothing from the bad ones");
	json_decref(j);
	scan_sum_ok(c, "rel.cache", 3);
	cr_assert_eq(hd_counter(c, "rel.cache", "compiles"), 0);
	down(&d, c);
}

/* Entries of cache/tmp left behind, not counting the running daemon's worker
 * scratch directories themselves (tmp/w.<daemon pid>.<n>/, the sandbox's:
 * docs/operations.md), whose own entries count. */
static int tmp_leftovers(const char *cache, pid_t daemon)
{
	char tmp[600], scratch[64], sub[900];
	DIR *dd;
	struct dirent *e;
	int left = 0;

	snprintf(tmp, sizeof tmp, "%s/tmp", cache);
	snprintf(scratch, sizeof scratch, "w.%d.", (int)daemon);
	dd = opendir(tmp);
	cr_assert_not_null(dd, "%s", tmp);
	while ((e = readdir(dd)) != NULL) {
		if (e->d_name[0] == '.')
			continue;
		if (strncmp(e->d_name, scratch, strlen(scratch)) != 0) {
			left++;
			continue;
		}
		snprintf(sub, sizeof sub, "%s/%s", tmp, e->d_name);
		DIR *sd = opendir(sub);
		for (struct dirent *f; sd && (f = readdir(sd)) != NULL;)
			left += f->d_name[0] != '.';
		if (sd)
			closedir(sd);
	}
	closedir(dd);
	return left;
}

/*
 * The disk fills up during a compile: COMPILE_FAILED whose message starts
 * with the cause, nothing left in tmp/, and not remembered: once there is
 * space the same request compiles.
 */
Test(reliability, a_full_disk_fails_the_compile_with_its_cause_and_is_not_remembered)
{
	char cache[512], filler[600];
	struct hd d;
	struct tl_client *c;
	struct tl_error err;
	struct statvfs vfs;
	int fd;

	h_tmpdir(cache, sizeof cache, "full");
	if (mount("tmpfs", cache, "tmpfs", 0, "size=16m,mode=0700") != 0)
		cr_skip_test("CANNOT TEST A FULL DISK HERE: mounting a tmpfs needs root (%s)",
		             strerror(errno));
	c = up(&d, cache, (const char *const[]){"--no-probe", NULL});
	reg_ok(c, "rel.full", CUMSUM_SRC);
	snprintf(filler, sizeof filler, "%s/filler", cache);
	fd = open(filler, O_WRONLY | O_CREAT, 0600);
	cr_assert_eq(statvfs(cache, &vfs), 0);
	cr_assert_eq(posix_fallocate(fd, 0, (off_t)(vfs.f_bavail * vfs.f_frsize) - 4096), 0);
	close(fd);
	expect_code(scan_sum(c, "rel.full", 3, &err), &err, "COMPILE_FAILED");
	cr_assert_not_null(strstr(err.message, "No space left on device"), "%s", err.message);
	cr_assert_lt(strstr(err.message, "No space left on device") - err.message, 100,
	             "the cause comes first: %s", err.message);
	cr_assert_eq(tmp_leftovers(cache, d.pid), 0, "the failed compile left files in %s/tmp",
	             cache);
	unlink(filler);
	scan_sum_ok(c, "rel.full", 3);
	cr_assert_eq(hd_counter(c, "rel.full", "compiles"), 2, "the failure was not remembered");
	down(&d, c);
	umount2(cache, MNT_DETACH);
}

/* ---- the worker ------------------------------------------------------------------- */

/*
 * A worker that dies at start (here: a wrapper that exits while a flag file
 * exists) is retried with backoff, not in a tight loop; meanwhile jobs fail
 * at once with WORKER_CRASHED and health is not ready; when the worker can
 * start again, everything works.
 */
Test(reliability, a_worker_that_cannot_start_backs_off_and_fails_waiters)
{
	char dir[512], wrapper[600], flag[600];
	const char *args[] = {"--no-probe", "--worker", wrapper, NULL};
	struct hd d;
	struct tl_client *c;
	struct tl_error err;
	bool backoff = false;
	pid_t w;

	h_tmpdir(dir, sizeof dir, "wrapper");
	snprintf(wrapper, sizeof wrapper, "%s/worker.py", dir);
	snprintf(flag, sizeof flag, "%s/broken", dir);
	h_write_file(wrapper,
	             "import os, runpy, sys\n"
	             "if os.path.exists(%s%s%s):\n    sys.exit(7)\n"
	             "sys.argv[0] = %s%s/daemon/worker/compile_worker.py%s\n"
	             "runpy.run_path(sys.argv[0], run_name='__main__')\n",
	             "'", flag, "'", "'", h_root(), "'");
	c = up(&d, NULL, args);
	close(open(flag, O_CREAT | O_WRONLY, 0600));
	w = h_child_of(d.pid);
	cr_assert_gt(w, 0);
	kill(w, SIGKILL);
	for (int k = 0; k < 100 && !backoff; k++) {
		json_t *j = health(c);
		backoff = strcmp(jstr(j, "worker_state"), "backoff") == 0 &&
		          json_is_false(json_object_get(j, "ready"));
		json_decref(j);
		usleep(100000);
	}
	cr_assert(backoff, "health reports the worker in backoff");
	expect_code(reg_src(c, "rel.nostart", CUMSUM_SRC, &err), &err, "WORKER_CRASHED");
	cr_assert_not_null(strstr(err.message, "cannot start"), "%s", err.message);
	/* backoff, not a tight loop: each failed start doubles the wait before the next */
	cr_assert(
	    log_has(&d, "compile worker: 3 start failure(s) in a row; next try in 1.00 s", 120),
	    "no third failed start within 120 s; log %s", d.log);
	cr_assert(log_has(&d, "compile worker: 1 start failure(s) in a row; next try in 0.25 s", 0),
	          "log %s", d.log);
	cr_assert(log_has(&d, "compile worker: 2 start failure(s) in a row; next try in 0.50 s", 0),
	          "log %s", d.log);
	cr_assert_geq(h_stat(c, "worker_start_failures"), 3);
	unlink(flag);
	hd_wait_ready(&d, 60); /* the next try (at most 32 s away) succeeds */
	reg_ok(c, "rel.nostart", CUMSUM_SRC);
	down(&d, c);
}

/*
 * A worker that speaks another protocol (a worker from another build, given
 * by --worker) fails the start, naming both versions; the real one starts.
 */
Test(reliability, a_worker_of_another_protocol_fails_the_start)
{
	char dir[512], wrapper[600];
	struct hd d;

	h_tmpdir(dir, sizeof dir, "protocol");
	snprintf(wrapper, sizeof wrapper, "%s/worker.py", dir);
	h_write_file(wrapper,
	             "import sys\n"
	             "sys.path.insert(0, '%s/daemon/worker')\n"
	             "import compile_worker as cw\n"
	             "cw.PROTOCOL = 99\n"
	             "sys.exit(cw.main())\n",
	             h_root());
	hd_start(&d, NULL, (const char *const[]){"--no-probe", "--worker", wrapper, NULL});
	cr_assert_eq(hd_exit_status(&d, 120), 1);
	cr_assert(log_has(&d, "speaks protocol 99, this daemon 1", 0), "log %s", d.log);
	hd_start(&d, NULL, (const char *const[]){"--no-probe", NULL});
	hd_wait_ready(&d, 120);
	cr_assert_eq(hd_stop(&d), 0);
}

#define KILLER_SRC                                                                                 \
	"import os, signal\n\ndef body(c, x):\n    os.kill(os.getpid(), signal.SIGKILL)\n"         \
	"    return c + x, c\n"

/* A body that kills the worker: transient once, refused after the second time. */
Test(reliability, a_body_that_kills_the_worker_twice_is_refused_until_re_registered)
{
	struct hd d;
	struct tl_client *c;
	struct tl_error err;

	c = up(&d, NULL, (const char *const[]){"--no-probe", NULL});
	reg_ok(c, "rel.killer", KILLER_SRC);
	expect_code(scan_sum(c, "rel.killer", 3, &err), &err, "WORKER_CRASHED");
	expect_code(scan_sum(c, "rel.killer", 3, &err), &err, "WORKER_CRASHED");
	cr_assert_not_null(strstr(err.message, "not compiled again"), "%s", err.message);
	expect_code(scan_sum(c, "rel.killer", 4, &err), &err, "WORKER_CRASHED");
	cr_assert_eq(hd_counter(c, "rel.killer", "compiles"), 2, "no third compile");
	cr_assert_eq(hd_counter(c, "rel.killer", "worker_crashes"), 2);
	still_serves(&d);
	reg_ok(c, "rel.killer", KILLER_SRC); /* the same definition again lifts the ban */
	expect_code(scan_sum(c, "rel.killer", 4, &err), &err, "WORKER_CRASHED");
	cr_assert_null(strstr(err.message, "not compiled again"), "%s", err.message);
	cr_assert_eq(hd_counter(c, "rel.killer", "compiles"), 3, "compiled again");
	reg_ok(c, "rel.killer", CUMSUM_SRC); /* a new definition starts afresh */
	scan_sum_ok(c, "rel.killer", 3);
	down(&d, c);
}

/* A timeout kills the worker's whole tree, a setsid'd grandchild included. */
Test(reliability, a_timeout_kills_the_worker_and_everything_it_started)
{
	const char *args[] = {"--no-probe", "--compile-timeout", "5", NULL};
	/* the body says its grandchild's pid on stderr, which the daemon logs (the
	 * worker's sandbox lets it write no file of the test's) */
	static const char src[] =
	    "import subprocess, sys, time\n\ndef body(c, x):\n"
	    "    p = subprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
	    "    sys.stderr.write('grandchild %d\\n' % p.pid)\n    sys.stderr.flush()\n"
	    "    time.sleep(600)\n    return c + x, c\n";
	struct hd d;
	struct tl_client *c;
	struct tl_error err;
	char *text, *at;
	int pid = 0;

	c = up(&d, NULL, args);
	reg_ok(c, "rel.tree", src);
	expect_code(scan_sum(c, "rel.tree", 3, &err), &err, "COMPILE_TIMEOUT");
	cr_assert(log_has(&d, "\"grandchild ", 10), "the body started its child; log %s", d.log);
	text = h_slurp(d.log);
	at = strstr(text, "\"grandchild ");
	cr_assert_eq(sscanf(at, "\"grandchild %d", &pid), 1);
	free(text);
	cr_assert(pid_gone(pid, 10), "the setsid'd sleep %d outlived the timeout", pid);
	cr_assert_geq(h_stat(c, "worker_orphans_killed"), 1);
	still_serves(&d);
	down(&d, c);
}

/* SIGKILL the daemon mid-compile: its worker dies too; the next start cleans tmp/. */
Test(reliability, a_dead_daemons_worker_dies_and_its_leftovers_are_cleaned)
{
	char cache[512], stale[800];
	struct hd d;
	struct tl_client *c;
	struct bg slow;
	pid_t w, dead;

	h_tmpdir(cache, sizeof cache, "orphan");
	c = up(&d, cache, (const char *const[]){"--no-probe", NULL});
	reg_ok(c, "rel.slow", SLOW_SRC);
	bg_start(&slow, &d, "rel.slow", 1);
	h_wait_spec_state(c, "rel.slow", "compiling", 60);
	w = h_child_of(d.pid);
	cr_assert_gt(w, 0, "the worker is compiling");
	dead = d.pid;
	kill(d.pid, SIGKILL);
	waitpid(d.pid, NULL, 0);
	d.pid = 0;
	pthread_join(slow.th, NULL);
	cr_assert_eq(slow.rc, -1, "the scan failed with its daemon");
	tl_close(c);
	cr_assert(pid_gone(w, 10), "the worker %d outlived its daemon", (int)w);
	/* what a compile of the dead daemon left behind */
	snprintf(stale, sizeof stale, "%s/tmp/0123456789abcdef.%d.0.so.d", cache, (int)dead);
	cr_assert_eq(mkdir(stale, 0700), 0);
	strcat(stale, "/wrapper.cpp");
	close(open(stale, O_CREAT | O_WRONLY, 0600));
	hd_start(&d, cache, (const char *const[]){"--no-probe", NULL});
	hd_wait_ready(&d, 120);
	cr_assert_eq(tmp_leftovers(cache, d.pid), 0, "tmp/ was cleaned at start");
	cr_assert_eq(hd_stop(&d), 0);
}

/*
 * The worker gets an allow-list of the daemon's environment, never the rest:
 * checked at import (register) and inside the body while it is compiled.
 * Inductor's cache is the daemon's cache directory's inductor/ when the
 * environment names none.
 */
Test(reliability, the_worker_sees_only_an_allow_listed_environment)
{
	static const char fmt[] =
	    "import os\n\n"
	    "def check():\n"
	    "    assert 'TL_TEST_SECRET' not in os.environ, 'the environment leaked'\n"
	    "    assert os.environ.get('PATH'), 'PATH must reach the worker'\n"
	    "    assert os.environ.get('OMP_TEST_VAR') == '3', 'OMP_* must reach the worker'\n"
	    "    got = os.environ.get('TORCHINDUCTOR_CACHE_DIR')\n"
	    "    assert got == '%s/inductor', got\n\n"
	    "check()\n\n"
	    "def body(carry, x):\n"
	    "    check()\n"
	    "    carry = carry + x\n"
	    "    return carry, carry\n";
	char text[sizeof fmt + PATH_MAX], src[sizeof text + 64];
	struct hd d;
	struct tl_client *c;

	snprintf(text, sizeof text, fmt, h_shared_cache());
	h_unchecked_src(src, sizeof src, text); /* imported at this register, not remembered */
	setenv("TL_TEST_SECRET", "hunter2", 1);
	setenv("OMP_TEST_VAR", "3", 1);
	unsetenv("TORCHINDUCTOR_CACHE_DIR");
	c = up(&d, NULL, (const char *const[]){"--no-probe", NULL});
	reg_ok(c, "rel.env", src);    /* the import runs in the worker at register time */
	scan_sum_ok(c, "rel.env", 3); /* and the body while it is traced */
	down(&d, c);
}

/*
 * torch.linalg.eigvalsh's _linalg_eigh has no C shim in torch 2.14 and takes a
 * string (UPLO), so the dispatcher path cannot take it either: the artifact
 * would need AOTI's C++ proxy executor.  Refused at compile time, naming the
 * aten op, using no budget, remembered.
 */
Test(reliability, a_graph_that_needs_the_proxy_executor_is_refused_at_compile_time)
{
	static const char src[] = "import torch\n\ndef body(c, x):\n"
	                          "    a = x + x.transpose(0, 1)\n"
	                          "    c = c + torch.linalg.eigvalsh(a)\n    return c, c\n";
	struct hd d;
	struct tl_client *c;
	struct tl_error err;
	struct tl_builder *b = tl_builder_new();
	double carry[3] = {1, 2, 3}, xs[18];
	int64_t cs[] = {3}, xsh[] = {2, 3, 3};
	struct tl_reply *r;

	h_fill(xs, TL_FLOAT64, 18, 9);
	c = up(&d, NULL, (const char *const[]){"--no-probe", NULL});
	reg_ok(c, "rel.eigh", src);
	for (int k = 0; k < 2; k++) {
		expect_code(tl_scan(c, "rel.eigh", tl_tensor(b, TL_FLOAT64, 1, cs, carry),
		                    tl_tensor(b, TL_FLOAT64, 3, xsh, xs), &r, &err),
		            &err, "PROXY_EXECUTOR_REQUIRED");
		cr_assert_not_null(strstr(err.message, "aten::_linalg_eigh"), "%s", err.message);
	}
	cr_assert_eq(hd_counter(c, "rel.eigh", "compiles"), 1, "remembered");
	cr_assert_eq(hd_counter(c, "rel.eigh", "graphs"), 0, "no budget used");
	still_serves(&d);
	tl_builder_free(b);
	down(&d, c);
}

/*
 * torch.linalg.solve in a source body: its _linalg_solve_ex has no C shim in
 * torch 2.14, so the artifact calls it through libtorch's dispatcher, not
 * AOTI's C++ proxy executor (worker dispatch_calls.py); export's error check
 * becomes the artifact's fault flag.  With x = 0 the matrix is 3 I: the
 * carry is divided by 3 each step (hand-computed); a step whose x is -3 I is
 * singular: LINALG_ERROR, no result, and the daemon serves the next scan.
 */
Test(reliability, a_linear_solve_in_a_step_runs_and_a_singular_one_fails_the_run)
{
	static const char src[] = "import torch\n\ndef body(c, x):\n"
	                          "    a = x + 3 * torch.eye(3, dtype=x.dtype)\n"
	                          "    c = torch.linalg.solve(a, c)\n    return c, c\n";
	struct hd d;
	struct tl_client *c;
	struct tl_error err;
	struct tl_builder *b = tl_builder_new();
	double carry[3] = {1, 2, 3}, xs[18] = {0}, bad[18] = {0};
	int64_t cs[] = {3}, xsh[] = {2, 3, 3};
	struct tl_reply *r;

	for (int i = 0; i < 3; i++)
		bad[9 + 4 * i] = -3; /* step 1: x = -3 I, a = 0 */
	c = up(&d, NULL, (const char *const[]){"--no-probe", NULL});
	reg_ok(c, "rel.solve", src);
	for (int k = 0; k < 2; k++) {
		const double *fin, *y;
		cr_assert_eq(tl_scan(c, "rel.solve", tl_tensor(b, TL_FLOAT64, 1, cs, carry),
		                     tl_tensor(b, TL_FLOAT64, 3, xsh, xs), &r, &err),
		             0, "%s %s", err.code, err.message);
		fin = tl_tree_data(tl_reply_tree(r, "carry"));
		y = tl_tree_data(tl_reply_tree(r, "outputs"));
		for (int i = 0; i < 3; i++) {
			cr_assert_float_eq(y[i], carry[i] / 3, 1e-15);
			cr_assert_float_eq(fin[i], carry[i] / 9, 1e-15);
		}
		tl_reply_free(r);
		expect_code(tl_scan(c, "rel.solve", tl_tensor(b, TL_FLOAT64, 1, cs, carry),
		                    tl_tensor(b, TL_FLOAT64, 3, xsh, bad), &r, &err),
		            &err, "LINALG_ERROR");
	}
	cr_assert_eq(hd_counter(c, "rel.solve", "graphs"), 1, "one graph for both");
	still_serves(&d);
	tl_builder_free(b);
	down(&d, c);
}

/* register imports the body first: errors are BODY_ERROR and nothing is registered. */
Test(reliability, register_refuses_a_body_that_does_not_import)
{
	static const struct {
		const char *src, *entry, *needle;
	} bad[] = {
	    {"def body(c, x)\n    return c, x\n", "body", "SyntaxError"},
	    {CUMSUM_SRC, "step", "has no function 'step'"},
	    {"raise ImportError('no such solver')\n" CUMSUM_SRC, "body", "no such solver"},
	    {"body = 3\n", "body", "has no function"},
	};
	struct hd d;
	struct tl_client *c;
	struct tl_error err;
	json_t *j;

	c = up(&d, NULL, (const char *const[]){"--no-probe", NULL});
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		struct tl_adapter_def def = {"rel.bad", bad[i].src, "bad.py", bad[i].entry,
		                             NULL,      0,          0,        0};
		expect_code(tl_register(c, &def, &err), &err, "BODY_ERROR");
		cr_assert_not_null(strstr(err.message, bad[i].needle), "case %zu: %s", i,
		                   err.message);
	}
	j = h_call_json(c, "list", NULL);
	cr_assert_eq(json_array_size(json_object_get(j, "adapters")), 0, "nothing registered");
	json_decref(j);
	reg_ok(c, "rel.bad", CUMSUM_SRC);
	down(&d, c);
}

/* ---- limits ----------------------------------------------------------------------- */

Test(reliability, max_connections_over_the_descriptor_limit_is_refused_at_start)
{
	struct rlimit rl = {256, 256};
	struct hd d;

	cr_assert_eq(setrlimit(RLIMIT_NOFILE, &rl), 0);
	hd_start(&d, NULL, (const char *const[]){"--no-probe", "--max-connections", "1000", NULL});
	cr_assert_eq(hd_exit_status(&d, 60), 1);
	cr_assert(log_has(&d, "LimitNOFILE", 0), "log %s", d.log);
	/* 2 x 60 (a connection and a memfd it may pass) + 64 + 64 + 2 x threads fits */
	hd_start(&d, NULL, (const char *const[]){"--no-probe", "--max-connections", "60", NULL});
	hd_wait_ready(&d, 120);
	cr_assert_eq(hd_stop(&d), 0);
}

static int hello_as(const char *sock, uid_t uid)
{
	pid_t pid = fork();
	int status;

	if (pid == 0) {
		struct tl_client *c;
		struct tl_error err;
		if (setgid(uid) != 0 || setuid(uid) != 0)
			_exit(3);
		if (tl_connect(sock, 5000, &c, &err) != 0 || tl_hello(c, &err) != 0)
			_exit(1);
		tl_close(c);
		_exit(0);
	}
	waitpid(pid, &status, 0);
	return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

Test(reliability, one_uid_cannot_take_every_connection)
{
	const char *args[] = {
	    "--no-probe", "--max-connections-per-uid", "3", "--socket-mode", "0666", NULL};
	struct hd d;
	struct tl_client *c[3];
	char code[64], msg[256];
	long long id;
	int fd;

	hd_start(&d, NULL, args);
	hd_wait_ready(&d, 120);
	chmod(d.dir, 0755);
	for (int k = 0; k < 3; k++)
		c[k] = hd_connect(&d);
	fd = raw_connect(d.sock);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
	cr_assert_str_eq(code, "BUSY", "%s", msg);
	cr_assert_not_null(strstr(msg, "max-connections-per-uid"), "%s", msg);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), -1, "then a close");
	close(fd);
	cr_assert_eq(hello_as(d.sock, 65534), 0, "another uid still gets in");
	tl_close(c[2]);
	/* the daemon closed its end: c[0] and c[1] are all that is open */
	await_stat_at_most(c[0], "open_connections", 2, "the closed client's connection");
	c[2] = hd_connect(&d); /* a slot came free */
	for (int k = 0; k < 3; k++)
		tl_close(c[k]);
	cr_assert_eq(hd_stop(&d), 0);
}

/* The client library reports a daemon that closed on it; it never raises SIGPIPE. */
Test(reliability, a_daemon_that_closes_mid_request_is_an_error_not_a_sigpipe)
{
	const char *args[] = {"--no-probe", "--max-frame", "1048576", NULL};
	struct hd d;
	struct tl_client *c;
	struct tl_error err;
	struct tl_builder *b = tl_builder_new();
	double carry[4] = {0};
	double *xs = calloc(4 * 131072, sizeof *xs); /* 4 MiB: over --max-frame */
	int64_t cs[] = {4}, xsh[] = {4, 131072};
	struct tl_reply *r;
	int rc;

	signal(SIGPIPE, SIG_DFL); /* what a solver process has */
	c = up(&d, NULL, args);
	rc = tl_scan(c, "rel.any", tl_tensor(b, TL_FLOAT64, 1, cs, carry),
	             tl_tensor(b, TL_FLOAT64, 2, xsh, xs), &r, &err);
	cr_assert_eq(rc, -1);
	cr_assert(strcmp(err.code, "FRAME_TOO_LARGE") == 0 || strcmp(err.code, "IO") == 0, "%s %s",
	          err.code, err.message);
	tl_close(c);
	still_serves(&d);
	tl_builder_free(b);
	free(xs);
	cr_assert_eq(hd_stop(&d), 0);
}

/* ---- requests and registrations -------------------------------------------------- */

/* A compile request whose carry is the shape tree given as raw msgpack. */
static void send_compile(int fd, const uint8_t *carry, size_t carry_len)
{
	struct writer w;
	size_t len;
	struct proto_err err;
	uint8_t *frame;

	cr_assert_eq(writer_init(&w), 0);
	msg_begin_request(&w, 9, "compile", 4);
	writer_key_str(&w, "adapter", "rel.dup");
	writer_key_str(&w, "dtype", "float64");
	writer_str(&w, "carry");
	writer_raw(&w, carry, carry_len);
	writer_str(&w, "inputs");
	msgpack_pack_map(&w.pk, 2);
	writer_key_str(&w, "k", "T");
	writer_str(&w, "s");
	msgpack_pack_array(&w.pk, 2);
	msgpack_pack_int(&w.pk, 3);
	msgpack_pack_int(&w.pk, 4);
	frame = writer_flatten(&w, &len, PROTO_FRAME_MAX, &err);
	cr_assert_not_null(frame);
	raw_send(fd, frame, len);
	free(frame);
	writer_destroy(&w);
}

static const char HEALTH[] = "\x82\xa2id\x01\xa2op\xa6"
                             "health";

/* Shape trees obey the tree rules (unique keys); an error names its cause once. */
Test(reliability, compile_refuses_duplicate_keys_and_names_the_cause_once)
{
	/* {"k": "dict", "keys": ["a", "a"], "c": [T[4], T[4]]} */
	static const uint8_t dup[] = {0x83, 0xa1, 'k',  0xa4, 'd',  'i',  'c',  't',  0xa4, 'k',
	                              'e',  'y',  's',  0x92, 0xa1, 'a',  0xa1, 'a',  0xa1, 'c',
	                              0x92, 0x82, 0xa1, 'k',  0xa1, 'T',  0xa1, 's',  0x91, 0x04,
	                              0x82, 0xa1, 'k',  0xa1, 'T',  0xa1, 's',  0x91, 0x04};
	/* {"k": "bogus", "c": []} */
	static const uint8_t bogus[] = {0x82, 0xa1, 'k', 0xa5, 'b', 'o',
	                                'g',  'u',  's', 0xa1, 'c', 0x90};
	struct hd d;
	struct tl_client *c;
	char code[64], msg[1024];
	long long id;
	int fd;

	c = up(&d, NULL, (const char *const[]){"--no-probe", NULL});
	reg_ok(c, "rel.dup", CUMSUM_SRC);
	fd = raw_connect(d.sock);
	send_compile(fd, dup, sizeof dup);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
	cr_assert_str_eq(code, "DUPLICATE_KEY", "%s", msg);
	cr_assert_not_null(strstr(msg, "\"a\""), "%s", msg);
	send_compile(fd, bogus, sizeof bogus);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
	cr_assert_str_eq(code, "INVALID_ARGUMENT", "%s", msg);
	cr_assert_str_eq(msg, "carry: malformed spec tree: node kind");
	cr_assert_eq(hd_counter(c, "rel.dup", "compiles"), 0);
	raw_send_frame(fd, HEALTH, sizeof HEALTH - 1); /* the connection serves on */
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
	cr_assert_str_eq(code, "");
	close(fd);
	down(&d, c);
}

/*
 * Failed specializations are remembered (no recompile of the same bad
 * request) but at most --max-failed-specs per adapter, least recently used
 * forgotten first (before the fix: unbounded, 33 000 of them from one uid).
 */
/* objects/<key>.lock files in a cache */
static int lock_files(const char *cache)
{
	char path[600];
	DIR *dp;
	struct dirent *e;
	int n = 0;

	snprintf(path, sizeof path, "%s/objects", cache);
	dp = opendir(path);
	cr_assert_not_null(dp, "%s", path);
	while ((e = readdir(dp)) != NULL)
		n += strstr(e->d_name, ".lock") != NULL;
	closedir(dp);
	return n;
}

Test(reliability, failed_specializations_are_bounded_per_adapter)
{
	static const char raises[] = "def body(c, x):\n    raise RuntimeError('diverged')\n";
	const char *args[] = {"--no-probe", "--max-failed-specs", "4", NULL};
	char cache[512], stale[700];
	struct hd d;
	struct tl_client *c;
	struct tl_error err;
	json_t *j;

	/* a lock file an older daemon left behind goes at start */
	h_tmpdir(cache, sizeof cache, "locks");
	snprintf(stale, sizeof stale, "%s/objects", cache);
	cr_assert_eq(mkdir(stale, 0700), 0);
	snprintf(stale, sizeof stale, "%s/objects/%064d.lock", cache, 7);
	close(open(stale, O_CREAT | O_WRONLY, 0600));
	c = up(&d, cache, args);
	cr_assert_eq(lock_files(cache), 0, "the stale lock file was removed at start");
	reg_ok(c, "rel.fail", raises);
	for (int T = 1; T <= 10; T++)
		expect_code(scan_sum(c, "rel.fail", T, &err), &err, "BODY_ERROR");
	cr_assert_eq(hd_counter(c, "rel.fail", "failed_specs"), 4);
	cr_assert_eq(hd_counter(c, "rel.fail", "failed_evictions"), 6);
	cr_assert_eq(h_stat(c, "failed_evictions"), 6);
	expect_code(scan_sum(c, "rel.fail", 10, &err), &err, "BODY_ERROR");
	cr_assert_eq(hd_counter(c, "rel.fail", "compiles"), 10, "T=10 is remembered");
	expect_code(scan_sum(c, "rel.fail", 1, &err), &err, "BODY_ERROR");
	cr_assert_eq(hd_counter(c, "rel.fail", "compiles"), 11, "T=1 was forgotten");
	j = h_call_json(c, "describe", "rel.fail");
	cr_assert_eq(json_array_size(json_object_get(j, "specializations")), 4);
	json_decref(j);
	/* 11 keys compiled and given up: not one lock file stays behind */
	cr_assert_eq(lock_files(cache), 0, "lock files left in %s/objects", cache);
	still_serves(&d);
	down(&d, c);
}

static void write_adapter_file(const char *dir, const char *name, const char *body)
{
	char path[1200];

	snprintf(path, sizeof path, "%s/%s.adapter", dir, name);
	h_write_file(path, "name = %s\nbody = %s\nmax_steps = 16\n", name, body);
}

static size_t adapter_count(struct tl_client *c)
{
	json_t *j = h_call_json(c, "list", NULL);
	size_t n = json_array_size(json_object_get(j, "adapters"));

	json_decref(j);
	return n;
}

static bool listed(struct tl_client *c, const char *name)
{
	json_t *j = h_call_json(c, "list", NULL), *a;
	size_t i;
	bool found = false;

	json_array_foreach(json_object_get(j, "adapters"), i, a)
	{
		found |= strcmp(jstr(a, "name"), name) == 0;
	}
	json_decref(j);
	return found;
}

/* SIGHUP, then waits until the daemon logs that this reload is done. */
static void reload(struct hd *d, int *reloads)
{
	kill(d->pid, SIGHUP);
	(*reloads)++;
	for (int k = 0; k < 300 && log_count(d, "SIGHUP: reload done") < *reloads; k++)
		usleep(100000);
	cr_assert_geq(log_count(d, "SIGHUP: reload done"), *reloads, "reload %d never finished",
	              *reloads);
}

/*
 * The adapters directory is read off the event loop: 300 files (over the old
 * 256 cap) survive a reload; a FIFO as a body does not freeze the daemon; a
 * body that is missing for a moment keeps its adapter; a removed file
 * unregisters its adapter.
 */
Test(reliability, sighup_reads_the_directory_off_the_loop_and_keeps_what_it_cannot_read)
{
	char dir[512], bodies[512], body[800], fifo[800], path[1200];
	const char *args[] = {"--no-probe", "--adapters", dir, NULL};
	struct hd d;
	struct tl_client *c;
	int reloads = 0, ready;
	struct tl_error err;

	h_tmpdir(dir, sizeof dir, "hupdir");
	h_tmpdir(bodies, sizeof bodies, "hupbodies");
	snprintf(body, sizeof body, "%s/cumsum.py", bodies);
	snprintf(path, sizeof path, "cp %s/examples/bodies/cumsum.py %s", h_root(), body);
	cr_assert_eq(system(path), 0);
	snprintf(path, sizeof path, "%s/examples/bodies/cumsum.py", h_root());
	for (int k = 0; k < 300; k++) { /* hup.005 has a body of its own, removed below */
		char name[32];
		snprintf(name, sizeof name, "hup.%03d", k);
		write_adapter_file(dir, name, k == 5 ? body : path);
	}
	c = up(&d, NULL, args);
	cr_assert_eq(adapter_count(c), 300);
	reload(&d, &reloads);
	cr_assert_eq(adapter_count(c), 300, "all 300 survive a reload");

	snprintf(fifo, sizeof fifo, "%s/fifo.py", bodies);
	cr_assert_eq(mkfifo(fifo, 0600), 0);
	write_adapter_file(dir, "hup.fifo", fifo);
	reload(&d, &reloads);
	cr_assert_eq(tl_health(c, &ready, &err), 0, "the loop answers: %s", err.message);
	cr_assert(log_has(&d, "not a regular file", 10), "log %s", d.log);
	cr_assert(!listed(c, "hup.fifo"));
	cr_assert_eq(adapter_count(c), 300);
	/* a file with a bad setting: the log names it (it once printed freed memory) */
	snprintf(path, sizeof path, "%s/hup.bad.adapter", dir);
	h_write_file(path, "%s", "garbage = 1\n");
	reload(&d, &reloads);
	cr_assert(log_has(&d, "bad setting 'garbage'", 10), "log %s", d.log);
	cr_assert(!listed(c, "hup.bad"));
	cr_assert_eq(unlink(path), 0);

	cr_assert_eq(unlink(body), 0); /* hup.005's body is missing for a moment */
	snprintf(path, sizeof path, "%s/hup.007.adapter", dir);
	cr_assert_eq(unlink(path), 0); /* hup.007's file is gone */
	reload(&d, &reloads);
	cr_assert(listed(c, "hup.005"), "kept while its body cannot be read");
	cr_assert(log_has(&d, "keeping the registered hup.005", 10), "log %s", d.log);
	cr_assert(!listed(c, "hup.007"), "unregistered: its file is gone");
	cr_assert_eq(adapter_count(c), 299);
	scan_sum_ok(c, "hup.005", 3);
	down(&d, c);
}

/* ---- registrations survive a restart (--state-dir) ---------------------------------- */

/* origin and persisted of one adapter in list, or NULL origin when absent. */
static bool listed_as(struct tl_client *c, const char *name, char *origin, size_t size,
                      bool *persisted)
{
	json_t *j = h_call_json(c, "list", NULL), *a;
	size_t i;
	bool found = false;

	json_array_foreach(json_object_get(j, "adapters"), i, a)
	{
		if (strcmp(jstr(a, "name"), name) == 0) {
			snprintf(origin, size, "%s", jstr(a, "origin"));
			*persisted = json_is_true(json_object_get(a, "persisted"));
			found = true;
		}
	}
	json_decref(j);
	return found;
}

Test(reliability, registrations_survive_a_restart_with_a_state_directory)
{
	char state[512], origin[32], path[700];
	const char *args[] = {"--no-probe", "--state-dir", state, NULL};
	struct tl_adapter_def evil = {
	    "rel.evil", CUMSUM_SRC, "x.py\nbody = /etc/passwd", "body", NULL, 16, 1048576, 8};
	struct tl_error err;
	struct hd d;
	struct tl_client *c;
	bool persisted;

	h_tmpdir(state, sizeof state, "state");
	c = up(&d, NULL, args);
	reg_ok(c, "rel.keep", CUMSUM_SRC);
	reg_ok(c, "rel.gone", CUMSUM_SRC);
	/* a body_file with a newline cannot add settings to the persisted file */
	cr_assert_eq(tl_register(c, &evil, &err), 0, "%s", err.message);
	cr_assert_eq(tl_unregister(c, "rel.gone", &err), 0);
	cr_assert(listed_as(c, "rel.keep", origin, sizeof origin, &persisted));
	cr_assert_str_eq(origin, "registered");
	cr_assert(persisted);
	scan_sum_ok(c, "rel.keep", 3);
	down(&d, c);

	c = up(&d, NULL, args);
	cr_assert(listed_as(c, "rel.keep", origin, sizeof origin, &persisted), "not restored");
	cr_assert_str_eq(origin, "restored");
	cr_assert(persisted);
	cr_assert_not(listed_as(c, "rel.gone", origin, sizeof origin, &persisted),
	              "an unregistered adapter came back");
	cr_assert(listed_as(c, "rel.evil", origin, sizeof origin, &persisted));
	scan_sum_ok(c, "rel.keep", 3);
	scan_sum_ok(c, "rel.evil", 2); /* its body is the registered one, not /etc/passwd */
	down(&d, c);

	/* a state directory others may write to is not trusted: nothing restored,
	 * the daemon starts and serves */
	snprintf(path, sizeof path, "%s/registered", state);
	cr_assert_eq(chmod(path, 0777), 0);
	c = up(&d, NULL, args);
	cr_assert_not(listed_as(c, "rel.keep", origin, sizeof origin, &persisted));
	cr_assert(log_has(&d, "not restoring registrations", 0), "log %s", d.log);
	reg_ok(c, "rel.after", CUMSUM_SRC);
	scan_sum_ok(c, "rel.after", 3);
	down(&d, c);

	/* without --state-dir nothing is kept, and list says so */
	c = up(&d, NULL, (const char *const[]){"--no-probe", NULL});
	reg_ok(c, "rel.keep", CUMSUM_SRC);
	cr_assert(listed_as(c, "rel.keep", origin, sizeof origin, &persisted));
	cr_assert_not(persisted);
	down(&d, c);
}

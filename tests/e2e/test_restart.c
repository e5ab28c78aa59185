/*
 * test_restart.c - clients across a daemon restart: libtorchloop's opt-in
 * retry (tl_set_reconnect) sends a request again, once, on a new connection
 * when the old one broke before any byte of its reply, or when a stopping
 * daemon refused it (SHUTTING_DOWN) while it drained another client's scan.
 */
#include "fixture.h"
#include "harness.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

TestSuite(restart, .timeout = 900);

/* A daemon listening on sock (the same path across restarts). */
static void start_on(struct hd *d, const char *sock)
{
	const char *const args[] = {"--no-probe", "--socket", sock, NULL};

	hd_start(d, NULL, args);
	snprintf(d->sock, sizeof d->sock, "%s", sock);
	hd_wait_ready(d, 120);
}

/*
 * libtorchloop's opt-in retry (tl_set_reconnect): across a daemon restart,
 * a health and a register on the same client go through, sent again once on
 * a new connection, and the scan after them is right; a client without it
 * gets IO; an unregister is never sent again.
 */
Test(restart, a_libtorchloop_client_with_reconnect_goes_on_across_restarts)
{
	struct fixture f = {0};
	struct tl_client *plain;
	struct tl_error err;
	char dir[512], sock[600];
	int ready;

	h_tmpdir(dir, sizeof dir, "rs");
	snprintf(sock, sizeof sock, "%s/sock", dir);
	start_on(&f.d, sock);
	f.c = hd_connect(&f.d);
	plain = hd_connect(&f.d);
	tl_set_reconnect(f.c, 60000);
	fixture_trees(&f);
	hd_register(f.c, "t4.cumsum", CUMSUM, "body", 12, 64, 3);
	scan_ok(&f, f.c);
	cr_assert_eq(hd_stop(&f.d), 0);
	start_on(&f.d, sock);
	cr_assert_eq(tl_health(f.c, &ready, &err), 0, "%s %s", err.code, err.message);
	cr_assert(ready);
	cr_assert_eq(tl_resent(f.c), 1, "the health was sent again");
	cr_assert_eq(tl_health(plain, &ready, &err), -1, "a client without reconnect");
	cr_assert_str_eq(err.code, "IO", "%s", err.message);
	cr_assert_eq(hd_stop(&f.d), 0);
	start_on(&f.d, sock);
	hd_register(f.c, "t4.cumsum", CUMSUM, "body", 12, 64, 3); /* sent again */
	cr_assert_eq(tl_resent(f.c), 2);
	scan_ok(&f, f.c);
	cr_assert_eq(hd_stop(&f.d), 0);
	start_on(&f.d, sock);
	cr_assert_eq(tl_unregister(f.c, "t4.cumsum", &err), -1, "unregister is not sent again");
	cr_assert_str_eq(err.code, "IO", "%s", err.message);
	cr_assert_eq(tl_resent(f.c), 2);
	tl_close(plain);
	teardown(&f);
}

/* A scan that runs for seconds: 48 steps of a 1024 x 1024 matmul (the scan op;
 * no constant to build into the graph). */
static const char SLOW[] = "import torch\n\ndef body(c, x):\n"
                           "    c = torch.tanh(0.001 * (c @ c) + x)\n    return c, c.sum()\n";
#define SLOW_N     1024
#define SLOW_STEPS 48

struct slow {
	const char *sock;
	int rc;
	struct tl_error err;
	double done_at; /* when its reply came */
};

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Another client's slow scan: in flight while the daemon stops. */
static void *slow_scan(void *p)
{
	static double carry[SLOW_N * SLOW_N], xs[SLOW_STEPS];
	struct slow *s = p;
	int64_t cs[] = {SLOW_N, SLOW_N}, xsh[] = {SLOW_STEPS, 1};
	struct tl_builder *b = tl_builder_new();
	struct tl_client *c;
	struct tl_reply *r = NULL;

	s->rc = tl_connect(s->sock, 5000, &c, &s->err);
	if (s->rc != 0)
		return NULL;
	s->rc = tl_scan(c, "sd.slow", tl_tensor(b, TL_FLOAT64, 2, cs, carry),
	                tl_tensor(b, TL_FLOAT64, 2, xsh, xs), &r, &s->err);
	s->done_at = now_s();
	tl_reply_free(r);
	tl_builder_free(b);
	tl_close(c);
	return NULL;
}

struct retried {
	struct tl_client *c;
	int rc;
	struct tl_error err;
	double sent_at;
};

/* Waits until d's log has needle; 120 s is only a failure guard. */
static void await_log(const struct hd *d, const char *needle)
{
	for (int k = 0; k < 1200; k++) {
		char *text = h_slurp(d->log);
		bool seen = strstr(text, needle) != NULL;
		free(text);
		if (seen)
			return;
		usleep(100 * 1000);
	}
	cr_assert_fail("no '%s' within 120 s; log %s", needle, d->log);
}

/* Waits until c's daemon has n requests in flight (the stats asking
 * included); 120 s is only a failure guard. */
static void await_inflight(struct tl_client *c, uint64_t n)
{
	uint64_t v = h_stat(c, "inflight");

	for (int k = 0; k < 1200 && v < n; k++) {
		usleep(100 * 1000);
		v = h_stat(c, "inflight");
	}
	cr_assert_geq(v, n, "%llu requests in flight after 120 s", (unsigned long long)v);
}

/* The request the stopping daemon refuses; its retry waits for the next one. */
static void *stats_across(void *p)
{
	struct retried *r = p;
	char *json = NULL;

	r->sent_at = now_s();
	r->rc = tl_call_json(r->c, "stats", NULL, &json, &r->err);
	free(json);
	return NULL;
}

/*
 * SIGTERM while another client's scan runs: the daemon drains it and
 * refuses the next request with SHUTTING_DOWN; a client with reconnect sends
 * that request again, once, to the daemon started after it (the stats it
 * gets are the new daemon's), and the drained scan completed.
 */
Test(restart, a_request_a_stopping_daemon_refused_is_sent_again_after_the_restart)
{
	struct tl_adapter_def def = {"sd.slow",       SLOW, NULL, "body", "scan", SLOW_STEPS,
	                             SLOW_N * SLOW_N, 2,    NULL};
	struct retried rt = {0};
	struct slow s = {0};
	pthread_t slow_t, stats_t;
	struct tl_error err;
	int status;
	char dir[512], sock[600];
	struct hd d;

	h_tmpdir(dir, sizeof dir, "sd");
	snprintf(sock, sizeof sock, "%s/sock", dir);
	start_on(&d, sock);
	rt.c = hd_connect(&d);
	cr_assert_eq(tl_register(rt.c, &def, &err), 0, "%s", err.message);
	s.sock = sock;
	slow_scan(&s); /* compiled (once per test run) and warm */
	cr_assert_eq(s.rc, 0, "%s %s", s.err.code, s.err.message);
	tl_set_reconnect(rt.c, 120000);
	pthread_create(&slow_t, NULL, slow_scan, &s);
	await_inflight(rt.c, 2); /* its scan runs (and this stats) */
	kill(d.pid, SIGTERM);
	/* the daemon drains it: stopping with the scan in flight */
	await_log(&d, "shutting down (SIGTERM); 1 requests in flight");
	pthread_create(&stats_t, NULL, stats_across, &rt);
	/* this thread starts the next daemon: a daemon's parent death signal
	 * follows the thread that forked it */
	cr_assert_eq(waitpid(d.pid, &status, 0), d.pid);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the first daemon's exit");
	start_on(&d, sock);
	pthread_join(stats_t, NULL);
	pthread_join(slow_t, NULL);
	cr_assert_eq(rt.rc, 0, "%s %s", rt.err.code, rt.err.message);
	cr_assert_eq(tl_resent(rt.c), 1, "the refused stats was sent again");
	cr_assert_eq(s.rc, 0, "the drained scan: %s %s", s.err.code, s.err.message);
	/* the first daemon exits only after that reply: it was draining, with the
	 * stats' connection open, when the stats went out (a refusal, not a break) */
	cr_assert_gt(s.done_at, rt.sent_at, "the slow scan ended before the stats was sent");
	tl_close(rt.c);
	cr_assert_eq(hd_stop(&d), 0);
}

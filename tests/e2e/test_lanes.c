/*
 * test_lanes.c - the compile service's lanes (daemon/base/compiler.h): a first
 * scan never waits behind a background compile, a registration never waits
 * behind a compile, the background upgrade is stopped while foreground work
 * runs and finishes afterwards.
 *
 * The worker is tests/helpers/gated_worker.py: a background compile waits
 * for a file this test creates, so with one queue for every compile the new
 * adapter's scan would never be answered.  Compiles, in a private cache: A's
 * quick graph and its upgrade (ema, T = 6, --quick-tier-steps 4), B's graph
 * (T = 3, a body whose every call waits for a second file, created once C is
 * registered: B's compile is still running then, on any machine), C's
 * import check.
 */
#include "harness.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

TestSuite(lanes, .timeout = 900);

#define EMA "examples/bodies/ema.py"
/* B's body: each call waits (at most 120 s) for the file GATE_B, which the
 * test creates once C is registered (printf format: the file's path) */
#define GATED_SRC                                                                                  \
	"import os\nimport time\n\nGATE = %s\n\n\ndef body(c, x):\n"                               \
	"    end = time.monotonic() + 120\n"                                                       \
	"    while not os.path.exists(GATE) and time.monotonic() < end:\n"                         \
	"        time.sleep(0.02)\n"                                                               \
	"    return c + x, c\n"
#define CUMSUM_SRC "def body(c, x):\n    return c + x, c\n"

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* lanes.<lane>.<key> of stats (a boolean as 0 or 1) */
static uint64_t lane_stat(struct tl_client *c, const char *lane, const char *key)
{
	json_t *j = h_call_json(c, "stats", NULL);
	json_t *v = json_object_get(json_object_get(json_object_get(j, "lanes"), lane), key);
	uint64_t n;

	cr_assert(json_is_integer(v) || json_is_boolean(v), "stats has no lanes.%s.%s", lane, key);
	n = json_is_boolean(v) ? json_is_true(v) : (uint64_t)json_integer_value(v);
	json_decref(j);
	return n;
}

static void await_lane(struct tl_client *c, const char *lane, const char *key, uint64_t min)
{
	for (int i = 0; i < 2400 && lane_stat(c, lane, key) < min; i++)
		usleep(50 * 1000);
	cr_assert_geq(lane_stat(c, lane, key), min, "lanes.%s.%s", lane, key);
}

/* The adapter's only specialization, as describe shows it (caller decrefs). */
static json_t *the_spec(struct tl_client *c, const char *adapter)
{
	json_t *desc = h_call_json(c, "describe", adapter);
	json_t *sp = json_incref(json_array_get(json_object_get(desc, "specializations"), 0));

	cr_assert_not_null(sp, "%s has a specialization", adapter);
	json_decref(desc);
	return sp;
}

static bool upgrading(struct tl_client *c, const char *adapter)
{
	json_t *sp = the_spec(c, adapter);
	bool yes = json_is_true(json_object_get(sp, "upgrading"));

	json_decref(sp);
	return yes;
}

/* B's scan, in a thread with its own connection: when its reply came. */
struct timed_scan {
	const char *sock, *adapter;
	struct tl_builder *b;
	struct tl_tree *carry, *inputs;
	struct tl_reply *r;
	struct tl_error err;
	int rc;
	double started, done;
	pthread_t th;
};

static void *timed_scan(void *arg)
{
	struct timed_scan *s = arg;
	struct tl_client *c;

	s->started = now_s();
	s->rc = tl_connect(s->sock, 5000, &c, &s->err);
	if (s->rc == 0) {
		s->rc = tl_scan(c, s->adapter, s->carry, s->inputs, &s->r, &s->err);
		tl_close(c);
	}
	s->done = now_s();
	return NULL;
}

/* c + x, c by hand: final = c0 + sum x, outputs[t] = c0 + x[0] + ... + x[t-1]. */
static void check_cumsum(const struct tl_reply *r, const double *c0, const double *x, int T, int n)
{
	const double *fin = tl_tree_data(tl_reply_tree(r, "carry"));
	const double *ys = tl_tree_data(tl_reply_tree(r, "outputs"));

	for (int i = 0; i < n; i++) {
		double acc = c0[i];
		for (int t = 0; t < T; t++) {
			cr_assert_float_eq(ys[t * n + i], acc, 1e-12, "outputs[%d][%d]", t, i);
			acc += x[t * n + i];
		}
		cr_assert_float_eq(fin[i], acc, 1e-12, "carry[%d]", i);
	}
}

Test(lanes, no_first_scan_waits_behind_a_background_compile_nor_a_registration_behind_a_compile)
{
	char cache[512], worker[600], gate[600];
	const char *args[] = {"--no-probe", "--quick-tier-steps", "4", "--worker", worker, NULL};
	struct tl_builder *b = tl_builder_new();
	struct h_bufs bb = {{0}, 0};
	int64_t cs[] = {3, 2}, xs[] = {6, 3, 2}, bc[] = {4}, bx[] = {3, 4};
	double c0[4] = {1, -2, 0.5, 3}, x[12];
	struct tl_tree *carry = h_rand_tensor(b, &bb, 2, cs, 1);
	struct tl_tree *inputs = h_rand_tensor(b, &bb, 3, xs, 2);
	struct timed_scan s = {0};
	struct tl_error err;
	struct tl_client *c;
	struct hd d;
	char gate_b[600], gate_b_py[700], b_src[1400];
	double compile_b;
	json_t *sp;

	h_tmpdir(cache, sizeof cache, "lanes");
	snprintf(worker, sizeof worker, "%s/tests/helpers/gated_worker.py", h_root());
	snprintf(gate, sizeof gate, "%s/gate", cache);
	snprintf(gate_b, sizeof gate_b, "%s/gate_b", cache);
	snprintf(gate_b_py, sizeof gate_b_py, "'%s'", gate_b);
	setenv("TORCHLOOP_TEST_GATE", gate, 1);
	hd_start(&d, cache, args);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);

	/* A: served by the quick tier; its upgrade runs in the background, held */
	hd_register(c, "lanes.a", EMA, "body", 8, 4096, 2);
	h_assert_scan_matches_reference(c, "lanes.a", EMA, "body", carry, inputs, b, "lanes_a");
	await_lane(c, "background", "busy", 1);

	/* B: a new adapter's first scan, in its own thread */
	snprintf(b_src, sizeof b_src, GATED_SRC, gate_b_py);
	cr_assert_eq(tl_register(c,
	                         &(struct tl_adapter_def){"lanes.b", b_src, NULL, "body", NULL, 8,
	                                                  64, 2, NULL},
	                         &err),
	             0, "%s", err.message);
	h_fill(x, TL_FLOAT64, 12, 3);
	s = (struct timed_scan){.sock = d.sock, .adapter = "lanes.b", .b = b};
	s.carry = tl_tensor(b, TL_FLOAT64, 1, bc, c0);
	s.inputs = tl_tensor(b, TL_FLOAT64, 2, bx, x);
	pthread_create(&s.th, NULL, timed_scan, &s);
	await_lane(c, "foreground", "busy", 1); /* B's compile is under way */
	await_lane(c, "background", "preempted", 1);

	/* C: a registration while B compiles and A's upgrade waits */
	cr_assert_eq(tl_register(c,
	                         &(struct tl_adapter_def){"lanes.c", CUMSUM_SRC, NULL, "body", NULL,
	                                                  8, 64, 2, NULL},
	                         &err),
	             0, "%s", err.message);
	cr_assert_eq(lane_stat(c, "check", "workers"), 1, "C was checked by a worker of its own");
	/* B's compile cannot end before its gate opens: C did not wait for it */
	cr_assert_eq(lane_stat(c, "foreground", "busy"), 1, "B still compiles");
	fclose(fopen(gate_b, "w"));

	pthread_join(s.th, NULL);
	cr_assert_eq(s.rc, 0, "%s: %s", s.err.code, s.err.message);
	check_cumsum(s.r, c0, x, 3, 4);
	tl_reply_free(s.r);
	sp = the_spec(c, "lanes.b");
	compile_b = json_number_value(json_object_get(sp, "compile_seconds"));
	json_decref(sp);
	cr_assert_lt(s.done - s.started, 1.5 * compile_b,
	             "B's first reply took %.1f s for a %.1f s compile", s.done - s.started,
	             compile_b);
	cr_assert(upgrading(c, "lanes.a"), "A's upgrade is still held at the gate");

	/*
	 * A re-registered mid-upgrade: its first scan waits for the graph the
	 * upgrade builds (its cache lock), so the upgrade is promoted; once the
	 * gate opens it finishes and that scan is served by the unrolled graph.
	 */
	cr_assert_eq(tl_unregister(c, "lanes.a", &err), 0, "%s", err.message);
	hd_register(c, "lanes.a", EMA, "body", 8, 4096, 2);
	s = (struct timed_scan){
	    .sock = d.sock, .adapter = "lanes.a", .b = b, .carry = carry, .inputs = inputs};
	pthread_create(&s.th, NULL, timed_scan, &s);
	await_lane(c, "background", "promoted", 1);
	cr_assert_eq(lane_stat(c, "background", "paused"), 0);
	fclose(fopen(gate, "w"));
	pthread_join(s.th, NULL);
	cr_assert_eq(s.rc, 0, "%s: %s", s.err.code, s.err.message);
	h_assert_reply_matches_reference(s.r, EMA, "body", carry, inputs, b, "lanes_a2");
	sp = the_spec(c, "lanes.a");
	cr_assert_str_eq(json_string_value(json_object_get(sp, "tier")), "final");
	cr_assert(json_is_true(json_object_get(sp, "from_cache")), "the upgrade's graph");
	json_decref(sp);
	cr_assert_eq(lane_stat(c, "background", "jobs"), 1);
	unsetenv("TORCHLOOP_TEST_GATE");
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
	h_bufs_free(&bb);
	tl_builder_free(b);
}

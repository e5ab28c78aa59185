/*
 * test_index.c - an index a graph reads from its inputs, out of range (issue
 * 53 row 2): the kernels' checks set the artifact's fault flag instead of
 * throwing inside an OpenMP region (worker index_guard.py, engine.c), so the
 * request fails with INDEX_OUT_OF_RANGE and the daemon serves on -- freshly
 * compiled, through grad, and served from the disk cache by a new daemon.
 *
 * One body (tests/fixtures/index_bodies.py), one scan and one grad
 * specialization (float64, T=3, carry [4]), compiled once into a private
 * cache that the second daemon reuses.
 */
#include "fixture.h"
#include "harness.h"

#include <math.h>
#include <string.h>

TestSuite(index, .timeout = 900);

#define BODY    "tests/fixtures/index_bodies.py"
#define ADAPTER "idx.table"

/* carry [4] of ones, inputs [3,4] holding in-range indices but for bad at
 * position [1][2] (when bad is not 0). */
static void trees(struct tl_builder *b, double *cbuf, double *xbuf, double bad,
                  struct tl_tree **carry, struct tl_tree **inputs)
{
	static const int64_t cs[1] = {4}, xs[2] = {3, 4};

	for (int i = 0; i < 4; i++)
		cbuf[i] = 1.0 + i;
	for (int i = 0; i < 12; i++)
		xbuf[i] = (double)((i * 5) % 16) - (i % 3 == 0 ? 16.0 : 0.0); /* [-16, 16) */
	if (bad != 0.0)
		xbuf[6] = bad;
	*carry = tl_tensor(b, TL_FLOAT64, 1, cs, cbuf);
	*inputs = tl_tensor(b, TL_FLOAT64, 2, xs, xbuf);
}

static void scan_good(struct tl_client *c, struct tl_builder *b, const char *tag)
{
	double cbuf[8] __attribute__((aligned(64))), xbuf[16] __attribute__((aligned(64)));
	struct tl_tree *carry, *inputs;

	trees(b, cbuf, xbuf, 0.0, &carry, &inputs);
	h_assert_scan_matches_reference(c, ADAPTER, BODY, "body", carry, inputs, b, tag);
}

static void refused(struct tl_client *c, struct tl_builder *b, double bad, bool grad)
{
	double cbuf[8] __attribute__((aligned(64))), xbuf[16] __attribute__((aligned(64)));
	struct tl_tree *carry, *inputs;
	struct tl_reply *r = NULL;
	struct tl_error err;
	int rc;

	trees(b, cbuf, xbuf, bad, &carry, &inputs);
	rc = grad ? tl_grad(c, ADAPTER, carry, inputs, NULL, NULL, &r, &err)
	          : tl_scan(c, ADAPTER, carry, inputs, &r, &err);
	cr_assert_eq(rc, -1, "index %g accepted", bad);
	cr_assert_str_eq(err.code, "INDEX_OUT_OF_RANGE", "index %g: %s: %s", bad, err.code,
	                 err.message);
	cr_assert(strstr(err.message, "out of range") != NULL, "%s", err.message);
}

static void grad_good(struct tl_client *c, struct tl_builder *b)
{
	double cbuf[8] __attribute__((aligned(64))), xbuf[16] __attribute__((aligned(64)));
	struct tl_tree *carry, *inputs;
	struct tl_reply *r;
	struct tl_error err;
	const double *g;

	trees(b, cbuf, xbuf, 0.0, &carry, &inputs);
	cr_assert_eq(tl_grad(c, ADAPTER, carry, inputs, NULL, NULL, &r, &err), 0, "%s: %s",
	             err.code, err.message);
	/* zero cotangents: every gradient is 0 (and x.long() passes none to x) */
	g = tl_tree_data(tl_reply_tree(r, "grad_inputs"));
	for (int i = 0; i < 12; i++)
		cr_assert_eq(g[i], 0.0);
	tl_reply_free(r);
}

/* Every bad index in turn, each followed by a good scan that matches eager. */
static void bad_indices_then_good(struct tl_client *c, struct tl_builder *b, const char *tag)
{
	const double bad[] = {20.0, -17.0, NAN};

	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		refused(c, b, bad[i], false);
		scan_good(c, b, tag);
	}
}

Test(index, an_index_out_of_range_fails_the_request_and_the_daemon_serves_on)
{
	char cache[512];
	struct h_session s = {0};

	h_tmpdir(cache, sizeof cache, "idxcache");
	hs_open(&s, cache, NO_PROBE);
	s.b = tl_builder_new();
	hd_register(s.c, ADAPTER, BODY, "body", 16, 65536, 8);
	scan_good(s.c, s.b, "idx1"); /* compiled with in-range values */
	bad_indices_then_good(s.c, s.b, "idx2");
	/* the grad graph's kernels too (compiled with in-range values: the
	 * compile's dry run is eager, on the request's data) */
	grad_good(s.c, s.b);
	refused(s.c, s.b, 20.0, true);
	grad_good(s.c, s.b);
	cr_assert_eq(hd_counter(s.c, ADAPTER, "compiles"), 2, "one scan and one grad graph");
	hs_close(&s);

	/* a new daemon on the same cache: the artifacts come from disk */
	hs_open(&s, cache, NO_PROBE);
	s.b = tl_builder_new();
	hd_register(s.c, ADAPTER, BODY, "body", 16, 65536, 8);
	refused(s.c, s.b, 20.0, false);
	bad_indices_then_good(s.c, s.b, "idx3");
	cr_assert_eq(hd_counter(s.c, ADAPTER, "compiles"), 0, "served from the disk cache");
	hs_close(&s);
}

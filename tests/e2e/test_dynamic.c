/*
 * test_dynamic.c - symbolic batch (adapter option dynamic = batch): one graph
 * per (structure, T, dtype) serves every batch size.  Scans and gradients at
 * several batch sizes (1 included) against the eager loop, torch.autograd
 * and finite differences (tests/helpers/eager_ref.py); one compile per kind
 * counted; every bad request with its code and path, the daemon serving on;
 * bodies that fix the batch size refused with BATCH_SPECIALIZED; symbolic
 * graphs loaded from the cache after a restart; strategy = scan lowered
 * unrolled, with a note.
 */
#include "harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

TestSuite(dynamic, .timeout = 900);

#define T 3

static const char *const ARGS[] = {"--no-probe", NULL};

static int register_strategy(struct tl_client *c, const char *name, const char *body_path,
                             const char *entry, const char *dynamic, const char *strategy,
                             struct tl_error *err)
{
	char path[1024], *src;
	int rc;

	snprintf(path, sizeof path, "%s/%s", body_path[0] == '/' ? "" : h_root(), body_path);
	src = h_slurp(path);
	rc = tl_register(c,
	                 &(struct tl_adapter_def){.name = name,
	                                          .body_source = src,
	                                          .body_file = body_path,
	                                          .entry = entry,
	                                          .max_steps = 8,
	                                          .max_elements = 4096,
	                                          .recompile_budget = 4,
	                                          .strategy = strategy,
	                                          .dynamic = dynamic},
	                 err);
	free(src);
	return rc;
}

static int register_dynamic(struct tl_client *c, const char *name, const char *body_path,
                            const char *entry, const char *dynamic, struct tl_error *err)
{
	return register_strategy(c, name, body_path, entry, dynamic, NULL, err);
}

/* rnn.py's (h, None) carry, inputs [T, batch, 3], cotangents of (h, None) and y. */
static void rnn_trees(struct tl_builder *b, struct h_bufs *bb, int64_t batch, uint64_t seed,
                      struct tl_tree **carry, struct tl_tree **inputs, struct tl_tree **cot_c,
                      struct tl_tree **cot_y)
{
	int64_t h[] = {batch, 8}, x[] = {T, batch, 3}, y[] = {T, batch, 8};
	struct tl_tree *items[2] = {h_rand_tensor(b, bb, 2, h, seed), tl_none(b)};
	struct tl_tree *citems[2] = {h_rand_tensor(b, bb, 2, h, seed + 1), tl_none(b)};

	*carry = tl_tuple(b, 2, items);
	*inputs = h_rand_tensor(b, bb, 3, x, seed + 2);
	*cot_c = tl_tuple(b, 2, citems);
	*cot_y = h_rand_tensor(b, bb, 3, y, seed + 3);
}

Test(dynamic, one_graph_serves_every_batch_size_for_scan_and_grad)
{
	static const int64_t batches[] = {4, 1, 9, 32};
	struct hd d;
	struct tl_client *c;
	struct tl_error err;

	hd_start(&d, NULL, ARGS);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	cr_assert_eq(register_dynamic(c, "t7.rnn", "examples/bodies/rnn.py", "cell", "batch", &err),
	             0, "%s %s", err.code, err.message);
	for (size_t i = 0; i < sizeof batches / sizeof batches[0]; i++) {
		struct tl_builder *b = tl_builder_new();
		struct h_bufs bb = {{0}, 0};
		struct tl_tree *carry, *inputs, *cot_c, *cot_y;
		struct tl_reply *r, *g;
		struct treejson tj;
		char dir[512];

		rnn_trees(b, &bb, batches[i], 40 + 4 * i, &carry, &inputs, &cot_c, &cot_y);
		cr_assert_eq(tl_scan(c, "t7.rnn", carry, inputs, &r, &err), 0, "batch %lld: %s %s",
		             (long long)batches[i], err.code, err.message);
		cr_assert_eq(tl_grad(c, "t7.rnn", carry, inputs, cot_c, cot_y, &g, &err), 0,
		             "batch %lld: %s %s", (long long)batches[i], err.code, err.message);
		h_tmpdir(dir, sizeof dir, "dynref");
		h_reference(dir, "examples/bodies/rnn.py", "cell", carry, inputs, cot_c, cot_y,
		            true, true);
		treejson_init(&tj, b, NULL);
		h_assert_close(tl_reply_tree(r, "carry"), h_load_ref(&tj, dir, "carry"), 1e-10,
		               1e-12, "carry");
		h_assert_close(tl_reply_tree(r, "outputs"), h_load_ref(&tj, dir, "outputs"), 1e-10,
		               1e-12, "outputs");
		h_assert_close(tl_reply_tree(g, "outputs"), h_load_ref(&tj, dir, "outputs"), 1e-10,
		               1e-12, "grad's outputs");
		h_assert_close(tl_reply_tree(g, "grad_carry"), h_load_ref(&tj, dir, "grad_carry"),
		               1e-10, 1e-12, "grad_carry vs autograd");
		h_assert_close(tl_reply_tree(g, "grad_inputs"), h_load_ref(&tj, dir, "grad_inputs"),
		               1e-10, 1e-12, "grad_inputs vs autograd");
		cr_assert_leq(h_normwise_error(tl_reply_tree(g, "grad_inputs"),
		                               h_load_ref(&tj, dir, "fd_inputs")),
		              1e-6, "grad_inputs vs finite differences");
		cr_assert_eq(tl_tree_shape(tl_reply_tree(r, "outputs"))[1], batches[i]);
		tl_reply_free(r);
		tl_reply_free(g);
		treejson_free(&tj);
		h_bufs_free(&bb);
		tl_builder_free(b);
	}
	/* four batch sizes, one graph per kind: two compiles, two budget slots */
	cr_assert_eq(hd_counter(c, "t7.rnn", "graphs"), 2);
	cr_assert_leq(hd_counter(c, "t7.rnn", "compiles"), 2);
	{
		json_t *desc = h_call_json(c, "describe", "t7.rnn");
		json_t *specs = json_object_get(desc, "specializations");
		cr_assert_str_eq(json_string_value(json_object_get(desc, "dynamic")), "batch");
		cr_assert_eq(json_integer_value(json_object_get(desc, "budget_used")), 2);
		for (size_t k = 0; k < json_array_size(specs); k++)
			cr_assert_str_eq(json_string_value(json_object_get(json_array_get(specs, k),
			                                                   "signature")),
			                 "float64 T=3 carry=t([B,8],N) inputs=[3,B,3]");
		json_decref(desc);
	}
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
}

/* strategy = scan with dynamic = batch: torch 2.14's Inductor fails on the
 * scan op over a symbolic size (KeyError on the symbol), so the worker
 * compiles the unrolled loop and says so; one graph still serves two batch
 * sizes with the eager loop's numbers. */
Test(dynamic, strategy_scan_with_a_symbolic_batch_compiles_the_unrolled_loop_and_says_so)
{
	static const int64_t batches[] = {4, 9};
	struct hd d;
	struct tl_client *c;
	struct tl_error err;
	json_t *desc, *sp;

	hd_start(&d, NULL, ARGS);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	cr_assert_eq(register_strategy(c, "t7.rnn_scan", "examples/bodies/rnn.py", "cell", "batch",
	                               "scan", &err),
	             0, "%s %s", err.code, err.message);
	for (size_t i = 0; i < sizeof batches / sizeof batches[0]; i++) {
		struct tl_builder *b = tl_builder_new();
		struct h_bufs bb = {{0}, 0};
		struct tl_tree *carry, *inputs, *cot_c, *cot_y;

		rnn_trees(b, &bb, batches[i], 90 + 4 * i, &carry, &inputs, &cot_c, &cot_y);
		h_assert_scan_matches_reference(c, "t7.rnn_scan", "examples/bodies/rnn.py", "cell",
		                                carry, inputs, b, "dynscan");
		h_bufs_free(&bb);
		tl_builder_free(b);
	}
	/* one graph for both batch sizes (0 compiles when the run's cache has it) */
	cr_assert_eq(hd_counter(c, "t7.rnn_scan", "graphs"), 1);
	cr_assert_leq(hd_counter(c, "t7.rnn_scan", "compiles"), 1);
	desc = h_call_json(c, "describe", "t7.rnn_scan");
	sp = json_array_get(json_object_get(desc, "specializations"), 0);
	cr_assert_str_eq(json_string_value(json_object_get(sp, "lowered")), "unroll");
	cr_assert(strstr(json_string_value(json_object_get(sp, "note")),
	                 "cannot lower the scan op over a symbolic batch") != NULL);
	json_decref(desc);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
}

/* A scan that must fail with code at path; the next good scan must succeed. */
static void expect_fail(struct tl_client *c, const struct tl_tree *carry,
                        const struct tl_tree *inputs, const char *code, const char *path,
                        const struct tl_tree *good_carry, const struct tl_tree *good_inputs)
{
	struct tl_reply *r;
	struct tl_error err;

	cr_assert_eq(tl_scan(c, "t7.rnn", carry, inputs, &r, &err), -1, "expected %s", code);
	cr_assert_str_eq(err.code, code, "%s", err.message);
	cr_assert_str_eq(err.path, path, "%s: %s", code, err.message);
	cr_assert_eq(tl_scan(c, "t7.rnn", good_carry, good_inputs, &r, &err), 0, "after %s: %s %s",
	             code, err.code, err.message);
	tl_reply_free(r);
}

Test(dynamic, batch_errors_get_their_code_and_path_and_the_daemon_serves_on)
{
	struct h_session s = {.b = tl_builder_new()};
	struct tl_tree *carry, *inputs, *cot_c, *cot_y, *items[2];
	struct tl_reply *r;
	struct tl_error err;
	int64_t h3[] = {3, 8}, h0[] = {0, 8}, h200[] = {200, 8}, x4[] = {T, 4, 3}, x1d[] = {T},
	        x0[] = {T, 0, 3}, x200[] = {T, 200, 3}, y4[] = {T, 4, 8};

	hs_open(&s, NULL, ARGS);
	/* a dynamic mode the daemon does not know */
	cr_assert_eq(
	    register_dynamic(s.c, "t7.bad", "examples/bodies/rnn.py", "cell", "sometimes", &err),
	    -1);
	cr_assert_str_eq(err.code, "INVALID_ARGUMENT");
	cr_assert_str_eq(err.path, "dynamic");
	cr_assert_eq(
	    register_dynamic(s.c, "t7.rnn", "examples/bodies/rnn.py", "cell", "batch", &err), 0,
	    "%s %s", err.code, err.message);
	rnn_trees(s.b, &s.bb, 3, 70, &carry, &inputs, &cot_c, &cot_y);

	/* carry batch 3, inputs batch 4 */
	expect_fail(s.c, carry, h_rand_tensor(s.b, &s.bb, 3, x4, 1), "BATCH_MISMATCH", "inputs",
	            carry, inputs);
	/* an input leaf without a batch dimension */
	expect_fail(s.c, carry, h_rand_tensor(s.b, &s.bb, 1, x1d, 2), "BATCH_MISMATCH", "inputs",
	            carry, inputs);
	/* batch size 0 */
	items[0] = h_rand_tensor(s.b, &s.bb, 2, h0, 3);
	items[1] = tl_none(s.b);
	expect_fail(s.c, tl_tuple(s.b, 2, items), h_rand_tensor(s.b, &s.bb, 3, x0, 4),
	            "BATCH_MISMATCH", "carry[0]", carry, inputs);
	/* within max_elements per leaf (200 x 8, 3 x 200 x 3) but the stacked
	 * outputs (3 x 200 x 8 = 4800) are over 4096 */
	items[0] = h_rand_tensor(s.b, &s.bb, 2, h200, 5);
	expect_fail(s.c, tl_tuple(s.b, 2, items), h_rand_tensor(s.b, &s.bb, 3, x200, 6),
	            "TOO_MANY_ELEMENTS", "outputs", carry, inputs);
	/* a cotangent of another batch size */
	items[0] = h_rand_tensor(s.b, &s.bb, 2, h3, 7);
	cr_assert_eq(tl_grad(s.c, "t7.rnn", carry, inputs, cot_c,
	                     h_rand_tensor(s.b, &s.bb, 3, y4, 8), &r, &err),
	             -1);
	cr_assert_str_eq(err.code, "COTANGENT_MISMATCH", "%s", err.message);
	cr_assert_str_eq(err.path, "cot_outputs");
	cr_assert_eq(tl_grad(s.c, "t7.rnn", carry, inputs, cot_c, cot_y, &r, &err), 0, "%s %s",
	             err.code, err.message);
	tl_reply_free(r);
	cr_assert_eq(hd_counter(s.c, "t7.rnn", "graphs"), 2, "errors take no budget slot");
	hs_close(&s);
}

/* Bodies that tie the batch size to something fixed. */
static const char FIXES_BATCH[] = "import torch\n"
                                  "def pinned(c, x):\n"
                                  "    # int() of the batch size pins it to the size traced\n"
                                  "    n = int(c.shape[0])\n"
                                  "    return c + x, c * torch.ones(n, 1, dtype=c.dtype)\n"
                                  "def flat(c, x):\n"
                                  "    # an output whose size is a multiple of the batch\n"
                                  "    return c + x, c.reshape(-1)\n";

Test(dynamic, a_body_that_fixes_the_batch_size_is_refused_with_BATCH_SPECIALIZED)
{
	struct h_session s = {.b = tl_builder_new()};
	static const char *const entries[] = {"pinned", "flat"};
	static const char *const paths[] = {"", "outputs"};
	char dir[512], body[600];
	struct tl_reply *r;
	struct tl_error err;
	int64_t cs[] = {3, 2}, xs[] = {T, 3, 2};

	h_tmpdir(dir, sizeof dir, "dynbody");
	snprintf(body, sizeof body, "%s/fixes_batch.py", dir);
	h_write_file(body, "%s", FIXES_BATCH);
	hs_open(&s, NULL, ARGS);
	for (int i = 0; i < 2; i++) {
		char name[32];
		snprintf(name, sizeof name, "t7.%s", entries[i]);
		cr_assert_eq(register_dynamic(s.c, name, body, entries[i], "batch", &err), 0, "%s",
		             err.message);
		cr_assert_eq(tl_scan(s.c, name, h_rand_tensor(s.b, &s.bb, 2, cs, 1),
		                     h_rand_tensor(s.b, &s.bb, 3, xs, 2), &r, &err),
		             -1, "%s compiled", entries[i]);
		cr_assert_str_eq(err.code, "BATCH_SPECIALIZED", "%s: %s", entries[i], err.message);
		cr_assert_str_eq(err.path, paths[i], "%s: %s", entries[i], err.message);
		cr_assert(strstr(err.message, "batch") != NULL, "%s", err.message);
		cr_assert_eq(hd_counter(s.c, name, "graphs"), 0, "a refused graph takes no slot");
	}
	/* the same body without dynamic = batch compiles per batch size, and serves */
	cr_assert_eq(register_dynamic(s.c, "t7.static", body, "flat", "none", &err), 0, "%s",
	             err.message);
	cr_assert_eq(tl_scan(s.c, "t7.static", h_rand_tensor(s.b, &s.bb, 2, cs, 3),
	                     h_rand_tensor(s.b, &s.bb, 3, xs, 4), &r, &err),
	             0, "%s %s", err.code, err.message);
	cr_assert_eq(tl_tree_shape(tl_reply_tree(r, "outputs"))[1], 6);
	tl_reply_free(r);
	hs_close(&s);
}

Test(dynamic, symbolic_graphs_are_loaded_from_the_cache_after_a_restart)
{
	char dir[512], path[700];
	const char *args[] = {"--no-probe", "--adapters", dir, NULL};
	struct tl_builder *b = tl_builder_new();
	struct h_bufs bb = {{0}, 0};
	struct tl_tree *carry, *inputs, *cot_c, *cot_y;
	struct tl_reply *r;
	struct tl_error err;
	struct hd d;
	struct tl_client *c;
	json_t *desc;

	h_tmpdir(dir, sizeof dir, "dynadapters");
	snprintf(path, sizeof path, "%s/t7.rnn.adapter", dir);
	h_write_file(path,
	             "name = t7.rnn\nbody = %s/examples/bodies/rnn.py\nentry = cell\n"
	             "dynamic = batch\nmax_steps = 8\nmax_elements = 4096\nrecompile_budget = 4\n",
	             h_root());
	/* the run's shared cache: test 1 may have compiled this graph already */
	hd_start(&d, NULL, args);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	rnn_trees(b, &bb, 5, 90, &carry, &inputs, &cot_c, &cot_y);
	cr_assert_eq(tl_scan(c, "t7.rnn", carry, inputs, &r, &err), 0, "%s %s", err.code,
	             err.message);
	tl_reply_free(r);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);

	hd_start(&d, NULL, args);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	desc = h_call_json(c, "describe", "t7.rnn");
	{
		json_t *sp = json_array_get(json_object_get(desc, "specializations"), 0);
		cr_assert_not_null(sp, "nothing preloaded");
		cr_assert_str_eq(json_string_value(json_object_get(sp, "state")), "ready");
		cr_assert_str_eq(json_string_value(json_object_get(sp, "signature")),
		                 "float64 T=3 carry=t([B,8],N) inputs=[3,B,3]");
	}
	json_decref(desc);
	h_bufs_free(&bb);
	rnn_trees(b, &bb, 2, 95, &carry, &inputs, &cot_c, &cot_y);
	cr_assert_eq(tl_scan(c, "t7.rnn", carry, inputs, &r, &err), 0, "%s %s", err.code,
	             err.message);
	cr_assert_eq(tl_tree_shape(tl_reply_tree(r, "outputs"))[1], 2);
	tl_reply_free(r);
	cr_assert_eq(hd_counter(c, "t7.rnn", "compiles"), 0, "another batch size, no compile");
	h_bufs_free(&bb);
	tl_builder_free(b);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
}

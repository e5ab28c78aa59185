/*
 * test_chunk.c - strategy = chunk: a scan of T steps, T a multiple of
 * PROTO_CHUNK_STEPS (16) and larger, runs the 16-step graph T / 16 times in
 * the daemon, the carry handed from chunk to chunk.  One graph serves T = 16,
 * 32, 48 and 128; results match an eager PyTorch loop
 * (tests/helpers/eager_ref.py) for a dict carry of three leaves, through the
 * socket and through shared memory; T that is not a multiple compiles its
 * own graph; grad runs the whole-T VJP graph (vs autograd and finite
 * differences); stacked outputs over max_elements are refused with
 * TOO_MANY_ELEMENTS and the next request is served.
 */
#include "harness.h"

#include "protocol.h"
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

TestSuite(chunk, .timeout = 900);

static const char *const ARGS[] = {"--no-probe", NULL};

/* lorenz.rk4: carry {x, y, z} of [3], inputs {forcing: [T, 3]}. */
static void lorenz_trees(struct tl_builder *b, struct h_bufs *bb, int64_t T, uint64_t seed,
                         struct tl_tree **carry, struct tl_tree **inputs)
{
	int64_t c[] = {3}, x[] = {T, 3};
	const char *keys[] = {"x", "y", "z"}, *fk[] = {"forcing"};
	struct tl_tree *xyz[3] = {h_rand_tensor(b, bb, 1, c, seed),
	                          h_rand_tensor(b, bb, 1, c, seed + 1),
	                          h_rand_tensor(b, bb, 1, c, seed + 2)};
	struct tl_tree *f = h_rand_tensor(b, bb, 2, x, seed + 3);

	*carry = tl_dict(b, 3, keys, xyz);
	*inputs = tl_dict(b, 1, fk, &f);
}

static void check_scan(struct tl_client *c, const char *adapter, const char *body,
                       const char *entry, struct tl_tree *carry, struct tl_tree *inputs,
                       struct tl_builder *b)
{
	h_assert_scan_matches_reference(c, adapter, body, entry, carry, inputs, b, "cref");
}

static const char *signature(json_t *desc, size_t i)
{
	json_t *sp = json_array_get(json_object_get(desc, "specializations"), i);

	return json_string_value(json_object_get(sp, "signature"));
}

Test(chunk, one_sixteen_step_graph_serves_every_multiple_and_matches_eager)
{
	struct h_session s = {.b = tl_builder_new()};
	static const int64_t steps[] = {16, 32, 48, 128};
	struct tl_tree *carry, *inputs;
	json_t *desc;

	cr_assert_eq(PROTO_CHUNK_STEPS, 16);
	hs_open(&s, NULL, ARGS);
	hd_register_strategy(s.c, "ck.lorenz", "examples/bodies/lorenz.py", "rk4", "chunk", 128,
	                     65536, 4);
	for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
		lorenz_trees(s.b, &s.bb, steps[i], 100 + 10 * i, &carry, &inputs);
		check_scan(s.c, "ck.lorenz", "examples/bodies/lorenz.py", "rk4", carry, inputs,
		           s.b);
	}
	cr_assert_eq(hd_counter(s.c, "ck.lorenz", "graphs"), 1, "one graph for T = 16 .. 128");
	cr_assert_leq(hd_counter(s.c, "ck.lorenz", "compiles"), 1);
	desc = h_call_json(s.c, "describe", "ck.lorenz");
	cr_assert_str_eq(json_string_value(json_object_get(desc, "strategy")), "chunk");
	cr_assert_str_eq(
	    signature(desc, 0),
	    "float64 T=16 carry=d(1:x=[3],1:y=[3],1:z=[3]) inputs=d(7:forcing=[16,3])");
	json_decref(desc);
	hs_close(&s);
}

/* The chunks write their stacked outputs straight into the client's region;
 * T that is not chunked still works as under unroll. */
Test(chunk, chunked_results_land_in_shared_memory_and_other_t_get_their_own_graph)
{
	struct h_session s = {.b = tl_builder_new()};
	struct tl_tree *carry, *inputs;
	struct tl_error err;
	int64_t cs[] = {3, 2}, xs[] = {48, 3, 2};

	hs_open(&s, NULL, ARGS);
	hd_register_strategy(s.c, "ck.ema", "examples/bodies/ema.py", "body", "chunk", 128, 65536,
	                     4);
	cr_assert_eq(tl_shm_attach(s.c, 1 << 20, &err), 0, "%s %s", err.code, err.message);
	tl_shm_set_threshold(s.c, 1);
	carry = h_rand_tensor(s.b, &s.bb, 2, cs, 21);
	inputs = h_rand_tensor(s.b, &s.bb, 3, xs, 22);
	check_scan(s.c, "ck.ema", "examples/bodies/ema.py", "body", carry, inputs, s.b);
	check_scan(s.c, "ck.ema", "examples/bodies/ema.py", "body", carry, inputs, s.b);
	cr_assert_geq(h_stat(s.c, "shm_attaches"), 1);
	cr_assert_eq(hd_counter(s.c, "ck.ema", "graphs"), 1);
	/* T = 8 (not above 16) and T = 20 (not a multiple): their own graphs */
	for (int k = 0; k < 2; k++) {
		int64_t x[] = {k ? 20 : 8, 3, 2};
		inputs = h_rand_tensor(s.b, &s.bb, 3, x, 23 + k);
		check_scan(s.c, "ck.ema", "examples/bodies/ema.py", "body", carry, inputs, s.b);
	}
	cr_assert_eq(hd_counter(s.c, "ck.ema", "graphs"), 3);
	hs_close(&s);
}

/* grad is not split: the VJP graph of the whole T, vs autograd and finite differences. */
Test(chunk, grad_runs_the_whole_vjp_graph_and_matches_autograd)
{
	struct h_session s = {.b = tl_builder_new()};
	struct tl_tree *carry, *inputs, *cot_c, *cot_y;
	struct tl_reply *r;
	struct tl_error err;
	int64_t cs[] = {3, 2}, xs[] = {32, 3, 2};
	json_t *desc;

	hs_open(&s, NULL, ARGS);
	hd_register_strategy(s.c, "ck.ema", "examples/bodies/ema.py", "body", "chunk", 128, 65536,
	                     4);
	carry = h_rand_tensor(s.b, &s.bb, 2, cs, 31);
	inputs = h_rand_tensor(s.b, &s.bb, 3, xs, 32);
	cot_c = h_rand_tensor(s.b, &s.bb, 2, cs, 33);
	cot_y = h_rand_tensor(s.b, &s.bb, 3, xs, 34);
	cr_assert_eq(tl_grad(s.c, "ck.ema", carry, inputs, cot_c, cot_y, &r, &err), 0, "%s %s",
	             err.code, err.message);
	h_assert_grad_matches_reference(r, s.b, "cgref", "examples/bodies/ema.py", "body", carry,
	                                inputs, cot_c, cot_y);
	tl_reply_free(r);
	desc = h_call_json(s.c, "describe", "ck.ema");
	cr_assert_str_eq(signature(desc, 0), "float64 T=32 carry=[3,2] inputs=[32,3,2]");
	json_decref(desc);
	hs_close(&s);
}

/*
 * rnn: x [T, 2, 3] but outputs [T, 2, 8].  max_elements 300: T = 32's inputs
 * (192) pass, the 16-step graph's outputs (256) too, the whole scan's (512)
 * do not -- refused before anything runs; T = 16 is still served.
 */
Test(chunk, stacked_outputs_over_max_elements_are_refused_and_the_next_scan_served)
{
	struct h_session s = {.b = tl_builder_new()};
	struct tl_tree *items[2], *carry, *inputs;
	struct tl_reply *r;
	struct tl_error err;
	int64_t h[] = {2, 8}, x16[] = {16, 2, 3}, x32[] = {32, 2, 3};

	hs_open(&s, NULL, ARGS);
	hd_register_strategy(s.c, "ck.rnn", "examples/bodies/rnn.py", "cell", "chunk", 128, 300, 4);
	items[0] = h_rand_tensor(s.b, &s.bb, 2, h, 41);
	items[1] = tl_none(s.b);
	carry = tl_tuple(s.b, 2, items);
	inputs = h_rand_tensor(s.b, &s.bb, 3, x16, 42);
	check_scan(s.c, "ck.rnn", "examples/bodies/rnn.py", "cell", carry, inputs, s.b);
	inputs = h_rand_tensor(s.b, &s.bb, 3, x32, 43);
	cr_assert_eq(tl_scan(s.c, "ck.rnn", carry, inputs, &r, &err), -1);
	cr_assert_str_eq(err.code, "TOO_MANY_ELEMENTS", "%s", err.message);
	cr_assert_str_eq(err.path, "outputs");
	cr_assert(strstr(err.message, "512") && strstr(err.message, "max_elements=300"), "%s",
	          err.message);
	inputs = h_rand_tensor(s.b, &s.bb, 3, x16, 44);
	check_scan(s.c, "ck.rnn", "examples/bodies/rnn.py", "cell", carry, inputs, s.b);
	cr_assert_eq(hd_counter(s.c, "ck.rnn", "graphs"), 1);
	hs_close(&s);
}

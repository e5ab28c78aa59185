/*
 * test_grad.c - first-order autograd over the socket.  float64 gradients of
 * the example bodies (tensor, dict and tuple carries, None leaves, captured
 * constants) at T=1 and T=max_steps, with both compile strategies and the
 * checkpointed VJP (tl_grad_checkpoint), against torch.autograd on an
 * eager loop
 * (<= 1e-10) and central finite differences (<= 1e-6), both computed by
 * tests/helpers/eager_ref.py; the saved pair (tl_scan_save, tl_grad_saved);
 * and mismatched cotangent trees.
 */
#include "harness.h"

#include "params.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_STEPS 6

TestSuite(grad, .timeout = 900);

static const char *const ARGS[] = {"--no-probe", NULL};

struct gcase {
	const char *adapter, *file, *entry;
	int kind; /* 0 tensor carry, 1 dict (lorenz), 2 tuple with None (rnn) */
	int64_t steps;
	const char *strategy; /* NULL: unroll (the default); "scan": torch's scan op */
	bool checkpoint;      /* tl_grad_checkpoint: carries kept, steps recomputed */
};

static const struct gcase CASES[] = {
    {"t6.ema", "examples/bodies/ema.py", "body", 0, 1},
    {"t6.ema", "examples/bodies/ema.py", "body", 0, MAX_STEPS},
    {"t6.lorenz", "examples/bodies/lorenz.py", "rk4", 1, 1},
    {"t6.lorenz", "examples/bodies/lorenz.py", "rk4", 1, MAX_STEPS},
    {"t6.rnn", "examples/bodies/rnn.py", "cell", 2, 1},
    {"t6.rnn", "examples/bodies/rnn.py", "cell", 2, MAX_STEPS},
    {"t6.dict_out", "examples/bodies/dict_out.py", "body", 0, MAX_STEPS},
    /* the vjp of torch's scan op (strategy = scan) */
    {"t6.ema_scan", "examples/bodies/ema.py", "body", 0, MAX_STEPS, "scan"},
    /* a dict carry: the scan op's VJP is traced with fake tensors (with real
     * ones torch 2.14's make_fx said "Mixing fake modes NYI") */
    {"t6.lorenz_scan", "examples/bodies/lorenz.py", "rk4", 1, MAX_STEPS, "scan"},
    /* strategy scan with module-level weights the body captures: they are the
     * scan op's additional inputs, the graph's constants */
    {"t6.rnn_scan", "examples/bodies/rnn.py", "cell", 2, MAX_STEPS, "scan"},
    /* libtorchloop's checkpointed VJP (a dict carry with a None cotangent) */
    {"t6.lorenz_ckpt", "examples/bodies/lorenz.py", "rk4", 1, MAX_STEPS, NULL, true},
};

/* carry, inputs and cotangents (None for the carry's None leaves). */
static void build(const struct gcase *gc, struct tl_builder *b, struct h_bufs *bb,
                  struct tl_tree **carry, struct tl_tree **inputs, struct tl_tree **cot_c,
                  struct tl_tree **cot_y)
{
	int64_t T = gc->steps;

	if (gc->kind == 0) {
		int64_t c[] = {3, 2}, x[] = {T, 3, 2};
		if (strcmp(gc->entry, "body") == 0 && strstr(gc->file, "dict_out")) {
			const char *k[] = {"value", "nothing"};
			struct tl_tree *items[2];
			*carry = h_rand_tensor(b, bb, 2, c, 1);
			*inputs = h_rand_tensor(b, bb, 3, x, 2);
			*cot_c = h_rand_tensor(b, bb, 2, c, 3);
			items[0] = h_rand_tensor(b, bb, 3, x, 4);
			items[1] = tl_none(b);
			*cot_y = tl_dict(b, 2, k, items);
			return;
		}
		*carry = h_rand_tensor(b, bb, 2, c, 1);
		*inputs = h_rand_tensor(b, bb, 3, x, 2);
		*cot_c = h_rand_tensor(b, bb, 2, c, 3);
		*cot_y = h_rand_tensor(b, bb, 3, x, 4);
	} else if (gc->kind == 1) {
		int64_t c[] = {3}, x[] = {T, 3};
		const char *keys[] = {"x", "y", "z"}, *fk[] = {"forcing"};
		struct tl_tree *xyz[3] = {h_rand_tensor(b, bb, 1, c, 5),
		                          h_rand_tensor(b, bb, 1, c, 6),
		                          h_rand_tensor(b, bb, 1, c, 7)};
		struct tl_tree *cxyz[3] = {h_rand_tensor(b, bb, 1, c, 8), tl_none(b),
		                           h_rand_tensor(b, bb, 1, c, 9)};
		struct tl_tree *f = h_rand_tensor(b, bb, 2, x, 10);
		*carry = tl_dict(b, 3, keys, xyz);
		*inputs = tl_dict(b, 1, fk, &f);
		*cot_c = tl_dict(b, 3, keys, cxyz); /* a None leaf: zero cotangent for y */
		*cot_y = h_rand_tensor(b, bb, 2, x, 11);
	} else {
		int64_t h[] = {2, 8}, x[] = {T, 2, 3}, y[] = {T, 2, 8};
		struct tl_tree *items[2] = {h_rand_tensor(b, bb, 2, h, 12), tl_none(b)};
		struct tl_tree *citems[2] = {h_rand_tensor(b, bb, 2, h, 13), tl_none(b)};
		*carry = tl_tuple(b, 2, items);
		*inputs = h_rand_tensor(b, bb, 3, x, 14);
		*cot_c = tl_tuple(b, 2, citems);
		*cot_y = h_rand_tensor(b, bb, 3, y, 15);
	}
}

TABLE_TEST(grad, gradients_match_autograd_and_finite_differences, CASES)
{
	struct h_session s = {.b = tl_builder_new()};
	const struct gcase *gc = &CASES[*i];
	struct tl_tree *carry, *inputs, *cot_c, *cot_y;
	struct tl_reply *r;
	struct tl_error err;

	build(gc, s.b, &s.bb, &carry, &inputs, &cot_c, &cot_y);
	hs_open(&s, NULL, ARGS);
	hd_register_strategy(s.c, gc->adapter, gc->file, gc->entry, gc->strategy, MAX_STEPS, 65536,
	                     8);
	cr_assert_eq((gc->checkpoint ? tl_grad_checkpoint : tl_grad)(
	                 s.c, gc->adapter, carry, inputs, cot_c, cot_y, &r, &err),
	             0, "%s: %s %s", gc->adapter, err.code, err.message);
	h_assert_grad_matches_reference(r, s.b, "gref", gc->file, gc->entry, carry, inputs, cot_c,
	                                cot_y);
	cr_assert_eq(hd_counter(s.c, gc->adapter, "graphs"), 1,
	             "the vjp graph counts against the budget");
	{
		/* how the loop was lowered, and why when not as the strategy asked */
		json_t *desc = h_call_json(s.c, "describe", gc->adapter);
		json_t *sp = json_array_get(json_object_get(desc, "specializations"), 0);
		const char *lowered = json_string_value(json_object_get(sp, "lowered"));
		const char *note = json_string_value(json_object_get(sp, "note"));
		const char *want = gc->strategy || gc->checkpoint ? "scan" : "unroll";
		cr_assert_not_null(lowered);
		cr_assert_not_null(note);
		cr_assert_str_eq(lowered, want, "%s: lowered %s (%s)", gc->adapter, lowered, note);
		/* every case is lowered as its strategy asks: no note, but the
		 * checkpointed graph's, which says what it is */
		cr_assert_str_eq(json_string_value(json_object_get(sp, "kind")),
		                 gc->checkpoint ? "grad_checkpoint" : "grad");
		if (gc->checkpoint)
			cr_assert(strstr(note, "checkpointed") != NULL, "%s", note);
		else
			cr_assert_str_eq(note, "", "%s", note);
		json_decref(desc);
	}
	tl_reply_free(r);
	hs_close(&s);
}

/* ---- the saved pair ------------------------------------------------------------- */

/* libtorchloop's tl_scan_save, then tl_grad_saved: the forward keeps saved,
 * the backward starts from it (kinds scan_save and grad_saved, two graphs),
 * against autograd and finite differences; a reply that is not a
 * tl_scan_save's is refused before anything is sent. */
Test(grad, the_saved_pair_matches_autograd_without_a_second_forward)
{
	struct h_session s = {.b = tl_builder_new()};
	const struct gcase *gc = &CASES[3]; /* lorenz, T = MAX_STEPS: a None cotangent leaf */
	struct tl_tree *carry, *inputs, *cot_c, *cot_y;
	struct tl_reply *fwd, *r, *plain, *none = NULL;
	struct tl_error err;

	build(gc, s.b, &s.bb, &carry, &inputs, &cot_c, &cot_y);
	hs_open(&s, NULL, ARGS);
	/* a budget of 2: the pair counts once (its backward with its forward, as
	 * torch.compile's backward with its frame), the plain scan below twice */
	hd_register(s.c, gc->adapter, gc->file, gc->entry, MAX_STEPS, 65536, 2);
	cr_assert_eq(tl_scan_save(s.c, gc->adapter, carry, inputs, &fwd, &err), 0, "%s %s",
	             err.code, err.message);
	cr_assert_not_null(tl_reply_tree(fwd, "saved"));
	{
		/* the backward's graph was asked for with the forward's (its compile
		 * started beside it): there before any grad */
		json_t *desc = h_call_json(s.c, "describe", gc->adapter);
		json_t *sps = json_object_get(desc, "specializations");
		bool found = false;
		for (size_t k = 0; k < json_array_size(sps); k++)
			found |= strcmp(json_string_value(
			                    json_object_get(json_array_get(sps, k), "kind")),
			                "grad_saved") == 0;
		cr_assert(found, "no grad_saved specialization after tl_scan_save");
		json_decref(desc);
	}
	cr_assert_eq(tl_grad_saved(s.c, gc->adapter, carry, inputs, fwd, cot_c, cot_y, &r, &err), 0,
	             "%s %s", err.code, err.message);
	cr_assert_null(tl_reply_tree(r, "carry"), "a grad with saved returns the gradients only");
	h_assert_pair_matches_reference(fwd, r, s.b, "gsaved", gc->file, gc->entry, carry, inputs,
	                                cot_c, cot_y);
	cr_assert_eq(hd_counter(s.c, gc->adapter, "graphs"), 2, "two graphs: the pair");
	{
		json_t *desc = h_call_json(s.c, "describe", gc->adapter);
		cr_assert_eq(json_integer_value(json_object_get(desc, "budget_used")), 1,
		             "the pair spends one of the budget");
		json_decref(desc);
	}
	tl_reply_free(r);
	cr_assert_eq(tl_scan(s.c, gc->adapter, carry, inputs, &plain, &err), 0, "%s", err.message);
	cr_assert_eq(
	    tl_grad_saved(s.c, gc->adapter, carry, inputs, plain, cot_c, cot_y, &none, &err), -1);
	cr_assert_null(none);
	cr_assert_str_eq(err.code, "INVALID_ARGUMENT");
	cr_assert_str_eq(err.path, "saved");
	tl_reply_free(plain);
	tl_reply_free(fwd);
	hs_close(&s);
}

/* ---- mismatched cotangents ------------------------------------------------------ */

Test(grad, mismatched_cotangents_get_their_code_and_leaf_path)
{
	struct h_session s = {.b = tl_builder_new()};
	static double buf[64];
	struct tl_tree *carry, *inputs, *cot_c, *cot_y;
	struct tl_reply *r;
	struct tl_error err;
	const struct gcase *gc = &CASES[5]; /* rnn, T = MAX_STEPS: tuple carry with None */
	int64_t h[] = {2, 8}, bad_h[] = {2, 7}, y[] = {MAX_STEPS, 2, 8};
	static float f32[16];
	struct tl_tree *items[2];

	build(gc, s.b, &s.bb, &carry, &inputs, &cot_c, &cot_y);
	hs_open(&s, NULL, ARGS);
	hd_register(s.c, gc->adapter, gc->file, gc->entry, MAX_STEPS, 65536, 8);
	/* a list where the carry is a tuple */
	items[0] = tl_tensor(s.b, TL_FLOAT64, 2, h, buf);
	items[1] = tl_none(s.b);
	cr_assert_eq(
	    tl_grad(s.c, gc->adapter, carry, inputs, tl_list(s.b, 2, items), cot_y, &r, &err), -1);
	cr_assert_str_eq(err.code, "COTANGENT_MISMATCH", "%s", err.message);
	cr_assert_str_eq(err.path, "cot_carry");
	/* a wrong shape */
	items[0] = tl_tensor(s.b, TL_FLOAT64, 2, bad_h, buf);
	cr_assert_eq(
	    tl_grad(s.c, gc->adapter, carry, inputs, tl_tuple(s.b, 2, items), cot_y, &r, &err), -1);
	cr_assert_str_eq(err.code, "COTANGENT_MISMATCH");
	cr_assert_str_eq(err.path, "cot_carry[0]");
	/* a tensor where the carry holds None */
	items[0] = tl_tensor(s.b, TL_FLOAT64, 2, h, buf);
	items[1] = tl_tensor(s.b, TL_FLOAT64, 2, h, buf);
	cr_assert_eq(
	    tl_grad(s.c, gc->adapter, carry, inputs, tl_tuple(s.b, 2, items), cot_y, &r, &err), -1);
	cr_assert_str_eq(err.code, "COTANGENT_MISMATCH");
	cr_assert_str_eq(err.path, "cot_carry[1]");
	/* a wrong dtype */
	cr_assert_eq(tl_grad(s.c, gc->adapter, carry, inputs, cot_c,
	                     tl_tensor(s.b, TL_FLOAT32, 1, (int64_t[]){16}, f32), &r, &err),
	             -1);
	cr_assert_str_eq(err.code, "COTANGENT_MISMATCH");
	cr_assert_str_eq(err.path, "cot_outputs");
	/* absent cotangents are zeros: zero gradients, and the daemon still serves */
	cr_assert_eq(tl_grad(s.c, gc->adapter, carry, inputs, NULL, NULL, &r, &err), 0, "%s",
	             err.message);
	{
		const struct tl_tree *g = tl_tree_item(tl_reply_tree(r, "grad_carry"), 0);
		const double *gd = tl_tree_data(g);
		cr_assert_eq(tl_tree_kind(tl_tree_item(tl_reply_tree(r, "grad_carry"), 1)),
		             TL_NONE);
		for (int k = 0; k < 16; k++)
			cr_assert_eq(gd[k], 0.0);
	}
	tl_reply_free(r);
	(void)y;
	hs_close(&s);
}

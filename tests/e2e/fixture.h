/*
 * fixture.h - the e2e suites' common fixture: a daemon without the probe
 * (socket mode 0666, for the access-control test), one client, and the cheap
 * t4.cumsum adapter (float64, T=3, carry [4]) whose scan is checked by hand.
 * Included by test_ops.c, test_service.c and test_requests.c.
 */
#ifndef TORCHLOOP_E2E_FIXTURE_H
#define TORCHLOOP_E2E_FIXTURE_H

#include "harness.h"

#include <stdio.h>
#include <string.h>

static const char *const NO_PROBE[] = {"--no-probe", "--socket-mode", "0666", NULL};
#define CUMSUM "examples/bodies/cumsum.py"

struct fixture {
	struct hd d;
	struct tl_client *c;
	struct tl_builder *b;
	double carry[4], xs[12];
	struct tl_tree *carry_t, *inputs_t;
};

/* The reference scan's trees (scan_ok), in f. */
static inline void fixture_trees(struct fixture *f)
{
	int64_t cs[] = {4}, xs[] = {3, 4};

	f->b = tl_builder_new();
	h_fill(f->carry, TL_FLOAT64, 4, 11);
	h_fill(f->xs, TL_FLOAT64, 12, 12);
	f->carry_t = tl_tensor(f->b, TL_FLOAT64, 1, cs, f->carry);
	f->inputs_t = tl_tensor(f->b, TL_FLOAT64, 2, xs, f->xs);
}

static inline void setup(struct fixture *f, const char *const *args)
{
	hd_start(&f->d, NULL, args ? args : NO_PROBE);
	hd_wait_ready(&f->d, 120);
	f->c = hd_connect(&f->d);
	hd_register(f->c, "t4.cumsum", CUMSUM, "body", 12, 64, 3);
	fixture_trees(f);
}

/* setup, and a raw connection (harness.h's raw_*) for hand-made frames. */
static inline int setup_raw(struct fixture *f, const char *const *args)
{
	setup(f, args);
	return raw_connect(f->d.sock);
}

static inline void teardown(struct fixture *f)
{
	tl_builder_free(f->b);
	tl_close(f->c);
	cr_assert_eq(hd_stop(&f->d), 0, "clean exit; log %s", f->d.log);
}

/* The reference scan, checked by hand: carry + running sums of x. */
static inline void scan_ok(struct fixture *f, struct tl_client *c)
{
	struct tl_reply *r;
	struct tl_error err;
	const double *y, *fin;

	cr_assert_eq(tl_scan(c, "t4.cumsum", f->carry_t, f->inputs_t, &r, &err), 0, "%s %s",
	             err.code, err.message);
	y = tl_tree_data(tl_reply_tree(r, "outputs"));
	fin = tl_tree_data(tl_reply_tree(r, "carry"));
	for (int k = 0; k < 4; k++) {
		double acc = f->carry[k];
		for (int s = 0; s < 3; s++) {
			acc += f->xs[4 * s + k];
			cr_assert_float_eq(y[4 * s + k], acc, 1e-12);
		}
		cr_assert_float_eq(fin[k], acc, 1e-12);
	}
	tl_reply_free(r);
}

static inline void write_adapter(const char *dir, const char *name)
{
	char path[600];

	snprintf(path, sizeof path, "%s/%s.adapter", dir, name);
	h_write_file(path, "# test\nname = %s\nbody = %s/%s\nentry = body\nmax_steps = 12\n", name,
	             h_root(), CUMSUM);
}

#endif

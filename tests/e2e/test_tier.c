/*
 * test_tier.c - the quick tier (--quick-tier-steps): an unrolled graph that
 * is not in the cache is served first by the scan op's graph, while the
 * unrolled one compiles in the background and then takes over.  Results
 * match an eager PyTorch loop (tests/helpers/eager_ref.py) before and after
 * the switch, for scan and for grad (vs autograd and finite differences);
 * the switch holds one budget slot; a restart serves the unrolled graph from
 * the cache, and a cache that holds only the quick tier's graph serves it
 * while the unrolled one is rebuilt (for an --adapters file, loaded at
 * start-up and upgraded with no request); a daemon stopped during an upgrade exits
 * cleanly; a body's module-level tensors are the scan op's constants; a
 * quick compile that fails falls back to the unrolled loop for the request
 * waiting on it, and an unrolled compile that fails leaves the scan op's
 * graph serving, with the reason in describe's note
 * (tests/fixtures/refuses.py has a body for each).  Which graph served a
 * reply is read right after it, and graph_key names that graph's object.
 *
 * Each test has its own cache (the quick tier is only taken on a miss), and
 * --quick-tier-steps 4 keeps the graphs small: T = 4 costs two compiles of a
 * few seconds per specialization.
 */
#include "harness.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

TestSuite(tier, .timeout = 900);

static const char *const ARGS[] = {"--no-probe", "--quick-tier-steps", "4", NULL};
#define REFUSED "tests/fixtures/refuses.py"
#define EMA     "examples/bodies/ema.py"
#define RNN     "examples/bodies/rnn.py"

/* The adapter's only specialization, as describe shows it (caller decrefs). */
static json_t *the_spec(struct tl_client *c, const char *adapter)
{
	json_t *desc = h_call_json(c, "describe", adapter);
	json_t *specs = json_object_get(desc, "specializations");
	json_t *sp;

	cr_assert_eq(json_array_size(specs), 1, "one specialization");
	sp = json_incref(json_array_get(specs, 0));
	json_decref(desc);
	return sp;
}

static const char *str(json_t *sp, const char *key)
{
	const char *s = json_string_value(json_object_get(sp, key));

	cr_assert_not_null(s, "describe has no %s", key);
	return s;
}

static void assert_tier(struct tl_client *c, const char *adapter, const char *tier,
                        const char *lowered, bool upgrading)
{
	json_t *sp = the_spec(c, adapter);

	cr_assert_str_eq(str(sp, "state"), "ready");
	cr_assert_str_eq(str(sp, "tier"), tier);
	cr_assert_str_eq(str(sp, "lowered"), lowered);
	cr_assert_eq(json_is_true(json_object_get(sp, "upgrading")), upgrading, "upgrading");
	/* graph_key names the object serving: the quick tier's own, then key's */
	if (strcmp(tier, "quick") == 0)
		cr_assert_str_neq(str(sp, "graph_key"), str(sp, "key"));
	else
		cr_assert_str_eq(str(sp, "graph_key"), str(sp, "key"));
	json_decref(sp);
}

/* Polls describe until the upgrade is over (at most 600 s); returns the
 * specialization then (caller decrefs). */
static json_t *await_upgrade(struct tl_client *c, const char *adapter)
{
	for (int i = 0; i < 2400; i++) {
		json_t *sp = the_spec(c, adapter);
		if (!json_is_true(json_object_get(sp, "upgrading")))
			return sp;
		json_decref(sp);
		usleep(250 * 1000);
	}
	cr_assert_fail("the upgrade was not over within 600 s");
	return NULL;
}

/* Waits until the unrolled graph took over. */
static void await_final(struct tl_client *c, const char *adapter)
{
	json_t *sp = await_upgrade(c, adapter);

	cr_assert_str_eq(str(sp, "tier"), "final", "the upgrade ended without the unrolled graph");
	json_decref(sp);
}

/* carry [3, 2], inputs [T, 3, 2] */
static void ema_trees(struct tl_builder *b, struct h_bufs *bb, int64_t T, uint64_t seed,
                      struct tl_tree **carry, struct tl_tree **inputs)
{
	int64_t cs[] = {3, 2}, xs[] = {T, 3, 2};

	*carry = h_rand_tensor(b, bb, 2, cs, seed);
	*inputs = h_rand_tensor(b, bb, 3, xs, seed + 1);
}

/* tier "quick": the scan op's graph, its upgrade under way; "final": the
 * unrolled graph, nothing under way; NULL: either. */
static void assert_served_by(struct tl_client *c, const char *adapter, const char *tier)
{
	if (tier != NULL && strcmp(tier, "quick") == 0)
		assert_tier(c, adapter, "quick", "scan", true);
	else if (tier != NULL)
		assert_tier(c, adapter, "final", "unroll", false);
}

/* A scan against the eager loop; which graph served it (tier, see above) is
 * read right after the reply, before the reference's seconds let an upgrade
 * under way end. */
static void check_scan(struct tl_client *c, const char *adapter, const char *body,
                       const char *entry, struct tl_tree *carry, struct tl_tree *inputs,
                       struct tl_builder *b, const char *tier)
{
	struct tl_reply *r;
	struct tl_error err;

	cr_assert_eq(tl_scan(c, adapter, carry, inputs, &r, &err), 0, "%s: %s %s", adapter,
	             err.code, err.message);
	assert_served_by(c, adapter, tier);
	h_assert_reply_matches_reference(r, body, entry, carry, inputs, b, "tref");
}

static void start(struct hd *d, const char *cache, struct tl_client **c, const char *adapter,
                  const char *body, const char *entry)
{
	hd_start(d, cache, ARGS);
	hd_wait_ready(d, 120);
	*c = hd_connect(d);
	hd_register(*c, adapter, body, entry, 8, 4096, 2);
}

static void remove_object(const char *cache, const char *key)
{
	char path[1024];

	for (int i = 0; i < 2; i++) {
		snprintf(path, sizeof path, "%s/objects/%s.%s", cache, key, i ? "meta" : "so");
		cr_assert_eq(unlink(path), 0, "unlink %s", path);
	}
}

Test(tier, a_long_unrolled_scan_is_served_by_the_scan_op_first_then_unrolled)
{
	struct tl_builder *b = tl_builder_new();
	struct h_bufs bb = {{0}, 0};
	struct tl_tree *carry, *inputs;
	char cache[512], key[128];
	struct tl_client *c;
	struct hd d;
	json_t *sp;

	h_tmpdir(cache, sizeof cache, "tcache");
	ema_trees(b, &bb, 4, 31, &carry, &inputs);
	start(&d, cache, &c, "tier.ema", EMA, "body");
	/* the first reply comes from the scan op's graph; the unrolled one is
	 * being built (a compile takes seconds, the describe microseconds) */
	check_scan(c, "tier.ema", EMA, "body", carry, inputs, b, "quick");
	check_scan(c, "tier.ema", EMA, "body", carry, inputs, b, NULL);
	await_final(c, "tier.ema");
	check_scan(c, "tier.ema", EMA, "body", carry, inputs, b, "final");
	cr_assert_eq(hd_counter(c, "tier.ema", "compiles"), 2, "the scan op's, then the unrolled");
	cr_assert_eq(hd_counter(c, "tier.ema", "graphs"), 1, "one budget slot");
	sp = the_spec(c, "tier.ema");
	snprintf(key, sizeof key, "%s", str(sp, "key"));
	json_decref(sp);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);

	/* a restart: the unrolled graph from the cache, no compile */
	start(&d, cache, &c, "tier.ema", EMA, "body");
	check_scan(c, "tier.ema", EMA, "body", carry, inputs, b, "final");
	cr_assert_eq(hd_counter(c, "tier.ema", "compiles"), 0);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);

	/* the cache holds only the quick tier's graph (a daemon stopped while it
	 * upgraded): that serves at once, and the unrolled one is built again */
	remove_object(cache, key);
	start(&d, cache, &c, "tier.ema", EMA, "body");
	check_scan(c, "tier.ema", EMA, "body", carry, inputs, b, "quick");
	sp = the_spec(c, "tier.ema");
	cr_assert(json_is_true(json_object_get(sp, "from_cache")));
	json_decref(sp);
	await_final(c, "tier.ema");
	check_scan(c, "tier.ema", EMA, "body", carry, inputs, b, "final");
	cr_assert_eq(hd_counter(c, "tier.ema", "compiles"), 1, "only the unrolled graph");
	cr_assert_eq(hd_counter(c, "tier.ema", "cache_hits"), 1, "the quick tier's");
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
	h_bufs_free(&bb);
	tl_builder_free(b);
}

/* A grad reply against autograd and finite differences on the eager loop. */
static void check_grad(struct tl_client *c, struct tl_builder *b, const char *tag,
                       struct tl_tree *carry, struct tl_tree *inputs, struct tl_tree *cot_c,
                       struct tl_tree *cot_y, const char *tier)
{
	struct tl_reply *r;
	struct tl_error err;

	cr_assert_eq(tl_grad(c, "tier.ema", carry, inputs, cot_c, cot_y, &r, &err), 0, "%s %s",
	             err.code, err.message);
	assert_served_by(c, "tier.ema", tier);
	h_assert_grad_matches_reference(r, b, tag, EMA, "body", carry, inputs, cot_c, cot_y);
	tl_reply_free(r);
}

Test(tier, grad_is_served_by_the_scan_ops_vjp_first_and_a_stop_mid_upgrade_is_clean)
{
	struct tl_builder *b = tl_builder_new();
	struct h_bufs bb = {{0}, 0};
	struct tl_tree *carry, *inputs, *cot_c, *cot_y;
	struct tl_client *c;
	struct hd d;
	char cache[512];

	h_tmpdir(cache, sizeof cache, "tcache");
	ema_trees(b, &bb, 4, 41, &carry, &inputs);
	ema_trees(b, &bb, 4, 43, &cot_c, &cot_y);
	start(&d, cache, &c, "tier.ema", EMA, "body");
	check_grad(c, b, "tq", carry, inputs, cot_c, cot_y, "quick");
	/* stopped while the unrolled graph compiles: a clean exit */
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0, "clean exit mid-upgrade; log %s", d.log);

	start(&d, cache, &c, "tier.ema", EMA, "body");
	check_grad(c, b, "tq2", carry, inputs, cot_c, cot_y, "quick");
	await_final(c, "tier.ema");
	check_grad(c, b, "tf", carry, inputs, cot_c, cot_y, "final");
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
	h_bufs_free(&bb);
	tl_builder_free(b);
}

/* rnn.py captures module-level tensors (its weights): the quick tier's scan
 * op takes them as additional inputs (constants of its graph), then the
 * unrolled graph takes over; both match the eager loop. */
Test(tier, a_body_capturing_module_tensors_is_served_by_the_scan_op_then_unrolled)
{
	struct tl_builder *b = tl_builder_new();
	struct h_bufs bb = {{0}, 0};
	int64_t hs[] = {2, 8}, xs[] = {4, 2, 3};
	struct tl_tree *items[2], *carry, *inputs;
	struct tl_client *c;
	struct hd d;
	char cache[512];
	json_t *sp;

	h_tmpdir(cache, sizeof cache, "tcache");
	items[0] = h_rand_tensor(b, &bb, 2, hs, 51);
	items[1] = tl_none(b);
	carry = tl_tuple(b, 2, items);
	inputs = h_rand_tensor(b, &bb, 3, xs, 52);
	start(&d, cache, &c, "tier.rnn", RNN, "cell");
	check_scan(c, "tier.rnn", RNN, "cell", carry, inputs, b, "quick");
	sp = the_spec(c, "tier.rnn");
	cr_assert_str_eq(str(sp, "note"), "", "lowered as asked");
	json_decref(sp);
	await_final(c, "tier.rnn");
	check_scan(c, "tier.rnn", RNN, "cell", carry, inputs, b, "final");
	cr_assert_eq(hd_counter(c, "tier.rnn", "compiles"), 2, "the scan op's, then the unrolled");
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
	h_bufs_free(&bb);
	tl_builder_free(b);
}

/* One adapter of tests/fixtures/refuses.py on a daemon of its own, with ema's
 * trees at T = 4. */
struct refused {
	struct tl_builder *b;
	struct h_bufs bb;
	struct tl_tree *carry, *inputs;
	struct tl_client *c;
	struct hd d;
	const char *adapter, *entry;
};

static void refused_start(struct refused *r, const char *adapter, const char *entry)
{
	char cache[512];

	memset(r, 0, sizeof *r);
	r->b = tl_builder_new();
	r->adapter = adapter;
	r->entry = entry;
	h_tmpdir(cache, sizeof cache, "tcache");
	ema_trees(r->b, &r->bb, 4, 61, &r->carry, &r->inputs);
	start(&r->d, cache, &r->c, adapter, REFUSED, entry);
}

static void refused_scan(struct refused *r, const char *tier)
{
	check_scan(r->c, r->adapter, REFUSED, r->entry, r->carry, r->inputs, r->b, tier);
}

static void refused_stop(struct refused *r)
{
	tl_close(r->c);
	cr_assert_eq(hd_stop(&r->d), 0);
	h_bufs_free(&r->bb);
	tl_builder_free(r->b);
}

/* tests/fixtures/refuses.py:scan_op_refuses cannot be traced inside the scan
 * op: the quick tier's compile fails, and the unrolled loop is compiled in
 * its place for the same waiting request. */
Test(tier, a_quick_tier_that_fails_falls_back_to_the_unrolled_loop)
{
	struct refused r;

	refused_start(&r, "tier.refused", "scan_op_refuses");
	refused_scan(&r, "final");
	cr_assert_eq(hd_counter(r.c, "tier.refused", "compiles"), 2,
	             "the scan op's, then unrolled");
	cr_assert_eq(hd_counter(r.c, "tier.refused", "graphs"), 1);
	refused_scan(&r, "final");
	refused_stop(&r);
}

/*
 * An adapter from an --adapters file whose daemon stopped mid-upgrade: at the
 * next start its quick graph is loaded from the cache before the daemon says
 * ready (the warm-start index), and the upgrade resumes with no request.
 */
Test(tier, a_preloaded_adapter_resumes_its_upgrade_after_a_restart)
{
	struct tl_builder *b = tl_builder_new();
	struct h_bufs bb = {{0}, 0};
	struct tl_tree *carry, *inputs;
	char cache[512], dir[512], path[700];
	const char *args[] = {"--no-probe", "--quick-tier-steps", "4", "--adapters", dir, NULL};
	struct tl_client *c;
	struct hd d;
	json_t *sp;

	h_tmpdir(cache, sizeof cache, "tcache");
	h_tmpdir(dir, sizeof dir, "tadapters");
	snprintf(path, sizeof path, "%s/tier.file.adapter", dir);
	h_write_file(path, "name = tier.file\nbody = %s/%s\nentry = body\nmax_steps = 8\n",
	             h_root(), EMA);
	ema_trees(b, &bb, 4, 71, &carry, &inputs);
	hd_start(&d, cache, args);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	check_scan(c, "tier.file", EMA, "body", carry, inputs, b, "quick");
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0, "clean exit mid-upgrade; log %s", d.log);

	hd_start(&d, cache, args);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	/* no request yet: loaded at start-up, and the unrolled graph on its way */
	sp = the_spec(c, "tier.file");
	cr_assert_str_eq(str(sp, "state"), "ready");
	cr_assert_str_eq(str(sp, "tier"), "quick");
	cr_assert(json_is_true(json_object_get(sp, "from_cache")));
	json_decref(sp);
	await_final(c, "tier.file");
	cr_assert_eq(hd_counter(c, "tier.file", "compiles"), 1, "only the unrolled graph");
	check_scan(c, "tier.file", EMA, "body", carry, inputs, b, "final");
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
	h_bufs_free(&bb);
	tl_builder_free(b);
}

/* tests/fixtures/refuses.py:unroll_refuses cannot be exported unrolled: the quick
 * tier's graph serves, the background compile fails, and the scan op's graph
 * keeps serving (still the eager loop's numbers) with the reason in note. */
Test(tier, an_unrolled_compile_that_fails_leaves_the_scan_op_serving)
{
	struct refused r;
	json_t *sp;

	refused_start(&r, "tier.nounroll", "unroll_refuses");
	refused_scan(&r, "quick");
	sp = await_upgrade(r.c, "tier.nounroll");
	cr_assert_str_eq(str(sp, "tier"), "quick");
	cr_assert_str_eq(str(sp, "lowered"), "scan");
	cr_assert(strstr(str(sp, "note"), "the upgrade (unroll) failed (UNSUPPORTED_OP)") != NULL,
	          "note: %s", str(sp, "note"));
	json_decref(sp);
	refused_scan(&r, NULL);
	cr_assert_eq(hd_counter(r.c, "tier.nounroll", "compiles"), 2,
	             "the scan op's, the failed one");
	cr_assert_eq(hd_counter(r.c, "tier.nounroll", "graphs"), 1);
	refused_stop(&r);
}

/* The adapter's specialization of kind (caller decrefs). */
static json_t *spec_of_kind(struct tl_client *c, const char *adapter, const char *kind)
{
	json_t *desc = h_call_json(c, "describe", adapter), *found = NULL, *sp;
	size_t i;

	json_array_foreach(json_object_get(desc, "specializations"), i, sp)
	{
		if (strcmp(str(sp, "kind"), kind) == 0)
			found = json_incref(sp);
	}
	json_decref(desc);
	cr_assert_not_null(found, "no %s specialization", kind);
	return found;
}

static double num(json_t *o, const char *key)
{
	json_t *v = json_object_get(o, key);

	cr_assert(json_is_number(v), "describe has no number %s", key);
	return json_number_value(v);
}

/*
 * --upgrade-budget 1: unrolling ema's 64 steps would add more than a second
 * to the compile (by the daemon's estimate from the step's ATen calls), so
 * the upgrade is the scan op over blocks of K unrolled steps; the blocked
 * graph then takes turns with the scan op's on the next runs and stays only
 * when faster (either verdict is consistent with the medians it reports).
 * A grad over the same budget gets no upgrade (a VJP is not built in
 * blocks): the scan op's VJP keeps serving.  Every reply matches eager.
 */
/* The specialization of adapter at T steps, as describe shows it (caller decrefs). */
static json_t *spec_at(struct tl_client *c, const char *adapter, int T)
{
	json_t *desc = h_call_json(c, "describe", adapter), *found = NULL;
	json_t *specs = json_object_get(desc, "specializations");
	char want[32];

	snprintf(want, sizeof want, "T=%d ", T);
	for (size_t i = 0; i < json_array_size(specs); i++)
		if (strstr(str(json_array_get(specs, i), "signature"), want))
			found = json_incref(json_array_get(specs, i));
	json_decref(desc);
	cr_assert_not_null(found, "no specialization at T=%d", T);
	return found;
}

/* Scans until the upgrade's trial at T steps has its verdict (into verdict). */
static void run_trial(struct tl_client *c, const char *adapter, int T, struct tl_tree *carry,
                      struct tl_tree *inputs, char *verdict, size_t size)
{
	struct tl_reply *r;
	struct tl_error err;

	snprintf(verdict, size, "trial");
	for (int i = 0; i < 400 && strcmp(verdict, "trial") == 0; i++) {
		json_t *sp;
		cr_assert_eq(tl_scan(c, adapter, carry, inputs, &r, &err), 0, "%s", err.message);
		tl_reply_free(r);
		sp = spec_at(c, adapter, T);
		snprintf(verdict, size, "%s", str(json_object_get(sp, "upgrade"), "verdict"));
		json_decref(sp);
	}
}

Test(tier, an_upgrade_over_its_budget_is_built_in_blocks_and_kept_only_when_faster)
{
	const char *args[] = {"--no-probe", "--quick-tier-steps", "4", "--upgrade-budget", "1",
	                      NULL};
	struct tl_builder *b = tl_builder_new();
	struct h_bufs bb = {{0}, 0};
	struct tl_tree *carry, *inputs, *cot_c, *cot_y;
	struct tl_client *c;
	char cache[512], plan[32], verdict[16] = "trial";
	json_t *sp, *up;
	struct hd d;

	h_tmpdir(cache, sizeof cache, "tcache");
	ema_trees(b, &bb, 64, 51, &carry, &inputs);
	ema_trees(b, &bb, 64, 53, &cot_c, &cot_y);
	hd_start(&d, cache, args);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	hd_register(c, "tier.ema", EMA, "body", 64, 4096, 2);
	check_scan(c, "tier.ema", EMA, "body", carry, inputs, b, "quick");
	sp = await_upgrade(c, "tier.ema");
	up = json_object_get(sp, "upgrade");
	snprintf(plan, sizeof plan, "%s", str(up, "plan"));
	cr_assert(strncmp(plan, "block", 5) == 0 && atoi(plan + 5) >= 4 && atoi(plan + 5) <= 32,
	          "plan %s", plan);
	cr_assert_gt(num(up, "step_ops"), 0);
	cr_assert_str_eq(str(sp, "tier"), "final");
	cr_assert_str_eq(str(sp, "lowered"), plan);
	cr_assert_str_eq(str(up, "verdict"), "trial");
	json_decref(sp);
	check_scan(c, "tier.ema", EMA, "body", carry, inputs, b, NULL);

	/* the trial: 16 runs of each graph (runs that try an OpenMP team do not count) */
	run_trial(c, "tier.ema", 64, carry, inputs, verdict, sizeof verdict);
	sp = spec_of_kind(c, "tier.ema", "scan");
	up = json_object_get(sp, "upgrade");
	cr_assert_eq(num(up, "trial_runs"), 32, "verdict %s", verdict);
	if (strcmp(verdict, "kept") == 0) {
		cr_assert_leq(num(up, "upgrade_run_us"), 0.9 * num(up, "quick_run_us"));
		cr_assert_str_eq(str(sp, "tier"), "final");
		cr_assert_str_eq(str(sp, "lowered"), plan);
	} else {
		cr_assert_str_eq(verdict, "reverted");
		cr_assert_gt(num(up, "upgrade_run_us"), 0.9 * num(up, "quick_run_us"));
		cr_assert_str_eq(str(sp, "tier"), "quick");
		cr_assert_str_eq(str(sp, "lowered"), "scan");
	}
	cr_assert(strstr(str(sp, "note"), plan) != NULL, "note: %s", str(sp, "note"));
	json_decref(sp);
	check_scan(c, "tier.ema", EMA, "body", carry, inputs, b, NULL);

	/* a grad over the budget: no upgrade */
	check_grad(c, b, "tbq", carry, inputs, cot_c, cot_y, NULL);
	sp = spec_of_kind(c, "tier.ema", "grad");
	up = json_object_get(sp, "upgrade");
	cr_assert_str_eq(str(up, "plan"), "");
	cr_assert_str_eq(str(sp, "tier"), "quick");
	cr_assert(!json_is_true(json_object_get(sp, "upgrading")));
	cr_assert(strstr(str(sp, "note"), "--upgrade-budget=1") != NULL, "note: %s",
	          str(sp, "note"));
	json_decref(sp);
	check_grad(c, b, "tbq2", carry, inputs, cot_c, cot_y, NULL);
	cr_assert_eq(hd_counter(c, "tier.ema", "compiles"), 3, "quick + blocked scan, quick grad");
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
	h_bufs_free(&bb);
	tl_builder_free(b);
}

/* Waits until the upgrade of adapter's T steps is planned and not under way. */
static json_t *await_planned(struct tl_client *c, const char *adapter, int T)
{
	for (int i = 0; i < 2400; i++) {
		json_t *sp = spec_at(c, adapter, T);
		if (json_is_object(json_object_get(sp, "upgrade")) &&
		    !json_is_true(json_object_get(sp, "upgrading")))
			return sp;
		json_decref(sp);
		usleep(250 * 1000);
	}
	cr_assert_fail("the upgrade at T=%d was not over within 600 s", T);
	return NULL;
}

/*
 * Upgrades that pay (upgrade.c): with --upgrade-keep-percent 1 the unrolled
 * upgrade of ema at T = 8 loses its trial (it would have to run 100 times
 * faster); the same adapter at T = 12 is then served by its scan op's graph
 * and builds no upgrade, its note naming the trial that decided it; the
 * counters say one started, one reverted, one skipped; every result matches
 * the eager loop.  Compiles: the two quick graphs and one unrolled loop.
 */
Test(tier, an_adapter_whose_upgrade_lost_its_trial_builds_no_more_of_that_kind)
{
	const char *args[] = {
	    "--no-probe", "--quick-tier-steps", "4", "--upgrade-keep-percent", "1", NULL};
	struct tl_builder *b = tl_builder_new();
	struct h_bufs bb = {{0}, 0};
	struct tl_tree *c8, *x8, *c12, *x12;
	struct tl_client *c;
	char cache[512], verdict[16] = "trial";
	json_t *sp, *up;
	struct hd d;

	h_tmpdir(cache, sizeof cache, "tpay");
	ema_trees(b, &bb, 8, 61, &c8, &x8);
	ema_trees(b, &bb, 12, 63, &c12, &x12);
	hd_start(&d, cache, args);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	hd_register(c, "pay.ema", EMA, "body", 64, 4096, 4);
	check_scan(c, "pay.ema", EMA, "body", c8, x8, b, "quick");
	json_decref(await_planned(c, "pay.ema", 8));
	run_trial(c, "pay.ema", 8, c8, x8, verdict, sizeof verdict);
	cr_assert_str_eq(verdict, "reverted");
	check_scan(c, "pay.ema", EMA, "body", c8, x8, b, NULL);

	check_scan(c, "pay.ema", EMA, "body", c12, x12, b, NULL);
	sp = await_planned(c, "pay.ema", 12);
	up = json_object_get(sp, "upgrade");
	cr_assert_str_eq(str(up, "plan"), "");
	cr_assert_str_eq(str(sp, "tier"), "quick");
	cr_assert_str_eq(str(sp, "lowered"), "scan");
	cr_assert(strstr(str(sp, "note"), "lost its trial") && strstr(str(sp, "note"), "T=8 "),
	          "note: %s", str(sp, "note"));
	json_decref(sp);
	check_scan(c, "pay.ema", EMA, "body", c12, x12, b, NULL);
	cr_assert_eq(hd_counter(c, "pay.ema", "upgrades_started"), 1);
	cr_assert_eq(hd_counter(c, "pay.ema", "upgrades_reverted"), 1);
	cr_assert_eq(hd_counter(c, "pay.ema", "upgrades_skipped"), 1);
	cr_assert_eq(hd_counter(c, "pay.ema", "upgrades_kept"), 0);
	cr_assert_eq(hd_counter(c, "pay.ema", "compiles"), 3, "two quick graphs, one unrolled");
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
	h_bufs_free(&bb);
	tl_builder_free(b);
}

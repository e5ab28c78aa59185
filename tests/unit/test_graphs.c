/*
 * test_graphs.c - the graph layer with no socket and no request: graphs.c and
 * run.c driven directly on a private libuv loop, with a real compile worker
 * and the run's shared compile cache (the specialization is the e2e suites'
 * t4.cumsum, float64, T=3, carry [4], so it is compiled at most once per run).
 *
 * Single flight (three waiters, one specialization, one compile or cache
 * hit), the budget (a new signature refused at once, by name; each uid's
 * share its own: T=2 is the one more specialization), a run checked
 * by hand, the warm-start index read past a corrupt record, background
 * compiles (a quick tier's upgrades) queued behind the others, the loop
 * closing with every handle closed (uv_loop_close returns 0), and every
 * limit flag's bounds.
 */
#include "daemon.h"
#include "graphs.h"
#include "helpers.h"

#include <criterion/criterion.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

TestSuite(graphs, .timeout = 900);

#define BODY "examples/bodies/cumsum.py"

static struct daemon d;
static uv_loop_t loop;
static bool worker_up;

static void on_up(struct daemon *dd, const struct proto_err *err)
{
	(void)dd;
	cr_assert_null(err, "compile worker: %s", err ? err->message : "");
	worker_up = true;
}

/* The daemon's log goes where scripts/run-tests.sh counts compiles. */
static void log_to_test_tmp(void)
{
	const char *tmp = getenv("TORCHLOOP_TEST_TMP");
	char dir[PATH_MAX];

	if (tmp == NULL)
		return;
	snprintf(dir, sizeof dir, "%s/graphs.XXXXXX", tmp);
	cr_assert_not_null(mkdtemp(dir));
	strncat(dir, "/log", sizeof dir - strlen(dir) - 1);
	cr_assert_not_null(freopen(dir, "a", stderr));
}

/* The graph layer over the test cache; workers: --compile-workers (0: the
 * default, one per core). */
static void open_graphs_with(const char *workers)
{
	const char *env = getenv("TORCHLOOP_TEST_CACHE");
	char cache[PATH_MAX];
	char *argv[] = {"torchloopd",        "--cache-dir",   cache, "--no-probe",
	                "--compile-workers", (char *)workers, NULL};

	snprintf(cache, sizeof cache, "%s", env ? env : "build/test-cache");
	mkdir(cache, 0755);
	cr_assert_not_null(realpath(env ? env : "build/test-cache", cache));
	log_to_test_tmp();
	optind = 0; /* glibc: start getopt afresh */
	cr_assert_eq(config_parse(&d.cfg, 6, argv), 0);
	cr_assert_eq(uv_loop_init(&loop), 0);
	d.loop = &loop;
	cr_assert_eq(daemon_graphs_open(&d), 0);
	cr_assert_eq(daemon_graphs_start_worker(&d, on_up), 0);
	while (!worker_up)
		uv_run(&loop, UV_RUN_ONCE);
}

static void open_graphs(void)
{
	open_graphs_with("0");
}

/* Everything the graph layer opened is closed: the loop can be closed. */
static void close_graphs(void)
{
	adapter_clear(&d.graphs.reg);
	compiler_stop(d.compiler);
	runner_close(&d.graphs.runner);
	uv_run(&loop, UV_RUN_DEFAULT);
	cr_assert_eq(uv_loop_close(&loop), 0, "a libuv handle is still open");
}

/* t4.cumsum as tests/e2e registers it: max_steps 12, max_elements 64. */
static struct adapter *add_adapter(int64_t budget)
{
	struct adapter_def def;
	struct proto_err err;
	bool replaced, unchanged;
	struct adapter *a;

	adapter_def_defaults(&def);
	snprintf(def.name, sizeof def.name, "t4.cumsum");
	snprintf(def.body_file, sizeof def.body_file, "%s", BODY);
	def.source = slurp(BODY);
	def.max_steps = 12;
	def.max_elements = 64;
	def.budget = budget;
	cr_assert_eq(adapter_def_validate(&def, &err), 0, "%s", err.message);
	a = adapter_register(&d.graphs.reg, &def, &replaced, &unchanged);
	cr_assert_not_null(a);
	return a;
}

/* ---- trees: carry [4], inputs [T, 4], float64, 64-byte aligned ---------- */

struct trees {
	double *carry, *xs;
	struct tree_node c, x;
	int64_t steps;
};

static void leaf(struct tree_node *n, double *data, uint32_t ndim, const int64_t *shape)
{
	memset(n, 0, sizeof *n);
	n->kind = TREE_TENSOR;
	n->tensor.dtype = PROTO_DTYPE_F64;
	n->tensor.ndim = ndim;
	n->tensor.numel = 1;
	for (uint32_t i = 0; i < ndim; i++) {
		n->tensor.shape[i] = shape[i];
		n->tensor.numel *= (uint64_t)shape[i];
	}
	n->tensor.nbytes = n->tensor.numel * 8;
	n->tensor.data = data;
}

static void make_trees(struct trees *t, int64_t steps)
{
	int64_t cs[] = {4}, xs[] = {steps, 4};

	t->steps = steps;
	t->carry = aligned_alloc(64, 64);
	t->xs = aligned_alloc(64, (size_t)(((steps * 4 * 8) + 63) / 64 * 64));
	for (int k = 0; k < 4; k++)
		t->carry[k] = 0.5 * k - 1.25;
	for (int64_t k = 0; k < 4 * steps; k++)
		t->xs[k] = 0.125 * (double)((k * 7) % 11) - 0.5;
	leaf(&t->c, t->carry, 1, cs);
	leaf(&t->x, t->xs, 2, xs);
}

static void free_trees(struct trees *t)
{
	free(t->carry);
	free(t->xs);
}

static struct scan_args args_of(const struct trees *t)
{
	return (struct scan_args){&t->c, &t->x, PROTO_DTYPE_F64, t->steps, 0, false};
}

/* ---- waiters ------------------------------------------------------------ */

struct waiter {
	struct graph_waiter w; /* first: the callbacks cast back */
	int done, events;
	struct specialization *sp;
	struct proto_err err;
};

static void on_done(struct graph_waiter *gw, struct specialization *sp, const struct proto_err *err)
{
	struct waiter *w = (struct waiter *)gw;

	w->done++;
	w->sp = sp;
	if (sp)
		graphs_ref(sp); /* held by the test past the callback */
	else
		w->err = *err;
}

static void on_event(struct graph_waiter *gw, const char *event, const struct specialization *sp,
                     double elapsed)
{
	struct waiter *w = (struct waiter *)gw;

	cr_assert(strcmp(event, "compiling") == 0 || strcmp(event, "progress") == 0, "%s", event);
	cr_assert_str_eq(sp->signature, "float64 T=3 carry=[4] inputs=[3,4]");
	cr_assert_geq(elapsed, 0);
	w->events++;
}

static void waiter_init(struct waiter *w)
{
	memset(w, 0, sizeof *w);
	w->w.done = on_done;
	w->w.event = on_event;
}

static void wait_all(struct waiter *w, int n)
{
	for (;;) {
		int pending = 0;
		for (int i = 0; i < n; i++)
			pending += w[i].done == 0;
		if (pending == 0)
			return;
		uv_run(&loop, UV_RUN_ONCE);
	}
}

/* Acquires t's specialization of a in w and waits until it can run. */
static void acquire_ready(struct waiter *w, struct adapter *a, const struct trees *t)
{
	struct scan_args args = args_of(t);

	waiter_init(w);
	graphs_acquire(&d.graphs, a, &args, &w->w);
	wait_all(w, 1);
	cr_assert_not_null(w->sp, "%s", w->err.message);
}

static unsigned count_specs(const struct adapter *a)
{
	unsigned n = 0;

	for (const struct specialization *sp = a->specs; sp; sp = sp->next)
		n++;
	return n;
}

/* ---- a run -------------------------------------------------------------- */

struct run_seen {
	int done;
	struct proto_err err;
	bool failed;
	double carry[4], y[3 * 4];
	size_t n;
};

static void on_run(struct run_job *j, void *arg)
{
	struct run_seen *s = arg;
	const struct engine_result *res = run_result(j);

	s->done++;
	s->failed = run_error(j) != NULL;
	if (s->failed) {
		s->err = *run_error(j);
		return;
	}
	s->n = res->n;
	cr_assert_eq(res->n, 2, "carry leaf + stacked output leaf");
	cr_assert_eq(res->tensors[0].nbytes, 4 * 8);
	cr_assert_eq(res->tensors[1].nbytes, 12 * 8);
	memcpy(s->carry, res->tensors[0].data, sizeof s->carry);
	memcpy(s->y, res->tensors[1].data, sizeof s->y);
}

static void run_and_check(struct specialization *sp, const struct trees *t)
{
	struct run_seen seen = {0};
	struct proto_err err;
	struct run_job *j = run_new(&d.graphs, sp, 0, NULL, &err);

	cr_assert_not_null(j, "%s", err.message);
	run_add(j, &t->c);
	run_add(j, &t->x);
	run_submit(j, on_run, &seen);
	while (seen.done == 0)
		uv_run(&loop, UV_RUN_ONCE);
	cr_assert_eq(seen.done, 1);
	cr_assert(!seen.failed, "%s", seen.err.message);
	/* by hand: the body adds x_t to the carry and emits the new carry */
	for (int k = 0; k < 4; k++) {
		double acc = t->carry[k];
		for (int s = 0; s < 3; s++) {
			acc += t->xs[4 * s + k];
			cr_assert_float_eq(seen.y[4 * s + k], acc, 1e-12);
		}
		cr_assert_float_eq(seen.carry[k], acc, 1e-12);
	}
}

/* ---- tests -------------------------------------------------------------- */

Test(graphs, three_waiters_share_one_specialization_and_its_run_is_right)
{
	struct waiter w[3];
	struct trees t;
	struct scan_args args;
	struct adapter *a;

	open_graphs();
	a = add_adapter(3);
	make_trees(&t, 3);
	args = args_of(&t);
	for (int i = 0; i < 3; i++) {
		waiter_init(&w[i]);
		graphs_acquire(&d.graphs, a, &args, &w[i].w);
	}
	/* a cache lookup is on the pool: nobody can have been answered yet */
	for (int i = 0; i < 3; i++)
		cr_assert_eq(w[i].done, 0);
	wait_all(w, 3);
	for (int i = 0; i < 3; i++) {
		cr_assert_eq(w[i].done, 1);
		cr_assert_not_null(w[i].sp, "%s", w[i].err.message);
		cr_assert_eq(w[i].sp, w[0].sp, "one specialization for all three");
	}
	cr_assert_eq(count_specs(a), 1);
	cr_assert_eq(a->held, 1);
	cr_assert_eq(a->stats.compiles + a->stats.cache_hits, 1,
	             "one compile or one cache hit, not three (compiles %llu, hits %llu)",
	             (unsigned long long)a->stats.compiles,
	             (unsigned long long)a->stats.cache_hits);
	cr_assert_str_eq(w[0].sp->signature, "float64 T=3 carry=[4] inputs=[3,4]");
	run_and_check(w[0].sp, &t);
	run_and_check(w[0].sp, &t); /* and again, on the same graph */
	cr_assert_eq(w[0].sp->runs, 2);
	for (int i = 0; i < 3; i++)
		graphs_unref(w[i].sp);
	free_trees(&t);
	close_graphs();
}

Test(graphs, a_full_budget_refuses_a_new_signature_at_once_naming_what_it_holds)
{
	struct waiter w, again, other;
	struct trees t3, t2;
	struct scan_args args;
	struct adapter *a;

	open_graphs();
	a = add_adapter(1);
	make_trees(&t3, 3);
	make_trees(&t2, 2);
	acquire_ready(&w, a, &t3);
	/* T=2 is another signature: over the budget of 1, refused right here */
	args = args_of(&t2);
	waiter_init(&other);
	graphs_acquire(&d.graphs, a, &args, &other.w);
	cr_assert_eq(other.done, 1, "refused synchronously, no compile");
	cr_assert_null(other.sp);
	cr_assert_eq(other.err.code, PROTO_E_RECOMPILE_BUDGET_EXHAUSTED);
	cr_assert(strstr(other.err.message, "recompile_budget=1") != NULL, "%s", other.err.message);
	cr_assert(strstr(other.err.message, "scan float64 T=3 carry=[4] inputs=[3,4]") != NULL,
	          "%s", other.err.message);
	cr_assert_eq(count_specs(a), 1);
	/* the specialization it holds is still served, at once (READY) */
	args = args_of(&t3);
	waiter_init(&again);
	graphs_acquire(&d.graphs, a, &args, &again.w);
	cr_assert_eq(again.done, 1);
	cr_assert_eq(again.sp, w.sp);
	run_and_check(again.sp, &t3);
	graphs_unref(w.sp);
	graphs_unref(again.sp);
	free_trees(&t3);
	free_trees(&t2);
	close_graphs();
}

/* Acquires t's specialization as uid; no progress events (other T). */
static void acquire_as(struct waiter *w, struct adapter *a, const struct trees *t, uid_t uid)
{
	struct scan_args args = args_of(t);

	args.uid = uid;
	waiter_init(w);
	w->w.event = NULL;
	graphs_acquire(&d.graphs, a, &args, &w->w);
}

Test(graphs, each_uid_spends_its_own_share_of_the_budget_and_uses_others_for_free)
{
	struct waiter mine, mine2, free_use, theirs, theirs2, late;
	struct trees t3, t2, t4;
	struct adapter *a;

	open_graphs();
	a = add_adapter(1); /* owner: uid 0 (adapter_def_defaults) */
	make_trees(&t3, 3);
	make_trees(&t2, 2);
	make_trees(&t4, 4);
	acquire_as(&mine, a, &t3, 1000);
	wait_all(&mine, 1);
	cr_assert_not_null(mine.sp, "%s", mine.err.message);
	/* uid 1000's share (1) is spent: its T=2 is refused at once, by uid */
	acquire_as(&mine2, a, &t2, 1000);
	cr_assert_eq(mine2.done, 1, "refused synchronously, no compile");
	cr_assert_eq(mine2.err.code, PROTO_E_RECOMPILE_BUDGET_EXHAUSTED);
	cr_assert(strstr(mine2.err.message, "uid 1000 holds recompile_budget=1") != NULL, "%s",
	          mine2.err.message);
	/* uid 2000 uses uid 1000's T=3 for free, then spends its own share on T=2 */
	acquire_as(&free_use, a, &t3, 2000);
	cr_assert_eq(free_use.done, 1);
	cr_assert_eq(free_use.sp, mine.sp);
	run_and_check(free_use.sp, &t3);
	acquire_as(&theirs, a, &t2, 2000);
	wait_all(&theirs, 1);
	cr_assert_not_null(theirs.sp, "uid 1000 did not spend uid 2000's share: %s",
	                   theirs.err.message);
	cr_assert_eq(a->held, 2);
	cr_assert_eq(adapter_budget_used(a, 1000), 1);
	cr_assert_eq(adapter_budget_used(a, 2000), 1);
	cr_assert_eq(a->n_shares, 2);
	acquire_as(&theirs2, a, &t4, 2000);
	cr_assert_eq(theirs2.err.code, PROTO_E_RECOMPILE_BUDGET_EXHAUSTED);
	/* two uids besides the owner hold shares: over --max-uids-per-adapter=2,
	 * a third one's new signature is refused (no compile), naming the limit */
	d.cfg.max_uids_per_adapter = 2;
	acquire_as(&late, a, &t4, 3000);
	cr_assert_eq(late.done, 1);
	cr_assert_eq(late.err.code, PROTO_E_RECOMPILE_BUDGET_EXHAUSTED);
	cr_assert(strstr(late.err.message, "--max-uids-per-adapter=2") != NULL, "%s",
	          late.err.message);
	/* re-registered (dropped): every share starts again */
	graphs_unref(mine.sp);
	graphs_unref(free_use.sp);
	graphs_unref(theirs.sp);
	graphs_drop_all(a);
	cr_assert_eq(a->held, 0);
	cr_assert_eq(a->n_shares, 0);
	cr_assert_eq(adapter_budget_used(a, 1000), 0);
	free_trees(&t3);
	free_trees(&t2);
	free_trees(&t4);
	close_graphs();
}

static unsigned prewarmed;

static void on_prewarmed(struct graphs *gg)
{
	(void)gg;
	prewarmed++;
}

Test(graphs, the_warm_start_index_is_read_past_a_corrupt_record)
{
	static const uint8_t corrupt[] = {0, 0, 0, 5, 0xc1, 0xc1, 0x92, 0xff, 0x00};
	char path[PATH_MAX];
	struct waiter w;
	struct trees t;
	struct scan_args args;
	struct adapter *a;
	char *saved;
	long len;
	FILE *f;
	unsigned started;

	open_graphs();
	a = add_adapter(3);
	make_trees(&t, 3);
	acquire_ready(&w, a, &t);
	graphs_unref(w.sp);
	/* the index lists it now; put a record that does not parse before it */
	graphs_index_path(&d.graphs, a, path, sizeof path);
	f = fopen(path, "rb");
	cr_assert_not_null(f, "no index at %s", path);
	fseek(f, 0, SEEK_END);
	len = ftell(f);
	rewind(f);
	saved = malloc((size_t)len);
	cr_assert_eq(fread(saved, 1, (size_t)len, f), (size_t)len);
	fclose(f);
	f = fopen(path, "wb");
	fwrite(corrupt, 1, sizeof corrupt, f);
	fwrite(saved, 1, (size_t)len, f);
	fclose(f);
	/* a fresh adapter of the same identity loads it from the index */
	cr_assert_eq(adapter_unregister(&d.graphs.reg, "t4.cumsum", 9), 0);
	a = add_adapter(3);
	cr_assert_eq(count_specs(a), 0);
	started = graphs_prewarm(&d.graphs, a, on_prewarmed);
	cr_assert_geq(started, 1, "the record after the corrupt one was read");
	while (prewarmed < started)
		uv_run(&loop, UV_RUN_ONCE);
	cr_assert_geq(graphs_loaded(&d.graphs), 1);
	cr_assert_eq(a->stats.compiles, 0, "loaded, not compiled");
	/* READY: a waiter is answered at once */
	args = args_of(&t);
	waiter_init(&w);
	graphs_acquire(&d.graphs, a, &args, &w.w);
	cr_assert_eq(w.done, 1);
	cr_assert_not_null(w.sp);
	run_and_check(w.sp, &t);
	graphs_unref(w.sp);
	/* the shared cache's index as it was */
	f = fopen(path, "wb");
	fwrite(saved, 1, (size_t)len, f);
	fclose(f);
	free(saved);
	free_trees(&t);
	close_graphs();
}

/* ---- the compile worker's queue ------------------------------------------ */

struct qjob {
	struct compile_job job; /* first: the callback casts back */
	int tag;
	int *order, *n;
	struct proto_err err;
};

static void queue_done(struct compile_job *job, const struct compile_result *res,
                       const struct proto_err *err)
{
	struct qjob *q = (struct qjob *)job;

	(void)res;
	cr_assert_not_null(err, "a body that raises on import cannot compile");
	q->err = *err;
	q->order[(*q->n)++] = q->tag;
}

/*
 * A quick tier's upgrade is a background job: it runs in a lane of its own
 * (compiler.h), never in front of a foreground job and never behind one.
 * Five jobs whose body raises on import (milliseconds each): foreground,
 * background, foreground, background, foreground.  Each lane keeps its own
 * order and counts its own jobs.  One foreground worker: with two, jobs 0
 * and 2 run at once and either may finish first (a worker imports the
 * compile path at its first job under TORCHLOOP_WORKER_PRELOAD=0).
 */
Test(graphs, background_compiles_run_in_a_lane_of_their_own_in_order)
{
	static const bool background[5] = {false, true, false, true, false};
	int at[5];
	struct lane_stats fg, bg;
	struct qjob q[5];
	struct trees t;
	int order[5], n = 0;
	char key[CACHE_KEY_HEX];

	open_graphs_with("1");
	make_trees(&t, 3);
	memset(key, 'e', sizeof key - 1);
	key[sizeof key - 1] = '\0';
	for (int i = 0; i < 5; i++) {
		memset(&q[i], 0, sizeof q[i]);
		q[i].job.body_source = "raise RuntimeError('queue order')\n";
		q[i].job.body_file = "queue.py";
		q[i].job.entry = "body";
		q[i].job.strategy = "unroll";
		q[i].job.kind = "forward";
		q[i].job.carry = &t.c;
		q[i].job.inputs = &t.x;
		q[i].job.dtype = PROTO_DTYPE_F64;
		q[i].job.steps = 3;
		q[i].job.background = background[i];
		q[i].job.done = queue_done;
		cache_tmp_path(d.graphs.cache, key, q[i].job.output, sizeof q[i].job.output);
		q[i].tag = i;
		q[i].order = order;
		q[i].n = &n;
		compiler_submit(d.compiler, &q[i].job);
	}
	cr_assert_eq(compiler_queue_length(d.compiler), 5, "in flight or queued");
	while (n < 5)
		uv_run(&loop, UV_RUN_ONCE);
	for (int i = 0; i < 5; i++) {
		at[order[i]] = i;
		cr_assert_eq(q[i].err.code, PROTO_E_BODY_ERROR, "%s: %s",
		             proto_code_name(q[i].err.code), q[i].err.message);
	}
	cr_assert(at[0] < at[2] && at[2] < at[4], "foreground jobs in their order");
	cr_assert(at[1] < at[3], "background jobs in their order");
	compiler_lane_stats(d.compiler, LANE_FOREGROUND, &fg);
	compiler_lane_stats(d.compiler, LANE_BACKGROUND, &bg);
	cr_assert_eq(fg.jobs, 3);
	cr_assert_eq(bg.jobs, 2);
	cr_assert_eq(bg.workers, 1, "the background lane has a worker of its own");
	cr_assert_eq(compiler_queue_length(d.compiler), 0);
	free_trees(&t);
	close_graphs();
}

/* ---- flags ---------------------------------------------------------------- */

static int parse_one(const char *flag, long long v)
{
	struct config cfg;
	char name[64], value[32];
	char *argv[] = {"torchloopd", name, value, NULL};

	snprintf(name, sizeof name, "--%s", flag);
	snprintf(value, sizeof value, "%lld", v);
	optind = 0; /* glibc: start getopt afresh */
	return config_parse(&cfg, 3, argv);
}

/* Every limit flag (config.h's table, --quick-tier-steps included) takes its
 * bounds and refuses one past either, before the daemon starts anything. */
Test(graphs, every_limit_flag_takes_its_bounds_and_refuses_one_past_them)
{
	static const struct {
		const char *name;
		long long min, max;
	} limits[] = {
#define LIMIT_ROW(name, field, min, def, max, help) {name, min, max},
	    CONFIG_LIMITS(LIMIT_ROW)
#undef LIMIT_ROW
	};
	bool tier = false;

	for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++) {
		cr_assert_eq(parse_one(limits[i].name, limits[i].min), 0, "--%s %lld",
		             limits[i].name, limits[i].min);
		cr_assert_eq(parse_one(limits[i].name, limits[i].max), 0, "--%s %lld",
		             limits[i].name, limits[i].max);
		cr_assert_eq(parse_one(limits[i].name, limits[i].min - 1), -1, "--%s %lld",
		             limits[i].name, limits[i].min - 1);
		cr_assert_eq(parse_one(limits[i].name, limits[i].max + 1), -1, "--%s %lld",
		             limits[i].name, limits[i].max + 1);
		tier |= strcmp(limits[i].name, "quick-tier-steps") == 0;
	}
	cr_assert(tier, "--quick-tier-steps is in the table");
}

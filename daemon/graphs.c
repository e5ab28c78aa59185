/*
 * graphs.c - specializations of an adapter: find, budget, single-flight
 * compile, load, and the waiters in between.
 *
 * States: LOADING (a pool thread looks in the cache and, on a hit,
 * dlopens) -> READY; or on a miss, with the key's flock held, COMPILING
 * (the worker builds it) -> LOADING (pool: commit to the cache, dlopen) ->
 * READY.  Any failure -> FAILED: deterministic compile errors (the body's
 * fault) stay FAILED so the same request is not recompiled -- at most
 * --max-failed-specs per adapter, the least recently asked for forgotten
 * first; transient ones (worker crash, timeout, shutdown, disk full) remove
 * the specialization so the next request tries again.  A definition during
 * whose compiles the worker died twice is refused from then on.  Requests
 * that arrive meanwhile wait on the specialization (single flight) and get
 * a progress event every 2 s.
 *
 * The key's lock (another daemon, or an unregistered adapter with the same
 * definition, compiling the same key) is only ever tried, never waited on by
 * a pool thread: a busy lock sends the lookup back to the loop, which looks
 * again after a pause, for at most --compile-timeout seconds.
 *
 * Loop thread, except the uv_work callbacks marked "pool", which own the
 * struct load_job and touch only the specialization fields that no one else
 * reads while the state is LOADING (graph, y, n_in/out, expected); values
 * the loop also reads (compile_seconds) go into the job and are published
 * by the completion callback.
 */
#include "graphs_internal.h"

#include "frame.h"
#include "log.h"
#include "signature.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* the graph layer never sees a request or a connection (docs/architecture.md) */
#pragma GCC poison request conn outmsg daemon

#define PROGRESS_MS 2000

static void lookup_work(uv_work_t *w);
/* ---- a quick tier's upgrade: built here, decided in upgrade.c ---------- */

/* The upgrade is over: it took over (err NULL), or the quick graph keeps serving. */
static void upgrade_over(struct load_job *j, const struct proto_err *err)
{
	j->sp->upgrading = false;
	spec_unlock(j->sp);
	if (err != NULL)
		upgrade_failed(j->sp, err);
	free_job(j);
}

/* Loop: the upgrade's lookup or commit came back. */
static void after_upgrade(struct load_job *j)
{
	struct specialization *sp = j->sp;
	struct adapter *a = sp->adapter;

	if (j->rc != 0) {
		upgrade_over(j, &j->err);
		return;
	}
	if (j->need_compile) {
		if (prepare_compile(j, &j->err) != 0) {
			upgrade_over(j, &j->err);
			return;
		}
		j->need_compile = false;
		a->stats.cache_misses++;
		a->stats.compiles++;
		log_line(LOG_INFO, 0, a->def.name,
		         "compiling %s %s as %s, in the background (estimated %.0f s)",
		         spec_kinds[sp->kind].name, sp->signature, sp->upgrade.plan,
		         sp->upgrade.estimate_s);
		compiler_submit(j->g->compiler, &j->job);
		return; /* j lives on until compile_done */
	}
	upgrade_take_over(j);
	upgrade_over(j, NULL);
}

/* sp's quick graph now serves: builds (or loads) what upgrade_plan picks. */
static void start_upgrade(struct graphs *g, struct specialization *sp, struct load_job *quick)
{
	struct load_job *j;
	char key[CACHE_KEY_HEX];

	if (!upgrade_plan(g, sp)) {
		spec_unlock(sp);
		return;
	}
	j = calloc(1, sizeof *j);
	if (j == NULL) {
		log_line(LOG_WARN, 0, sp->adapter->def.name,
		         "%s %s: out of memory; the scan op's graph keeps serving",
		         spec_kinds[sp->kind].name, sp->signature);
		spec_unlock(sp);
		return;
	}
	j->upgrade = true;
	j->sample = quick->sample; /* checked on the same inputs as the quick graph */
	j->sample_len = quick->sample_len;
	quick->sample = NULL;
	sp->upgrading = true;
	if (strcmp(sp->upgrade.plan, "unroll") == 0) {
		start_lookup(g, sp, j, NULL);
		return;
	}
	memcpy(j->strategy, sp->upgrade.plan, sizeof j->strategy);
	key_for(g, sp, j->strategy, key);
	start_lookup(g, sp, j, key);
}

static void after_load(uv_work_t *w, int status);
static void fill_expected(struct specialization *sp);
static void fill_expected_out(struct specialization *sp);

/* Lets go of (and removes) the key's lock file, if sp holds it. */
void spec_unlock(struct specialization *sp)
{
	if (sp->lock_fd >= 0)
		cache_unlock(sp->cache, sp->key, sp->lock_fd);
	sp->lock_fd = -1;
}

void graphs_ref(struct specialization *sp)
{
	sp->refs++;
}

static void progress_closed(uv_handle_t *h)
{
	free(h);
}

void graphs_unref(struct specialization *sp)
{
	if (--sp->refs > 0)
		return;
	if (sp->progress)
		uv_close((uv_handle_t *)sp->progress, progress_closed);
	engine_unload(sp->graph);
	engine_unload(sp->retired);
	spec_unlock(sp);
	free(sp->expected);
	free(sp->expected_out);
	msgpack_zone_free(sp->zone);
	adapter_unref(sp->adapter);
	free(sp);
}

static bool counts_against_budget(const struct specialization *sp)
{
	return sp->state != SPEC_FAILED;
}

static void unlist_spec(struct specialization *sp)
{
	struct adapter *a = sp->adapter;
	struct specialization **pp = &a->specs;

	while (*pp && *pp != sp)
		pp = &(*pp)->next;
	if (*pp == NULL)
		return;
	*pp = sp->next;
	if (counts_against_budget(sp) && a->held > 0)
		a->held--;
	if (sp->state == SPEC_FAILED && a->failed > 0)
		a->failed--;
	graphs_unref(sp);
}

void graphs_drop_all(struct adapter *a)
{
	while (a->specs)
		unlist_spec(a->specs);
	a->held = 0;
	a->failed = 0;
}

void graphs_invalidate(struct graphs *g, struct specialization *sp, const char *why)
{
	cache_quarantine(g->cache, sp->graph_key[0] ? sp->graph_key : sp->key, why);
	log_line(LOG_ERROR, 0, sp->adapter->def.name, "%s %s dropped: %s",
	         spec_kinds[sp->kind].name, sp->signature, why);
	unlist_spec(sp);
}

/* Keeps at most max_failed FAILED specializations: forgets the least recently used. */
static void bound_failed(struct graphs *g, struct adapter *a)
{
	while (a->failed > (unsigned)g->cfg->max_failed_specs) {
		struct specialization *lru = NULL;
		for (struct specialization *sp = a->specs; sp; sp = sp->next)
			if (sp->state == SPEC_FAILED && sp->waiters == NULL &&
			    (lru == NULL || sp->last_used < lru->last_used))
				lru = sp;
		if (lru == NULL)
			return;
		a->stats.failed_evictions++;
		g->failed_evictions++;
		unlist_spec(lru);
	}
}

unsigned graphs_loaded(const struct graphs *g)
{
	unsigned n = 0;

	for (const struct adapter *a = g->reg.head; a; a = a->next)
		for (const struct specialization *sp = a->specs; sp; sp = sp->next)
			n += sp->state == SPEC_READY;
	return n;
}

/* ---- waiters ----------------------------------------------------------- */

static void stop_progress(struct specialization *sp)
{
	if (sp->progress) {
		uv_close((uv_handle_t *)sp->progress, progress_closed);
		sp->progress = NULL;
	}
}

static void release_waiters(struct specialization *sp)
{
	struct graph_waiter *w = sp->waiters;

	sp->waiters = NULL;
	stop_progress(sp);
	while (w) {
		struct graph_waiter *next = w->next;
		w->next = NULL;
		if (sp->state == SPEC_READY)
			w->done(w, sp, NULL);
		else
			w->done(w, NULL, &sp->error);
		graphs_unref(sp);
		w = next;
	}
}

static void tell_waiters(struct specialization *sp, const char *event)
{
	double elapsed = log_now() - sp->wait_started;

	for (struct graph_waiter *w = sp->waiters; w; w = w->next)
		if (w->event)
			w->event(w, event, sp, elapsed);
}

static void on_progress(uv_timer_t *t)
{
	tell_waiters(t->data, "progress");
}

static void add_waiter(struct specialization *sp, struct graph_waiter *w)
{
	graphs_ref(sp);
	w->next = sp->waiters;
	sp->waiters = w;
	if (sp->state == SPEC_COMPILING && w->event)
		w->event(w, "compiling", sp, log_now() - sp->wait_started);
}

/* A compile starts: tell every waiter, then every PROGRESS_MS. */
static void start_progress(struct graphs *g, struct specialization *sp)
{
	tell_waiters(sp, "compiling");
	if (sp->progress != NULL)
		return;
	sp->progress = malloc(sizeof *sp->progress);
	if (sp->progress) {
		uv_timer_init(g->loop, sp->progress);
		sp->progress->data = sp;
		uv_timer_start(sp->progress, on_progress, PROGRESS_MS, PROGRESS_MS);
	}
}

/* ---- finishing --------------------------------------------------------- */

static bool transient(const struct proto_err *err)
{
	enum proto_code code = err->code;

	return (err->flags & PROTO_ERR_TRANSIENT) || code == PROTO_E_WORKER_CRASHED ||
	       code == PROTO_E_COMPILE_TIMEOUT || code == PROTO_E_SHUTTING_DOWN ||
	       code == PROTO_E_INTERNAL || code == PROTO_E_ARTIFACT_CORRUPT;
}

static void spec_failed(struct graphs *g, struct specialization *sp, const struct proto_err *err)
{
	struct adapter *a = sp->adapter;
	bool remember;

	spec_unlock(sp);
	if (counts_against_budget(sp) && a->held > 0)
		a->held--;
	sp->state = SPEC_FAILED;
	sp->error = *err;
	remember = !transient(err) && a->live;
	log_line(LOG_WARN, 0, a->def.name, "%s: %s: %s%s", sp->signature,
	         proto_code_name(err->code), err->message,
	         remember ? "" : " (not remembered: the next request tries again)");
	if (remember)
		a->failed++;
	graphs_ref(sp);
	release_waiters(sp);
	if (!remember)
		unlist_spec(sp);
	else
		bound_failed(g, a);
	graphs_unref(sp);
}

static void spec_ready(struct graphs *g, struct specialization *sp)
{
	(void)g;
	sp->state = SPEC_READY;
	if (sp->from_cache || sp->compile_phases[3] <= 0)
		log_line(LOG_INFO, 0, sp->adapter->def.name, "%s %s ready (%s, %.1f s compile)",
		         spec_kinds[sp->kind].name, sp->signature,
		         sp->from_cache ? "from cache" : "compiled", sp->compile_seconds);
	else
		log_line(LOG_INFO, 0, sp->adapter->def.name,
		         "%s %s ready (compiled, %.1f s: set-up %.1f, eager %.1f, export %.1f, "
		         "inductor %.1f, parity %.1f)",
		         spec_kinds[sp->kind].name, sp->signature, sp->compile_seconds,
		         sp->compile_phases[0], sp->compile_phases[1], sp->compile_phases[2],
		         sp->compile_phases[3], sp->compile_phases[4]);
	if (sp->note[0])
		log_line(LOG_INFO, 0, sp->adapter->def.name, "%s %s: %s", spec_kinds[sp->kind].name,
		         sp->signature, sp->note);
	graphs_ref(sp);
	release_waiters(sp);
	graphs_unref(sp);
}

/* ---- pool: cache lookup, commit, load ---------------------------------- */

static int check_arity(struct specialization *sp, size_t n_in, size_t n_out, struct proto_err *err)
{
	size_t want_in = tree_count_tensors(&sp->carry) + tree_count_tensors(&sp->inputs);
	size_t want_out = tree_count_tensors(&sp->carry) + tree_count_tensors(&sp->y);

	if (spec_grad(sp)) {
		want_in += want_out;
		want_out += tree_count_tensors(&sp->carry) + tree_count_tensors(&sp->inputs);
	}
	if (n_in != want_in || n_out != want_out)
		return proto_fail(err, PROTO_E_ARTIFACT_CORRUPT, NULL,
		                  "artifact takes %zu inputs and gives %zu outputs; the signature "
		                  "needs %zu and %zu",
		                  n_in, n_out, want_in, want_out);
	return 0;
}

/*
 * Parses the y spec and dlopens the artifact of j's key: pool.  An upgrade
 * loads into the job (the specialization is READY: its y spec, the same for
 * every lowering, is not written again) and must take what the quick tier's
 * graph took.
 */
static int load_artifact(struct load_job *j, const uint8_t *y, size_t y_len, struct proto_err *err)
{
	struct specialization *sp = j->sp;
	struct engine_graph **graph = j->upgrade ? &j->graph : &sp->graph;
	msgpack_unpacked up;
	size_t off = 0, n_in, n_out;
	char so[PATH_MAX];
	int rc;

	if (j->upgrade)
		goto open;
	msgpack_unpacked_init(&up);
	if (msgpack_unpack_next(&up, (const char *)y, y_len, &off) != MSGPACK_UNPACK_SUCCESS) {
		msgpack_unpacked_destroy(&up);
		return proto_fail(err, PROTO_E_ARTIFACT_CORRUPT, NULL, "unreadable output spec");
	}
	rc = shapes_read(&up.data, sp->zone, sp->dtype, sp->batch, &sp->y, err);
	msgpack_unpacked_destroy(&up);
	if (rc != 0)
		return -1;
open:
	if (cache_load_link(j->g->cache, j->key, so, sizeof so, err) != 0)
		return -1;
	/* one model per pool thread, plus the loop thread's inline runs */
	rc = engine_load(so, (size_t)j->g->cfg->threads + 1, graph, err);
	unlink(so);
	if (rc != 0)
		return -1;
	n_in = engine_num_inputs(*graph);
	n_out = engine_num_outputs(*graph);
	if (!j->upgrade) {
		sp->n_in = n_in;
		sp->n_out = n_out;
	}
	return check_arity(sp, n_in, n_out, err);
}

/* After a load into the specialization (not an upgrade): pool. */
static void loaded(struct load_job *j)
{
	if (j->upgrade)
		return;
	fill_expected(j->sp);
	fill_expected_out(j->sp);
	index_append(j->g, j->sp);
}

static void fill_expected(struct specialization *sp)
{
	size_t n = 0;

	sp->expected = calloc(sp->n_in ? sp->n_in : 1, sizeof *sp->expected);
	if (sp->expected == NULL)
		return;
	signature_flatten(&sp->carry, sp->expected, &n);
	signature_flatten(&sp->inputs, sp->expected, &n);
	if (spec_grad(sp)) {
		/* cotangents: final carry (carry's shapes), then stacked outputs */
		size_t ny = 0;
		signature_flatten(&sp->carry, sp->expected, &n);
		signature_flatten(&sp->y, sp->expected + n, &ny);
		for (size_t i = n; i < n + ny; i++) {
			struct engine_tensor *t = &sp->expected[i];
			memmove(t->shape + 1, t->shape, (PROTO_MAX_NDIM - 1) * sizeof t->shape[0]);
			t->shape[0] = sp->steps;
			t->ndim++;
		}
	}
}

/* Shapes (and sizes: the engine lays the result buffers out by them) of one
 * tree's tensor leaves, with T prepended when stacked. */
static void expect_tree(const struct tree_node *t, int64_t stacked, struct engine_tensor *out,
                        size_t *n)
{
	size_t first = *n;

	signature_flatten(t, out, n);
	for (size_t i = first; i < *n; i++) {
		if (stacked > 0) {
			memmove(out[i].shape + 1, out[i].shape,
			        (PROTO_MAX_NDIM - 1) * sizeof out[i].shape[0]);
			out[i].shape[0] = stacked;
			out[i].ndim++;
		}
		out[i].nbytes = proto_dtype_size(out[i].dtype);
		for (uint32_t k = 0; k < out[i].ndim; k++)
			out[i].nbytes *= (uint64_t)out[i].shape[k];
		out[i].data = NULL;
	}
}

/* What the graph must return: final carry, stacked outputs (then the grads). */
static void fill_expected_out(struct specialization *sp)
{
	size_t n = 0;

	sp->expected_out = calloc(sp->n_out ? sp->n_out : 1, sizeof *sp->expected_out);
	if (sp->expected_out == NULL)
		return;
	expect_tree(&sp->carry, 0, sp->expected_out, &n);
	expect_tree(&sp->y, sp->steps, sp->expected_out, &n);
	if (spec_grad(sp)) {
		expect_tree(&sp->carry, 0, sp->expected_out, &n);
		expect_tree(&sp->inputs, 0, sp->expected_out, &n);
	}
}

static void lookup_work(uv_work_t *w)
{
	struct load_job *j = w->data;
	struct specialization *sp = j->sp;
	struct cache_meta meta;
	int found;

	found = cache_lookup(j->g->cache, j->key, &meta, &j->quarantined, &j->err);
	if (found == 0 && j->prewarm) {
		j->need_compile = true;
		return;
	}
	if (found == 0 && sp->lock_fd < 0) {
		/* someone else may be compiling this key: never wait here, look again later */
		int locked = cache_trylock(j->g->cache, sp->key, &sp->lock_fd, &j->err);
		if (locked == 1) {
			j->lock_busy = true;
			return;
		}
		if (locked < 0) {
			j->rc = -1;
			return;
		}
		found = cache_lookup(j->g->cache, j->key, &meta, &j->quarantined, &j->err);
	}
	if (found < 0) {
		j->rc = -1;
		return;
	}
	if (found == 0) {
		j->need_compile = true;
		return;
	}
	j->hit = true;
	j->compile_seconds = meta.compile_seconds;
	memcpy(j->lowered, meta.lowered, sizeof j->lowered);
	memcpy(j->note, meta.note, sizeof j->note);
	j->step_ops = meta.step_ops;
	j->rc = load_artifact(j, meta.y_spec, meta.y_spec_len, &j->err);
	cache_meta_free(&meta);
	if (j->rc == 0) {
		if (!j->prewarm)
			loaded(j); /* compiled by an earlier daemon: remember it */
		else if (!j->upgrade) {
			fill_expected(sp);
			fill_expected_out(sp);
		}
	} else if (j->err.code == PROTO_E_ARTIFACT_CORRUPT)
		cache_quarantine(j->g->cache, j->key, j->err.message);
}

static void commit_work(uv_work_t *w)
{
	struct load_job *j = w->data;
	struct specialization *sp = j->sp;
	struct cache_meta meta = {0};

	meta.n_inputs = j->res.n_inputs;
	meta.n_outputs = j->res.n_outputs;
	meta.compile_seconds = j->res.compile_seconds;
	snprintf(meta.strategy, sizeof meta.strategy, "%s", j->job.strategy);
	memcpy(meta.lowered, j->res.lowered, sizeof meta.lowered);
	memcpy(meta.note, j->res.note, sizeof meta.note);
	memcpy(j->lowered, j->res.lowered, sizeof j->lowered);
	memcpy(j->note, j->res.note, sizeof j->note);
	meta.step_ops = j->step_ops = j->res.step_ops;
	meta.y_spec = j->res.y_spec;
	meta.y_spec_len = j->res.y_spec_len;
	j->rc = cache_commit(j->g->cache, j->key, j->res.so_path, &meta, &j->err);
	cache_remove_job(j->job.output);
	/* the lock is the unrolled graph's: a quick tier keeps it for its upgrade */
	if (!j->quick)
		spec_unlock(sp);
	if (j->rc == 0)
		j->rc = load_artifact(j, j->res.y_spec, j->res.y_spec_len, &j->err);
	if (j->rc == 0)
		loaded(j);
}

static void compile_done(struct compile_job *cj, const struct compile_result *res,
                         const struct proto_err *err);

struct bound_ctx {
	int64_t steps, max, batch;
	struct proto_err *err;
};

static int check_output_leaf(const struct tree_node *leaf, const char *path, void *ctx)
{
	struct bound_ctx *b = ctx;
	struct tree_tensor t = leaf->tensor;

	/* numel <= max_elements <= 2^20 and steps <= 128: the product fits */
	if (shapes_sizes(&t, b->batch) == 0 && t.numel <= (uint64_t)b->max &&
	    t.numel * (uint64_t)b->steps <= (uint64_t)b->max)
		return 0;
	return proto_fail(b->err, PROTO_E_TOO_MANY_ELEMENTS, path,
	                  "%s: the stacked output has %lld x %llu elements, over max_elements=%lld",
	                  path, (long long)b->steps, (unsigned long long)t.numel,
	                  (long long)b->max);
}

int graphs_check_outputs(const struct specialization *sp, int64_t batch, struct proto_err *err)
{
	struct bound_ctx b = {sp->steps, sp->adapter->def.max_elements, batch, err};

	return tree_visit(&sp->y, "outputs", 0, check_output_leaf, &b);
}

/* Stacked outputs are bounded too; known only once the graph exists (for a
 * symbolic batch, at batch size 1 here and at the request's before each run). */
static bool outputs_too_large(struct specialization *sp, struct proto_err *err)
{
	return graphs_check_outputs(sp, 1, err) != 0;
}

struct lock_retry {
	uv_timer_t timer;
	struct load_job *job;
};

static void lock_retry_closed(uv_handle_t *h)
{
	free(h->data);
}

static void on_lock_retry(uv_timer_t *t)
{
	struct lock_retry *r = t->data;

	uv_queue_work(r->job->g->loop, &r->job->work, lookup_work, after_load);
	uv_close((uv_handle_t *)t, lock_retry_closed);
}

/*
 * The key's lock was busy: look again in CACHE_LOCK_RETRY_MS, for at most
 * --compile-timeout seconds in all.  Returns false (err filled) once that
 * is over or the daemon is stopping.
 */
static bool retry_lookup(struct load_job *j)
{
	struct lock_retry *r;
	double waited;

	j->lock_busy = false;
	if (j->lock_wait_started == 0)
		j->lock_wait_started = log_now();
	waited = log_now() - j->lock_wait_started;
	if (j->g->stopping) {
		proto_fail(&j->err, PROTO_E_SHUTTING_DOWN, NULL, "the daemon is stopping");
		return false;
	}
	if (waited > (double)j->g->cfg->compile_timeout) {
		proto_fail(&j->err, PROTO_E_COMPILE_TIMEOUT, NULL,
		           "another compile of this graph (another daemon on this cache, or an "
		           "earlier registration of the same definition) has held its lock for "
		           "%.0f s, over --compile-timeout=%lld",
		           waited, j->g->cfg->compile_timeout);
		return false;
	}
	/* the holder may be our own background upgrade: a request now waits for it */
	if (!j->upgrade)
		compiler_promote(j->g->compiler, j->key);
	r = malloc(sizeof *r);
	if (r == NULL) {
		proto_fail(&j->err, PROTO_E_INTERNAL, NULL, "out of memory");
		return false;
	}
	r->job = j;
	uv_timer_init(j->g->loop, &r->timer);
	r->timer.data = r;
	uv_timer_start(&r->timer, on_lock_retry, CACHE_LOCK_RETRY_MS, 0);
	return true;
}

static void largest_leaf(const struct tree_node *n, uint64_t *max)
{
	if (n->kind == TREE_TENSOR && n->tensor.numel > *max)
		*max = n->tensor.numel;
	for (uint32_t i = 0; i < n->count; i++)
		largest_leaf(&n->items[i], max);
}

/* The largest batch size whose leaves stay within max_elements (sizes at 1). */
static int64_t max_batch(const struct specialization *sp)
{
	uint64_t per = 1;

	largest_leaf(&sp->carry, &per);
	largest_leaf(&sp->inputs, &per);
	return sp->adapter->def.max_elements / (int64_t)(per ? per : 1);
}

/* Fills job for the worker; refuses a definition that crashed the worker twice. */
int prepare_compile(struct load_job *j, struct proto_err *err)
{
	struct specialization *sp = j->sp;
	struct adapter *a = sp->adapter;

	if (a->worker_crashes >= 2) {
		*err = a->crash_err;
		return -1;
	}
	memset(&j->job, 0, sizeof j->job);
	j->job.body_source = a->def.source;
	j->job.graph = a->def.graph;
	j->job.body_file = a->def.body_file[0] ? a->def.body_file : a->def.name;
	j->job.entry = a->def.entry;
	/* a chunk graph is an unrolled loop of PROTO_CHUNK_STEPS (or fewer) steps */
	j->job.strategy = j->strategy[0]                          ? j->strategy
	                  : j->quick                              ? "scan"
	                  : strcmp(a->def.strategy, "chunk") == 0 ? "unroll"
	                                                          : a->def.strategy;
	j->job.background = j->upgrade;
	j->job.kind = spec_kinds[sp->kind].job;
	j->job.carry = &sp->carry;
	j->job.inputs = &sp->inputs;
	j->job.dtype = sp->dtype;
	j->job.steps = sp->steps;
	j->job.max_batch = sp->batch ? max_batch(sp) : 0;
	j->job.sample = j->sample;
	j->job.key = j->key;
	j->job.sample_len = j->sample_len;
	j->job.done = compile_done;
	j->job.data = j;
	cache_tmp_path(j->g->cache, j->key, j->job.output, sizeof j->job.output);
	return 0;
}

void free_job(struct load_job *j)
{
	engine_unload(j->graph);
	free(j->res.y_spec);
	free(j->sample);
	graphs_unref(j->sp);
	free(j);
}

static void after_load(uv_work_t *w, int status)
{
	struct load_job *j = w->data;
	struct specialization *sp = j->sp;
	struct adapter *a = sp->adapter;

	(void)status;
	if (j->rc == 0 && j->lock_busy) {
		if (retry_lookup(j))
			return; /* j lives on until the next lookup */
		j->rc = -1;
	}
	if (j->upgrade) {
		after_upgrade(j);
		return;
	}
	if (j->rc == 0 && j->need_compile && !j->quick && tier_applies(j->g, sp)) {
		/* the unrolled graph is not cached: look for (or build) the quick tier's */
		j->quick = true;
		j->need_compile = false;
		key_for(j->g, sp, "scan", j->key);
		uv_queue_work(j->g->loop, &j->work, lookup_work, after_load);
		return;
	}
	if (j->rc == 0 && j->hit)
		sp->compile_seconds = j->compile_seconds;
	if (j->prewarm && (j->rc != 0 || j->need_compile)) {
		j->prewarm = false;
		j->prewarmed(j->g);
		if (sp->waiters == NULL) {
			/* not (validly) in the cache and nobody asked: forget it */
			unlist_spec(sp);
			graphs_unref(sp);
			free(j);
			return;
		}
		/* requests joined while it loaded: compile it for them */
		j->rc = 0;
		j->need_compile = true;
	}
	if (j->rc != 0) {
		spec_failed(j->g, sp, &j->err);
	} else if (j->need_compile && prepare_compile(j, &j->err) != 0) {
		spec_failed(j->g, sp, &j->err);
	} else if (j->need_compile) {
		a->stats.cache_misses++;
		a->stats.compiles++;
		sp->state = SPEC_COMPILING;
		j->need_compile = false;
		log_line(LOG_INFO, 0, a->def.name, "compiling %s %s%s", spec_kinds[sp->kind].name,
		         sp->signature,
		         j->quick ? " with the scan op first (quick tier), then its upgrade" : "");
		start_progress(j->g, sp);
		compiler_submit(j->g->compiler, &j->job);
		return; /* j lives on until compile_done */
	} else if (outputs_too_large(sp, &j->err)) {
		spec_failed(j->g, sp, &j->err);
	} else {
		bool upgrade;
		if (j->hit)
			a->stats.cache_hits++;
		sp->from_cache = j->hit;
		if (!j->hit)
			a->stats.compile_seconds += sp->compile_seconds;
		memcpy(sp->graph_key, j->key, sizeof sp->graph_key);
		memcpy(sp->lowered, j->lowered, sizeof sp->lowered);
		memcpy(sp->note, j->note, sizeof sp->note);
		sp->upgrade.step_ops = j->step_ops;
		/* the worker lowered the quick compile unrolled (a scan-op VJP torch
		 * could not export): final already */
		upgrade = j->quick && strcmp(sp->lowered, "scan") == 0;
		sp->quick = upgrade;
		if (!upgrade)
			spec_unlock(sp);
		spec_ready(j->g, sp);
		if (j->prewarm)
			j->prewarmed(j->g);
		if (upgrade)
			start_upgrade(j->g, sp, j);
	}
	free_job(j);
}

/*
 * The worker died while compiling this definition.  Once is a transient
 * failure (the next request tries again); twice and the definition is
 * refused -- remembered against this adapter until it is re-registered --
 * so one body cannot keep the worker in a crash loop.
 */
static void note_worker_crash(struct adapter *a, struct proto_err *err)
{
	if (++a->worker_crashes < 2)
		return;
	proto_fail(&a->crash_err, PROTO_E_WORKER_CRASHED, NULL,
	           "the compile worker died %u times compiling adapter %s's body; it is not "
	           "compiled again until the adapter is re-registered",
	           a->worker_crashes, a->def.name);
	*err = a->crash_err;
}

/*
 * A quick tier's compile failed in a way the unrolled loop may not: the body
 * and its carry were fine in the eager dry run (BODY_ERROR and
 * CARRY_MISMATCH come before any lowering, and say the same of both), and
 * the daemon is not stopping.  A MISCOMPILE is a verdict already: the worker
 * rebuilt the graph once before giving it (build_placed), and no third build
 * is tried.
 */
static bool lowering_failed(const struct proto_err *e)
{
	return e->code != PROTO_E_BODY_ERROR && e->code != PROTO_E_CARRY_MISMATCH &&
	       e->code != PROTO_E_SHUTTING_DOWN && e->code != PROTO_E_MISCOMPILE;
}

static void compile_done(struct compile_job *cj, const struct compile_result *res,
                         const struct proto_err *err)
{
	struct load_job *j = cj->data;
	struct specialization *sp = j->sp;

	if (err != NULL) {
		struct proto_err e = *err;
		cache_remove_job(cj->output);
		if (e.flags & PROTO_ERR_JOB_CRASH)
			note_worker_crash(sp->adapter, &e);
		if (e.code == PROTO_E_MISCOMPILE && j->sample == NULL)
			e.flags |=
			    PROTO_ERR_TRANSIENT; /* random inputs: not a verdict on real ones */
		if (j->upgrade) {
			upgrade_over(j, &e);
			return;
		}
		if (j->quick && lowering_failed(&e)) {
			/* the scan op could not take it: the unrolled loop may */
			log_line(LOG_WARN, 0, sp->adapter->def.name,
			         "%s %s: the quick tier failed (%s: %s); compiling it unrolled",
			         spec_kinds[sp->kind].name, sp->signature, proto_code_name(e.code),
			         e.message);
			j->quick = false;
			memcpy(j->key, sp->key, sizeof j->key);
			if (prepare_compile(j, &e) == 0) {
				sp->adapter->stats.compiles++;
				compiler_submit(j->g->compiler, &j->job);
				return;
			}
		}
		spec_failed(j->g, sp, &e);
		free_job(j);
		return;
	}
	j->res = *res;
	j->res.y_spec = malloc(res->y_spec_len ? res->y_spec_len : 1);
	if (j->res.y_spec)
		memcpy(j->res.y_spec, res->y_spec, res->y_spec_len);
	if (!j->upgrade) {
		sp->compile_seconds = res->compile_seconds;
		memcpy(sp->compile_phases, res->phases, sizeof sp->compile_phases);
		sp->state = SPEC_LOADING;
	}
	uv_queue_work(j->g->loop, &j->work, commit_work, after_load);
}

/* ---- acquire ----------------------------------------------------------- */

/* The cache key of sp's graph lowered with this strategy. */
void key_for(struct graphs *g, const struct specialization *sp, const char *strategy,
             char key[CACHE_KEY_HEX])
{
	struct adapter *a = sp->adapter;
	const struct worker_info *wi = compiler_info(g->compiler);
	char bounds[128], torch[160];
	const char *parts[12];

	/* a static adapter's keys are what they were before dynamic existed */
	snprintf(bounds, sizeof bounds, "max_steps=%lld;max_elements=%lld%s",
	         (long long)a->def.max_steps, (long long)a->def.max_elements,
	         sp->batch ? ";dynamic=batch" : "");
	snprintf(torch, sizeof torch, "%s;%s;cxx11abi=%d", wi->torch, wi->torch_git, wi->cxx11_abi);
	parts[0] = a->def.name;
	parts[1] = a->body_sha;
	parts[2] = bounds;
	parts[3] = sp->signature;
	parts[4] = spec_kinds[sp->kind].job;
	parts[5] = torch;
	parts[6] = AOTI_OPTIONS;
	parts[7] = strategy;
	parts[8] = TORCHLOOP_VERSION;
	parts[9] = g->worker_sha;
	parts[10] = g->isa;
	cache_key(parts, 11, key);
}

struct specialization *spec_new(struct graphs *g, struct adapter *a, const struct scan_args *args,
                                const char *sig)
{
	struct specialization *sp = calloc(1, sizeof *sp);
	size_t n = strlen(sig);

	if (sp == NULL)
		return NULL;
	sp->zone = msgpack_zone_new(4096);
	sp->lock_fd = -1;
	sp->cache = g->cache;
	sp->refs = 1; /* the adapter's list */
	sp->adapter = a;
	adapter_ref(a);
	sp->kind = args->kind;
	sp->batch = args->batch > 0;
	sp->dtype = args->dtype;
	sp->steps = args->steps;
	sp->signature = sp->zone ? msgpack_zone_malloc(sp->zone, n + 1) : NULL;
	if (sp->signature == NULL || signature_copy(args->carry, sp->zone, &sp->carry) != 0 ||
	    signature_copy(args->inputs, sp->zone, &sp->inputs) != 0) {
		graphs_unref(sp);
		return NULL;
	}
	memcpy(sp->signature, sig, n + 1);
	if (sp->batch)
		signature_mark_batch(&sp->carry, &sp->inputs);
	key_for(g, sp, a->def.strategy, sp->key);
	sp->next = a->specs;
	a->specs = sp;
	a->held++;
	sp->state = SPEC_LOADING;
	sp->wait_started = log_now();
	sp->last_used = ++g->reg.tick;
	return sp;
}

static void budget_exhausted(struct adapter *a, struct proto_err *err)
{
	char list[PROTO_MESSAGE_MAX - 200] = "";
	size_t len = 0;

	for (struct specialization *sp = a->specs; sp; sp = sp->next) {
		if (!counts_against_budget(sp))
			continue;
		int w = snprintf(list + len, sizeof list - len, "%s%s %s", len ? "; " : "",
		                 spec_kinds[sp->kind].name, sp->signature);
		if (w < 0 || (size_t)w >= sizeof list - len)
			break;
		len += (size_t)w;
	}
	proto_fail(err, PROTO_E_RECOMPILE_BUDGET_EXHAUSTED, NULL,
	           "adapter %s holds recompile_budget=%lld specializations already: %s",
	           a->def.name, (long long)a->def.budget, list);
}

void graphs_acquire(struct graphs *g, struct adapter *a, const struct scan_args *args,
                    struct graph_waiter *w)
{
	char sig[SPEC_SIG_MAX];
	struct specialization *sp;
	struct load_job *j;
	struct proto_err err;

	if (signature_of(args->carry, args->inputs, args->dtype, args->steps, args->batch > 0, sig,
	                 sizeof sig) != 0) {
		proto_fail(&err, PROTO_E_INVALID_ARGUMENT, NULL, "request signature too long");
		w->done(w, NULL, &err);
		return;
	}
	for (sp = a->specs; sp; sp = sp->next)
		if (sp->kind == args->kind && strcmp(sp->signature, sig) == 0)
			break;
	if (sp)
		sp->last_used = ++g->reg.tick;
	if (sp && sp->state == SPEC_READY) {
		graphs_ref(sp);
		w->done(w, sp, NULL);
		graphs_unref(sp);
		return;
	}
	if (sp && sp->state == SPEC_FAILED) {
		w->done(w, NULL, &sp->error);
		return;
	}
	if (sp) {
		add_waiter(sp, w);
		return;
	}
	if (a->held >= (unsigned)a->def.budget) {
		budget_exhausted(a, &err);
		w->done(w, NULL, &err);
		return;
	}
	sp = spec_new(g, a, args, sig);
	j = sp ? calloc(1, sizeof *j) : NULL;
	if (j == NULL) {
		proto_fail(&err, PROTO_E_INTERNAL, NULL, "out of memory");
		w->done(w, NULL, &err);
		return;
	}
	add_waiter(sp, w);
	if (!sp->batch) /* a symbolic-batch graph is checked at its probe sizes */
		j->sample = signature_sample(args->carry, args->inputs, &j->sample_len);
	start_lookup(g, sp, j, NULL);
}

void start_lookup(struct graphs *g, struct specialization *sp, struct load_job *j, const char *key)
{
	j->g = g;
	j->sp = sp;
	memcpy(j->key, key ? key : sp->key, sizeof j->key);
	j->work.data = j;
	graphs_ref(sp);
	uv_queue_work(g->loop, &j->work, lookup_work, after_load);
}

/* The leading length of the first tensor leaf (T). */
static int64_t first_steps(const struct tree_node *n)
{
	if (n->kind == TREE_TENSOR)
		return n->tensor.ndim ? n->tensor.shape[0] : -1;
	for (uint32_t i = 0; i < n->count; i++) {
		int64_t t = first_steps(&n->items[i]);
		if (t != 0)
			return t;
	}
	return 0;
}

/*
 * Starts loading every indexed specialization of a from the cache; calls
 * done(g) once per started load when it finishes.  Returns how many started.
 */
unsigned graphs_prewarm(struct graphs *g, struct adapter *a, void (*done)(struct graphs *g))
{
	struct prewarm_rec recs[PROTO_MAX_BUDGET * 4];
	msgpack_zone *zone = msgpack_zone_new(4096);
	unsigned started = 0;
	int n = zone ? index_read(g, a, zone, recs, (int)(sizeof recs / sizeof recs[0])) : 0;

	for (int i = 0; i < n && a->held < (unsigned)a->def.budget; i++) {
		struct scan_args args = {
		    &recs[i].carry, &recs[i].inputs, recs[i].dtype, 0, adapter_batched(a) ? 1 : 0,
		    recs[i].kind};
		char sig[SPEC_SIG_MAX];
		struct specialization *sp;
		struct load_job *j;
		if (recs[i].inputs.kind == TREE_NONE)
			continue;
		args.steps = first_steps(&recs[i].inputs);
		if (args.steps <= 0 || signature_of(args.carry, args.inputs, args.dtype, args.steps,
		                                    args.batch > 0, sig, sizeof sig) != 0)
			continue;
		for (sp = a->specs; sp; sp = sp->next)
			if (sp->kind == args.kind && strcmp(sp->signature, sig) == 0)
				break;
		if (sp != NULL)
			continue; /* listed twice */
		sp = spec_new(g, a, &args, sig);
		j = sp ? calloc(1, sizeof *j) : NULL;
		if (j == NULL)
			break;
		j->prewarm = true;
		j->prewarmed = done;
		start_lookup(g, sp, j, NULL);
		started++;
	}
	msgpack_zone_free(zone);
	return started;
}

/*
 * specs.c - a specialization's life, whatever path built it: its references,
 * the requests waiting on it (and their progress events), its end as READY
 * or FAILED (a deterministic failure remembered, at most --max-failed-specs
 * per adapter; a transient one forgotten), its cache key and the bound on
 * its stacked outputs.  The cold path (coldpath.c) drives it; graphs.c
 * creates it.
 *
 * Loop thread.
 */
#include "graphs_internal.h"

#include "log.h"
#include "shapes.h"
#include "signature.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the graph layer never sees a request or a connection (docs/architecture.md) */
#pragma GCC poison request conn outmsg daemon

#define PROGRESS_MS 2000

/* Lets go of (and removes) the key's lock file, if sp holds it. */
void spec_unlock(struct specialization *sp)
{
	if (sp->lock_fd >= 0)
		cache_unlock(sp->cache, sp->key, sp->lock_fd);
	sp->lock_fd = -1;
}

static void progress_closed(uv_handle_t *h)
{
	free(h);
}

void spec_free(struct specialization *sp)
{
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

bool spec_counts(const struct specialization *sp)
{
	return sp->state != SPEC_FAILED && spec_kinds[sp->kind].budgeted;
}

/* A new sp counts against its adapter's budget: held, and its uid's share
 * (graphs_acquire checked that the share table has room). */
static void spec_charge(struct specialization *sp)
{
	struct adapter *a = sp->adapter;

	if (!spec_counts(sp))
		return;
	a->held++;
	if (sp->uid == SPEC_NO_UID)
		return;
	for (unsigned i = 0; i < a->n_shares; i++)
		if (a->shares[i].uid == sp->uid) {
			a->shares[i].used++;
			return;
		}
	assert(a->n_shares < sizeof a->shares / sizeof a->shares[0]);
	a->shares[a->n_shares++] = (struct budget_share){sp->uid, 1};
}

/* sp stops counting (it failed, or leaves the list): an empty share goes. */
static void spec_refund(struct specialization *sp)
{
	struct adapter *a = sp->adapter;

	if (!spec_counts(sp))
		return;
	if (a->held > 0)
		a->held--;
	for (unsigned i = 0; i < a->n_shares; i++)
		if (a->shares[i].uid == sp->uid) {
			if (--a->shares[i].used == 0)
				a->shares[i] = a->shares[--a->n_shares];
			return;
		}
}

void spec_unlist(struct specialization *sp)
{
	struct adapter *a = sp->adapter;
	struct specialization **pp = &a->specs;

	while (*pp && *pp != sp)
		pp = &(*pp)->next;
	if (*pp == NULL)
		return;
	*pp = sp->next;
	spec_refund(sp);
	if (sp->state == SPEC_FAILED && a->failed > 0)
		a->failed--;
	graphs_unref(sp);
}

void graphs_drop_all(struct adapter *a)
{
	while (a->specs)
		spec_unlist(a->specs);
	a->held = 0;
	a->n_shares = 0;
	a->failed = 0;
}

void graphs_invalidate(struct graphs *g, struct specialization *sp, const char *why)
{
	cache_quarantine(g->cache, sp->graph_key[0] ? sp->graph_key : sp->key, why);
	log_line(LOG_ERROR, 0, sp->adapter->def.name, "%s %s dropped: %s",
	         spec_kinds[sp->kind].name, sp->signature, why);
	spec_unlist(sp);
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
		spec_unlist(lru);
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

void spec_add_waiter(struct specialization *sp, struct graph_waiter *w)
{
	graphs_ref(sp);
	w->next = sp->waiters;
	sp->waiters = w;
	if (sp->state == SPEC_COMPILING && w->event)
		w->event(w, "compiling", sp, log_now() - sp->wait_started);
}

/* A compile starts: tell every waiter, then every PROGRESS_MS. */
void spec_start_progress(struct graphs *g, struct specialization *sp)
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

/* The state machine of a specialization: the states each may move to. */
#define TO(s) (1u << SPEC_##s)
static const unsigned SPEC_NEXT[] = {
    [SPEC_LOADING] = TO(LOADING) | TO(COMPILING) | TO(READY) | TO(FAILED),
    [SPEC_COMPILING] = TO(LOADING) | TO(COMPILING) | TO(READY) | TO(FAILED),
    [SPEC_READY] = TO(READY),
    [SPEC_FAILED] = 0,
};
#undef TO

void spec_set_state(struct specialization *sp, enum spec_state s)
{
	assert(SPEC_NEXT[sp->state] & (1u << s));
	sp->state = s;
}

void spec_failed(struct graphs *g, struct specialization *sp, const struct proto_err *err)
{
	struct adapter *a = sp->adapter;
	bool remember;

	spec_unlock(sp);
	spec_refund(sp);
	spec_set_state(sp, SPEC_FAILED);
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
		spec_unlist(sp);
	else
		bound_failed(g, a);
	graphs_unref(sp);
}

void spec_ready(struct graphs *g, struct specialization *sp)
{
	(void)g;
	spec_set_state(sp, SPEC_READY);
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
bool spec_outputs_too_large(struct specialization *sp, struct proto_err *err)
{
	return graphs_check_outputs(sp, 1, err) != 0;
}

static void key_of(struct graphs *g, const struct specialization *sp, const char *strategy,
                   const char *job, char key[CACHE_KEY_HEX]);

/* The cache key of sp's graph lowered with this strategy. */
void spec_key(struct graphs *g, const struct specialization *sp, const char *strategy,
              char key[CACHE_KEY_HEX])
{
	key_of(g, sp, strategy, spec_kinds[sp->kind].job, key);
}

/* Everything in a cache key but the kind: what the two graphs of the saved
 * pair share (a grad's saved_key must be the forward's). */
static void key_of(struct graphs *g, const struct specialization *sp, const char *strategy,
                   const char *job, char key[CACHE_KEY_HEX])
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
	parts[4] = job;
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
	sp->wrt = signature_wrt_of(sp->signature);
	if (sp->batch)
		signature_mark_batch(&sp->carry, &sp->inputs);
	spec_key(g, sp, a->def.strategy, sp->key);
	if (spec_kinds[sp->kind].saved)
		key_of(g, sp, a->def.strategy, "saved pair", sp->pair_key);
	sp->next = a->specs;
	a->specs = sp;
	sp->uid = args->uid;
	spec_set_state(sp, SPEC_LOADING); /* new: calloc'ed in LOADING */
	spec_charge(sp);
	sp->wait_started = log_now();
	sp->last_used = ++g->reg.tick;
	return sp;
}

static void largest_leaf(const struct tree_node *n, uint64_t *max)
{
	if (n->kind == TREE_TENSOR && n->tensor.numel > *max)
		*max = n->tensor.numel;
	for (uint32_t i = 0; i < n->count; i++)
		largest_leaf(&n->items[i], max);
}

int64_t spec_max_batch(const struct specialization *sp)
{
	uint64_t per = 1;

	largest_leaf(&sp->carry, &per);
	largest_leaf(&sp->inputs, &per);
	return sp->adapter->def.max_elements / (int64_t)(per ? per : 1);
}

/*
 * The worker died while compiling this definition.  Once is a transient
 * failure (the next request tries again); twice and the definition is
 * refused -- remembered against this adapter until it is re-registered --
 * so one body cannot keep the worker in a crash loop.
 */
void spec_note_worker_crash(struct adapter *a, struct proto_err *err)
{
	if (++a->worker_crashes < 2)
		return;
	proto_fail(&a->crash_err, PROTO_E_WORKER_CRASHED, NULL,
	           "the compile worker died %u times compiling adapter %s's body; it is not "
	           "compiled again until the adapter is re-registered",
	           a->worker_crashes, a->def.name);
	*err = a->crash_err;
}

/*
 * graphs.c - specializations of an adapter: found or created for a request
 * (within the requesting uid's share of the adapter's recompilation budget:
 * graphs.h, struct budget_share), or created at start-up from the warm-start
 * index (nobody's share: who made them is not persisted); the graph layer
 * opened and closed.
 *
 * A specialization's states: LOADING -> READY, or LOADING -> COMPILING ->
 * LOADING -> READY, or FAILED (specs.c keeps the waiters, the failures and
 * the key); the cold path in between is coldpath.c's state machine.
 * Requests that arrive meanwhile wait on the specialization (single flight)
 * and get a progress event every 2 s.
 *
 * Loop thread.
 */
#include "graphs_internal.h"

#include "log.h"
#include "runner.h"
#include "signature.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the graph layer never sees a request or a connection (docs/architecture.md) */
#pragma GCC poison request conn outmsg daemon

/* The remote tier, when --remote-cache names one: -1 when it is misconfigured. */
static int open_remote(struct graphs *g)
{
	const struct config *c = g->cfg;
	struct remote_opts o = {
	    c->remote_url,     c->remote_secret_file,          c->remote_auth_file,
	    c->remote_timeout, (uint64_t)c->remote_max_object, c->remote_ttl,
	    c->remote_lease_ms};
	char why[512];
	int bad;

	g->remote = remote_open(g->loop, &o, why, sizeof why, &bad);
	if (bad) {
		log_error("remote cache: %s", why);
		return -1;
	}
	if (g->remote)
		log_info("remote cache %s: on (lease %lld ms, timeout %lld ms, objects up to %lld "
		         "bytes, kept %lld s)",
		         c->remote_url, c->remote_lease_ms, c->remote_timeout, c->remote_max_object,
		         c->remote_ttl);
	else if (why[0])
		log_warn("remote cache %s: %s", c->remote_url, why);
	return 0;
}

int graphs_open(struct graphs *g, uv_loop_t *loop, const struct config *cfg, struct cache *cache,
                const char *worker_sha, const char *isa)
{
	g->loop = loop;
	g->cfg = cfg;
	g->cache = cache;
	g->worker_sha = worker_sha;
	g->isa = isa;
	if (open_remote(g) != 0)
		return -1;
	if (runner_start(&g->runner, loop) != 0)
		log_warn("graph runs with an OpenMP team go to the thread pool");
	return 0;
}

/* No more runs with an OpenMP team (those in flight finish). */
void graphs_stop_runs(struct graphs *g)
{
	runner_close(&g->runner);
}

/* Drops every adapter (and, with the last references, their graphs). */
void graphs_close(struct graphs *g)
{
	adapter_clear(&g->reg);
	remote_close(g->remote);
	g->remote = NULL;
}

/* RECOMPILE_BUDGET_EXHAUSTED: uid's share is full; the message lists it. */
static int budget_exhausted(struct adapter *a, uid_t uid, struct proto_err *err)
{
	char list[PROTO_MESSAGE_MAX - 200] = "";
	size_t len = 0;

	for (struct specialization *sp = a->specs; sp; sp = sp->next) {
		if (!spec_counts(sp) || sp->uid != uid)
			continue;
		int w = snprintf(list + len, sizeof list - len, "%s%s %s", len ? "; " : "",
		                 spec_kinds[sp->kind].name, sp->signature);
		if (w < 0 || (size_t)w >= sizeof list - len)
			break;
		len += (size_t)w;
	}
	return proto_fail(err, PROTO_E_RECOMPILE_BUDGET_EXHAUSTED, NULL,
	                  "uid %d holds recompile_budget=%lld specializations of adapter %s "
	                  "already (each uid has a budget of its own): %s",
	                  (int)uid, (long long)a->def.budget, a->def.name, list);
}

/*
 * May uid make a new specialization of this kind?  Within its own share of
 * the budget, and, unless it owns the adapter or holds a share already, while
 * fewer than --max-uids-per-adapter other uids hold one (what an adapter
 * holds stays bounded).  0, or -1 with RECOMPILE_BUDGET_EXHAUSTED.
 */
static int budget_check(struct graphs *g, struct adapter *a, const struct scan_args *args,
                        struct proto_err *err)
{
	unsigned others = a->n_shares;

	if (!spec_kinds[args->kind].budgeted)
		return 0;
	if (adapter_budget_used(a, args->uid) >= (unsigned)a->def.budget)
		return budget_exhausted(a, args->uid, err);
	if (adapter_budget_used(a, args->uid) > 0 || args->uid == a->def.owner)
		return 0;
	others -= adapter_budget_used(a, a->def.owner) > 0;
	if (others < (unsigned)g->cfg->max_uids_per_adapter)
		return 0;
	return proto_fail(err, PROTO_E_RECOMPILE_BUDGET_EXHAUSTED, NULL,
	                  "adapter %s holds specializations of %u uids besides its owner, "
	                  "--max-uids-per-adapter=%lld: uid %d may use those (scan at their "
	                  "signatures) but not make a new one",
	                  a->def.name, others, g->cfg->max_uids_per_adapter, (int)args->uid);
}

static void partner_done(struct graph_waiter *w, struct specialization *sp,
                         const struct proto_err *err)
{
	(void)sp;
	(void)err; /* the backward's own request will say it */
	free(w);
}

/* A saved pair's forward that is not there yet: its backward is the next
 * request of a client that asked for it, so that graph's load or compile
 * starts now, beside the forward's, not after it. */
static void acquire_partner(struct graphs *g, struct adapter *a, const struct scan_args *args)
{
	struct scan_args b = *args;
	struct graph_waiter *w = calloc(1, sizeof *w);

	if (w == NULL)
		return;
	w->done = partner_done;
	b.kind = SPEC_GRAD_SAVED;
	graphs_acquire(g, a, &b, w);
}

void graphs_acquire(struct graphs *g, struct adapter *a, const struct scan_args *args,
                    struct graph_waiter *w)
{
	char sig[SPEC_SIG_MAX];
	struct specialization *sp;
	struct load_job *j;
	struct proto_err err;

	if (signature_of(args->carry, args->inputs, args->dtype, args->steps, args->batch > 0, sig,
	                 sizeof sig) != 0 ||
	    signature_wrt(sig, sizeof sig, args->wrt) != 0) {
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
		spec_add_waiter(sp, w);
		return;
	}
	if (budget_check(g, a, args, &err) != 0) {
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
	spec_add_waiter(sp, w);
	if (!sp->batch) /* a symbolic-batch graph is checked at its probe sizes */
		j->sample = signature_sample(args->carry, args->inputs, &j->sample_len);
	start_lookup(g, sp, j, NULL);
	if (args->kind == SPEC_SCAN_SAVE)
		acquire_partner(g, a, args);
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
		    recs[i].kind,   recs[i].wrt,     SPEC_NO_UID};
		char sig[SPEC_SIG_MAX];
		struct specialization *sp;
		struct load_job *j;
		if (recs[i].inputs.kind == TREE_NONE)
			continue;
		args.steps = first_steps(&recs[i].inputs);
		if (args.steps <= 0 ||
		    signature_of(args.carry, args.inputs, args.dtype, args.steps, args.batch > 0,
		                 sig, sizeof sig) != 0 ||
		    signature_wrt(sig, sizeof sig, args.wrt) != 0)
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
		j->purpose = LOAD_PREWARM;
		j->prewarmed = done;
		start_lookup(g, sp, j, NULL);
		started++;
	}
	msgpack_zone_free(zone);
	return started;
}

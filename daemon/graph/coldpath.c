/*
 * coldpath.c - the cold path of a specialization as a state machine: one
 * struct load_job walks the stages below, each started by enter() and
 * continued by its own short function on the loop (the `stages` table;
 * docs/architecture.md, "The cold path", draws it).
 *
 * What each stage does and which it may enter next is the table at the end
 * (stages[], .next asserted by enter()); docs/architecture.md draws it
 * (LOOKUP, LOCK_WAIT, REMOTE, LEASE, LEASE_WAIT, COMPILE, COMMIT).
 *
 * Any failure ends the job: the specialization FAILED (specs.c), or for an
 * upgrade, the quick graph keeps serving.  A READY quick graph starts its
 * upgrade (a job of its own, purpose LOAD_UPGRADE) when upgrade.c plans one.
 *
 * Loop thread, except the uv_work callbacks marked "pool", which own the
 * job and touch only the specialization fields that no one else reads while
 * the state is LOADING (graph, y, n_in/out, expected); values the loop also
 * reads (compile_seconds) go into the job and are published on the loop.
 */
#include "graphs_internal.h"

#include "frame.h"
#include "log.h"
#include "shapes.h"
#include "signature.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* the graph layer never sees a request or a connection (docs/architecture.md) */
#pragma GCC poison request conn outmsg daemon

/* ---- the stages --------------------------------------------------------- */

static int prepare_compile(struct load_job *j, struct proto_err *err);

/* Each stage: its work on a pool thread (or none), how it begins on the
 * loop, and the loop's continuation that picks the next stage (the table is
 * at the end of this file, below the functions it names). */
struct stage {
	const char *name;
	uv_work_cb pool;
	void (*start)(struct load_job *j);
	void (*done)(struct load_job *j);
	unsigned next; /* the stages it may enter (1 << stage each), asserted by enter() */
};
static const struct stage stages[STAGES];

/* A job begins in LOOKUP (start_lookup: its stage is 0 before) and moves
 * only along stages[].next. */
static void enter(struct load_job *j, enum load_stage s)
{
	assert(stages[j->stage].next & (1u << s));
	j->stage = s;
	log_line(LOG_DEBUG, 0, j->sp->adapter->def.name, "%s %s: %s (%s key %.16s)",
	         spec_kinds[j->sp->kind].name, j->sp->signature, stages[s].name,
	         j->purpose == LOAD_UPGRADE ? "upgrade"
	         : j->quick                 ? "quick"
	                                    : "its",
	         j->key);
	stages[s].start(j);
}

static void after_pool(uv_work_t *w, int status)
{
	struct load_job *j = w->data;

	(void)status;
	stages[j->stage].done(j);
}

static void start_pool(struct load_job *j)
{
	uv_queue_work(j->g->loop, &j->work, stages[j->stage].pool, after_pool);
}

static void free_job(struct load_job *j)
{
	engine_unload(j->graph);
	free(j->blob);
	free(j->publish);
	free(j->res.y_spec);
	free(j->sample);
	graphs_unref(j->sp);
	free(j);
}

/* ---- the ends ----------------------------------------------------------- */

/* The upgrade is over: it took over (err NULL), or the quick graph keeps serving. */
static void upgrade_over(struct load_job *j, const struct proto_err *err)
{
	j->sp->upgrading = false;
	spec_unlock(j->sp);
	if (err != NULL)
		upgrade_failed(j->sp, err);
	free_job(j);
}

static void job_failed(struct load_job *j, const struct proto_err *err)
{
	remote_keeper_stop(j->renewal);
	j->renewal = NULL;
	if (j->leased) /* waiting nodes take it over at once, not after the lease time */
		remote_lease_release(j->g->remote, j->key);
	j->leased = false;
	if (j->purpose == LOAD_UPGRADE) {
		upgrade_over(j, err);
		return;
	}
	if (j->purpose == LOAD_PREWARM)
		j->prewarmed(j->g);
	spec_failed(j->g, j->sp, err);
	free_job(j);
}

static void start_upgrade(struct graphs *g, struct specialization *sp, struct load_job *quick);

/* The graph j loaded serves: READY (or, for an upgrade, it takes over). */
static void publish(struct load_job *j)
{
	struct specialization *sp = j->sp;
	struct adapter *a = sp->adapter;
	bool upgrade;

	if (j->purpose == LOAD_UPGRADE) {
		upgrade_take_over(j);
		upgrade_over(j, NULL);
		return;
	}
	if (spec_outputs_too_large(sp, &j->err)) {
		job_failed(j, &j->err);
		return;
	}
	if (j->hit)
		a->stats.cache_hits++;
	else if (j->blob == NULL) /* a fetched blob's compile was another node's */
		a->stats.compile_seconds += sp->compile_seconds;
	sp->from_cache = j->hit || j->blob != NULL;
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
	if (j->purpose == LOAD_PREWARM)
		j->prewarmed(j->g);
	if (upgrade)
		start_upgrade(j->g, sp, j);
	free_job(j);
}

/* ---- LOOKUP ------------------------------------------------------------- */

/* A prewarm missed: dropped when nobody asked for it meanwhile (false), else
 * the job becomes the requests' that joined (true). */
static bool prewarm_missed(struct load_job *j)
{
	j->prewarmed(j->g);
	j->purpose = LOAD_REQUEST;
	if (j->sp->waiters != NULL) {
		j->rc = 0;
		j->hit = false;
		return true;
	}
	spec_unlist(j->sp);
	graphs_unref(j->sp);
	free(j);
	return false;
}

/* The key is in no cache (or the remote tier cannot say): the worker builds it. */
static void compile_locally(struct load_job *j)
{
	if (prepare_compile(j, &j->err) != 0)
		job_failed(j, &j->err);
	else
		enter(j, STAGE_COMPILE);
}

static void looked_up(struct load_job *j)
{
	struct specialization *sp = j->sp;

	if (j->rc == 0 && j->lock_busy) {
		enter(j, STAGE_LOCK_WAIT);
		return;
	}
	if (j->rc == 0 && !j->hit && !j->quick && j->purpose != LOAD_UPGRADE &&
	    tier_applies(j->g, sp)) {
		/* the unrolled graph is not cached: look for (or build) the quick tier's */
		j->quick = true;
		spec_key(j->g, sp, "scan", j->key);
		enter(j, STAGE_LOOKUP);
		return;
	}
	if (j->purpose == LOAD_PREWARM && (j->rc != 0 || !j->hit)) {
		if (prewarm_missed(j))
			enter(j, STAGE_LOOKUP); /* as theirs: the key's lock, then a compile */
		return;
	}
	if (j->rc != 0) {
		job_failed(j, &j->err);
	} else if (j->hit) {
		if (j->purpose != LOAD_UPGRADE)
			sp->compile_seconds = j->compile_seconds;
		publish(j);
	} else {
		sp->adapter->stats.cache_misses++;
		if (j->g->remote != NULL)
			enter(j, STAGE_REMOTE);
		else
			compile_locally(j);
	}
}

/* ---- LOCK_WAIT ---------------------------------------------------------- */

static void wait_closed(uv_handle_t *h)
{
	free(h);
}

static void on_waited(uv_timer_t *t)
{
	struct load_job *j = t->data;

	uv_close((uv_handle_t *)t, wait_closed);
	stages[j->stage].done(j);
}

/* The stage's continuation in ms (LOCK_WAIT, LEASE_WAIT); -1 without memory. */
static int wait_ms(struct load_job *j, uint64_t ms)
{
	uv_timer_t *t = malloc(sizeof *t);

	if (t == NULL)
		return -1;
	uv_timer_init(j->g->loop, t);
	t->data = j;
	uv_timer_start(t, on_waited, ms, 0);
	return 0;
}

/* The key's lock was busy: look again in CACHE_LOCK_RETRY_MS, for at most
 * --compile-timeout seconds in all, and not once the daemon is stopping. */
static void start_lock_wait(struct load_job *j)
{
	double waited;

	if (j->lock_wait_started == 0)
		j->lock_wait_started = log_now();
	waited = log_now() - j->lock_wait_started;
	if (j->g->stopping) {
		proto_fail(&j->err, PROTO_E_SHUTTING_DOWN, NULL, "the daemon is stopping");
		job_failed(j, &j->err);
		return;
	}
	if (waited > (double)j->g->cfg->compile_timeout) {
		proto_fail(&j->err, PROTO_E_COMPILE_TIMEOUT, NULL,
		           "another compile of this graph (another daemon on this cache, or an "
		           "earlier registration of the same definition) has held its lock for "
		           "%.0f s, over --compile-timeout=%lld",
		           waited, j->g->cfg->compile_timeout);
		job_failed(j, &j->err);
		return;
	}
	/* the holder may be our own background upgrade: a request now waits for it */
	if (j->purpose != LOAD_UPGRADE)
		compiler_promote(j->g->compiler, j->key);
	if (wait_ms(j, CACHE_LOCK_RETRY_MS) != 0) {
		proto_fail(&j->err, PROTO_E_INTERNAL, NULL, "out of memory");
		job_failed(j, &j->err);
	}
}

static void lock_waited(struct load_job *j)
{
	enter(j, STAGE_LOOKUP);
}

/* ---- REMOTE, LEASE, LEASE_WAIT: the remote tier (remote.h) -------------- */

/* How often a node that waits for another's compile looks for its blob. */
#define LEASE_POLL_MS 250

static void on_fetched(void *arg, enum remote_result res, uint8_t *blob, size_t len)
{
	struct load_job *j = arg;

	j->rc = res == REMOTE_FAILED ? -1 : 0;
	j->hit = res == REMOTE_OK;
	j->blob = blob;
	j->blob_len = len;
	stages[j->stage].done(j);
}

static void start_fetch(struct load_job *j)
{
	remote_fetch(j->g->remote, j->key, on_fetched, j);
}

/* A blob from the remote tier goes through COMMIT (verified there); none:
 * the lease; the tier failing: the worker builds it (and publishes it). */
static void fetched(struct load_job *j)
{
	if (j->hit) {
		j->hit = false; /* not the local cache's hit */
		enter(j, STAGE_COMMIT);
	} else if (j->rc == 0) {
		enter(j, STAGE_LEASE);
	} else {
		j->rc = 0;
		compile_locally(j);
	}
}

static void on_leased(void *arg, enum remote_result res)
{
	struct load_job *j = arg;

	j->leased = res == REMOTE_OK;
	j->rc = res == REMOTE_FAILED ? -1 : 0;
	stages[j->stage].done(j);
}

static void start_lease(struct load_job *j)
{
	remote_lease(j->g->remote, j->key, on_leased, j);
}

static void leased(struct load_job *j)
{
	struct remote_stats *st = remote_counters(j->g->remote);

	if (j->leased) {
		if (j->lease_wait_started != 0)
			st->lease_takeovers++; /* its holder went away without a blob */
		/* renewed every third of its time while the worker builds; without
		 * memory for that it may expire mid-compile: another node compiles too */
		j->renewal = remote_keep_lease(j->g->remote, j->key);
		compile_locally(j);
	} else if (j->rc == 0) {
		if (j->lease_wait_started == 0)
			st->lease_waits++;
		enter(j, STAGE_LEASE_WAIT);
	} else {
		j->rc = 0;
		compile_locally(j);
	}
}

/* Another node compiles the key: look for its blob (and whether its lease
 * still stands) every LEASE_POLL_MS, for at most --compile-timeout. */
static void start_lease_wait(struct load_job *j)
{
	if (j->lease_wait_started == 0)
		j->lease_wait_started = log_now();
	if (log_now() - j->lease_wait_started > (double)j->g->cfg->compile_timeout ||
	    j->g->stopping || wait_ms(j, LEASE_POLL_MS) != 0)
		compile_locally(j);
}

/* Its blob, if published; else the lease again (taken over once expired). */
static void lease_waited(struct load_job *j)
{
	enter(j, STAGE_REMOTE);
}

/* COMMIT refused a fetched blob: counted by why. */
static void remote_refused(struct load_job *j)
{
	remote_count_refusal(j->g->remote, j->refusal);
	log_line(LOG_WARN, 0, j->sp->adapter->def.name,
	         "remote cache: %.16s refused: %s; compiling it", j->key, j->err.message);
	free(j->blob);
	j->blob = NULL;
	j->rc = 0;
}

/* ---- COMPILE ------------------------------------------------------------ */

static void on_compiled(struct compile_job *cj, const struct compile_result *res,
                        const struct proto_err *err);

/* Fills job for the worker; refuses a definition that crashed the worker twice. */
static int prepare_compile(struct load_job *j, struct proto_err *err)
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
	j->job.background = j->purpose == LOAD_UPGRADE;
	j->job.kind = spec_kinds[sp->kind].job;
	j->job.carry = &sp->carry;
	j->job.inputs = &sp->inputs;
	j->job.dtype = sp->dtype;
	j->job.steps = sp->steps;
	j->job.max_batch = sp->batch ? spec_max_batch(sp) : 0;
	j->job.wrt = sp->wrt;
	j->job.tenant = compiler_tenant(a->def.owner);
	/* no request data reaches a captured graph's worker (it checks on generated inputs) */
	j->job.sample = a->def.graph ? NULL : j->sample;
	j->job.key = j->key;
	j->job.sample_len = j->job.sample ? j->sample_len : 0;
	j->job.done = on_compiled;
	j->job.data = j;
	cache_tmp_path(j->g->cache, j->key, j->job.output, sizeof j->job.output);
	return 0;
}

static void start_compile(struct load_job *j)
{
	struct specialization *sp = j->sp;
	struct adapter *a = sp->adapter;

	a->stats.compiles++;
	if (j->purpose == LOAD_UPGRADE) {
		log_line(LOG_INFO, 0, a->def.name,
		         "compiling %s %s as %s, in the background (estimated %.0f s)",
		         spec_kinds[sp->kind].name, sp->signature, sp->upgrade.plan,
		         sp->upgrade.estimate_s);
	} else if (sp->state != SPEC_COMPILING) {
		spec_set_state(sp, SPEC_COMPILING);
		log_line(LOG_INFO, 0, a->def.name, "compiling %s %s%s", spec_kinds[sp->kind].name,
		         sp->signature,
		         j->quick ? " with the scan op first (quick tier), then its upgrade" : "");
		spec_start_progress(j->g, sp);
	}
	compiler_submit(j->g->compiler, &j->job);
}

/* The worker's reply: kept in the job, then the stage's continuation. */
static void on_compiled(struct compile_job *cj, const struct compile_result *res,
                        const struct proto_err *err)
{
	struct load_job *j = cj->data;

	j->rc = err ? -1 : 0;
	if (err != NULL) {
		j->err = *err;
		cache_remove_job(cj->output);
	} else {
		j->res = *res;
		j->res.y_spec = malloc(res->y_spec_len ? res->y_spec_len : 1);
		if (j->res.y_spec)
			memcpy(j->res.y_spec, res->y_spec, res->y_spec_len);
	}
	stages[j->stage].done(j);
}

static void compiled(struct load_job *j)
{
	struct specialization *sp = j->sp;

	if (j->rc != 0) {
		struct proto_err e = j->err;
		if (e.flags & PROTO_ERR_JOB_CRASH)
			spec_note_worker_crash(sp->adapter, &e);
		if (e.code == PROTO_E_MISCOMPILE && j->sample == NULL)
			e.flags |=
			    PROTO_ERR_TRANSIENT; /* random inputs: not a verdict on real ones */
		if (j->quick && j->purpose != LOAD_UPGRADE && tier_lowering_failed(&e)) {
			/* the scan op could not take it: the unrolled loop may */
			log_line(LOG_WARN, 0, sp->adapter->def.name,
			         "%s %s: the quick tier failed (%s: %s); compiling it unrolled",
			         spec_kinds[sp->kind].name, sp->signature, proto_code_name(e.code),
			         e.message);
			j->quick = false;
			memcpy(j->key, sp->key, sizeof j->key);
			if (prepare_compile(j, &e) == 0) {
				enter(j, STAGE_COMPILE);
				return;
			}
		}
		job_failed(j, &e);
		return;
	}
	if (j->purpose != LOAD_UPGRADE) {
		sp->compile_seconds = j->res.compile_seconds;
		memcpy(sp->compile_phases, j->res.phases, sizeof sp->compile_phases);
		spec_set_state(sp, SPEC_LOADING);
	}
	enter(j, STAGE_COMMIT);
}

/* ---- COMMIT ------------------------------------------------------------- */

static void committed(struct load_job *j)
{
	struct remote *r = j->g->remote;

	remote_keeper_stop(j->renewal);
	j->renewal = NULL;
	if (j->blob != NULL && j->rc != 0) {
		/* a fetched blob refused, or not loadable here (counted): what the
		 * worker builds replaces it -- never a failed scan for the remote tier */
		remote_refused(j);
		compile_locally(j);
		return;
	}
	if (j->blob != NULL && j->rc == 0) {
		remote_counters(r)->hits++;
		j->sp->compile_seconds = j->res.compile_seconds;
	}
	if (r != NULL && j->publish != NULL) {
		remote_publish(r, j->key, j->publish, j->publish_len); /* and the lease released */
		j->publish = NULL;
	} else if (r != NULL && j->leased) {
		if (j->publish_skipped)
			remote_counters(r)->publish_skipped++;
		remote_lease_release(r, j->key);
	}
	j->leased = false;
	if (j->rc != 0)
		job_failed(j, &j->err);
	else
		publish(j);
}

/* ---- starting a job ----------------------------------------------------- */

void start_lookup(struct graphs *g, struct specialization *sp, struct load_job *j, const char *key)
{
	j->g = g;
	j->sp = sp;
	memcpy(j->key, key ? key : sp->key, sizeof j->key);
	j->work.data = j;
	graphs_ref(sp);
	enter(j, STAGE_LOOKUP);
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
	j->purpose = LOAD_UPGRADE;
	j->sample = quick->sample; /* checked on the same inputs as the quick graph */
	j->sample_len = quick->sample_len;
	quick->sample = NULL;
	sp->upgrading = true;
	if (strcmp(sp->upgrade.plan, "unroll") == 0) {
		start_lookup(g, sp, j, NULL);
		return;
	}
	memcpy(j->strategy, sp->upgrade.plan, sizeof j->strategy);
	spec_key(g, sp, j->strategy, key);
	start_lookup(g, sp, j, key);
}

#define TO(s) (1u << STAGE_##s)
static const struct stage stages[STAGES] = {
    [STAGE_LOOKUP] = {"lookup", lookup_work, start_pool, looked_up,
                      TO(LOOKUP) | TO(LOCK_WAIT) | TO(REMOTE) | TO(COMPILE)},
    [STAGE_LOCK_WAIT] = {"lock_wait", NULL, start_lock_wait, lock_waited, TO(LOOKUP)},
    [STAGE_REMOTE] = {"remote", NULL, start_fetch, fetched, TO(COMMIT) | TO(LEASE) | TO(COMPILE)},
    [STAGE_LEASE] = {"lease", NULL, start_lease, leased, TO(COMPILE) | TO(LEASE_WAIT)},
    [STAGE_LEASE_WAIT] = {"lease_wait", NULL, start_lease_wait, lease_waited,
                          TO(REMOTE) | TO(COMPILE)},
    [STAGE_COMPILE] = {"compile", NULL, start_compile, compiled, TO(COMPILE) | TO(COMMIT)},
    [STAGE_COMMIT] = {"commit", commit_work, start_pool, committed, TO(COMPILE)},
};
#undef TO

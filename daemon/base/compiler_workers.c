/*
 * compiler_workers.c - the compile service's worker processes (see
 * compiler.h): starting one in a slot, its exit (a crash fails its job; the
 * first worker is restarted, with backoff while workers die before their
 * hello), the orphans dead workers leave, idle retirement, and the service's
 * start and stop.  The struct is freed once compiler_stop has run and every
 * timer and worker process has closed.
 */
#include "compiler_pool.h"

#include "log.h"
#include "proctree.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

const char *const COMPILER_LANE_NAMES[COMPILER_LANES] = {"check", "foreground", "background"};

unsigned compiler_default_workers(void)
{
	uint64_t mem = uv_get_constrained_memory();
	uint64_t total = uv_get_total_memory();
	unsigned n = uv_available_parallelism();
	uint64_t by_mem;

	if (mem == 0 || mem > total)
		mem = total;
	by_mem = mem / (3ULL << 29); /* 1.5 GiB */
	if (by_mem < n)
		n = (unsigned)by_mem;
	return n < 1 ? 1 : n > LANE_SLOTS ? LANE_SLOTS : n;
}

/*
 * Alive: some worker said hello, or -- once the service has been up and no
 * start has failed since -- the first worker is being replaced (a tenant's
 * turn, idle retirement, a crash): that is not a fault a prober should see.
 */
bool compiler_alive(const struct compiler *c)
{
	for (int k = 0; k < COMPILER_LANES; k++)
		for (unsigned i = 0; i < c->lanes[k].max; i++)
			if (c->lanes[k].slots[i].p != NULL && c->lanes[k].slots[i].hello)
				return true;
	return c->ready == NULL && c->start_failures == 0 && PRIMARY(c)->p != NULL;
}
void pool_fail_current(struct slot *s, enum proto_code code, unsigned flags, const char *why)
{
	struct compile_job *job = s->current;
	struct proto_err err;

	if (job == NULL)
		return;
	s->current = NULL;
	s->promoted = false;
	s->c->lanes[job->lane].jobs++;
	pool_disarm(s);
	proto_fail(&err, code, NULL, "%s", why);
	err.flags = flags;
	job->done(job, NULL, &err);
}

/* Fails every queued job of every lane (not those in flight) with err. */
void pool_fail_queues(struct compiler *c, const struct proto_err *err)
{
	for (int k = 0; k < COMPILER_LANES; k++) {
		struct lane *l = &c->lanes[k];
		while (l->head) {
			struct compile_job *j = l->head;
			l->head = j->next;
			if (l->head == NULL)
				l->tail = NULL;
			j->done(j, NULL, err);
		}
	}
}

/* While workers keep dying before their hello: why, and when the next try is. */
void pool_start_failure_err(const struct compiler *c, struct proto_err *err)
{
	proto_fail(err, PROTO_E_WORKER_CRASHED, NULL,
	           "the compile worker cannot start (%u tries in a row; the last %s); the "
	           "daemon keeps retrying with backoff",
	           c->start_failures, c->last_exit);
	err->flags = PROTO_ERR_TRANSIENT;
}

/* Kills the slot's worker's whole tree and detaches it: nothing more goes to it. */
void pool_retire(struct slot *s)
{
	s->retired = wproc_pid(s->p);
	pool_kill_slot(s);
}

void pool_kill_slot(struct slot *s)
{
	struct wproc *p = s->p;
	size_t extra;

	if (p == NULL)
		return;
	s->p = NULL;
	s->hello = s->paused = s->ready = false;
	pool_disarm(s);
	extra = wproc_kill(p);
	s->c->orphans_killed += extra;
	if (extra)
		log_warn("compile worker %d: killed %zu descendant process(es) with it",
		         wproc_pid(p), extra);
}

/*
 * The slot's timer ran out.  A worker with no hello yet is killed but not
 * detached: its exit is a start failure (on_exited).  One that has a job but
 * is still importing the compile path fails it as a crash; one that was
 * ready when its job came, or became ready since, exceeded the compile
 * timeout (it runs from then: an import never counts against a compile).
 */
static void on_timeout(uv_timer_t *t)
{
	struct slot *s = t->data;
	struct compiler *c = s->c;
	char why[200];

	if (s->p == NULL || (!s->hello && wproc_killed(s->p)) || (s->hello && !s->current))
		return;
	if (!s->hello) {
		log_warn(
		    "compile worker %d (%s lane): no hello within %.0f s (--worker-start-timeout); "
		    "killing it",
		    wproc_pid(s->p), COMPILER_LANE_NAMES[s->lane], c->start_timeout);
		c->orphans_killed += wproc_kill(s->p);
		return;
	}
	if (!s->ready) {
		log_warn("compile worker %d (%s lane): job %llu came %.0f s ago and the worker has "
		         "still not imported the compile path (--worker-start-timeout); killing it",
		         wproc_pid(s->p), COMPILER_LANE_NAMES[s->lane],
		         (unsigned long long)s->current->id, c->start_timeout);
		snprintf(why, sizeof why,
		         "the compile worker did not finish starting (importing the compile path) "
		         "within --worker-start-timeout=%.0f s; it was restarted",
		         c->start_timeout);
		pool_kill_slot(s);
		pool_fail_current(s, PROTO_E_WORKER_CRASHED, PROTO_ERR_TRANSIENT, why);
		return;
	}
	log_warn("compile worker (%s): job %llu exceeded %.0f s; killing the worker",
	         COMPILER_LANE_NAMES[s->lane], (unsigned long long)s->current->id, c->timeout);
	pool_kill_slot(s);
	pool_fail_current(s, PROTO_E_COMPILE_TIMEOUT, PROTO_ERR_TRANSIENT,
	                  "the compile exceeded its timeout; the worker was restarted");
}

void pool_arm(struct slot *s, uint64_t ms)
{
	s->left_ms = ms;
	if (s->paused)
		uv_timer_stop(&s->timer);
	else
		uv_timer_start(&s->timer, on_timeout, ms, 0);
}

void pool_disarm(struct slot *s)
{
	s->left_ms = 0;
	uv_timer_stop(&s->timer);
}

uint64_t pool_start_ms(const struct compiler *c)
{
	return (uint64_t)(c->start_timeout * 1000);
}

uint64_t pool_compile_ms(const struct compiler *c)
{
	return (uint64_t)(c->timeout * 1000);
}

void pool_release(struct compiler *c)
{
	if (--c->open_handles == 0 && c->stopping) {
		free(c->wopts.env);
		free(c);
	}
}

static void slot_timer_closed(uv_handle_t *h)
{
	struct slot *s = h->data;
	pool_release(s->c);
}

static void pool_timer_closed(uv_handle_t *h)
{
	pool_release(h->data);
}

/* A worker process's handles all closed (wproc's data is its slot). */
static void worker_closed(void *data)
{
	struct slot *s = data;

	pool_release(s->c);
}

/* ---- exits, restarts, orphans ------------------------------------------- */

static void on_reap(uv_timer_t *t)
{
	struct compiler *c = t->data;
	size_t k = 0;

	for (size_t i = 0; i < c->n_orphans; i++)
		if (!proctree_reap(c->orphans[i]))
			c->orphans[k++] = c->orphans[i];
	c->n_orphans = k;
	if (k == 0)
		uv_timer_stop(t);
}

/* Kills what dead workers left behind (re-parented to us), then reaps it. */
static void kill_orphans(struct compiler *c)
{
	pid_t found[REAP_MAX];
	size_t n = proctree_adopted(c->live, c->n_live, found, REAP_MAX);

	for (size_t i = 0; i < n; i++) {
		c->orphans_killed += 1 + proctree_kill(found[i]);
		if (c->n_orphans < REAP_MAX)
			c->orphans[c->n_orphans++] = found[i];
	}
	if (n > 0) {
		log_warn("compile worker: killed %zu leftover process(es) it had started", n);
		if (!c->stopping) /* at shutdown the reaper is closing; init reaps them */
			uv_timer_start(&c->reaper, on_reap, REAP_POLL_MS, REAP_POLL_MS);
	}
}

static void forget_pid(struct compiler *c, pid_t pid)
{
	for (size_t i = 0; i < c->n_live; i++)
		if (c->live[i] == pid) {
			c->live[i] = c->live[--c->n_live];
			return;
		}
}

static void on_restart(uv_timer_t *t)
{
	struct compiler *c = t->data;

	PRIMARY(c)->tenant = 0; /* the first worker comes back trusted */
	if (!c->stopping && PRIMARY(c)->p == NULL)
		pool_spawn(PRIMARY(c));
}

/* The first worker again: at once after one that had said hello, else backoff. */
static void schedule_restart(struct compiler *c)
{
	uint64_t ms = 0;

	if (c->start_failures > 0) {
		unsigned shift = c->start_failures - 1 < 7 ? c->start_failures - 1 : 7;
		ms = (uint64_t)BACKOFF_FIRST_MS << shift;
		if (ms > BACKOFF_MAX_MS)
			ms = BACKOFF_MAX_MS;
		log_warn("compile worker: %u start failure(s) in a row; next try in %.2f s",
		         c->start_failures, (double)ms / 1000);
	}
	uv_timer_start(&c->restart, on_restart, ms, 0);
}

/* A worker died before its hello: the first start's error, or backoff. */
static void start_failed(struct compiler *c, struct slot *s)
{
	struct proto_err err;

	c->start_failures++;
	if (c->ready) {
		compiler_ready_cb ready = c->ready;
		c->ready = NULL;
		proto_fail(&err, PROTO_E_INTERNAL, NULL,
		           "the compile worker (%s %s) %s before it was ready; is torch installed "
		           "in that interpreter?",
		           c->python, c->script, c->last_exit);
		ready(c, &err);
		return;
	}
	pool_start_failure_err(c, &err);
	pool_fail_current(s, err.code, err.flags, err.message);
	if (!compiler_alive(c))
		pool_fail_queues(c, &err);
}

static void on_exited(struct wproc *p, const char *how)
{
	struct slot *s = wproc_data(p);
	struct compiler *c = s->c;
	bool live = s->p == p, retired = s->retired == wproc_pid(p), starting = c->ready != NULL;

	if (live && !s->hello && wproc_killed(p)) /* on_timeout: no hello in time */
		snprintf(c->last_exit, sizeof c->last_exit,
		         "was killed after --worker-start-timeout=%.0f s without a hello",
		         c->start_timeout);
	else
		snprintf(c->last_exit, sizeof c->last_exit, "%s", how);
	forget_pid(c, wproc_pid(p));
	if (c->stopping || retired)
		log_info("compile worker %d stopped", wproc_pid(p));
	else
		log_warn("compile worker %d %s%s", wproc_pid(p), how,
		         wproc_killed(p) ? " (killed)" : "");
	if (live) {
		bool said_hello = s->hello;
		s->p = NULL;
		s->hello = s->paused = s->ready = false;
		pool_disarm(s);
		if (!said_hello)
			start_failed(c, s);
		else
			pool_fail_current(
			    s, PROTO_E_WORKER_CRASHED, PROTO_ERR_TRANSIENT | PROTO_ERR_JOB_CRASH,
			    "the compile worker died during the compile; it was restarted");
	}
	kill_orphans(c);
	if (c->stopping || starting)
		return; /* at start, the owner hears of it (ready) and decides */
	if (!retired)
		c->restarts++;
	if (s == PRIMARY(c) && s->p == NULL)
		schedule_restart(c);
	else
		c->hooks.pump(c);
}

/* ---- starting, idling, stopping ------------------------------------------ */

/* the upper layer's handlers (compiler.c), reached through c->hooks */
static void on_reply(struct wproc *p, const struct msg *m)
{
	struct slot *s = wproc_data(p);
	s->c->hooks.reply(p, m);
}

static void on_broken(struct wproc *p, const char *why)
{
	struct slot *s = wproc_data(p);
	s->c->hooks.broken(p, why);
}

static const struct wproc_ops WPROC_OPS = {on_reply, on_broken, on_exited, worker_closed};

void pool_spawn(struct slot *s)
{
	struct compiler *c = s->c;
	struct wproc_opts o = c->wopts;
	struct pool_tenant tenant;
	struct proto_err err;
	char scratch[1024];
	int rc;

	o.nice = s->lane == LANE_BACKGROUND ? BACKGROUND_NICE : 0;
	s->hello = s->paused = s->ready = false;
	o.scratch = scratch;
	if (pool_tenant_opts(c, s->tenant, &o, &tenant) != 0) {
		log_error("compile worker: cannot create the directory of tenant %u (%s): %s",
		          s->tenant, tenant.dir, strerror(errno));
		s->p = NULL;
		rc = UV_EIO;
	} else if (sandbox_scratch_create(c->scratch_root, ++c->scratches, scratch,
	                                  sizeof scratch) != 0) {
		log_error("compile worker: cannot create its scratch directory %s: %s", scratch,
		          strerror(errno));
		s->p = NULL;
		rc = UV_EIO;
	} else {
		s->p = wproc_spawn(c->loop, &o, &WPROC_OPS, s, &rc);
	}
	if (s->p != NULL) {
		struct writer *w = wproc_begin();
		c->open_handles++; /* released by worker_closed */
		if (c->n_live < LIVE_MAX)
			c->live[c->n_live++] = wproc_pid(s->p);
		if (w)
			msg_begin_request(w, 0, "hello", 0);
		if (w == NULL || wproc_send(s->p, w) != 0)
			log_warn("compile worker: cannot send hello");
		pool_arm(s, pool_start_ms(c)); /* until its hello */
		log_info("compile worker started (pid %d, %s lane, tenant %u)", wproc_pid(s->p),
		         COMPILER_LANE_NAMES[s->lane], s->tenant);
		return;
	}
	log_error("cannot start the compile worker %s: %s", c->python, uv_strerror(rc));
	snprintf(c->last_exit, sizeof c->last_exit, "could not be spawned: %s", uv_strerror(rc));
	if (c->ready) {
		compiler_ready_cb ready = c->ready;
		c->ready = NULL;
		proto_fail(&err, PROTO_E_INTERNAL, NULL, "cannot start the compile worker %s: %s",
		           c->python, uv_strerror(rc));
		ready(c, &err);
		return;
	}
	c->start_failures++;
	pool_start_failure_err(c, &err);
	if (!compiler_alive(c))
		pool_fail_queues(c, &err);
	if (s == PRIMARY(c))
		schedule_restart(c);
}

/* Retires workers idle for COMPILER_IDLE_S (each is ~1 GB); the first one only when it runs a
 * tenant's jobs, and it comes back trusted. */
static void on_idle(uv_timer_t *t)
{
	struct compiler *c = t->data;
	uint64_t now = uv_now(c->loop);

	for (int k = 0; k < COMPILER_LANES; k++)
		for (unsigned i = 0; i < c->lanes[k].max; i++) {
			struct slot *s = &c->lanes[k].slots[i];
			if ((s == PRIMARY(c) && s->tenant == 0) || s->p == NULL || !s->hello ||
			    s->current || now - s->idle_since < COMPILER_IDLE_S * 1000ULL)
				continue;
			log_info("compile worker %d (%s lane): idle for %d s, retired",
			         wproc_pid(s->p), COMPILER_LANE_NAMES[k], COMPILER_IDLE_S);
			pool_retire(s);
			if (s == PRIMARY(c)) { /* the first one is always there, trusted */
				s->tenant = 0;
				pool_spawn(s);
			}
		}
}

static void init_timer(struct compiler *c, uv_timer_t *t, void *data)
{
	uv_timer_init(c->loop, t);
	t->data = data;
	c->open_handles++;
}

int pool_init(struct compiler *c, const struct compiler_opts *opts)
{
	unsigned max[COMPILER_LANES] = {1, opts->foreground_workers, 1};

	if (pool_sandbox_init(c, opts) != 0)
		return -1;
	c->wopts.env = wproc_env(opts->env_extra);
	if (c->wopts.env == NULL)
		return -1;
	if (proctree_become_subreaper() != 0)
		log_warn("prctl(PR_SET_CHILD_SUBREAPER) failed: processes a killed worker leaves "
		         "behind may survive it");
	snprintf(c->python, sizeof c->python, "%s", opts->python);
	snprintf(c->script, sizeof c->script, "%s", opts->script);
	c->wopts.python = c->python;
	c->wopts.script = c->script;
	if (max[LANE_FOREGROUND] == 0)
		max[LANE_FOREGROUND] = compiler_default_workers();
	if (max[LANE_FOREGROUND] > LANE_SLOTS)
		max[LANE_FOREGROUND] = LANE_SLOTS;
	for (int k = 0; k < COMPILER_LANES; k++) {
		c->lanes[k].max = max[k];
		for (unsigned i = 0; i < max[k]; i++) {
			struct slot *s = &c->lanes[k].slots[i];
			*s = (struct slot){.c = c, .lane = (unsigned)k, .index = i};
			init_timer(c, &s->timer, s);
		}
	}
	init_timer(c, &c->restart, c);
	init_timer(c, &c->reaper, c);
	init_timer(c, &c->idle, c);
	uv_timer_start(&c->idle, on_idle, IDLE_POLL_MS, IDLE_POLL_MS);
	uv_unref((uv_handle_t *)&c->idle);
	return 0;
}

void compiler_stop(struct compiler *c)
{
	struct proto_err err;

	c->stopping = true;
	c->ready = NULL;
	proto_fail(&err, PROTO_E_SHUTTING_DOWN, NULL, "the daemon is stopping");
	err.flags = PROTO_ERR_TRANSIENT;
	for (int k = 0; k < COMPILER_LANES; k++)
		for (unsigned i = 0; i < c->lanes[k].max; i++) {
			struct slot *s = &c->lanes[k].slots[i];
			if (s->current) {
				struct compile_job *j = s->current;
				s->current = NULL;
				j->done(j, NULL, &err);
			}
			uv_timer_stop(&s->timer);
			uv_close((uv_handle_t *)&s->timer, slot_timer_closed);
			pool_kill_slot(s); /* the exit callback closes the rest */
		}
	pool_fail_queues(c, &err);
	uv_timer_stop(&c->restart);
	uv_timer_stop(&c->idle);
	uv_close((uv_handle_t *)&c->restart, pool_timer_closed);
	uv_close((uv_handle_t *)&c->reaper, pool_timer_closed);
	uv_close((uv_handle_t *)&c->idle, pool_timer_closed);
}

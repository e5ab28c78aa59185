/*
 * compiler.c - see compiler.h.  The lanes, their queues and worker slots,
 * and the pool-wide timers: restart (backoff) of the first worker, orphan
 * reaping, idle retirement.  The struct is freed once compiler_stop has run
 * and every timer and worker process has closed.
 *
 * A worker is "detached" (its slot no longer points at it) the moment it is
 * killed for a timeout, a broken frame, a recycle or retirement: nothing is
 * sent to it any more, its replies are dropped, and only its exit callback
 * still runs.  This is what keeps a queued job from going to a worker that
 * is being killed (and its timer from killing the fresh one).
 */
#include "compiler.h"

#include "log.h"
#include "msg.h"
#include "proctree.h"
#include "shapes.h"
#include "wproc.h"
#include "writer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BACKOFF_FIRST_MS 250
#define BACKOFF_MAX_MS   30000
#define REAP_POLL_MS     100
#define REAP_MAX         64
#define IDLE_POLL_MS     5000
#define LANE_SLOTS       16
#define LIVE_MAX         64
#define BACKGROUND_NICE  10

const char *const COMPILE_PHASE_NAMES[COMPILE_PHASES] = {"setup", "eager", "export", "inductor",
                                                         "parity"};
const char *const COMPILER_LANE_NAMES[COMPILER_LANES] = {"check", "foreground", "background"};

struct compiler;

struct slot {
	struct compiler *c;
	unsigned lane, index;
	struct wproc *p; /* its live worker, or NULL */
	bool hello, paused;
	struct compile_job *current;
	uv_timer_t timer;      /* the job's timeout */
	uint64_t left_ms;      /* of the timeout, while paused */
	uint64_t idle_since;   /* loop time of its last job's end */
	pid_t retired;         /* a worker retired for idleness: its exit is no restart */
};

struct lane {
	struct compile_job *head, *tail;
	unsigned max;
	uint64_t jobs, preempted;
	struct slot slots[LANE_SLOTS];
};

struct compiler {
	uv_loop_t *loop;
	struct lane lanes[COMPILER_LANES];
	uv_timer_t restart, reaper, idle;
	struct wproc_opts wopts;
	char python[1024], script[1024];
	double timeout;
	compiler_ready_cb ready;
	void *data;
	struct worker_info info;
	bool stopping;
	int open_handles;
	uint64_t next_id, restarts, orphans_killed, recycled;
	unsigned start_failures; /* workers in a row that died before their hello */
	char last_exit[160];     /* how the last of them ended, for error messages */
	pid_t orphans[REAP_MAX], live[LIVE_MAX];
	size_t n_orphans, n_live;
};

static void pump(struct compiler *c);
static void spawn(struct slot *s);

#define PRIMARY(c) (&(c)->lanes[LANE_FOREGROUND].slots[0])

/* ---- accessors ----------------------------------------------------------- */

void *compiler_data(const struct compiler *c)
{
	return c->data;
}
const struct worker_info *compiler_info(const struct compiler *c)
{
	return &c->info;
}
bool compiler_alive(const struct compiler *c)
{
	return PRIMARY(c)->p != NULL && PRIMARY(c)->hello;
}
uint64_t compiler_restarts(const struct compiler *c)
{
	return c->restarts;
}
pid_t compiler_pid(const struct compiler *c)
{
	return PRIMARY(c)->p ? wproc_pid(PRIMARY(c)->p) : 0;
}
unsigned compiler_start_failures(const struct compiler *c)
{
	return c->start_failures;
}
uint64_t compiler_orphans_killed(const struct compiler *c)
{
	return c->orphans_killed;
}
uint64_t compiler_recycled(const struct compiler *c)
{
	return c->recycled;
}

const char *compiler_state(const struct compiler *c)
{
	if (compiler_alive(c))
		return "ok";
	return c->start_failures > 0 ? "backoff" : "starting";
}

void compiler_lane_stats(const struct compiler *c, enum compiler_lane lane, struct lane_stats *out)
{
	const struct lane *l = &c->lanes[lane];

	memset(out, 0, sizeof *out);
	out->max = l->max;
	out->jobs = l->jobs;
	out->preempted = l->preempted;
	for (const struct compile_job *j = l->head; j; j = j->next)
		out->queued++;
	for (unsigned i = 0; i < l->max; i++) {
		out->workers += l->slots[i].p != NULL;
		out->busy += l->slots[i].current != NULL;
		out->paused |= l->slots[i].paused;
	}
}

unsigned compiler_queue_length(const struct compiler *c)
{
	unsigned n = 0;
	struct lane_stats st;

	for (int k = 0; k < COMPILER_LANES; k++) {
		compiler_lane_stats(c, (enum compiler_lane)k, &st);
		n += st.queued + st.busy;
	}
	return n;
}

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

/* ---- finishing jobs ------------------------------------------------------ */

static void fail_current(struct slot *s, enum proto_code code, unsigned flags, const char *why)
{
	struct compile_job *job = s->current;
	struct proto_err err;

	if (job == NULL)
		return;
	s->current = NULL;
	s->c->lanes[job->lane].jobs++;
	uv_timer_stop(&s->timer);
	proto_fail(&err, code, NULL, "%s", why);
	err.flags = flags;
	job->done(job, NULL, &err);
}

/* Fails every queued job of every lane (not those in flight) with err. */
static void fail_queues(struct compiler *c, const struct proto_err *err)
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
static void start_failure_err(const struct compiler *c, struct proto_err *err)
{
	proto_fail(err, PROTO_E_WORKER_CRASHED, NULL,
	           "the compile worker cannot start (%u tries in a row; the last %s); the "
	           "daemon keeps retrying with backoff",
	           c->start_failures, c->last_exit);
	err->flags = PROTO_ERR_TRANSIENT;
}

static void compiler_release(struct compiler *c)
{
	if (--c->open_handles == 0 && c->stopping) {
		free(c->wopts.env);
		free(c);
	}
}

static void handle_closed(uv_handle_t *h)
{
	struct slot *s = h->data;
	compiler_release(s->c);
}

static void pool_timer_closed(uv_handle_t *h)
{
	compiler_release(h->data);
}

static void worker_closed(void *data)
{
	compiler_release(data);
}

/* ---- sending ------------------------------------------------------------- */

static int send_job(struct slot *s, struct compile_job *j)
{
	struct writer *w = wproc_begin();

	if (w == NULL)
		return -1;
	if (j->check_only) {
		msg_begin_request(w, j->id, "check", 3);
		writer_key_str(w, j->graph ? "body_graph" : "body_source", j->body_source);
		writer_key_str(w, "body_file", j->body_file);
		writer_key_str(w, "entry", j->entry);
		return wproc_send(s->p, w);
	}
	msg_begin_request(w, j->id, "compile", j->sample ? 13 : 12);
	writer_key_str(w, j->graph ? "body_graph" : "body_source", j->body_source);
	writer_key_str(w, "body_file", j->body_file);
	writer_key_str(w, "entry", j->entry);
	writer_key_str(w, "strategy", j->strategy);
	writer_key_str(w, "kind", j->kind);
	writer_key_str(w, "dtype", proto_dtype_name(j->dtype));
	writer_key_i64(w, "steps", j->steps);
	writer_key_i64(w, "max_batch", j->max_batch);
	writer_key_str(w, "output", j->output);
	writer_key_str(w, "lane", COMPILER_LANE_NAMES[s->lane]);
	writer_str(w, "carry");
	shapes_write(w, j->carry);
	writer_str(w, "inputs");
	shapes_write(w, j->inputs);
	if (j->sample) {
		writer_str(w, "sample");
		writer_raw(w, j->sample, j->sample_len); /* copied: the job may end first */
	}
	return wproc_send(s->p, w);
}

/* ---- killing, pausing ---------------------------------------------------- */

/* Kills the slot's worker's whole tree and detaches it: nothing more goes to it. */
static void kill_slot(struct slot *s)
{
	struct wproc *p = s->p;
	size_t extra;

	if (p == NULL)
		return;
	s->p = NULL;
	s->hello = s->paused = false;
	extra = wproc_kill(p);
	s->c->orphans_killed += extra;
	if (extra)
		log_warn("compile worker %d: killed %zu descendant process(es) with it",
		         wproc_pid(p), extra);
}

static void on_timeout(uv_timer_t *t)
{
	struct slot *s = t->data;

	log_warn("compile worker (%s): job %llu exceeded %.0f s; killing the worker",
	         COMPILER_LANE_NAMES[s->lane],
	         (unsigned long long)(s->current ? s->current->id : 0), s->c->timeout);
	kill_slot(s);
	fail_current(s, PROTO_E_COMPILE_TIMEOUT, PROTO_ERR_TRANSIENT,
	             "the compile exceeded its timeout; the worker was restarted");
}

static void start_timer(struct slot *s, uint64_t ms)
{
	uv_timer_start(&s->timer, on_timeout, ms, 0);
}

/*
 * The background lane runs only while no check or foreground job does: it
 * is stopped (its tree SIGSTOPped, its job's timeout frozen) and continued.
 */
static void preempt(struct compiler *c)
{
	bool waited_for = false;
	struct lane *bg = &c->lanes[LANE_BACKGROUND];

	for (int k = LANE_CHECK; k <= LANE_FOREGROUND; k++)
		for (unsigned i = 0; i < c->lanes[k].max; i++)
			waited_for |= c->lanes[k].slots[i].current != NULL;
	for (unsigned i = 0; i < bg->max; i++) {
		struct slot *s = &bg->slots[i];
		if (s->p == NULL || s->paused == waited_for)
			continue;
		s->paused = waited_for;
		wproc_pause(s->p, waited_for);
		if (waited_for) {
			bg->preempted++;
			s->left_ms = s->current ? uv_timer_get_due_in(&s->timer) : 0;
			uv_timer_stop(&s->timer);
		} else if (s->current) {
			start_timer(s, s->left_ms);
		}
	}
}

/* ---- dispatch ------------------------------------------------------------ */

static struct slot *idle_slot(struct lane *l)
{
	for (unsigned i = 0; i < l->max; i++)
		if (l->slots[i].p && l->slots[i].hello && l->slots[i].current == NULL)
			return &l->slots[i];
	return NULL;
}

/* Starts one more worker in l when its queue has more jobs than workers coming. */
static void grow(struct compiler *c, struct lane *l)
{
	unsigned starting = 0, queued = 0;
	struct slot *free_slot = NULL;

	if (c->stopping || c->start_failures > 0)
		return; /* backoff: only the restart timer starts a worker */
	for (const struct compile_job *j = l->head; j; j = j->next)
		queued++;
	for (unsigned i = 0; i < l->max; i++) {
		starting += l->slots[i].p && !l->slots[i].hello;
		if (l->slots[i].p == NULL && free_slot == NULL)
			free_slot = &l->slots[i];
	}
	if (free_slot && queued > starting)
		spawn(free_slot);
}

static void dispatch(struct slot *s, struct compile_job *j)
{
	s->current = j;
	if (send_job(s, j) != 0) {
		fail_current(s, PROTO_E_INTERNAL, PROTO_ERR_TRANSIENT,
		             "cannot send the job to the compile worker");
		return;
	}
	start_timer(s, (uint64_t)(s->c->timeout * 1000));
}

static void pump(struct compiler *c)
{
	for (int k = 0; k < COMPILER_LANES && !c->stopping; k++) {
		struct lane *l = &c->lanes[k];
		while (l->head) {
			struct slot *s = idle_slot(l);
			struct compile_job *j = l->head;
			if (s == NULL && k == LANE_CHECK) /* an idle compile worker checks too */
				s = idle_slot(&c->lanes[LANE_FOREGROUND]);
			if (s == NULL) {
				grow(c, l);
				break;
			}
			l->head = j->next;
			if (l->head == NULL)
				l->tail = NULL;
			dispatch(s, j);
		}
	}
	preempt(c);
}

void compiler_submit(struct compiler *c, struct compile_job *job)
{
	struct proto_err err;
	struct lane *l;

	if (c->stopping) {
		proto_fail(&err, PROTO_E_SHUTTING_DOWN, NULL, "the daemon is stopping");
		err.flags = PROTO_ERR_TRANSIENT;
		job->done(job, NULL, &err);
		return;
	}
	if (c->start_failures > 0 && !compiler_alive(c)) {
		start_failure_err(c, &err);
		job->done(job, NULL, &err);
		return;
	}
	job->id = ++c->next_id;
	job->next = NULL;
	job->lane = job->check_only ? LANE_CHECK : job->background ? LANE_BACKGROUND : LANE_FOREGROUND;
	l = &c->lanes[job->lane];
	if (l->tail)
		l->tail->next = job;
	else
		l->head = job;
	l->tail = job;
	pump(c);
}

/* ---- replies ------------------------------------------------------------- */

static void read_hello(struct slot *s, const struct msg *m)
{
	struct compiler *c = s->c;
	const msgpack_object *r = msg_field(m, "result");
	struct worker_info *wi = &c->info;
	const char *str;
	uint32_t n;
	bool ok = false;
	struct proto_err err;

	if (msg_get_str(r, "torch", &str, &n, NULL) == 0)
		snprintf(wi->torch, sizeof wi->torch, "%.*s", (int)n, str);
	if (msg_get_str(r, "torch_git", &str, &n, NULL) == 0)
		snprintf(wi->torch_git, sizeof wi->torch_git, "%.*s", (int)n, str);
	if (msg_get_str(r, "isa", &str, &n, NULL) == 0)
		snprintf(wi->isa, sizeof wi->isa, "%.*s", (int)n, str);
	msg_get_bool(r, "cxx11_abi", &wi->cxx11_abi, NULL);
	msg_get_bool(r, "torch_ok", &ok, NULL);
	wi->torch_ok = ok;
	s->hello = true;
	s->idle_since = uv_now(c->loop);
	c->start_failures = 0;
	if (c->ready) {
		compiler_ready_cb ready = c->ready;
		c->ready = NULL;
		proto_fail(&err, PROTO_E_INTERNAL, NULL,
		           "Compiled loops require Torch >= 2.14 (found %s)", wi->torch);
		ready(c, ok ? NULL : &err);
	}
}

static int read_result(const struct msg *m, struct compile_result *res, struct proto_err *err)
{
	const msgpack_object *r = msg_field(m, "result"), *y = msg_obj_field(r, "y");
	const msgpack_object *cs = msg_obj_field(r, "compile_seconds");
	const msgpack_object *ph = msg_obj_field(r, "phases");
	const char *s;
	uint32_t n;
	int64_t v;
	msgpack_sbuffer sb;
	msgpack_packer pk;

	memset(res, 0, sizeof *res);
	if (y == NULL || msg_get_str(r, "so", &s, &n, NULL) != 0 || n >= sizeof res->so_path)
		return proto_fail(err, PROTO_E_COMPILE_FAILED, NULL, "malformed worker reply");
	memcpy(res->so_path, s, n);
	if (msg_get_i64(r, "n_inputs", &v, NULL) == 0)
		res->n_inputs = (uint32_t)v;
	if (msg_get_i64(r, "n_outputs", &v, NULL) == 0)
		res->n_outputs = (uint32_t)v;
	if (cs && cs->type == MSGPACK_OBJECT_FLOAT64)
		res->compile_seconds = cs->via.f64;
	for (int i = 0; ph && ph->type == MSGPACK_OBJECT_MAP && i < COMPILE_PHASES; i++) {
		const msgpack_object *p = msg_obj_field(ph, COMPILE_PHASE_NAMES[i]);
		if (p && p->type == MSGPACK_OBJECT_FLOAT64)
			res->phases[i] = p->via.f64;
	}
	if (msg_get_str(r, "lowered", &s, &n, NULL) == 0 && n < sizeof res->lowered)
		memcpy(res->lowered, s, n);
	if (msg_get_str(r, "note", &s, &n, NULL) == 0)
		snprintf(res->note, sizeof res->note, "%.*s", (int)n, s);
	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	msgpack_pack_object(&pk, *y);
	res->y_spec = (uint8_t *)sb.data;
	res->y_spec_len = sb.size;
	return 0;
}

/*
 * A worker that has loaded many artifacts (its parity checks dlopen them, and
 * they can never be unloaded) asks to be replaced: it is idle now, so it is
 * detached and killed like a timed-out one, and the next job starts a fresh
 * worker.  Not a crash: no backoff, no job fails.
 */
static void recycle(struct slot *s, const struct msg *m)
{
	bool yes = false;

	if (msg_get_bool(&m->up.data, "recycle", &yes, NULL) != 0 || !yes)
		return;
	log_info("compile worker %d: replaced after %s", wproc_pid(s->p),
	         "loading its share of artifacts (they cannot be unloaded)");
	s->c->recycled++;
	kill_slot(s);
}

static void finish(struct slot *s, struct compile_job *job, const struct msg *m)
{
	struct proto_err err;
	struct compile_result res;

	memset(&res, 0, sizeof res);
	if (m->is_error) {
		msg_reply_error(m, &err);
		job->done(job, NULL, &err);
	} else if (job->check_only) {
		job->done(job, &res, NULL);
	} else if (read_result(m, &res, &err) != 0) {
		job->done(job, NULL, &err);
	} else {
		job->done(job, &res, NULL);
		free(res.y_spec);
	}
	(void)s;
}

static void on_reply(struct wproc *p, const struct msg *m)
{
	struct slot *s = wproc_data(p);
	struct compile_job *job = s->current;

	if (s->p != p)
		return; /* detached */
	if (!s->hello) {
		read_hello(s, m);
	} else if (job == NULL || !m->has_id || m->id != job->id) {
		log_warn("compile worker: reply for an unknown job");
		return;
	} else {
		s->current = NULL;
		s->idle_since = uv_now(s->c->loop);
		s->c->lanes[job->lane].jobs++;
		uv_timer_stop(&s->timer);
		finish(s, job, m);
		if (s->p == p)
			recycle(s, m);
	}
	pump(s->c);
}

static void on_broken(struct wproc *p, const char *why)
{
	struct slot *s = wproc_data(p);

	(void)why;
	if (s->p != p)
		return;
	kill_slot(s);
	fail_current(s, PROTO_E_WORKER_CRASHED, PROTO_ERR_TRANSIENT | PROTO_ERR_JOB_CRASH,
	             "the compile worker broke the framing; it was restarted");
	pump(s->c);
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

	if (!c->stopping && PRIMARY(c)->p == NULL)
		spawn(PRIMARY(c));
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
	start_failure_err(c, &err);
	fail_current(s, err.code, err.flags, err.message);
	if (!compiler_alive(c))
		fail_queues(c, &err);
}

static void on_exited(struct wproc *p, const char *how)
{
	struct slot *s = wproc_data(p);
	struct compiler *c = s->c;
	bool live = s->p == p, retired = s->retired == wproc_pid(p), starting = c->ready != NULL;

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
		s->hello = s->paused = false;
		if (!said_hello)
			start_failed(c, s);
		else
			fail_current(s, PROTO_E_WORKER_CRASHED,
			             PROTO_ERR_TRANSIENT | PROTO_ERR_JOB_CRASH,
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
		pump(c);
}

/* ---- starting, idling, stopping ------------------------------------------ */

static const struct wproc_ops WPROC_OPS = {on_reply, on_broken, on_exited, worker_closed};

static void spawn(struct slot *s)
{
	struct compiler *c = s->c;
	struct wproc_opts o = c->wopts;
	struct proto_err err;
	int rc;

	o.nice = s->lane == LANE_BACKGROUND ? BACKGROUND_NICE : 0;
	s->hello = s->paused = false;
	s->p = wproc_spawn(c->loop, &o, &WPROC_OPS, s, &rc);
	if (s->p != NULL) {
		struct writer *w = wproc_begin();
		c->open_handles++; /* released by worker_closed */
		if (c->n_live < LIVE_MAX)
			c->live[c->n_live++] = wproc_pid(s->p);
		if (w)
			msg_begin_request(w, 0, "hello", 0);
		if (w == NULL || wproc_send(s->p, w) != 0)
			log_warn("compile worker: cannot send hello");
		log_info("compile worker started (pid %d, %s lane)", wproc_pid(s->p),
		         COMPILER_LANE_NAMES[s->lane]);
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
	start_failure_err(c, &err);
	if (!compiler_alive(c))
		fail_queues(c, &err);
	if (s == PRIMARY(c))
		schedule_restart(c);
}

/* Retires workers (not the first) idle for COMPILER_IDLE_S: each is ~1 GB. */
static void on_idle(uv_timer_t *t)
{
	struct compiler *c = t->data;
	uint64_t now = uv_now(c->loop);

	for (int k = 0; k < COMPILER_LANES; k++)
		for (unsigned i = 0; i < c->lanes[k].max; i++) {
			struct slot *s = &c->lanes[k].slots[i];
			if (s == PRIMARY(c) || s->p == NULL || !s->hello || s->current ||
			    now - s->idle_since < COMPILER_IDLE_S * 1000ULL)
				continue;
			log_info("compile worker %d (%s lane): idle for %d s, retired",
			         wproc_pid(s->p), COMPILER_LANE_NAMES[k], COMPILER_IDLE_S);
			s->retired = wproc_pid(s->p);
			kill_slot(s);
		}
}

static void init_timer(struct compiler *c, uv_timer_t *t, void *data)
{
	uv_timer_init(c->loop, t);
	t->data = data;
	c->open_handles++;
}

struct compiler *compiler_start(uv_loop_t *loop, const struct compiler_opts *opts,
                                compiler_ready_cb ready, void *data)
{
	struct compiler *c = calloc(1, sizeof *c);
	unsigned max[COMPILER_LANES] = {1, opts->foreground_workers, 1};

	if (c == NULL)
		return NULL;
	c->loop = loop;
	c->timeout = opts->timeout_seconds;
	c->ready = ready;
	c->data = data;
	c->wopts.env = wproc_env(opts->env_extra);
	if (c->wopts.env == NULL) {
		free(c);
		return NULL;
	}
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
	spawn(PRIMARY(c));
	return c;
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
			uv_close((uv_handle_t *)&s->timer, handle_closed);
			kill_slot(s); /* the exit callback closes the rest */
		}
	fail_queues(c, &err);
	uv_timer_stop(&c->restart);
	uv_timer_stop(&c->idle);
	uv_close((uv_handle_t *)&c->restart, pool_timer_closed);
	uv_close((uv_handle_t *)&c->reaper, pool_timer_closed);
	uv_close((uv_handle_t *)&c->idle, pool_timer_closed);
}

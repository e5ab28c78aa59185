/*
 * compiler.c - see compiler.h.  The lanes: their queues, dispatch to the
 * workers' slots, the background lane's pauses, job timeouts and the
 * workers' replies.  Starting and stopping workers: compiler_workers.c.
 *
 * A worker is "detached" (its slot no longer points at it) the moment it is
 * killed for a timeout, a broken frame, a recycle or retirement: nothing is
 * sent to it any more, its replies are dropped, and only its exit callback
 * still runs.  This is what keeps a queued job from going to a worker that
 * is being killed (and its timer from killing the fresh one).
 */
#include "compiler_pool.h"

#include "log.h"
#include "msg.h"
#include "proctree.h"
#include "shapes.h"
#include "writer.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void pump(struct compiler *c);

const char *const COMPILE_PHASE_NAMES[COMPILE_PHASES] = {"setup", "eager", "export", "inductor",
                                                         "parity"};

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
	msg_begin_request(w, j->id, "compile", 12 + (j->sample != NULL) + (j->wrt != NULL));
	writer_key_str(w, j->graph ? "body_graph" : "body_source", j->body_source);
	writer_key_str(w, "body_file", j->body_file);
	writer_key_str(w, "entry", j->entry);
	writer_key_str(w, "strategy", j->strategy);
	writer_key_str(w, "kind", j->kind);
	writer_key_str(w, "dtype", proto_dtype_name(j->dtype));
	writer_key_i64(w, "steps", j->steps);
	writer_key_i64(w, "max_batch", j->max_batch);
	writer_key_str(w, "output", j->staged);
	writer_key_str(w, "lane", COMPILER_LANE_NAMES[s->lane]);
	if (j->wrt)
		writer_key_str(w, "wrt", j->wrt);
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

/* ---- pausing ------------------------------------------------------------ */

/*
 * The background lane runs only while no check or foreground job does: it
 * is stopped (its tree SIGSTOPped, its timeout frozen: a job's, or the
 * start timeout of a worker not yet started) and continued.
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
		bool stop = waited_for && !s->promoted;
		if (s->p == NULL || s->paused == stop)
			continue;
		s->paused = stop;
		wproc_pause(s->p, stop);
		if (stop) {
			bg->preempted++;
			s->left_ms = uv_is_active((uv_handle_t *)&s->timer)
			                 ? uv_timer_get_due_in(&s->timer)
			                 : s->left_ms;
			uv_timer_stop(&s->timer);
		} else if (!s->hello || s->current) {
			pool_arm(s, s->left_ms);
		}
	}
}

/* ---- dispatch ------------------------------------------------------------ */

static struct slot *idle_slot(struct lane *l, uint32_t tenant)
{
	for (unsigned i = 0; i < l->max; i++)
		if (l->slots[i].p && l->slots[i].hello && l->slots[i].current == NULL &&
		    l->slots[i].tenant == tenant)
			return &l->slots[i];
	return NULL;
}

/*
 * Starts one more worker in l for tenant when its queue has more of that
 * tenant's jobs than workers of it are starting: in a free slot, else in
 * place of an idle worker of another tenant.
 */
static void grow(struct compiler *c, struct lane *l, uint32_t tenant)
{
	unsigned starting = 0, queued = 0;
	struct slot *free_slot = NULL, *other = NULL;

	if (c->stopping || c->start_failures > 0)
		return; /* backoff: only the restart timer starts a worker */
	for (const struct compile_job *j = l->head; j; j = j->next)
		queued += j->tenant == tenant;
	for (unsigned i = 0; i < l->max; i++) {
		struct slot *s = &l->slots[i];
		starting += s->p && !s->hello && s->tenant == tenant;
		if (s->p == NULL && free_slot == NULL)
			free_slot = s;
		/* the first worker last: while it restarts, only the others serve */
		if (s->p && s->hello && s->current == NULL && s->tenant != tenant &&
		    (other == NULL || other == PRIMARY(c)))
			other = s;
	}
	if (queued <= starting || (free_slot == NULL && other == NULL))
		return;
	if (free_slot == NULL) {
		log_info("compile worker %d (%s lane, tenant %u): replaced by one for tenant %u",
		         wproc_pid(other->p), COMPILER_LANE_NAMES[other->lane], other->tenant,
		         tenant);
		pool_retire(other);
		free_slot = other;
	}
	free_slot->tenant = tenant;
	pool_spawn(free_slot);
}

/*
 * The job's output goes into the scratch of the worker that runs it (the
 * only place it may write); the reply moves it out (take_artifact).
 */
static void stage(struct slot *s, struct compile_job *j)
{
	const char *scratch = wproc_scratch(s->p), *base = strrchr(j->output, '/');

	if (scratch[0]) {
		if (snprintf(j->staged, sizeof j->staged, "%s/%s", scratch,
		             base ? base + 1 : j->output) >= (int)sizeof j->staged)
			log_warn("compile job %llu: its output path is too long: %s",
			         (unsigned long long)j->id, j->staged);
	} else
		snprintf(j->staged, sizeof j->staged, "%s", j->output);
}

/*
 * The job goes to its worker at once; its compile timeout runs from when the
 * worker is ready (read_event), the start timeout until then.
 */
static void dispatch(struct slot *s, struct compile_job *j)
{
	s->current = j;
	stage(s, j);
	if (send_job(s, j) != 0) {
		pool_fail_current(s, PROTO_E_INTERNAL, PROTO_ERR_TRANSIENT,
		                  "cannot send the job to the compile worker");
		return;
	}
	pool_arm(s, s->ready ? pool_compile_ms(s->c) : pool_start_ms(s->c));
}

/* The first job of lane k that has an idle worker of its tenant (*s), or NULL. */
static struct compile_job *runnable(struct compiler *c, int k, struct slot **s)
{
	for (struct compile_job *j = c->lanes[k].head; j; j = j->next) {
		*s = idle_slot(&c->lanes[k], j->tenant);
		if (*s == NULL && k == LANE_CHECK) /* an idle compile worker checks too */
			*s = idle_slot(&c->lanes[LANE_FOREGROUND], j->tenant);
		if (*s)
			return j;
	}
	return NULL;
}

static void unlink_job(struct lane *l, struct compile_job *j)
{
	struct compile_job **at = &l->head, *prev = NULL;

	while (*at != j) {
		prev = *at;
		at = &(*at)->next;
	}
	*at = j->next;
	if (l->tail == j)
		l->tail = prev;
}

/* Each lane's jobs in order (FIFO per tenant), then a worker for its head's tenant. */
static void pump(struct compiler *c)
{
	for (int k = 0; k < COMPILER_LANES && !c->stopping; k++) {
		struct lane *l = &c->lanes[k];
		struct slot *s;
		struct compile_job *j;
		while (!c->stopping && (j = runnable(c, k, &s)) != NULL) {
			unlink_job(l, j);
			dispatch(s, j);
		}
		if (l->head && !c->stopping)
			grow(c, l, l->head->tenant);
	}
	preempt(c);
}

static void enqueue(struct lane *l, struct compile_job *job)
{
	job->next = NULL;
	if (l->tail)
		l->tail->next = job;
	else
		l->head = job;
	l->tail = job;
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
		pool_start_failure_err(c, &err);
		job->done(job, NULL, &err);
		return;
	}
	job->id = ++c->next_id;
	job->lane = job->check_only   ? LANE_CHECK
	            : job->background ? LANE_BACKGROUND
	                              : LANE_FOREGROUND;
	l = &c->lanes[job->lane];
	enqueue(l, job);
	pump(c);
}

bool compiler_promote(struct compiler *c, const char *key)
{
	struct lane *bg = &c->lanes[LANE_BACKGROUND];
	struct compile_job *prev = NULL;

	for (struct compile_job *j = bg->head; j; prev = j, j = j->next) {
		if (j->key == NULL || strcmp(j->key, key) != 0)
			continue;
		if (prev)
			prev->next = j->next;
		else
			bg->head = j->next;
		if (bg->tail == j)
			bg->tail = prev;
		j->lane = LANE_FOREGROUND;
		enqueue(&c->lanes[LANE_FOREGROUND], j);
		bg->promoted++;
		log_info("compile job %llu is waited for: moved to the foreground lane",
		         (unsigned long long)j->id);
		pump(c);
		return true;
	}
	for (unsigned i = 0; i < bg->max; i++) {
		struct slot *s = &bg->slots[i];
		if (s->current == NULL || s->current->key == NULL ||
		    strcmp(s->current->key, key) != 0)
			continue;
		if (!s->promoted) {
			s->promoted = true;
			bg->promoted++;
			log_info("compile worker %d: its background job is waited for; no longer "
			         "stopped for foreground work",
			         wproc_pid(s->p));
			pump(c);
		}
		return true;
	}
	return false;
}

/* ---- replies ------------------------------------------------------------- */

static void read_hello(struct slot *s, const struct msg *m)
{
	struct compiler *c = s->c;
	const msgpack_object *r = msg_field(m, "result");
	struct worker_info *wi = &c->info;
	const char *str;
	uint32_t n;
	bool ok = false, announces = false;
	struct proto_err err;

	if (msg_get_str(r, "torch", &str, &n, NULL) == 0)
		snprintf(wi->torch, sizeof wi->torch, "%.*s", (int)n, str);
	if (msg_get_str(r, "torch_git", &str, &n, NULL) == 0)
		snprintf(wi->torch_git, sizeof wi->torch_git, "%.*s", (int)n, str);
	if (msg_get_str(r, "isa", &str, &n, NULL) == 0)
		snprintf(wi->isa, sizeof wi->isa, "%.*s", (int)n, str);
	msg_get_bool(r, "cxx11_abi", &wi->cxx11_abi, NULL);
	msg_get_bool(r, "torch_ok", &ok, NULL);
	msg_get_bool(r, "ready_event", &announces, NULL);
	s->ready = !announces; /* else its "ready" event follows (read_event) */
	pool_disarm(s);        /* its start timeout: a job's runs again until it is ready */
	wi->torch_ok = ok;
	wi->protocol = 0;
	msg_get_i64(r, "protocol", &wi->protocol, NULL);
	s->hello = true;
	s->idle_since = uv_now(c->loop);
	c->start_failures = 0;
	if (c->ready) {
		compiler_ready_cb ready = c->ready;
		c->ready = NULL;
		if (wi->protocol != WORKER_PROTOCOL)
			proto_fail(&err, PROTO_E_INTERNAL, NULL,
			           "the compile worker speaks protocol %" PRId64
			           ", this daemon %d (a worker from another build? --worker)",
			           wi->protocol, WORKER_PROTOCOL);
		else
			proto_fail(&err, PROTO_E_INTERNAL, NULL,
			           "Compiled loops require Torch >= 2.14 (found %s)", wi->torch);
		ready(c, ok && wi->protocol == WORKER_PROTOCOL ? NULL : &err);
	} else if (wi->protocol != WORKER_PROTOCOL) {
		log_error("compile worker %d speaks protocol %" PRId64 ", this daemon %d: its "
		          "jobs will fail",
		          wproc_pid(s->p), wi->protocol, WORKER_PROTOCOL);
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
	if (msg_get_i64(r, "step_ops", &v, NULL) == 0 && v > 0 && v <= UINT32_MAX)
		res->step_ops = (uint32_t)v;
	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	msgpack_pack_object(&pk, *y);
	res->y_spec = (uint8_t *)sb.data;
	res->y_spec_len = sb.size;
	return 0;
}

/*
 * A worker that has loaded many artifacts (its parity checks dlopen them; what
 * a long-lived worker accumulates is bounded this way) asks to be replaced: it is idle now, so it
 * is detached and killed like a timed-out one, and the next job starts a fresh worker.  Not a
 * crash: no backoff, no job fails.
 */
static void recycle(struct slot *s, const struct msg *m)
{
	bool yes = false;

	if (msg_get_bool(&m->up.data, "recycle", &yes, NULL) != 0 || !yes)
		return;
	log_info("compile worker %d: replaced after %s", wproc_pid(s->p),
	         "loading its share of artifacts");
	s->c->recycled++;
	pool_kill_slot(s);
}

/*
 * A worker's artifact is taken only from the path its job was given, and
 * moved out of the worker's scratch (to the job's output, under <cache>/tmp)
 * before the scratch goes with the worker; cache_commit then copies it, so
 * nothing the worker still holds open becomes a cache entry.
 */
static int take_artifact(struct compile_job *job, struct compile_result *res, struct proto_err *err)
{
	struct stat st;

	if (strcmp(res->so_path, job->staged) != 0 || lstat(job->staged, &st) != 0 ||
	    !S_ISREG(st.st_mode)) {
		free(res->y_spec);
		return proto_fail(err, PROTO_E_COMPILE_FAILED, NULL,
		                  "the compile worker's artifact is not a file at its job's path");
	}
	if (strcmp(job->staged, job->output) != 0 && rename(job->staged, job->output) != 0) {
		free(res->y_spec);
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "cannot take the artifact %s: %s",
		                  job->staged, strerror(errno));
	}
	snprintf(res->so_path, sizeof res->so_path, "%s", job->output);
	return 0;
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
	} else if (read_result(m, &res, &err) != 0 || take_artifact(job, &res, &err) != 0) {
		job->done(job, NULL, &err);
	} else {
		job->done(job, &res, NULL);
		free(res.y_spec);
	}
	(void)s;
}

/*
 * An event from a worker: "ready" once it has imported the compile path
 * (after its hello, or at its first job), so its job's compile timeout
 * starts now; until then the start timeout ran (dispatch).
 */
static void read_event(struct slot *s, const struct msg *m)
{
	const char *name;
	uint32_t n;

	if (msg_get_str(&m->up.data, "event", &name, &n, NULL) != 0 || n != 5 ||
	    memcmp(name, "ready", 5) != 0 || s->ready)
		return;
	s->ready = true;
	log_debug("compile worker %d: ready", wproc_pid(s->p));
	if (s->current)
		pool_arm(s, pool_compile_ms(s->c));
}

static void on_reply(struct wproc *p, const struct msg *m)
{
	struct slot *s = wproc_data(p);
	struct compile_job *job = s->current;

	if (s->p != p)
		return; /* detached */
	if (m->is_event) {
		if (s->hello)
			read_event(s, m);
		return;
	}
	if (!s->hello) {
		read_hello(s, m);
	} else if (job == NULL || !m->has_id || m->id != job->id) {
		log_warn("compile worker: reply for an unknown job");
		return;
	} else {
		s->current = NULL;
		s->promoted = false;
		s->idle_since = uv_now(s->c->loop);
		s->c->lanes[job->lane].jobs++;
		pool_disarm(s);
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
	pool_kill_slot(s);
	pool_fail_current(s, PROTO_E_WORKER_CRASHED, PROTO_ERR_TRANSIENT | PROTO_ERR_JOB_CRASH,
	                  "the compile worker broke the framing; it was restarted");
	pump(s->c);
}

struct compiler *compiler_start(uv_loop_t *loop, const struct compiler_opts *opts,
                                compiler_ready_cb ready, void *data)
{
	struct compiler *c = calloc(1, sizeof *c);

	if (c == NULL)
		return NULL;
	c->loop = loop;
	c->timeout = opts->timeout_seconds;
	c->start_timeout = opts->start_timeout_seconds > 0 ? opts->start_timeout_seconds
	                                                   : COMPILER_START_TIMEOUT_S;
	c->ready = ready;
	c->data = data;
	c->hooks = (struct pool_hooks){pump, on_reply, on_broken};
	if (pool_init(c, opts) != 0) {
		free(c);
		return NULL;
	}
	pool_spawn(PRIMARY(c));
	return c;
}

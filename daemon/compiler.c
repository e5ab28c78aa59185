/*
 * compiler.c - see compiler.h.  Owns the worker's uv_process_t, its two
 * pipes, the job timer, the restart (backoff) timer and the orphan-reaping
 * timer; all are freed in their close callbacks, and the struct itself once
 * the last of them has closed after compiler_stop.
 *
 * A worker process is "detached" (c->wp no longer points at it) the moment
 * it is killed for a timeout: nothing is sent to it any more, its replies
 * are dropped, and only its exit callback still runs, which then starts the
 * next worker.  This is what keeps a queued job from going to a worker that
 * is being killed (and its timer from killing the fresh one).
 */
#include "compiler.h"

#include "frame.h"
#include "log.h"
#include "proctree.h"
#include "uvframe.h"
#include "msg.h"
#include "signature.h"
#include "writer.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BACKOFF_FIRST_MS 250
#define BACKOFF_MAX_MS   30000
#define REAP_POLL_MS     100
#define REAP_MAX         64

extern char **environ;

struct write_req {
	uv_write_t req;
	struct writer w;
};

/* One worker process and its pipes; freed when all three have closed. */
struct wproc {
	uv_process_t proc;
	uv_pipe_t in, out;
	struct frame_reader reader;
	struct compiler *c;
	int open;
	bool hello_done;
	bool killed; /* killed on purpose (timeout, stop): its exit is expected */
};

struct compiler {
	uv_loop_t *loop;
	struct wproc *wp; /* the live worker, or NULL */
	uv_timer_t timer, restart, reaper;
	char python[1024], script[1024];
	double timeout;
	compiler_ready_cb ready;
	void *data;
	struct worker_info info;
	bool stopping;
	int open_handles;
	struct compile_job *head, *tail, *current;
	uint64_t next_id, restarts, orphans_killed, recycled;
	unsigned start_failures; /* workers in a row that died before their hello */
	char last_exit[160];     /* how the last of them ended, for error messages */
	pid_t orphans[REAP_MAX];
	size_t n_orphans;
	char **env;
};

static void spawn_worker(struct compiler *c);
static void pump(struct compiler *c);

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
	return c->wp != NULL && c->wp->hello_done;
}
uint64_t compiler_restarts(const struct compiler *c)
{
	return c->restarts;
}
pid_t compiler_pid(const struct compiler *c)
{
	return c->wp ? c->wp->proc.pid : 0;
}
unsigned compiler_start_failures(const struct compiler *c)
{
	return c->start_failures;
}
uint64_t compiler_orphans_killed(const struct compiler *c)
{
	return c->orphans_killed;
}

const char *const COMPILE_PHASE_NAMES[COMPILE_PHASES] = {"setup", "eager", "export", "inductor",
                                                         "parity"};

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

unsigned compiler_queue_length(const struct compiler *c)
{
	unsigned n = c->current != NULL;

	for (struct compile_job *j = c->head; j; j = j->next)
		n++;
	return n;
}

/*
 * The worker's environment: an allow-list of what Python, torch, Inductor,
 * OpenMP and the C++ toolchain read, never the rest of ours (secrets,
 * NOTIFY_SOCKET, LISTEN_*, ...); then env_extra, which overrides.
 */
static bool env_allowed(const char *kv)
{
	static const char *const exact[] = {"PATH",
	                                    "HOME",
	                                    "USER",
	                                    "LOGNAME",
	                                    "LANG",
	                                    "LANGUAGE",
	                                    "TZ",
	                                    "TMPDIR",
	                                    "CC",
	                                    "CXX",
	                                    "ATEN_CPU_CAPABILITY",
	                                    "CUDA_VISIBLE_DEVICES"};
	static const char *const prefix[] = {"LC_",   "TORCH", "PYTORCH_",  "OMP_",    "KMP_",
	                                     "GOMP_", "MKL_",  "OPENBLAS_", "ONEDNN_", "DNNL_"};
	size_t n = strcspn(kv, "=");

	for (size_t i = 0; i < sizeof exact / sizeof exact[0]; i++)
		if (strlen(exact[i]) == n && strncmp(kv, exact[i], n) == 0)
			return true;
	for (size_t i = 0; i < sizeof prefix / sizeof prefix[0]; i++)
		if (strncmp(kv, prefix[i], strlen(prefix[i])) == 0)
			return true;
	return false;
}

static bool overridden(const char *kv, const char *const *extra)
{
	size_t n = strcspn(kv, "=");

	for (; extra && *extra; extra++)
		if (strncmp(kv, *extra, n) == 0 && (*extra)[n] == '=')
			return true;
	return false;
}

static char **worker_env(const char *const *extra)
{
	static char pid_var[32];
	size_t n = 0, k = 0, n_extra = 0;
	char **env;

	while (environ[n])
		n++;
	while (extra && extra[n_extra])
		n_extra++;
	env = calloc(n + n_extra + 5, sizeof *env);
	if (env == NULL)
		return NULL;
	for (size_t i = 0; i < n; i++)
		if (env_allowed(environ[i]) && !overridden(environ[i], extra))
			env[k++] = environ[i];
	for (size_t i = 0; i < n_extra; i++)
		env[k++] = (char *)extra[i];
	snprintf(pid_var, sizeof pid_var, "TORCHLOOPD_PID=%ld", (long)getpid());
	env[k++] = pid_var;
	env[k++] = "PYTHONDONTWRITEBYTECODE=1";
	env[k++] = "PYTHONNOUSERSITE=1";
	return env;
}

static void finish(struct compiler *c, struct compile_job *job, const struct compile_result *res,
                   const struct proto_err *err)
{
	(void)c;
	job->done(job, res, err);
}

static void fail_current(struct compiler *c, enum proto_code code, unsigned flags, const char *why)
{
	struct compile_job *job = c->current;
	struct proto_err err;

	if (job == NULL)
		return;
	c->current = NULL;
	uv_timer_stop(&c->timer);
	proto_fail(&err, code, NULL, "%s", why);
	err.flags = flags;
	finish(c, job, NULL, &err);
}

/* Fails every queued job (not the one in flight) with err. */
static void fail_queue(struct compiler *c, const struct proto_err *err)
{
	while (c->head) {
		struct compile_job *j = c->head;
		c->head = j->next;
		if (c->head == NULL)
			c->tail = NULL;
		j->done(j, NULL, err);
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
		free(c->env);
		free(c);
	}
}

static void timer_closed(uv_handle_t *h)
{
	compiler_release(h->data);
}

static void wproc_closed(uv_handle_t *h)
{
	struct wproc *wp = h->data;
	struct compiler *c = wp->c;

	if (--wp->open > 0)
		return;
	frame_reader_free(&wp->reader);
	free(wp);
	compiler_release(c);
}

static void on_write(uv_write_t *req, int status)
{
	struct write_req *wr = (struct write_req *)req;

	if (status != 0)
		log_warn("compile worker: write failed: %s", uv_strerror(status));
	writer_destroy(&wr->w);
	free(wr);
}

/* Sends one framed message that the caller built in wr->w. */
static int send_msg(struct compiler *c, struct write_req *wr)
{
	uv_buf_t bufs[64];
	struct iovec iov[64];
	struct proto_err err;
	int n = writer_finish(&wr->w, iov, 64, PROTO_FRAME_MAX, &err);

	if (n < 0) {
		writer_destroy(&wr->w);
		free(wr);
		return -1;
	}
	for (int i = 0; i < n; i++)
		bufs[i] = uv_buf_init(iov[i].iov_base, (unsigned)iov[i].iov_len);
	if (c->wp == NULL ||
	    uv_write(&wr->req, (uv_stream_t *)&c->wp->in, bufs, (unsigned)n, on_write) != 0) {
		writer_destroy(&wr->w);
		free(wr);
		return -1;
	}
	return 0;
}

static int send_job(struct compiler *c, struct compile_job *j)
{
	struct write_req *wr = malloc(sizeof *wr);

	if (wr == NULL || writer_init(&wr->w) != 0) {
		free(wr);
		return -1;
	}
	if (j->check_only) {
		msg_begin_request(&wr->w, j->id, "check", 3);
		writer_key_str(&wr->w, j->graph ? "body_graph" : "body_source", j->body_source);
		writer_key_str(&wr->w, "body_file", j->body_file);
		writer_key_str(&wr->w, "entry", j->entry);
		return send_msg(c, wr);
	}
	msg_begin_request(&wr->w, j->id, "compile", j->sample ? 12 : 11);
	writer_key_str(&wr->w, j->graph ? "body_graph" : "body_source", j->body_source);
	writer_key_str(&wr->w, "body_file", j->body_file);
	writer_key_str(&wr->w, "entry", j->entry);
	writer_key_str(&wr->w, "strategy", j->strategy);
	writer_key_str(&wr->w, "kind", j->kind);
	writer_key_str(&wr->w, "dtype", proto_dtype_name(j->dtype));
	writer_key_i64(&wr->w, "steps", j->steps);
	writer_key_i64(&wr->w, "max_batch", j->max_batch);
	writer_key_str(&wr->w, "output", j->output);
	writer_str(&wr->w, "carry");
	shapes_write(&wr->w, j->carry);
	writer_str(&wr->w, "inputs");
	shapes_write(&wr->w, j->inputs);
	if (j->sample) {
		writer_str(&wr->w, "sample");
		writer_raw(&wr->w, j->sample, j->sample_len); /* copied: the job may end first */
	}
	return send_msg(c, wr);
}

/* Kills the worker's whole tree and detaches it: nothing more goes to it. */
static void kill_worker(struct compiler *c, struct wproc *wp)
{
	size_t extra;

	wp->killed = true;
	if (c->wp == wp)
		c->wp = NULL;
	extra = proctree_kill(wp->proc.pid);
	c->orphans_killed += extra;
	if (extra)
		log_warn("compile worker %d: killed %zu descendant process(es) with it",
		         wp->proc.pid, extra);
}

static void on_timeout(uv_timer_t *t)
{
	struct compiler *c = t->data;

	log_warn("compile worker: job %llu exceeded %.0f s; killing the worker",
	         (unsigned long long)(c->current ? c->current->id : 0), c->timeout);
	if (c->wp)
		kill_worker(c, c->wp);
	fail_current(c, PROTO_E_COMPILE_TIMEOUT, PROTO_ERR_TRANSIENT,
	             "the compile exceeded its timeout; the worker was restarted");
}

static void pump(struct compiler *c)
{
	struct compile_job *j;

	if (c->current || !c->head || !compiler_alive(c) || c->stopping)
		return;
	j = c->head;
	c->head = j->next;
	if (c->head == NULL)
		c->tail = NULL;
	c->current = j;
	if (send_job(c, j) != 0) {
		fail_current(c, PROTO_E_INTERNAL, PROTO_ERR_TRANSIENT,
		             "cannot send the job to the compile worker");
		pump(c);
		return;
	}
	uv_timer_start(&c->timer, on_timeout, (uint64_t)(c->timeout * 1000), 0);
}

void compiler_submit(struct compiler *c, struct compile_job *job)
{
	struct proto_err err;

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
	if (job->check_only) { /* milliseconds: ahead of the compiles */
		job->next = c->head;
		c->head = job;
		if (c->tail == NULL)
			c->tail = job;
	} else if (!job->background) {
		/* ahead of the queued background jobs, behind everything else */
		struct compile_job **pp = &c->head;
		while (*pp && !(*pp)->background)
			pp = &(*pp)->next;
		job->next = *pp;
		*pp = job;
		if (job->next == NULL)
			c->tail = job;
	} else {
		if (c->tail)
			c->tail->next = job;
		else
			c->head = job;
		c->tail = job;
	}
	pump(c);
}

static void read_hello(struct compiler *c, struct wproc *wp, const struct msg *m)
{
	const msgpack_object *r = msg_field(m, "result");
	const char *s;
	uint32_t n;
	bool ok = false;
	struct proto_err err;

	if (msg_get_str(r, "torch", &s, &n, NULL) == 0)
		snprintf(c->info.torch, sizeof c->info.torch, "%.*s", (int)n, s);
	if (msg_get_str(r, "torch_git", &s, &n, NULL) == 0)
		snprintf(c->info.torch_git, sizeof c->info.torch_git, "%.*s", (int)n, s);
	if (msg_get_str(r, "isa", &s, &n, NULL) == 0)
		snprintf(c->info.isa, sizeof c->info.isa, "%.*s", (int)n, s);
	msg_get_bool(r, "cxx11_abi", &c->info.cxx11_abi, NULL);
	msg_get_bool(r, "torch_ok", &ok, NULL);
	c->info.torch_ok = ok;
	wp->hello_done = true;
	c->start_failures = 0;
	if (c->ready) {
		compiler_ready_cb ready = c->ready;
		c->ready = NULL;
		if (!ok) {
			proto_fail(&err, PROTO_E_INTERNAL, NULL,
			           "Compiled loops require Torch >= 2.14 (found %s)",
			           c->info.torch);
			ready(c, &err);
		} else {
			ready(c, NULL);
		}
	}
	pump(c);
}

static int read_result(const struct msg *m, struct compile_result *res, struct proto_err *err)
{
	const msgpack_object *r = msg_field(m, "result"), *y = msg_obj_field(r, "y");
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
	{
		const msgpack_object *cs = msg_obj_field(r, "compile_seconds");
		const msgpack_object *ph = msg_obj_field(r, "phases");
		if (cs && cs->type == MSGPACK_OBJECT_FLOAT64)
			res->compile_seconds = cs->via.f64;
		for (int i = 0; ph && ph->type == MSGPACK_OBJECT_MAP && i < COMPILE_PHASES; i++) {
			const msgpack_object *p = msg_obj_field(ph, COMPILE_PHASE_NAMES[i]);
			if (p && p->type == MSGPACK_OBJECT_FLOAT64)
				res->phases[i] = p->via.f64;
		}
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
static void recycle(struct compiler *c, struct wproc *wp, const struct msg *m)
{
	bool yes = false;

	if (msg_get_bool(&m->up.data, "recycle", &yes, NULL) != 0 || !yes || c->wp != wp)
		return;
	log_info("compile worker %d: replaced after %s", wp->proc.pid,
	         "loading its share of artifacts (they cannot be unloaded)");
	c->recycled++;
	kill_worker(c, wp);
}

static void on_reply(struct compiler *c, struct wproc *wp, const uint8_t *body, uint32_t len)
{
	struct msg m;
	struct proto_err err;
	struct compile_result res;
	struct compile_job *job = c->current;

	if (msg_parse(&m, body, len, MSG_REPLY, &err) != 0) {
		log_error("compile worker: bad reply: %s", err.message);
	} else if (!wp->hello_done) {
		read_hello(c, wp, &m);
	} else if (job == NULL || !m.has_id || m.id != job->id) {
		log_warn("compile worker: reply for an unknown job");
	} else {
		c->current = NULL;
		uv_timer_stop(&c->timer);
		if (m.is_error) {
			msg_reply_error(&m, &err);
			finish(c, job, NULL, &err);
		} else if (job->check_only) {
			memset(&res, 0, sizeof res);
			finish(c, job, &res, NULL);
		} else if (read_result(&m, &res, &err) != 0) {
			finish(c, job, NULL, &err);
		} else {
			finish(c, job, &res, NULL);
			free(res.y_spec);
		}
		recycle(c, wp, &m);
		pump(c);
	}
	msg_destroy(&m);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
	struct wproc *wp = h->data;

	(void)suggested;
	uvframe_alloc(&wp->reader, buf);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
	struct wproc *wp = s->data;
	struct proto_err err;
	enum frame_status st;

	(void)buf;
	if (nread == 0)
		return;
	if (nread < 0) {
		uv_read_stop(s);
		return; /* EOF: the exit callback does the rest */
	}
	st = frame_reader_commit(&wp->reader, (size_t)nread, &err);
	if (st == FRAME_ERROR) {
		log_error("compile worker: %s; killing it", err.message);
		uv_read_stop(s);
		if (wp == wp->c->wp)
			fail_current(wp->c, PROTO_E_WORKER_CRASHED,
			             PROTO_ERR_TRANSIENT | PROTO_ERR_JOB_CRASH,
			             "the compile worker broke the framing; it was restarted");
		kill_worker(wp->c, wp);
	} else if (st == FRAME_READY) {
		uint32_t len;
		uint8_t *body = frame_reader_take(&wp->reader, &len);
		if (wp == wp->c->wp)
			on_reply(wp->c, wp, body, len);
		frame_free(body);
	}
}

static void close_wproc(struct wproc *wp)
{
	uv_close((uv_handle_t *)&wp->in, wproc_closed);
	uv_close((uv_handle_t *)&wp->out, wproc_closed);
	uv_close((uv_handle_t *)&wp->proc, wproc_closed);
}

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

/* Kills what the dead worker left behind (re-parented to us), then reaps it. */
static void kill_orphans(struct compiler *c)
{
	pid_t found[REAP_MAX];
	size_t n = proctree_adopted(c->wp ? c->wp->proc.pid : 0, found, REAP_MAX);

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

static void on_restart(uv_timer_t *t)
{
	struct compiler *c = t->data;

	if (!c->stopping && c->wp == NULL)
		spawn_worker(c);
}

/* The next worker: at once after a worker that had said hello, else backoff. */
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
	c->restarts++;
	uv_timer_start(&c->restart, on_restart, ms, 0);
}

static void on_exit_cb(uv_process_t *p, int64_t status, int sig)
{
	struct wproc *wp = p->data;
	struct compiler *c = wp->c;
	bool live = c->wp == wp;

	if (sig)
		snprintf(c->last_exit, sizeof c->last_exit, "was killed by signal %d", sig);
	else
		snprintf(c->last_exit, sizeof c->last_exit, "exited with status %lld",
		         (long long)status);
	if (c->stopping)
		log_info("compile worker %d stopped", p->pid); /* compiler_stop killed it */
	else
		log_warn("compile worker %d %s%s", p->pid, c->last_exit,
		         wp->killed ? " (killed)" : "");
	if (live)
		c->wp = NULL;
	if (!wp->killed)
		proctree_kill(p->pid); /* its group and any setsid'd children */
	close_wproc(wp);
	kill_orphans(c);
	if (live && !wp->hello_done) {
		c->start_failures++;
		if (c->ready == NULL) {
			struct proto_err err;
			start_failure_err(c, &err);
			fail_current(c, err.code, err.flags, err.message);
			fail_queue(c, &err);
		}
	} else if (live) {
		fail_current(c, PROTO_E_WORKER_CRASHED, PROTO_ERR_TRANSIENT | PROTO_ERR_JOB_CRASH,
		             "the compile worker died during the compile; it was restarted");
	}
	if (c->ready && live && !wp->hello_done) {
		struct proto_err err;
		compiler_ready_cb ready = c->ready;
		c->ready = NULL;
		proto_fail(&err, PROTO_E_INTERNAL, NULL,
		           "the compile worker (%s %s) %s before it was ready; is torch installed "
		           "in that interpreter?",
		           c->python, c->script, c->last_exit);
		ready(c, &err);
		return;
	}
	if (!c->stopping && c->wp == NULL)
		schedule_restart(c);
}

static void send_hello(struct compiler *c)
{
	struct write_req *wr = malloc(sizeof *wr);

	if (wr == NULL || writer_init(&wr->w) != 0) {
		free(wr);
		return;
	}
	msg_begin_request(&wr->w, 0, "hello", 0);
	send_msg(c, wr);
}

static void spawn_worker(struct compiler *c)
{
	char *args[] = {c->python, "-u", c->script, NULL};
	uv_stdio_container_t stdio[3];
	uv_process_options_t o = {0};
	struct wproc *wp = calloc(1, sizeof *wp);
	int rc;

	if (wp == NULL)
		return;
	wp->c = c;
	frame_reader_init(&wp->reader, PROTO_FRAME_MAX);
	uv_pipe_init(c->loop, &wp->in, 0);
	uv_pipe_init(c->loop, &wp->out, 0);
	wp->in.data = wp->out.data = wp->proc.data = wp;
	wp->open = 3;
	c->open_handles++;
	stdio[0] = (uv_stdio_container_t){.flags = UV_CREATE_PIPE | UV_READABLE_PIPE,
	                                  .data.stream = (uv_stream_t *)&wp->in};
	stdio[1] = (uv_stdio_container_t){.flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE,
	                                  .data.stream = (uv_stream_t *)&wp->out};
	stdio[2] = (uv_stdio_container_t){.flags = UV_INHERIT_FD, .data.fd = 2};
	o.file = c->python;
	o.args = args;
	o.env = c->env;
	o.stdio = stdio;
	o.stdio_count = 3;
	o.exit_cb = on_exit_cb;
	o.flags = UV_PROCESS_DETACHED; /* own session and process group */
	rc = uv_spawn(c->loop, &wp->proc, &o);
	if (rc != 0) {
		struct proto_err err;
		log_error("cannot start the compile worker %s: %s", c->python, uv_strerror(rc));
		close_wproc(wp);
		snprintf(c->last_exit, sizeof c->last_exit, "could not be spawned: %s",
		         uv_strerror(rc));
		c->start_failures++;
		proto_fail(&err, PROTO_E_INTERNAL, NULL, "cannot start the compile worker %s: %s",
		           c->python, uv_strerror(rc));
		if (c->ready) {
			compiler_ready_cb ready = c->ready;
			c->ready = NULL;
			ready(c, &err);
			return;
		}
		start_failure_err(c, &err);
		fail_queue(c, &err);
		schedule_restart(c);
		return;
	}
	c->wp = wp;
	uv_read_start((uv_stream_t *)&wp->out, on_alloc, on_read);
	send_hello(c);
	log_info("compile worker started (pid %d)", wp->proc.pid);
}

static void init_timer(struct compiler *c, uv_timer_t *t)
{
	uv_timer_init(c->loop, t);
	t->data = c;
	c->open_handles++;
}

struct compiler *compiler_start(uv_loop_t *loop, const struct compiler_opts *opts,
                                compiler_ready_cb ready, void *data)
{
	struct compiler *c = calloc(1, sizeof *c);

	if (c == NULL)
		return NULL;
	c->loop = loop;
	c->timeout = opts->timeout_seconds;
	c->ready = ready;
	c->data = data;
	c->env = worker_env(opts->env_extra);
	if (c->env == NULL) {
		free(c);
		return NULL;
	}
	if (proctree_become_subreaper() != 0)
		log_warn("prctl(PR_SET_CHILD_SUBREAPER) failed: processes a killed worker leaves "
		         "behind may survive it");
	snprintf(c->python, sizeof c->python, "%s", opts->python);
	snprintf(c->script, sizeof c->script, "%s", opts->script);
	init_timer(c, &c->timer);
	init_timer(c, &c->restart);
	init_timer(c, &c->reaper);
	spawn_worker(c);
	return c;
}

void compiler_stop(struct compiler *c)
{
	struct proto_err err;

	c->stopping = true;
	c->ready = NULL;
	proto_fail(&err, PROTO_E_SHUTTING_DOWN, NULL, "the daemon is stopping");
	err.flags = PROTO_ERR_TRANSIENT;
	if (c->current) {
		struct compile_job *j = c->current;
		c->current = NULL;
		j->done(j, NULL, &err);
	}
	fail_queue(c, &err);
	uv_timer_stop(&c->timer);
	uv_timer_stop(&c->restart);
	uv_close((uv_handle_t *)&c->timer, timer_closed);
	uv_close((uv_handle_t *)&c->restart, timer_closed);
	uv_close((uv_handle_t *)&c->reaper, timer_closed);
	if (c->wp)
		kill_worker(c, c->wp); /* the exit callback closes the rest */
}

/*
 * wproc.c - see wproc.h.  Owns the worker's uv_process_t and its three pipes
 * (jobs in, replies out, its stderr); the struct is freed once all four
 * have closed (after the exit callback).  The worker's stderr is never the
 * daemon's: each line of it is relayed into the daemon's log quoted and
 * escaped (log_relay), so nothing a worker or a compiler it runs prints
 * can forge a daemon log line.
 */
#include "wproc.h"

#include "frame.h"
#include "log.h"
#include "proctree.h"
#include "sandbox.h"
#include "uvframe.h"

#include <fcntl.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/resource.h>

struct wproc {
	uv_process_t proc;
	uv_pipe_t in, out, err;
	struct frame_reader reader;
	char line[4096]; /* the stderr line being read (relayed whole or at 4 KiB) */
	size_t line_len;
	const struct wproc_ops *ops;
	void *data;
	int open;
	bool killed, exited;
	char scratch[1024]; /* its own directory (removed when it is gone), or "" */
};

extern char **environ;

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
char **wproc_env(const char *const *extra)
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

struct write_req {
	uv_write_t req;
	struct writer w;
};

void *wproc_data(const struct wproc *p)
{
	return p->data;
}

const char *wproc_scratch(const struct wproc *p)
{
	return p->scratch;
}

pid_t wproc_pid(const struct wproc *p)
{
	return p->proc.pid;
}

bool wproc_killed(const struct wproc *p)
{
	return p->killed;
}

static void closed(uv_handle_t *h)
{
	struct wproc *p = h->data;
	void (*done)(void *) = p->ops->closed;
	void *data = p->data;

	if (--p->open > 0)
		return;
	frame_reader_free(&p->reader);
	free(p);
	done(data);
}

static void nobody(void *data)
{
	(void)data;
}

static void close_all(struct wproc *p)
{
	uv_close((uv_handle_t *)&p->in, closed);
	uv_close((uv_handle_t *)&p->out, closed);
	uv_close((uv_handle_t *)&p->err, closed);
	uv_close((uv_handle_t *)&p->proc, closed);
}

static void on_write(uv_write_t *req, int status)
{
	struct write_req *wr = (struct write_req *)req;

	if (status != 0)
		log_warn("compile worker: write failed: %s", uv_strerror(status));
	writer_destroy(&wr->w);
	free(wr);
}

struct writer *wproc_begin(void)
{
	struct write_req *wr = malloc(sizeof *wr);

	if (wr == NULL || writer_init(&wr->w) != 0) {
		free(wr);
		return NULL;
	}
	return &wr->w;
}

int wproc_send(struct wproc *p, struct writer *w)
{
	uv_buf_t bufs[64];
	struct iovec iov[64];
	struct proto_err err;
	struct write_req *wr = (struct write_req *)((char *)w - offsetof(struct write_req, w));
	int n = writer_finish(&wr->w, iov, 64, PROTO_FRAME_MAX, &err);

	for (int i = 0; i < n; i++)
		bufs[i] = uv_buf_init(iov[i].iov_base, (unsigned)iov[i].iov_len);
	if (n < 0 || p == NULL || p->exited || p->killed ||
	    uv_write(&wr->req, (uv_stream_t *)&p->in, bufs, (unsigned)n, on_write) != 0) {
		writer_destroy(&wr->w);
		free(wr);
		return -1;
	}
	return 0;
}

size_t wproc_kill(struct wproc *p)
{
	p->killed = true;
	return p->exited ? 0 : proctree_kill(p->proc.pid);
}

void wproc_pause(struct wproc *p, bool stop)
{
	if (!p->exited)
		proctree_signal(p->proc.pid, stop ? SIGSTOP : SIGCONT);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
	struct wproc *p = h->data;

	(void)suggested;
	uvframe_alloc(&p->reader, buf);
}

static void on_frame(struct wproc *p, const uint8_t *body, uint32_t len)
{
	struct msg m;
	struct proto_err err;

	if (msg_parse(&m, body, len, MSG_REPLY, &err) != 0) {
		log_error("compile worker %d: bad reply: %s", p->proc.pid, err.message);
		return;
	}
	p->ops->reply(p, &m);
	msg_destroy(&m);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
	struct wproc *p = s->data;
	struct proto_err err;
	enum frame_status st;

	(void)buf;
	if (nread == 0)
		return;
	if (nread < 0) {
		uv_read_stop(s);
		return; /* EOF: the exit callback does the rest */
	}
	st = frame_reader_commit(&p->reader, (size_t)nread, &err);
	if (st == FRAME_ERROR) {
		log_error("compile worker %d: %s; killing it", p->proc.pid, err.message);
		uv_read_stop(s);
		if (!p->killed)
			p->ops->broken(p, err.message);
		wproc_kill(p);
	} else if (st == FRAME_READY) {
		uint32_t len;
		uint8_t *body = frame_reader_take(&p->reader, &len);
		if (!p->killed)
			on_frame(p, body, len);
		frame_free(body);
	}
}

/* ---- the worker's stderr -------------------------------------------------- */

static void relay_line(struct wproc *p)
{
	char who[48];

	snprintf(who, sizeof who, "compile worker %d", p->proc.pid);
	if (p->line_len > 0)
		log_relay(LOG_INFO, who, p->line, p->line_len);
	p->line_len = 0;
}

static void relay(struct wproc *p, const char *data, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		if (data[i] == '\n') {
			relay_line(p);
			continue;
		}
		if (p->line_len == sizeof p->line)
			relay_line(p); /* a line this long goes out in pieces */
		p->line[p->line_len++] = data[i];
	}
}

static void on_err_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
	static char chunk[16384]; /* loop thread; relayed before the next read */

	(void)h;
	(void)suggested;
	*buf = uv_buf_init(chunk, sizeof chunk);
}

static void on_err_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
	struct wproc *p = s->data;

	if (nread > 0) {
		relay(p, buf->base, (size_t)nread);
	} else if (nread < 0) {
		relay_line(p);
		uv_read_stop(s);
	}
}

/* What the worker wrote just before it exited (its last traceback): the
 * pipe is read dry now, before it closes with the process (at most 1 MiB:
 * a grandchild still writing is killed with the tree). */
static void drain_err(struct wproc *p)
{
	uv_os_fd_t fd;
	char buf[4096];
	size_t total = 0;
	ssize_t n;

	if (uv_fileno((uv_handle_t *)&p->err, &fd) != 0 ||
	    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) != 0)
		return;
	while (total < (1u << 20) && (n = read(fd, buf, sizeof buf)) > 0) {
		relay(p, buf, (size_t)n);
		total += (size_t)n;
	}
	relay_line(p);
}

static void on_exit_cb(uv_process_t *proc, int64_t status, int sig)
{
	struct wproc *p = proc->data;
	char how[64];

	if (sig)
		snprintf(how, sizeof how, "was killed by signal %d", sig);
	else
		snprintf(how, sizeof how, "exited with status %lld", (long long)status);
	if (!p->killed)
		proctree_kill(proc->pid); /* its group and any setsid'd children */
	p->exited = true;
	drain_err(p);
	if (p->scratch[0]) /* what a job left there was moved out at its reply */
		sandbox_scratch_remove(p->scratch);
	p->ops->exited(p, how);
	close_all(p);
}

/* flag path, for each of paths (as many as fit before the interpreter's 5 slots) */
static size_t path_args(char **args, size_t n, size_t max, const char *flag,
                        const char *const *paths)
{
	for (; paths && *paths && n + 7 < max; paths++) {
		args[n++] = (char *)flag;
		args[n++] = (char *)*paths;
	}
	return n;
}

/* The worker's argv: the interpreter, behind the sandbox's launcher when there is one. */
static void worker_args(const struct wproc_opts *o, char **args, size_t max)
{
	size_t n = 0;

	if (o->sandbox) {
		args[n++] = (char *)o->sandbox;
		args[n++] = "--scratch";
		args[n++] = (char *)o->scratch;
		n = path_args(args, n, max, "--write", o->write);
		n = path_args(args, n, max, "--hide", o->hide);
		n = path_args(args, n, max, "--keep", o->keep);
		args[n++] = "--";
	}
	args[n++] = (char *)o->python;
	args[n++] = "-u";
	args[n++] = (char *)o->script;
	args[n] = NULL;
}

/* env with kv in place of its name's entry (malloc'ed: free it), or NULL */
static char **env_with(char *const *env, const char *kv)
{
	size_t n = 0, k = 0;
	char **out;

	while (env[n])
		n++;
	out = calloc(n + 2, sizeof *out);
	if (out == NULL)
		return NULL;
	for (size_t i = 0; i < n; i++)
		if (!overridden(env[i], (const char *const[]){kv, NULL}))
			out[k++] = env[i];
	out[k] = (char *)kv;
	return out;
}

struct wproc *wproc_spawn(uv_loop_t *loop, const struct wproc_opts *o, const struct wproc_ops *ops,
                          void *data, int *uv_err)
{
	char *args[80];
	uv_stdio_container_t stdio[3];
	uv_process_options_t po = {0};
	char **env = o->env_set ? env_with(o->env, o->env_set) : o->env;
	struct wproc *p = env ? calloc(1, sizeof *p) : NULL;

	*uv_err = UV_ENOMEM;
	if (p == NULL) {
		if (env != o->env)
			free(env);
		return NULL;
	}
	p->ops = ops;
	p->data = data;
	snprintf(p->scratch, sizeof p->scratch, "%s", o->scratch ? o->scratch : "");
	frame_reader_init(&p->reader, PROTO_FRAME_MAX);
	uv_pipe_init(loop, &p->in, 0);
	uv_pipe_init(loop, &p->out, 0);
	uv_pipe_init(loop, &p->err, 0);
	p->in.data = p->out.data = p->err.data = p->proc.data = p;
	p->open = 4;
	stdio[0] = (uv_stdio_container_t){.flags = UV_CREATE_PIPE | UV_READABLE_PIPE,
	                                  .data.stream = (uv_stream_t *)&p->in};
	stdio[1] = (uv_stdio_container_t){.flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE,
	                                  .data.stream = (uv_stream_t *)&p->out};
	stdio[2] = (uv_stdio_container_t){.flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE,
	                                  .data.stream = (uv_stream_t *)&p->err};
	worker_args(o, args, sizeof args / sizeof args[0]);
	po.file = args[0];
	po.args = args;
	po.env = env;
	po.stdio = stdio;
	po.stdio_count = 3;
	po.exit_cb = on_exit_cb;
	po.flags = UV_PROCESS_DETACHED; /* own session and process group */
	*uv_err = uv_spawn(loop, &p->proc, &po);
	if (env != o->env)
		free(env); /* the child has its copy: uv_spawn returns after its exec */
	if (*uv_err != 0) {
		/* nothing runs; the handles still close (and free p), telling nobody */
		static const struct wproc_ops unspawned = {.closed = nobody};
		if (p->scratch[0])
			sandbox_scratch_remove(p->scratch);
		p->exited = true;
		p->ops = &unspawned;
		p->data = NULL;
		close_all(p);
		return NULL;
	}
	/* before the interpreter starts a thread or a child: they inherit it */
	if (o->nice && setpriority(PRIO_PROCESS, (id_t)p->proc.pid, o->nice) != 0)
		log_warn("compile worker %d: setpriority failed", p->proc.pid);
	uv_read_start((uv_stream_t *)&p->out, on_alloc, on_read);
	uv_read_start((uv_stream_t *)&p->err, on_err_alloc, on_err_read);
	return p;
}

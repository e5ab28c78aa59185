/*
 * torchloop.c - libtorchloop (see torchloop.h).  Blocking I/O on one Unix
 * socket per client; the caller's thread does everything.  Requests are
 * written with writev straight from the caller's tensor buffers; replies are
 * read into one aligned buffer that the reply's trees point into.
 */
#include "tl_internal.h"

#include "busypoll.h"
#include "fdpass.h"
#include "frame.h"
#include "msg.h"
#include "shapes.h"
#include "shmalloc.h"
#include "tree.h"
#include "writer.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
int tlc_fail(struct tl_error *err, const char *code, const char *path, const char *fmt, ...)
{
	va_list ap;

	if (err == NULL)
		return -1;
	snprintf(err->code, sizeof err->code, "%s", code);
	snprintf(err->path, sizeof err->path, "%s", path ? path : "");
	va_start(ap, fmt);
	vsnprintf(err->message, sizeof err->message, fmt, ap);
	va_end(ap);
	return -1;
}

void tlc_ok(struct tl_error *err)
{
	if (err) {
		snprintf(err->code, sizeof err->code, "OK");
		err->message[0] = err->path[0] = '\0';
	}
}
/* ---- connection ---------------------------------------------------------- */

static void default_path(char *out, size_t size)
{
	const char *env = getenv("TORCHLOOP_SOCKET"), *rt = getenv("XDG_RUNTIME_DIR");

	if (env && *env)
		snprintf(out, size, "%s", env);
	else if (rt && *rt)
		snprintf(out, size, "%s/torchloopd/torchloopd.sock", rt);
	else
		snprintf(out, size, "/tmp/torchloopd-%u/torchloopd.sock", (unsigned)getuid());
}

static int wait_fd(int fd, short events, int timeout_ms)
{
	struct pollfd p = {fd, events, 0};
	int rc;

	do
		rc = poll(&p, 1, timeout_ms > 0 ? timeout_ms : -1);
	while (rc < 0 && errno == EINTR);
	return rc;
}

/* A connected, blocking socket to p (fd), or -1 with err. */
static int open_socket(const char *p, int timeout_ms, int *out, struct tl_error *err)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd, rc, soerr = 0;
	socklen_t len = sizeof soerr;

	memcpy(sa.sun_path, p, strlen(p) + 1);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return tlc_fail(err, "CONNECT", NULL, "socket: %s", strerror(errno));
	rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
	if (rc != 0 && (errno == EINPROGRESS || errno == EAGAIN)) {
		rc = wait_fd(fd, POLLOUT, timeout_ms > 0 ? timeout_ms : 5000);
		if (rc == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) == 0 &&
		    soerr == 0)
			rc = 0;
		else
			errno = rc == 0 ? ETIMEDOUT : soerr;
	}
	if (rc != 0) {
		int e = errno;
		close(fd);
		return tlc_fail(err, "CONNECT", NULL, "cannot connect to %s: %s", p, strerror(e));
	}
	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
	*out = fd;
	return 0;
}

int tl_connect(const char *path, int timeout_ms, struct tl_client **out, struct tl_error *err)
{
	char p[sizeof(((struct sockaddr_un *)0)->sun_path) + 1];
	struct tl_client *c;
	int fd;

	if (path == NULL || *path == '\0')
		default_path(p, sizeof p);
	else if (strlen(path) >= sizeof p - 1)
		return tlc_fail(err, "CONNECT", NULL, "socket path longer than %zu bytes",
		                sizeof p - 2);
	else
		snprintf(p, sizeof p, "%s", path);
	if (open_socket(p, timeout_ms, &fd, err) != 0)
		return -1;
	c = calloc(1, sizeof *c);
	if (c == NULL) {
		close(fd);
		return tlc_fail(err, "IO", NULL, "out of memory");
	}
	c->fd = fd;
	c->poll_reply = true;
	snprintf(c->path, sizeof c->path, "%s", p);
	const char *bp = getenv("TORCHLOOP_BUSY_POLL_US");
	tl_set_busy_poll(c, bp && *bp ? atoi(bp) : TL_BUSY_POLL_US_DEFAULT);
	*out = c;
	tlc_ok(err);
	return 0;
}

void tl_set_reconnect(struct tl_client *c, int wait_ms)
{
	c->reconnect_ms = wait_ms > 0 ? wait_ms : 0;
}

uint64_t tl_resent(const struct tl_client *c)
{
	return c->resent;
}

static int send_frame_fd(struct tl_client *c, struct writer *w, int pass_fd, struct tl_error *err);
static int read_reply(struct tl_client *c, uint64_t id, struct tl_reply *r, struct tl_error *err);

/* A hello on a new connection: any reply says a daemon reads it. */
static int hello_probe(struct tl_client *c, struct tl_error *err)
{
	struct tl_reply *r = calloc(1, sizeof *r);
	struct writer w;
	uint64_t id = ++c->next_id;
	int rc;

	if (r == NULL || writer_init(&w) != 0) {
		free(r);
		return tlc_fail(err, "IO", NULL, "out of memory");
	}
	r->area = UINT64_MAX;
	msg_begin_request(&w, id, "hello", 1);
	writer_key_u64(&w, "protocol", TL_PROTOCOL);
	rc = send_frame_fd(c, &w, -1, err);
	writer_destroy(&w);
	if (rc == 0)
		rc = read_reply(c, id, r, err);
	tl_reply_free(r);
	return rc;
}

/*
 * A new connection in place of the broken one, trying for reconnect_ms.
 * It must answer a hello before the request goes again: a connection made
 * while a killed daemon's listening socket was still open (into its
 * backlog, never to be accepted) breaks under the hello, and the next one
 * is tried, so the one resend goes to a daemon that reads it.
 */
static int reconnect(struct tl_client *c, struct tl_error *err)
{
	struct timespec ts;
	double end;
	int fd;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	end = (double)ts.tv_sec + ts.tv_nsec / 1e9 + c->reconnect_ms / 1e3;
	for (;;) {
		if (open_socket(c->path, 1000, &fd, err) == 0) {
			close(c->fd);
			c->fd = fd;
			c->rb_off = c->rb_len = 0;
			c->broken = false;
			if (hello_probe(c, err) == 0)
				break;
			if (!c->broken)
				return -1; /* a daemon that answers nothing (tl_set_timeout) */
		}
		clock_gettime(CLOCK_MONOTONIC, &ts);
		if ((double)ts.tv_sec + ts.tv_nsec / 1e9 >= end)
			return -1;
		usleep(50 * 1000);
	}
	c->got = 0;
	return 0;
}

void tl_close(struct tl_client *c)
{
	if (c) {
		close(c->fd);
		shm_region_unref(c->shm);
		free(c);
	}
}

void tl_set_timeout(struct tl_client *c, int timeout_ms)
{
	c->timeout_ms = timeout_ms;
}

void tl_set_busy_poll(struct tl_client *c, int us)
{
	cpu_set_t set;
	int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;

	if (us < 0 || cpus < 2) /* one CPU: the poller would hold the daemon off it */
		us = 0;
	busypoll_init(&c->poll, (uint64_t)(us > 1000 ? 1000 : us) * 1000);
}

void tl_set_progress(struct tl_client *c, tl_progress_fn fn, void *user)
{
	c->progress = fn;
	c->user = user;
}

/* ---- transport ----------------------------------------------------------------- */

/* Sends the frame in w; pass_fd >= 0 rides on its first bytes (SCM_RIGHTS). */
static int send_frame_fd(struct tl_client *c, struct writer *w, int pass_fd, struct tl_error *err)
{
	size_t n = writer_iovcnt(w), off = 0;
	struct iovec *iov = malloc(n * sizeof *iov);
	struct proto_err perr;
	int cnt;

	if (iov == NULL)
		return tlc_fail(err, "IO", NULL, "out of memory");
	cnt = writer_finish(w, iov, n, PROTO_FRAME_MAX, &perr);
	if (cnt < 0) {
		free(iov);
		return tlc_fail(err, proto_code_name(perr.code), NULL, "%s", perr.message);
	}
	while (off < (size_t)cnt) {
		/* sendmsg with MSG_NOSIGNAL, not writev: a daemon that closed must give
		 * the caller EPIPE, never kill its process with SIGPIPE */
		size_t left = (size_t)cnt - off;
		ssize_t k = fdpass_sendmsg(c->fd, iov + off, left > 1024 ? 1024 : left, pass_fd);

		if (k > 0)
			pass_fd = -1; /* sent with the first bytes */
		if (k < 0 && errno == EINTR)
			continue;
		if (k < 0) {
			c->broken = errno == EPIPE || errno == ECONNRESET;
			free(iov);
			return tlc_fail(err, "IO", NULL, "write to torchloopd: %s",
			                strerror(errno));
		}
		while (off < (size_t)cnt && (size_t)k >= iov[off].iov_len)
			k -= (ssize_t)iov[off++].iov_len;
		if (off < (size_t)cnt) {
			iov[off].iov_base = (char *)iov[off].iov_base + k;
			iov[off].iov_len -= (size_t)k;
		}
	}
	free(iov);
	return 0;
}

static int read_some(struct tl_client *c, uint8_t *p, size_t n, ssize_t *got, struct tl_error *err)
{
	bool adapt = c->poll.max_ns > 0 && c->poll_reply;
	uint64_t t0 = adapt ? busypoll_now_ns() : 0;

	/* poll first (proto/busypoll.h), then sleep in read(2) */
	for (bool polling = adapt && c->poll.window_ns > 0;;) {
		if (!polling && c->timeout_ms > 0 && wait_fd(c->fd, POLLIN, c->timeout_ms) == 0)
			return tlc_fail(err, "IO", NULL, "no reply from torchloopd within %d ms",
			                c->timeout_ms);
		*got = polling ? recv(c->fd, p, n, MSG_DONTWAIT) : read(c->fd, p, n);
		if (*got < 0 && (errno == EINTR || (polling && errno == EAGAIN))) {
			polling = polling && busypoll_now_ns() - t0 < c->poll.window_ns;
			continue;
		}
		if (*got <= 0) {
			c->broken = *got == 0 || errno == ECONNRESET;
			return tlc_fail(err, "IO", NULL, "torchloopd closed the connection%s%s",
			                *got < 0 ? ": " : "", *got < 0 ? strerror(errno) : "");
		}
		c->got += (uint64_t)*got;
		if (!polling && adapt)
			busypoll_update(&c->poll, false, busypoll_now_ns() - t0);
		c->polled += polling;
		return 0;
	}
}

uint64_t tl_polled_reads(const struct tl_client *c)
{
	return c->polled;
}

/* An end of stream inside a frame (after `done` of its bytes): FRAME_TRUNCATED,
 * not the clean close between frames that read_some reports. */
static int truncated(struct tl_client *c, ssize_t got, size_t done, struct tl_error *err)
{
	if (got != 0 || done == 0 || !c->broken)
		return -1;
	return tlc_fail(err, "FRAME_TRUNCATED", NULL,
	                "torchloopd closed the connection %zu bytes into a reply frame", done);
}

/* Reads n bytes of a frame of which `done` bytes came already. */
static int read_full(struct tl_client *c, uint8_t *p, size_t n, size_t done, struct tl_error *err)
{
	size_t want = n;

	while (n > 0) {
		size_t have = c->rb_len - c->rb_off, k;
		ssize_t got = -1;

		if (have > 0) {
			k = have < n ? have : n;
			memcpy(p, c->rbuf + c->rb_off, k);
			c->rb_off += (uint32_t)k;
			p += k;
			n -= k;
			continue;
		}
		if (n >= TL_RBUF) { /* large: in place */
			if (read_some(c, p, n, &got, err) != 0)
				return truncated(c, got, done + want - n, err);
			p += got;
			n -= (size_t)got;
			continue;
		}
		if (read_some(c, c->rbuf, TL_RBUF, &got, err) != 0)
			return truncated(c, got, done + want - n, err);
		c->rb_off = 0;
		c->rb_len = (uint32_t)got;
	}
	return 0;
}

static void emit_progress(struct tl_client *c, const struct msg *m)
{
	const char *e = "", *a = "", *s = "";
	uint32_t el = 0, al = 0, sl = 0;
	const msgpack_object *t = msg_field(m, "elapsed");
	char ev[32], ad[80], sig[1024];

	if (c->progress == NULL)
		return;
	msg_get_str(&m->up.data, "event", &e, &el, NULL);
	msg_get_str(&m->up.data, "adapter", &a, &al, NULL);
	msg_get_str(&m->up.data, "signature", &s, &sl, NULL);
	snprintf(ev, sizeof ev, "%.*s", (int)el, e);
	snprintf(ad, sizeof ad, "%.*s", (int)al, a);
	snprintf(sig, sizeof sig, "%.*s", (int)sl, s);
	c->progress(ev, ad, sig, t && t->type == MSGPACK_OBJECT_FLOAT64 ? t->via.f64 : 0, c->user);
}

/* Reads frames until the reply to id; events go to the progress callback. */
static int read_reply(struct tl_client *c, uint64_t id, struct tl_reply *r, struct tl_error *err)
{
	for (;;) {
		uint8_t head[4];
		uint32_t len;
		struct proto_err perr;

		if (read_full(c, head, 4, 0, err) != 0)
			return -1;
		len = (uint32_t)head[0] << 24 | (uint32_t)head[1] << 16 | (uint32_t)head[2] << 8 |
		      head[3];
		if (len > PROTO_FRAME_MAX)
			return tlc_fail(err, "FRAME_TOO_LARGE", NULL, "reply of %u bytes", len);
		r->body = frame_alloc(len);
		if (r->body == NULL)
			return tlc_fail(err, "IO", NULL, "out of memory for a %u-byte reply", len);
		if (read_full(c, r->body, len, 4, err) != 0)
			return -1;
		if (msg_parse(&r->msg, r->body, len, MSG_REPLY, &perr) != 0)
			return tlc_fail(err, proto_code_name(perr.code), NULL, "bad reply: %s",
			                perr.message);
		if (!r->msg.is_event && (!r->msg.has_id || r->msg.id == id))
			return 0;
		if (r->msg.is_event) {
			emit_progress(c, &r->msg);
			/* a progress event (a compile it waits on) is not its reply:
			 * only bytes read past it count against tl_set_reconnect */
			c->got = c->rb_len - c->rb_off;
		}
		msg_destroy(&r->msg);
		frame_free(r->body);
		r->body = NULL;
	}
}

void tl_reply_free(struct tl_reply *r)
{
	if (r) {
		if (r->body)
			msg_destroy(&r->msg);
		frame_free(r->body);
		if (r->shm && r->area != UINT64_MAX)
			shm_region_free(r->shm, r->area);
		shm_region_unref(r->shm);
		free(r);
	}
}

static int reply_error(struct tl_reply *r, struct tl_error *err)
{
	struct proto_err perr;
	const msgpack_object *e = msg_field(&r->msg, "error");
	const char *code = "INTERNAL";
	uint32_t n = 8;

	msg_reply_error(&r->msg, &perr);
	msg_get_str(e, "code", &code, &n, NULL);
	snprintf(err->code, sizeof err->code, "%.*s", (int)n, code);
	snprintf(err->message, sizeof err->message, "%s", perr.message);
	snprintf(err->path, sizeof err->path, "%s", perr.path);
	return -1;
}

/* A SHUTTING_DOWN reply with tl_set_reconnect: the request did not run; the
 * old connection counts as broken before its reply. */
static bool resend_refused(struct tl_client *c, struct tl_reply *r, struct tl_error *err)
{
	if (c->reconnect_ms <= 0 || !c->retryable)
		return false;
	reply_error(r, err);
	if (strcmp(err->code, "SHUTTING_DOWN") != 0)
		return false;
	c->broken = true;
	c->got = 0;
	return true;
}

/* Sends the request in w (already begun with nfields), with pass_fd when
 * >= 0, and reads the reply. */
int tlc_roundtrip_fd(struct tl_client *c, struct writer *w, int pass_fd, uint64_t id,
                     struct tl_reply **out, struct tl_error *err)
{
	struct tl_reply *r = calloc(1, sizeof *r);
	int rc;

	if (r == NULL)
		return tlc_fail(err, "IO", NULL, "out of memory");
	r->area = UINT64_MAX;
	c->got = 0;
	c->broken = false;
	rc = send_frame_fd(c, w, pass_fd, err);
	if (rc == 0)
		rc = read_reply(c, id, r, err);
	if (rc == 0 && r->msg.is_error && err && resend_refused(c, r, err))
		rc = -1; /* SHUTTING_DOWN: not run */
	/* tl_set_reconnect: once more on a new connection, when the old one broke
	 * before any byte of the reply (the daemon restarted) or a stopping
	 * daemon refused it, and running the request twice gives the same
	 * result; not with shared memory (its descriptor went to the old daemon) */
	if (rc != 0 && c->reconnect_ms > 0 && c->retryable && c->broken && c->got == 0 &&
	    pass_fd < 0 && c->shm == NULL && reconnect(c, err) == 0) {
		if (r->body) { /* the refusal */
			msg_destroy(&r->msg);
			frame_free(r->body);
			r->body = NULL;
		}
		c->resent++;
		rc = send_frame_fd(c, w, -1, err);
		if (rc == 0)
			rc = read_reply(c, id, r, err);
	}
	if (rc == 0 && r->msg.is_error)
		rc = err ? reply_error(r, err) : -1;
	if (rc != 0) {
		tl_reply_free(r);
		return -1;
	}
	tlc_ok(err);
	if (out)
		*out = r;
	else
		tl_reply_free(r);
	return 0;
}

int tlc_roundtrip(struct tl_client *c, struct writer *w, uint64_t id, struct tl_reply **out,
                  struct tl_error *err)
{
	int rc = tlc_roundtrip_fd(c, w, -1, id, out, err);

	writer_destroy(w);
	return rc;
}

int tlc_begin(struct tl_client *c, struct writer *w, const char *op, uint32_t nfields, uint64_t *id,
              struct tl_error *err)
{
	static const char *const again[] = {"hello",    "health",  "list", "describe", "stats",
	                                    "register", "compile", "scan", "grad"};

	if (writer_init(w) != 0)
		return tlc_fail(err, "IO", NULL, "out of memory");
	c->retryable = false;
	for (size_t i = 0; i < sizeof again / sizeof again[0]; i++)
		c->retryable = c->retryable || strcmp(op, again[i]) == 0;
	*id = ++c->next_id;
	msg_begin_request(w, *id, op, nfields);
	return 0;
}

/* ---- requests ------------------------------------------------------------------ */

int tl_hello(struct tl_client *c, struct tl_error *err)
{
	struct writer w;
	uint64_t id = 0;

	if (tlc_begin(c, &w, "hello", 1, &id, err) != 0)
		return -1;
	writer_key_u64(&w, "protocol", TL_PROTOCOL);
	return tlc_roundtrip(c, &w, id, NULL, err);
}

int tlc_call(struct tl_client *c, const char *op, const char *name, struct tl_reply **out,
             struct tl_error *err)
{
	struct writer w;
	uint64_t id = 0;

	if (tlc_begin(c, &w, op, name ? 1 : 0, &id, err) != 0)
		return -1;
	if (name)
		writer_key_str(&w, "name", name);
	return tlc_roundtrip(c, &w, id, out, err);
}

int tl_health(struct tl_client *c, int *ready, struct tl_error *err)
{
	struct tl_reply *r;
	int rc = tlc_call(c, "health", NULL, &r, err);

	if (rc == 0) {
		*ready = tl_reply_number(r, "ready") == 1;
		tl_reply_free(r);
	}
	return rc;
}

int tl_register(struct tl_client *c, const struct tl_adapter_def *def, struct tl_error *err)
{
	struct writer w;
	uint64_t id = 0;

	if (tlc_begin(c, &w, "register", 9, &id, err) != 0)
		return -1;
	writer_key_str(&w, "name", def->name ? def->name : "");
	writer_key_str(&w, "body_source", def->body_source ? def->body_source : "");
	writer_key_str(&w, "body_file", def->body_file ? def->body_file : "<client>");
	writer_key_str(&w, "entry", def->entry ? def->entry : "body");
	writer_key_str(&w, "strategy", def->strategy ? def->strategy : "unroll");
	writer_key_str(&w, "dynamic", def->dynamic ? def->dynamic : "none");
	writer_key_i64(&w, "max_steps", def->max_steps ? def->max_steps : PROTO_DEFAULT_STEPS);
	writer_key_i64(&w, "max_elements",
	               def->max_elements ? def->max_elements : PROTO_DEFAULT_ELEMENTS);
	writer_key_i64(&w, "recompile_budget",
	               def->recompile_budget ? def->recompile_budget : PROTO_DEFAULT_BUDGET);
	return tlc_roundtrip(c, &w, id, NULL, err);
}

int tl_unregister(struct tl_client *c, const char *name, struct tl_error *err)
{
	return tlc_call(c, "unregister", name, NULL, err);
}

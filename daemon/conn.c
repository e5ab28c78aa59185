/*
 * conn.c - the listening socket and client connections.  Loop thread only.
 *
 * Each connection owns a uv_pipe_t and a frame reader that reads straight
 * into the frame body (no intermediate copy).  A complete frame becomes a
 * struct request (request.c) and is dispatched through OP_TABLE.  A frame
 * whose length prefix breaks the limit gets FRAME_TOO_LARGE and the
 * connection is closed after that reply; any other malformed frame gets its
 * error and the connection stays usable.  Writes queue per connection; past
 * write-queue-cap bytes the connection stops reading until it drains, so a
 * slow client only slows itself.  Memory of a connection is freed in its
 * close callback once no request or write refers to it.
 */
#include "daemon.h"

#include "log.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

static void conn_close(struct conn *c);

void conn_ref(struct conn *c)
{
	c->refs++;
}

void conn_unref(struct conn *c)
{
	if (--c->refs > 0)
		return;
	frame_reader_free(&c->reader);
	free(c);
}

static void conn_closed(uv_handle_t *h)
{
	struct conn *c = h->data;

	conn_unref(c);
}

static void conn_close(struct conn *c)
{
	struct daemon *d = c->d;

	if (c->closing)
		return;
	c->closing = true;
	if (c->prev)
		c->prev->next = c->next;
	else
		d->conns = c->next;
	if (c->next)
		c->next->prev = c->prev;
	d->n_conns--;
	uv_close((uv_handle_t *)&c->handle, conn_closed);
}

void conns_close_all(struct daemon *d)
{
	while (d->conns)
		conn_close(d->conns);
}

struct outmsg *outmsg_new(struct conn *c)
{
	struct outmsg *out = calloc(1, sizeof *out);

	if (out == NULL || writer_init(&out->w) != 0) {
		free(out);
		return NULL;
	}
	out->conn = c;
	conn_ref(c);
	return out;
}

void outmsg_free(struct outmsg *out)
{
	if (out->cleanup)
		out->cleanup(out->cleanup_arg);
	writer_destroy(&out->w);
	frame_free(out->keep_body);
	conn_unref(out->conn);
	free(out);
}

static void resume_reading(struct conn *c);

static void on_write(uv_write_t *req, int status)
{
	struct outmsg *out = (struct outmsg *)req;
	struct conn *c = out->conn;

	if (status != 0 && !c->closing)
		conn_close(c);
	else if (out->close_after)
		conn_close(c);
	else if (c->paused && uv_stream_get_write_queue_size((uv_stream_t *)&c->handle) <
	                          (size_t)c->d->cfg.write_queue_cap / 2)
		resume_reading(c);
	outmsg_free(out);
}

/* The whole frame went out without queueing: what on_write would do. */
static void sent_now(struct conn *c, struct outmsg *out)
{
	if (out->close_after)
		conn_close(c);
	outmsg_free(out);
}

/*
 * Writes the frame now if the socket takes all of it (the common case for a
 * reply to a waiting client: one writev, no write request, no callback on the
 * next loop turn); queues what is left otherwise.
 */
void conn_send(struct conn *c, struct outmsg *out)
{
	struct iovec iov[256];
	uv_buf_t bufs[256];
	struct proto_err err;
	size_t need = writer_iovcnt(&out->w), total = 0;
	struct iovec *iv = need <= 256 ? iov : malloc(need * sizeof *iv);
	uv_buf_t *bv = need <= 256 ? bufs : malloc(need * sizeof *bv);
	int n, first = 0, sent;

	if (c->closing || iv == NULL || bv == NULL) {
		outmsg_free(out);
		goto done;
	}
	n = writer_finish(&out->w, iv, need, (uint32_t)c->d->cfg.max_frame, &err);
	if (n < 0) {
		log_error("cannot send a reply: %s", err.message);
		outmsg_free(out);
		goto done;
	}
	for (int i = 0; i < n; i++) {
		bv[i] = uv_buf_init(iv[i].iov_base, (unsigned)iv[i].iov_len);
		total += iv[i].iov_len;
	}
	sent = uv_stream_get_write_queue_size((uv_stream_t *)&c->handle) == 0
	           ? uv_try_write((uv_stream_t *)&c->handle, bv, (unsigned)n)
	           : UV_EAGAIN;
	if (sent < 0 && sent != UV_EAGAIN) {
		conn_close(c);
		outmsg_free(out);
		goto done;
	}
	if (sent > 0 && (size_t)sent == total) {
		sent_now(c, out);
		goto done;
	}
	for (size_t skip = sent > 0 ? (size_t)sent : 0; skip > 0;) {
		if (skip >= bv[first].len) {
			skip -= bv[first++].len;
			continue;
		}
		bv[first].base += skip;
		bv[first].len -= (unsigned)skip;
		skip = 0;
	}
	if (uv_write(&out->req, (uv_stream_t *)&c->handle, bv + first, (unsigned)(n - first),
	             on_write) != 0) {
		outmsg_free(out);
		conn_close(c);
		goto done;
	}
	if (!c->paused && uv_stream_get_write_queue_size((uv_stream_t *)&c->handle) >
	                      (size_t)c->d->cfg.write_queue_cap) {
		log_warn("connection %llu: write queue over %lld bytes; pausing its reads",
		         (unsigned long long)c->serial, c->d->cfg.write_queue_cap);
		c->d->stats.limit_breaches++;
		c->paused = true;
		uv_read_stop((uv_stream_t *)&c->handle);
	}
done:
	if (iv != iov)
		free(iv);
	if (bv != bufs)
		free(bv);
}

/* A frame-level error: reply without an id. */
static void frame_error(struct conn *c, const struct proto_err *err, bool close_after)
{
	struct outmsg *out = outmsg_new(c);

	c->d->stats.frame_errors++;
	c->d->stats.error_codes[err->code]++;
	log_warn("connection %llu: %s: %s", (unsigned long long)c->serial,
	         proto_code_name(err->code), err->message);
	if (out == NULL) {
		conn_close(c);
		return;
	}
	msg_write_error(&out->w, false, 0, err);
	out->close_after = close_after;
	conn_send(c, out);
}

void request_dispatch(struct conn *c, uint8_t *body, uint32_t len);

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
	struct conn *c = h->data;
	struct proto_err err;
	uint8_t *p;
	size_t want;

	(void)suggested;
	if (frame_reader_want(&c->reader, &p, &want, &err) != FRAME_ERROR &&
	    c->reader.header_have == PROTO_FRAME_HEADER && want >= CONN_STAGE) {
		*buf = uv_buf_init((char *)p, (unsigned)want); /* large body: in place */
		return;
	}
	*buf = uv_buf_init((char *)c->stage, CONN_STAGE);
}

/* Returns false when the connection must not read on (closed or paused). */
static bool frame_status_step(struct conn *c, enum frame_status st, struct proto_err *err)
{
	if (st == FRAME_ERROR) {
		uv_read_stop((uv_stream_t *)&c->handle);
		frame_error(c, err, true);
		return false;
	}
	if (st == FRAME_READY) {
		uint32_t len;
		uint8_t *body = frame_reader_take(&c->reader, &len);
		request_dispatch(c, body, len);
	}
	return !c->closing && !c->paused;
}

/* Feeds staged bytes into the frame reader, dispatching each whole frame;
 * stops (keeping the rest) when a dispatch paused or closed the connection. */
static void feed_stage(struct conn *c)
{
	struct proto_err err;

	while (c->stage_off < c->stage_len && !c->closing && !c->paused) {
		size_t used;
		enum frame_status st = frame_reader_feed(&c->reader, c->stage + c->stage_off,
		                                         c->stage_len - c->stage_off, &used, &err);
		c->stage_off += (uint32_t)used;
		if (!frame_status_step(c, st, &err))
			break;
	}
	if (c->stage_off == c->stage_len)
		c->stage_off = c->stage_len = 0;
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
	struct conn *c = s->data;
	struct proto_err err;

	if (nread == 0)
		return;
	if (nread < 0) {
		if (nread != UV_EOF)
			log_debug("connection %llu: %s", (unsigned long long)c->serial,
			          uv_strerror((int)nread));
		else if (frame_reader_eof(&c->reader, &err) != 0)
			log_warn("connection %llu: %s", (unsigned long long)c->serial, err.message);
		conn_close(c);
		return;
	}
	if ((uint8_t *)buf->base == c->stage) {
		c->stage_off = 0;
		c->stage_len = (uint32_t)nread;
		feed_stage(c);
		return;
	}
	frame_status_step(c, frame_reader_commit(&c->reader, (size_t)nread, &err), &err);
}

static void resume_reading(struct conn *c)
{
	c->paused = false;
	feed_stage(c); /* frames that arrived with the one that paused us */
	if (!c->closing && !c->paused)
		uv_read_start((uv_stream_t *)&c->handle, on_alloc, on_read);
}

static void read_peer(struct conn *c)
{
	struct ucred cred;
	socklen_t len = sizeof cred;
	uv_os_fd_t fd;

	c->uid = (uid_t)-1;
	c->gid = (gid_t)-1;
	if (uv_fileno((uv_handle_t *)&c->handle, &fd) == 0 &&
	    getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
		c->uid = cred.uid;
		c->gid = cred.gid;
		c->pid = cred.pid;
	}
}

static void on_connection(uv_stream_t *server, int status)
{
	struct daemon *d = server->data;
	struct conn *c;

	if (status != 0) {
		log_warn("accept: %s", uv_strerror(status));
		return;
	}
	c = calloc(1, sizeof *c);
	if (c == NULL)
		return;
	uv_pipe_init(d->loop, &c->handle, 0);
	c->handle.data = c;
	c->d = d;
	c->refs = 1;
	if (uv_accept(server, (uv_stream_t *)&c->handle) != 0) {
		uv_close((uv_handle_t *)&c->handle, conn_closed);
		return;
	}
	frame_reader_init(&c->reader, (uint32_t)d->cfg.max_frame);
	read_peer(c);
	c->serial = ++d->stats.connections;
	c->next = d->conns;
	if (d->conns)
		d->conns->prev = c;
	d->conns = c;
	d->n_conns++;
	if (d->n_conns > (unsigned)d->cfg.max_connections || d->shutting_down) {
		struct proto_err err;
		proto_fail(&err, d->shutting_down ? PROTO_E_SHUTTING_DOWN : PROTO_E_BUSY, NULL,
		           d->shutting_down ? "the daemon is stopping"
		                            : "too many connections (max-connections=%lld)",
		           d->cfg.max_connections);
		if (!d->shutting_down)
			d->stats.limit_breaches++;
		frame_error(c, &err, true);
		return;
	}
	uv_read_start((uv_stream_t *)&c->handle, on_alloc, on_read);
}

/* A leftover socket file: unlink it only if nothing answers there. */
static int clear_stale(const char *path, struct proto_err *err)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	struct stat st;
	int fd, rc;

	if (lstat(path, &st) != 0)
		return 0;
	if (!S_ISSOCK(st.st_mode))
		return proto_fail(err, PROTO_E_INTERNAL, NULL,
		                  "%s exists and is not a socket; refusing to touch it", path);
	snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "socket: %s", strerror(errno));
	rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
	close(fd);
	if (rc == 0)
		return proto_fail(err, PROTO_E_INTERNAL, NULL,
		                  "another torchloopd is listening on %s", path);
	if (errno != ECONNREFUSED)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "cannot probe %s: %s", path,
		                  strerror(errno));
	log_info("removing stale socket %s", path);
	unlink(path);
	return 0;
}

static int make_parent(const char *path, struct proto_err *err)
{
	char dir[PATH_MAX];
	char *slash;

	snprintf(dir, sizeof dir, "%s", path);
	slash = strrchr(dir, '/');
	if (slash == NULL || slash == dir)
		return 0;
	*slash = '\0';
	if (mkdir(dir, 0750) != 0 && errno != EEXIST)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "cannot create %s: %s", dir,
		                  strerror(errno));
	return 0;
}

int server_listen(struct daemon *d, struct proto_err *err)
{
	const char *path = d->cfg.socket_path;
	int rc;

	if (strlen(path) > sizeof(((struct sockaddr_un *)0)->sun_path) - 1)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, NULL,
		                  "socket path is %zu bytes; Unix sockets allow at most 107: %s",
		                  strlen(path), path);
	if (make_parent(path, err) != 0 || clear_stale(path, err) != 0)
		return -1;
	uv_pipe_init(d->loop, &d->server, 0);
	d->server.data = d;
	d->server_open = true;
	rc = uv_pipe_bind(&d->server, path);
	if (rc == 0) {
		d->own_socket = true;
		if (chmod(path, d->cfg.socket_mode) != 0)
			rc = uv_translate_sys_error(errno);
	}
	if (rc == 0)
		rc = uv_listen((uv_stream_t *)&d->server, 128, on_connection);
	if (rc != 0)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "cannot listen on %s: %s", path,
		                  uv_strerror(rc));
	log_info("listening on %s (mode %04o)", path, d->cfg.socket_mode);
	return 0;
}

/* Starts accepting on an already bound (or inherited) socket. */
void server_start_listening(struct daemon *d, int *rc)
{
	*rc = uv_listen((uv_stream_t *)&d->server, 128, on_connection);
}

void server_close(struct daemon *d)
{
	if (!d->server_open)
		return;
	d->server_open = false;
	uv_close((uv_handle_t *)&d->server, NULL);
	if (d->own_socket)
		unlink(d->cfg.socket_path);
}

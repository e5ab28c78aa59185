/*
 * conn.c - client connections, accepted on the listening socket (listen.c
 * binds it).  Loop thread only.
 *
 * Each connection owns a uv_pipe_t and a frame reader that reads straight
 * into the frame body (no intermediate copy).  A complete frame goes to
 * d->dispatch (ops_dispatch: conn.c knows no request or op).  A frame
 * whose length prefix breaks the limit gets FRAME_TOO_LARGE and the
 * connection is closed after that reply; any other malformed frame gets its
 * error and the connection stays usable.  Memory of a connection is freed
 * in its close callback once no request or write refers to it.
 *
 * Memory a client can make the daemon hold is accounted as it is used: the
 * bytes received of the frame being read, the bodies of its requests in
 * flight, and its queued replies (a small reply that must queue is copied
 * into one exact-size buffer, so a client that pipelines and never reads
 * costs its reply bytes, not a writer's chunks).  Over write-queue-cap for
 * the connection, or -- holding more than its share -- over
 * max-queued-memory for all of them, the connection stops reading at the
 * next frame boundary until it is under half again.  A frame's whole
 * announced body counts from its length prefix on, and the body is read
 * only if it fits the caps (admit): otherwise reading pauses right after the
 * prefix, holding nothing.  Timeouts: conn_sweep.c; descriptors: conn_fds.c;
 * the socket file: listen.c.
 */
#include "daemon.h"

#include "log.h"
#include "shm.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void resume_reading(struct conn *c);

#define FLATTEN_LIMIT (256u << 10) /* queued replies up to this are copied flat */

static uint64_t conn_mem(const struct conn *c)
{
	return c->mem_partial + c->mem_requests + c->mem_replies;
}

static void account(struct conn *c, uint64_t *field, int64_t delta)
{
	*field = (uint64_t)((int64_t)*field + delta);
	c->d->queued_bytes = (uint64_t)((int64_t)c->d->queued_bytes + delta);
}

/*
 * The global cap pauses only connections holding more than an even share of
 * it: a client with a few small requests in flight is never paused because
 * others filled the daemon.  All clients together then hold at most about
 * 1.5 x max-queued-memory (plus frames being read, each bounded by max-frame
 * and closed by frame-timeout when they stall).
 */
static uint64_t fair_share(const struct daemon *d)
{
	return (uint64_t)d->cfg.max_queued_memory / (2 * (uint64_t)(d->n_conns ? d->n_conns : 1));
}

static bool over_limits(const struct conn *c)
{
	const struct daemon *d = c->d;

	return conn_mem(c) > (uint64_t)d->cfg.write_queue_cap ||
	       (d->queued_bytes > (uint64_t)d->cfg.max_queued_memory &&
	        conn_mem(c) > fair_share(d));
}

static bool under_half(const struct conn *c)
{
	return conn_mem(c) < (uint64_t)c->d->cfg.write_queue_cap / 2 &&
	       c->d->queued_bytes < (uint64_t)c->d->cfg.max_queued_memory / 2;
}

static void pause_reading(struct conn *c)
{
	struct daemon *d = c->d;

	if (c->paused || c->closing)
		return;
	c->pause_pending = false;
	c->paused = true;
	d->n_paused++;
	d->stats.limit_breaches++;
	d->stats.memory_pauses++;
	uv_read_stop((uv_stream_t *)&c->handle);
	log_warn("connection %llu: holds %llu bytes (all clients %llu; write-queue-cap=%lld, "
	         "max-queued-memory=%lld); pausing its reads",
	         (unsigned long long)c->serial, (unsigned long long)conn_mem(c),
	         (unsigned long long)d->queued_bytes, d->cfg.write_queue_cap,
	         d->cfg.max_queued_memory);
}

/* Over a limit: stop reading, but never in the middle of a frame (a frame
 * is bounded by max-frame; a half-read one would only hold its memory). */
static void check_memory(struct conn *c)
{
	if (c->paused || c->closing || !over_limits(c))
		return;
	if (c->reader.header_have > 0)
		c->pause_pending = true;
	else
		pause_reading(c);
}

/*
 * Resumes every paused connection that is under half its limits again.  Runs
 * from an idle handle, i.e. at the top of a loop iteration: resuming feeds
 * staged frames to their ops, which must not happen inside another request's
 * completion (request_free is where most memory is released).
 */
static void on_resume_idle(uv_idle_t *h)
{
	struct daemon *d = h->data;

	uv_idle_stop(h);
	for (struct conn *o = d->conns, *next; o && d->n_paused; o = next) {
		next = o->next;
		if (o->paused && !o->closing && under_half(o))
			resume_reading(o);
	}
}

/* Memory went down somewhere: resume what can go on, at the next safe point. */
static void memory_freed(struct conn *c)
{
	struct daemon *d = c->d;

	if (d->n_paused > 0 && d->resume_idle.type == UV_IDLE &&
	    !uv_is_closing((uv_handle_t *)&d->resume_idle))
		uv_idle_start(&d->resume_idle, on_resume_idle);
}

void conn_account_request(struct conn *c, int64_t delta)
{
	account(c, &c->mem_requests, delta);
	if (delta < 0)
		memory_freed(c);
	else
		check_memory(c);
}

/* The frame being read holds its whole announced body once admitted. */
static void account_partial(struct conn *c)
{
	uint64_t now = c->reader.header_have < PROTO_FRAME_HEADER ? 0
	               : c->admitted                              ? c->reader.body_len
	                                                          : c->reader.body_have;

	account(c, &c->mem_partial, (int64_t)now - (int64_t)c->mem_partial);
}

/*
 * A frame's length has arrived: its body is admitted only if the
 * connection and the daemon can hold all of it within the caps (counted
 * from now on, before a byte of it comes), else reading pauses before the
 * body (nothing held) until memory is freed.  A body over write-queue-cap
 * could never be taken: FRAME_TOO_LARGE.  Returns true when admitted.
 */
static bool admit(struct conn *c)
{
	const struct daemon *d = c->d;
	uint64_t len = c->reader.body_len, mine = conn_mem(c) - c->mem_partial + len;
	struct proto_err err;

	if (c->admitted || c->reader.header_have < PROTO_FRAME_HEADER)
		return true;
	if (len > (uint64_t)d->cfg.write_queue_cap) {
		uv_read_stop((uv_stream_t *)&c->handle);
		proto_fail(&err, PROTO_E_FRAME_TOO_LARGE, NULL,
		           "a frame of %llu bytes is over write-queue-cap=%lld: it could never be "
		           "taken; closing",
		           (unsigned long long)len, d->cfg.write_queue_cap);
		conn_frame_error(c, &err, true);
		return false;
	}
	if (mine > (uint64_t)d->cfg.write_queue_cap ||
	    (d->queued_bytes - c->mem_partial + len > (uint64_t)d->cfg.max_queued_memory &&
	     mine > fair_share(d))) {
		pause_reading(c);
		return false;
	}
	c->admitted = true;
	account_partial(c);
	return true;
}

void conn_ref(struct conn *c)
{
	c->refs++;
}

void conn_unref(struct conn *c)
{
	assert(c->refs > 0);
	if (--c->refs > 0)
		return;
	if (c->pending_fd >= 0)
		close(c->pending_fd);
	shm_detach(c->d, &c->region); /* no request or reply of this connection is left */
	frame_reader_free(&c->reader);
	free(c);
}

static void conn_closed(uv_handle_t *h)
{
	struct conn *c = h->data;

	conn_unref(c);
}

void conn_close(struct conn *c)
{
	struct daemon *d = c->d;

	if (c->closing)
		return;
	c->closing = true;
	if (c->paused)
		d->n_paused--;
	account(c, &c->mem_partial, -(int64_t)c->mem_partial);
	memory_freed(c); /* its partial frame may have been what others wait for */
	if (c->prev)
		c->prev->next = c->next;
	else
		d->conns = c->next;
	if (c->next)
		c->next->prev = c->prev;
	d->n_conns--;
	uv_close((uv_handle_t *)&c->handle, conn_closed);
}

struct outmsg *conn_outmsg_new(struct conn *c)
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

void conn_outmsg_free(struct outmsg *out)
{
	if (out->cleanup)
		out->cleanup(out->cleanup_arg);
	if (!out->writer_gone)
		writer_destroy(&out->w);
	free(out->flat);
	frame_free(out->keep_body);
	conn_unref(out->conn);
	free(out);
}

static void on_write(uv_write_t *req, int status)
{
	struct outmsg *out = (struct outmsg *)req;
	struct conn *c = out->conn;

	c->write_since = log_now();
	account(c, &c->mem_replies, -(int64_t)out->mem);
	if (status != 0 && !c->closing)
		conn_close(c);
	else if (out->close_after)
		conn_close(c);
	else
		memory_freed(c);
	conn_outmsg_free(out);
}

/*
 * A small reply that must queue: copy what is left to send into one buffer
 * and drop the writer's chunks, the request body and the engine result it
 * referenced.  Returns the bytes now held (0 when it was not flattened).
 */
static uint64_t flatten_queued(struct outmsg *out, uv_buf_t *bv, int n)
{
	size_t total = 0, off = 0;

	for (int i = 0; i < n; i++)
		total += bv[i].len;
	if (total > FLATTEN_LIMIT || (out->flat = malloc(total ? total : 1)) == NULL)
		return 0;
	for (int i = 0; i < n; i++) {
		memcpy(out->flat + off, bv[i].base, bv[i].len);
		off += bv[i].len;
	}
	if (out->cleanup)
		out->cleanup(out->cleanup_arg);
	out->cleanup = NULL;
	frame_free(out->keep_body);
	out->keep_body = NULL;
	writer_destroy(&out->w);
	out->writer_gone = true;
	bv[0] = uv_buf_init((char *)out->flat, (unsigned)total);
	return total + sizeof *out;
}

/* The whole frame went out without queueing: what on_write would do. */
static void sent_now(struct conn *c, struct outmsg *out)
{
	if (out->close_after)
		conn_close(c);
	conn_outmsg_free(out);
}

/*
 * The socket took only the first `skip` bytes of bv[0, n) (or it has writes
 * queued already): the rest goes with a write request, its memory accounted
 * to the connection until on_write.  Takes ownership of out.
 */
static void queue_unsent(struct conn *c, struct outmsg *out, uv_buf_t *bv, int n, size_t skip)
{
	int first = 0;

	while (skip > 0) {
		if (skip >= bv[first].len) {
			skip -= bv[first++].len;
			continue;
		}
		bv[first].base += skip;
		bv[first].len -= (unsigned)skip;
		skip = 0;
	}
	out->mem = flatten_queued(out, bv + first, n - first);
	if (out->mem != 0) {
		n = first + 1;
	} else {
		/* referenced payloads: the frame's bytes plus the writer's chunk */
		out->mem = sizeof *out + 8192 + out->body_size;
		for (int i = first; i < n; i++)
			out->mem += bv[i].len;
	}
	if (uv_stream_get_write_queue_size((uv_stream_t *)&c->handle) == 0)
		c->write_since = log_now();
	if (uv_write(&out->req, (uv_stream_t *)&c->handle, bv + first, (unsigned)(n - first),
	             on_write) != 0) {
		conn_outmsg_free(out);
		conn_close(c);
		return;
	}
	account(c, &c->mem_replies, (int64_t)out->mem);
	check_memory(c);
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
	int n, sent;

	if (c->closing || iv == NULL || bv == NULL) {
		conn_outmsg_free(out);
		goto done;
	}
	n = writer_finish(&out->w, iv, need, (uint32_t)c->d->cfg.max_frame, &err);
	if (n < 0) {
		log_error("cannot send a reply: %s", err.message);
		conn_outmsg_free(out);
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
		conn_outmsg_free(out);
		goto done;
	}
	if (sent > 0 && (size_t)sent == total)
		sent_now(c, out);
	else
		queue_unsent(c, out, bv, n, sent > 0 ? (size_t)sent : 0);
done:
	if (iv != iov)
		free(iv);
	if (bv != bufs)
		free(bv);
}

/* A frame-level error: reply without an id. */
void conn_frame_error(struct conn *c, const struct proto_err *err, bool close_after)
{
	struct outmsg *out = conn_outmsg_new(c);

	c->d->stats.frame_errors++;
	c->d->stats.error_codes[err->code]++;
	log_warn("connection %llu: %s: %s", (unsigned long long)c->serial,
	         proto_code_name(err->code), err->message);
	c->doomed |= close_after; /* that line says why it closes: the only one (conn_sweep.c) */
	if (out == NULL) {
		conn_close(c);
		return;
	}
	msg_write_error(&out->w, false, 0, err);
	out->close_after = close_after;
	conn_send(c, out);
}

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
		conn_frame_error(c, err, true);
		return false;
	}
	if (st == FRAME_READY) {
		uint32_t len;
		uint8_t *body = frame_reader_take(&c->reader, &len);
		c->admitted = false;
		account_partial(c);
		c->last_activity = log_now();
		c->frames_done++;
		c->d->dispatch(c, body, len);
		conn_drop_stray_fd(c);
		if (c->pause_pending || (!c->closing && over_limits(c)))
			pause_reading(c);
	}
	return !c->closing && !c->paused;
}

/* Feeds staged bytes into the frame reader, dispatching each whole frame;
 * stops (keeping the rest) when a dispatch paused or closed the connection. */
static void feed_stage(struct conn *c)
{
	struct proto_err err;

	while (c->stage_off < c->stage_len && !c->closing && !c->paused) {
		size_t used, n = c->stage_len - c->stage_off;
		bool boundary = c->reader.header_have == 0;
		enum frame_status st;
		if (c->reader.header_have < PROTO_FRAME_HEADER &&
		    n > PROTO_FRAME_HEADER - c->reader.header_have)
			n = PROTO_FRAME_HEADER - c->reader.header_have; /* the length, then admit */
		st = frame_reader_feed(&c->reader, c->stage + c->stage_off, n, &used, &err);
		c->stage_off += (uint32_t)used;
		if (boundary && used > 0) {
			c->frames_begun++;
			c->frame_started = log_now();
		}
		if (st == FRAME_NEED_MORE && !admit(c))
			break;
		if (!frame_status_step(c, st, &err))
			break;
	}
	if (c->stage_off == c->stage_len) {
		c->stage_off = c->stage_len = 0;
		conn_close_fd_window(c);
	}
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
	struct conn *c = s->data;
	struct proto_err err;

	conn_take_fds(c);
	if (nread == 0)
		return;
	c->last_read = log_now();
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
	} else {
		frame_status_step(c, frame_reader_commit(&c->reader, (size_t)nread, &err), &err);
		conn_close_fd_window(c);
	}
	if (!c->closing)
		account_partial(c);
}

static void resume_reading(struct conn *c)
{
	if (c->paused)
		c->d->n_paused--;
	c->paused = false;
	c->last_read = log_now(); /* the stall clock starts again */
	if (!c->admitted && c->reader.header_have == PROTO_FRAME_HEADER)
		c->frame_started = c->last_read; /* its deadline counts from admission */
	if (!admit(c))                           /* paused before a body: it must fit now */
		return;
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

/* A new connection accepted from server and linked into the daemon's list
 * (not reading yet: listen.c admits it first); NULL when it could not be. */
struct conn *conn_accept(struct daemon *d, uv_stream_t *server)
{
	struct conn *c = calloc(1, sizeof *c);

	if (c == NULL)
		return NULL;
	uv_pipe_init(d->loop, &c->handle, 1); /* IPC: descriptors may come (attach) */
	c->handle.data = c;
	c->d = d;
	c->refs = 1;
	c->pending_fd = -1;
	if (uv_accept(server, (uv_stream_t *)&c->handle) != 0) {
		uv_close((uv_handle_t *)&c->handle, conn_closed);
		return NULL;
	}
	frame_reader_init(&c->reader, (uint32_t)d->cfg.max_frame);
	read_peer(c);
	c->serial = ++d->stats.connections;
	c->last_read = c->last_activity = log_now();
	c->next = d->conns;
	if (d->conns)
		d->conns->prev = c;
	d->conns = c;
	d->n_conns++;
	return c;
}

void conn_start_reading(struct conn *c)
{
	uv_read_start((uv_stream_t *)&c->handle, on_alloc, on_read);
}

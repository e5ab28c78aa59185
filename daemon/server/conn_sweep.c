/*
 * conn_sweep.c - the once-a-second sweep over client connections: a frame
 * that stopped arriving for frame-timeout seconds, or that takes longer
 * than its deadline (frame-timeout plus 1 s per MiB: a trickle is closed,
 * not held), replies that stopped leaving (FRAME_TIMEOUT), and connections
 * idle (nothing in flight, nothing sent) for idle-timeout seconds; and at
 * shutdown, every connection closed once its queued replies have left (a
 * drained request's reply is delivered, not cancelled).  A connection is
 * closed with one log line: one whose error frame is queued (doomed) is not
 * swept again but closed if that frame does not leave.  Loop thread only.
 */
#include "daemon.h"

#include "log.h"

#define SWEEP_MS 1000
/* A frame must arrive at this rate on average (past --frame-timeout). */
#define FRAME_MIN_RATE (1u << 20) /* bytes per second */

static void close_stalled(struct conn *c, const char *what, double since)
{
	struct proto_err err;

	c->d->stats.stalled_frames_closed++;
	c->d->stats.limit_breaches++;
	uv_read_stop((uv_stream_t *)&c->handle);
	proto_fail(&err, PROTO_E_FRAME_TIMEOUT, NULL,
	           "%s made no progress for %.0f s (frame-timeout=%lld); closing", what,
	           log_now() - since, c->d->cfg.frame_timeout);
	conn_frame_error(c, &err, true);
}

/* Seconds a frame may take to arrive whole: --frame-timeout, plus its
 * size at FRAME_MIN_RATE. */
static double frame_deadline(const struct conn *c)
{
	uint64_t len = c->reader.header_have == PROTO_FRAME_HEADER ? c->reader.body_len : 0;

	return (double)c->d->cfg.frame_timeout + (double)len / FRAME_MIN_RATE;
}

static void frame_too_slow(struct conn *c, double now)
{
	struct proto_err err;

	c->d->stats.stalled_frames_closed++;
	c->d->stats.limit_breaches++;
	uv_read_stop((uv_stream_t *)&c->handle);
	proto_fail(&err, PROTO_E_FRAME_TIMEOUT, NULL,
	           "a frame of %u bytes has taken %.0f s to arrive (%u so far; the deadline is "
	           "frame-timeout=%lld s plus 1 s per MiB); closing",
	           c->reader.body_len, now - c->frame_started, (unsigned)c->reader.body_have,
	           c->d->cfg.frame_timeout);
	conn_frame_error(c, &err, true);
}

static void sweep_one(struct conn *c, double now)
{
	const struct config *cfg = &c->d->cfg;
	size_t queued = uv_stream_get_write_queue_size((uv_stream_t *)&c->handle);

	if (c->doomed) {
		/* its error frame (logged: one line per connection) closes it once
		 * written; a client that does not read it is closed all the same */
		if (queued > 0 && now - c->write_since > (double)cfg->frame_timeout)
			conn_close(c);
	} else if (c->reader.header_have > 0 && !c->paused &&
	           now - c->last_read > (double)cfg->frame_timeout) {
		close_stalled(c, "the frame being received", c->last_read);
	} else if (c->reader.header_have > 0 && !c->paused &&
	           now - c->frame_started > frame_deadline(c)) {
		frame_too_slow(c, now);
	} else if (queued > 0 && now - c->write_since > (double)cfg->frame_timeout) {
		/* it does not read its replies: no error frame could reach it either */
		log_warn("connection %llu: %zu reply bytes have not moved for %.0f s "
		         "(frame-timeout=%lld); closing",
		         (unsigned long long)c->serial, queued, now - c->write_since,
		         cfg->frame_timeout);
		c->d->stats.stalled_frames_closed++;
		c->d->stats.limit_breaches++;
		conn_close(c);
	} else if (cfg->idle_timeout > 0 && c->inflight == 0 && c->reader.header_have == 0 &&
	           queued == 0 && c->stage_len == 0 &&
	           now - c->last_activity > (double)cfg->idle_timeout) {
		log_info("connection %llu: idle for %.0f s (idle-timeout=%lld); closing",
		         (unsigned long long)c->serial, now - c->last_activity, cfg->idle_timeout);
		c->d->stats.idle_closed++;
		conn_close(c);
	}
}

static void on_sweep(uv_timer_t *t)
{
	struct daemon *d = t->data;
	double now = log_now();

	for (struct conn *c = d->conns, *next; c; c = next) {
		next = c->next;
		if (!c->closing)
			sweep_one(c, now);
	}
}

void conns_start_sweep(struct daemon *d)
{
	uv_idle_init(d->loop, &d->resume_idle);
	d->resume_idle.data = d;
	uv_timer_init(d->loop, &d->conn_sweep);
	d->conn_sweep.data = d;
	uv_timer_start(&d->conn_sweep, on_sweep, SWEEP_MS, SWEEP_MS);
}

static void shut_down(uv_shutdown_t *req, int status)
{
	struct conn *c = req->data;

	(void)status; /* written or not, the connection goes */
	free(req);
	conn_close(c);
	conn_unref(c);
}

/* Closes c once the replies queued on it are written (uv_shutdown waits for
 * them); at once when none are, or the shutdown cannot start.  The exit grace
 * timer bounds a client that never reads. */
static void close_when_written(struct conn *c)
{
	uv_stream_t *s = (uv_stream_t *)&c->handle;
	uv_shutdown_t *req;

	if (uv_stream_get_write_queue_size(s) == 0 || (req = malloc(sizeof *req)) == NULL) {
		conn_close(c);
		return;
	}
	uv_read_stop(s);
	req->data = c;
	conn_ref(c);
	if (uv_shutdown(req, s, shut_down) != 0) {
		free(req);
		conn_unref(c);
		conn_close(c);
	}
}

void conns_close_all(struct daemon *d)
{
	struct conn *c, *next;

	for (c = d->conns; c; c = next) {
		next = c->next;
		close_when_written(c);
	}
	if (d->conn_sweep.type == UV_TIMER && !uv_is_closing((uv_handle_t *)&d->conn_sweep))
		uv_close((uv_handle_t *)&d->conn_sweep, NULL);
	if (d->resume_idle.type == UV_IDLE && !uv_is_closing((uv_handle_t *)&d->resume_idle))
		uv_close((uv_handle_t *)&d->resume_idle, NULL);
}

/*
 * ops.c - the op table, generated from PROTO_OPS (proto/protocol.h).  Each op
 * lives in its own op_<id>.c, which defines op_<id>_desc: adding an op is
 * that file and one line in PROTO_OPS; an op without a descriptor is a link
 * error, never a NULL call.
 *
 * ops_dispatch is the connections' frame handler (main.c sets it in struct
 * daemon: conn.c knows no op): it parses the envelope once (the edge),
 * applies the connection's in-flight limit, the shutdown state and
 * admin-only access, then hands the request to its op.  Loop thread.
 *
 * At start-up a request that names adapters waits (held, in arrival order)
 * until the registrations of --state-dir and --adapters are registered, and
 * one that may register, compile or run also until the first worker said
 * hello and the probe passed (daemon.c): a client that retried across a
 * restart gets its answer, never NOT_FOUND.  The wait is bounded by the
 * start-up's own bounds (--worker-start-timeout, the probe's compile); a
 * start that fails answers them SHUTTING_DOWN.
 */
#include "daemon.h"

#include "log.h"

#define X(e, id) extern const struct op_desc op_##id##_desc;
PROTO_OPS(X)
#undef X

const struct op_desc *const OP_TABLE[PROTO_OP__COUNT] = {
#define X(e, id) [PROTO_OP_##e] = &op_##id##_desc,
    PROTO_OPS(X)
#undef X
};

/* Whether req must wait for the start-up (see the top of this file). */
static bool held_at_start(const struct daemon *d, int op)
{
	if (d->adapters_open || d->shutting_down)
		return false;
	switch (op) {
	case PROTO_OP_HELLO:
	case PROTO_OP_HEALTH:
	case PROTO_OP_STATS:
	case PROTO_OP_SHUTDOWN:
	case PROTO_OP_ATTACH:
		return false;
	case PROTO_OP_LIST:
	case PROTO_OP_DESCRIBE:
		return !d->restored;
	default: /* register, unregister, scan, grad, compile, artifact, report */
		return true;
	}
}

static bool refused_stopping(struct request *req, const struct op_desc *op)
{
	if (!req->d->shutting_down || (op->flags & OP_WHILE_STOPPING))
		return false;
	request_fail_code(req, PROTO_E_SHUTTING_DOWN, NULL, "the daemon is stopping");
	return true;
}

/* The op, unless the daemon stopped or the start-up holds it (again: it
 * was held before, and is counted). */
static void proceed(struct request *req, bool again)
{
	struct daemon *d = req->d;
	const struct op_desc *op = OP_TABLE[req->op];

	if (refused_stopping(req, op))
		return;
	if (!held_at_start(d, req->op)) {
		op->handler(req);
		return;
	}
	if (!again && d->held_total++ == 0)
		log_info("requests on adapters wait until the registrations are restored and "
		         "the compile worker is up");
	d->held_n++;
	req->held_next = NULL;
	if (d->held_last)
		d->held_last->held_next = req;
	else
		d->held = req;
	d->held_last = req;
}

void ops_release_held(struct daemon *d)
{
	struct request *req = d->held, *next;

	d->held = d->held_last = NULL;
	d->held_n = 0;
	for (; req; req = next) {
		next = req->held_next;
		if (req->conn->closing)
			request_drop(req); /* its client is gone: nothing to answer */
		else
			proceed(req, true);
	}
}

void ops_dispatch(struct conn *c, uint8_t *body, uint32_t len)
{
	struct daemon *d = c->d;
	struct request *req = request_new(c, body, len);
	struct proto_err err;
	const struct op_desc *op;

	if (req == NULL)
		return;
	d->stats.requests++;
	if (msg_parse(&req->msg, body, len, MSG_REQUEST, &err) != 0) {
		req->has_id = req->msg.has_id;
		req->id = req->msg.id;
		request_fail(req, &err);
		return;
	}
	req->has_id = true;
	req->id = req->msg.id;
	req->op = req->msg.op;
	if (c->region.base != NULL)
		req->msg.region = &c->region;
	if (req->op < 0) {
		request_fail_code(req, PROTO_E_UNKNOWN_OP, NULL, "unknown op '%.*s'",
		                  (int)req->msg.op_len, req->msg.op_name);
		return;
	}
	if (c->inflight > (unsigned)d->cfg.max_inflight) {
		d->stats.busy++;
		d->stats.limit_breaches++;
		request_fail_code(
		    req, PROTO_E_BUSY, NULL,
		    "more than max-inflight=%lld requests in flight on this connection",
		    d->cfg.max_inflight);
		return;
	}
	op = OP_TABLE[req->op];
	if (refused_stopping(req, op))
		return;
	if ((op->flags & OP_ADMIN) && !request_is_admin(req)) {
		request_fail_code(req, PROTO_E_PERMISSION_DENIED, NULL,
		                  "%s is reserved to the daemon's user, root and the admin group "
		                  "(peer uid %d)",
		                  op->name, (int)c->uid);
		return;
	}
	proceed(req, false);
}

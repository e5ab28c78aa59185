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
 */
#include "daemon.h"

#define X(e, id) extern const struct op_desc op_##id##_desc;
PROTO_OPS(X)
#undef X

const struct op_desc *const OP_TABLE[PROTO_OP__COUNT] = {
#define X(e, id) [PROTO_OP_##e] = &op_##id##_desc,
    PROTO_OPS(X)
#undef X
};

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
	if (d->shutting_down && !(op->flags & OP_WHILE_STOPPING)) {
		request_fail_code(req, PROTO_E_SHUTTING_DOWN, NULL, "the daemon is stopping");
		return;
	}
	if ((op->flags & OP_ADMIN) && !request_is_admin(req)) {
		request_fail_code(req, PROTO_E_PERMISSION_DENIED, NULL,
		                  "%s is reserved to the daemon's user, root and the admin group "
		                  "(peer uid %d)",
		                  op->name, (int)c->uid);
		return;
	}
	op->handler(req);
}

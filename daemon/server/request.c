/*
 * request.c - one request from frame to reply.  Loop thread only.
 *
 * A request owns its frame body (trees are views into it) and holds its
 * connection; ops_dispatch (ops.c) hands it to its op, and it ends with
 * exactly one request_reply or request_fail, which frees it.  A reply to a connection
 * that has closed is dropped.
 *
 * That is code: struct request's reply_state moves only along REQ_NEXT (asserted
 * by request_set_state, on in every build):
 *
 *   OPEN -> REPLYING   request_begin_result: a result frame is being built
 *   OPEN or REPLYING -> FAILED   request_fail(_code): an error frame (or
 *                      nothing, out of memory); also a result's failure
 *   REPLYING -> REPLIED   request_reply (a result over --max-frame goes out
 *                      as FRAME_TOO_LARGE instead, still REPLIED)
 *   OPEN -> DROPPED    request_drop: no reply, for the one reason there is
 *                      nobody to hear it - the start-up held it (ops.c
 *                      ops_release_held) and its connection closed meanwhile
 *   REPLIED, FAILED or DROPPED -> FREED   request_free, the only free, run
 *                      by the three above
 *
 * So a second reply, a reply after free (while the memory still reads as
 * FREED) or a free without a reply aborts the daemon.  Every other end is a
 * reply: a connection that closes with requests in flight gets them
 * answered into the void (conn_send drops them), shutdown refuses the held
 * ones (SHUTTING_DOWN) and fails or finishes the running ones.
 */
#include "daemon.h"

#include "log.h"

#include <assert.h>
#include <grp.h>
#include <pwd.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The moves of the comment at the top, each (1 << state) it may enter. */
#define TO(s) (1u << REQ_##s)
static const unsigned REQ_NEXT[] = {
    [REQ_OPEN] = TO(REPLYING) | TO(FAILED) | TO(DROPPED),
    [REQ_REPLYING] = TO(REPLIED) | TO(FAILED),
    [REQ_REPLIED] = TO(FREED),
    [REQ_FAILED] = TO(FREED),
    [REQ_DROPPED] = TO(FREED),
    [REQ_FREED] = 0,
};
#undef TO

static void request_set_state(struct request *req, enum request_state s)
{
	assert(REQ_NEXT[req->reply_state] & (1u << s));
	req->reply_state = s;
}

static void request_free(struct request *req)
{
	request_set_state(req, REQ_FREED);
	if (req->state_free)
		req->state_free(req->state);
	if (req->adapter)
		adapter_unref(req->adapter);
	msg_destroy(&req->msg);
	frame_free(req->body);
	assert(req->conn->inflight > 0);
	req->conn->inflight--;
	req->conn->last_activity = log_now();
	conn_account_request(req->conn, -(int64_t)req->len);
	conn_unref(req->conn);
	daemon_request_done(req->d);
	free(req);
}

void request_drop(struct request *req)
{
	assert(req->conn->closing); /* the only reason not to answer: nobody hears it */
	request_set_state(req, REQ_DROPPED);
	request_free(req);
}

struct outmsg *request_begin_result(struct request *req, uint32_t nfields)
{
	struct outmsg *out;

	request_set_state(req, REQ_REPLYING);
	out = conn_outmsg_new(req->conn);
	if (out == NULL) {
		request_fail_code(req, PROTO_E_INTERNAL, NULL, "out of memory for the reply");
		return NULL;
	}
	msg_begin_result(&out->w, req->has_id, req->id, nfields);
	return out;
}

static void send_error(struct request *req, const struct proto_err *failed);

void request_reply(struct request *req, struct outmsg *out)
{
	request_set_state(req, REQ_REPLIED);
	if (out->w.pos > (uint64_t)req->d->cfg.max_frame) {
		/* a frame the client could not take: it hears why instead of nothing */
		struct proto_err err;
		uint64_t n = out->w.pos;

		conn_outmsg_free(out);
		proto_fail(&err, PROTO_E_FRAME_TOO_LARGE, NULL,
		           "the reply of %llu bytes exceeds --max-frame=%llu bytes: its results "
		           "come back inline unless they fit the request's output area in shared "
		           "memory (docs/protocol.md, \"Shared memory\")",
		           (unsigned long long)n, (unsigned long long)req->d->cfg.max_frame);
		send_error(req, &err);
		return;
	}
	out->keep_body = req->body; /* output tensors may alias input bytes */
	out->body_size = req->body ? req->len : 0;
	req->body = NULL;
	conn_send(req->conn, out);
	request_free(req);
}

/* In place: carry[0] -> carry, carry[1] -> params (one pass, left to right). */
static void params_path(char *s, size_t size)
{
	char out[PROTO_MESSAGE_MAX];
	size_t k = 0;

	for (const char *p = s; *p && k + 8 < sizeof out;) {
		if (strncmp(p, "carry[0]", 8) == 0) {
			memcpy(out + k, "carry", 5), k += 5, p += 8;
		} else if (strncmp(p, "carry[1]", 8) == 0) {
			memcpy(out + k, "params", 6), k += 6, p += 8;
		} else {
			out[k++] = *p++;
		}
	}
	out[k] = '\0';
	snprintf(s, size, "%s", out);
}

/* The error frame of request_fail (request_reply's too, once REPLIED). */
static void send_error(struct request *req, const struct proto_err *failed)
{
	struct outmsg *out = conn_outmsg_new(req->conn);
	struct daemon *d = req->d;
	struct proto_err said = *failed, *err = &said;

	if (req->params) { /* the graph's carry is (carry, params): say it as the client did */
		params_path(said.path, sizeof said.path);
		params_path(said.message, sizeof said.message);
	}

	d->stats.errors++;
	d->stats.error_codes[err->code]++;
	if (req->adapter)
		req->adapter->stats.errors++;
	log_line(err->code == PROTO_E_INTERNAL ? LOG_ERROR : LOG_INFO, req->id,
	         req->adapter ? req->adapter->def.name : NULL, "%s %s: %s",
	         req->op >= 0 ? proto_op_name(req->op) : "?", proto_code_name(err->code),
	         err->message);
	if (out != NULL) {
		msg_write_error(&out->w, req->has_id, req->id, err);
		conn_send(req->conn, out);
	}
	request_free(req);
}

void request_fail(struct request *req, const struct proto_err *failed)
{
	request_set_state(req, REQ_FAILED);
	send_error(req, failed);
}

void request_fail_code(struct request *req, enum proto_code code, const char *path, const char *fmt,
                       ...)
{
	struct proto_err err;
	va_list ap;

	err.code = code;
	snprintf(err.path, sizeof err.path, "%s", path ? path : "");
	va_start(ap, fmt);
	vsnprintf(err.message, sizeof err.message, fmt, ap);
	va_end(ap);
	request_fail(req, &err);
}

static void request_event(struct request *req, const char *event, const char *adapter,
                          const char *signature, double elapsed)
{
	struct outmsg *out = conn_outmsg_new(req->conn);

	if (out == NULL)
		return;
	msg_begin_event(&out->w, req->id, event, 3);
	writer_key_str(&out->w, "adapter", adapter);
	writer_key_str(&out->w, "signature", signature);
	writer_key_f64(&out->w, "elapsed", elapsed);
	conn_send(req->conn, out);
}

/* ---- waiting for a specialization (the graph layer's waiter) ----------- */

#define REQUEST_OF(w) ((struct request *)((char *)(w)-offsetof(struct request, waiter)))

static void waiter_done(struct graph_waiter *w, struct specialization *sp,
                        const struct proto_err *err)
{
	struct request *req = REQUEST_OF(w);

	if (sp)
		req->ready(req, sp);
	else
		request_fail(req, err);
}

static void waiter_event(struct graph_waiter *w, const char *event, const struct specialization *sp,
                         double elapsed)
{
	request_event(REQUEST_OF(w), event, sp->adapter->def.name, sp->signature, elapsed);
}

void request_acquire(struct request *req, struct adapter *a, const struct scan_args *args,
                     void (*ready)(struct request *req, struct specialization *sp))
{
	struct scan_args mine = *args;

	mine.uid = req->conn->uid; /* a new specialization spends this uid's budget */
	req->batch = args->batch;
	req->ready = ready;
	req->waiter = (struct graph_waiter){NULL, waiter_done, waiter_event};
	graphs_acquire(&req->d->graphs, a, &mine, &req->waiter);
}

int request_name(struct request *req, const char **name, uint32_t *len)
{
	struct proto_err err;
	int rc = msg_get_str(&req->msg.up.data, "name", name, len, &err);

	if (rc > 0 || (rc == 0 && *len == 0))
		proto_fail(&err, PROTO_E_INVALID_NAME, "name",
		           "Loop adapter namespace must not be empty");
	if (rc != 0 || *len == 0) {
		request_fail(req, &err);
		return -1;
	}
	return 0;
}

int request_i64(struct request *req, const char *key, int64_t *v, const char *need)
{
	struct proto_err err;
	int rc = msg_get_i64(&req->msg.up.data, key, v, &err);

	if (rc > 0)
		proto_fail(&err, PROTO_E_INVALID_ARGUMENT, key, "%s", need);
	if (rc != 0)
		request_fail(req, &err);
	return rc != 0 ? -1 : 0;
}

int request_adapter(struct request *req, struct adapter **a, struct proto_err *err)
{
	const char *name;
	uint32_t len;
	int rc = msg_get_str(&req->msg.up.data, "adapter", &name, &len, err);

	if (rc < 0)
		return -1;
	if (rc > 0)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "adapter",
		                  "request has no adapter");
	*a = adapter_find(&req->d->graphs.reg, name, len);
	if (*a == NULL)
		return proto_fail(err, PROTO_E_NOT_FOUND, "adapter", "no adapter named '%.*s'",
		                  (int)len, name);
	adapter_ref(*a);
	req->adapter = *a;
	(*a)->stats.requests++;
	return 0;
}

/* The daemon's uid, root, or a member of --admin-group. */
bool request_is_admin(const struct request *req)
{
	const struct conn *c = req->conn;
	const struct config *cfg = &req->d->cfg;
	struct passwd *pw;
	gid_t groups[256];
	int n = 256;

	if (c->uid == 0 || c->uid == getuid())
		return true;
	if (!cfg->has_admin_gid)
		return false;
	if (c->gid == cfg->admin_gid)
		return true;
	pw = getpwuid(c->uid);
	if (pw == NULL || getgrouplist(pw->pw_name, pw->pw_gid, groups, &n) < 0)
		return false;
	for (int i = 0; i < n; i++)
		if (groups[i] == cfg->admin_gid)
			return true;
	return false;
}

struct request *request_new(struct conn *c, uint8_t *body, uint32_t len)
{
	struct request *req = calloc(1, sizeof *req);

	if (req == NULL) {
		frame_free(body);
		return NULL;
	}
	req->conn = c;
	req->d = c->d;
	req->body = body;
	req->len = len;
	req->op = -1;
	req->reply_state = REQ_OPEN;
	req->started = log_now();
	conn_ref(c);
	c->inflight++;
	c->d->inflight++;
	conn_account_request(c, (int64_t)len);
	return req;
}

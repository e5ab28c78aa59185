/*
 * op_attach.c - attach: maps the memfd that came with this frame (never one
 * an earlier frame brought: conn_take_fd) as the connection's shared
 * region, once.
 */
#include "daemon.h"

#include "log.h"
#include "shm.h"

#include <unistd.h>

static void op_attach(struct request *req)
{
	struct conn *c = req->conn;
	struct proto_err err;
	struct outmsg *out;
	int64_t size = 0;
	int fd;

	if (c->region.base != NULL) {
		request_fail_code(req, PROTO_E_SHM_ALREADY_ATTACHED, NULL,
		                  "this connection has a region of %llu bytes already; a "
		                  "connection attaches once (open another for another region)",
		                  (unsigned long long)c->region.size);
		return;
	}
	if (request_i64(req, "size", &size, "attach needs size (bytes, an integer)") != 0)
		return;
	fd = conn_take_fd(c);
	if (fd < 0) {
		request_fail_code(req, PROTO_E_SHM_NO_FD, NULL,
		                  "attach came without a descriptor: send the memfd with "
		                  "SCM_RIGHTS on the attach frame");
		return;
	}
	if (shm_attach(req->d, fd, size, &c->region, &err) != 0) {
		request_fail(req, &err);
		return;
	}
	log_debug("connection %llu: attached %lld bytes of shared memory",
	          (unsigned long long)c->serial, (long long)size);
	out = request_begin_result(req, 1);
	if (out == NULL)
		return;
	writer_key_u64(&out->w, "size", c->region.size);
	request_reply(req, out);
}

const struct op_desc op_attach_desc = {"attach", op_attach, 0};

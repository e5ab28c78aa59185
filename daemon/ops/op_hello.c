/* op_hello.c - hello: the version handshake; a mismatch is refused naming both. */
#include "daemon.h"

static void op_hello(struct request *req)
{
	struct daemon *d = req->d;
	struct outmsg *out;
	int64_t v = 0;

	if (request_i64(req, "protocol", &v, "hello needs protocol (an integer)") != 0)
		return;
	if (v != PROTO_VERSION) {
		request_fail_code(req, PROTO_E_VERSION_MISMATCH, "protocol",
		                  "client speaks protocol %lld, torchloopd %s speaks protocol %d",
		                  (long long)v, TORCHLOOP_VERSION, PROTO_VERSION);
		return;
	}
	out = request_begin_result(req, 4);
	if (out == NULL)
		return;
	writer_key_u64(&out->w, "protocol", PROTO_VERSION);
	writer_key_str(&out->w, "daemon", TORCHLOOP_VERSION);
	writer_key_str(&out->w, "torch", compiler_info(d->compiler)->torch);
	writer_key_u64(&out->w, "max_frame", (uint64_t)d->cfg.max_frame);
	request_reply(req, out);
}

const struct op_desc op_hello_desc = {"hello", op_hello, OP_WHILE_STOPPING};

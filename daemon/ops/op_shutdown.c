/* op_shutdown.c - shutdown (admin): reply, then drain and stop like SIGTERM. */
#include "daemon.h"

static void op_shutdown(struct request *req)
{
	struct daemon *d = req->d;
	struct outmsg *out = request_begin_result(req, 1);

	if (out == NULL)
		return;
	writer_key_bool(&out->w, "stopping", true);
	request_reply(req, out);
	daemon_begin_shutdown(d, "shutdown requested");
}

const struct op_desc op_shutdown_desc = {"shutdown", op_shutdown, OP_ADMIN};

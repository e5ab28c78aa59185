/* op_unregister.c - unregister (admin): drop an adapter and its graphs. */
#include "daemon.h"

#include "log.h"

static void op_unregister(struct request *req)
{
	const char *name;
	uint32_t len;
	struct outmsg *out;

	if (request_name(req, &name, &len) != 0)
		return;
	if (adapter_unregister(&req->d->graphs.reg, name, len) != 0) {
		request_fail_code(req, PROTO_E_NOT_FOUND, "name", "no adapter named '%.*s'",
		                  (int)len, name);
		return;
	}
	persist_forget(req->d, name, len);
	log_line(LOG_INFO, req->id, NULL, "unregistered %.*s", (int)len, name);
	out = request_begin_result(req, 1);
	if (out == NULL)
		return;
	writer_str(&out->w, "name");
	writer_strn(&out->w, name, len);
	request_reply(req, out);
}

const struct op_desc op_unregister_desc = {"unregister", op_unregister, OP_ADMIN};

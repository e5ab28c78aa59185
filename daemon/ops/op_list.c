/* op_list.c - list: every adapter with its bounds and budget use. */
#include "describe.h"

static void op_list(struct request *req)
{
	struct outmsg *out = request_begin_result(req, 1);

	if (out == NULL)
		return;
	writer_str(&out->w, "adapters");
	msgpack_pack_array(&out->w.pk, req->d->graphs.reg.count);
	for (const struct adapter *a = req->d->graphs.reg.head; a; a = a->next) {
		msgpack_pack_map(&out->w.pk, DESCRIBE_BOUNDS + 2);
		describe_bounds(&out->w, a);
		describe_origin(&out->w, req->d, a);
	}
	request_reply(req, out);
}

const struct op_desc op_list_desc = {"list", op_list, 0};

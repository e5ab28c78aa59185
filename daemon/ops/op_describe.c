/* op_describe.c - describe: one adapter's bounds, graphs and counters. */
#include "describe.h"

static void op_describe(struct request *req)
{
	const char *name;
	uint32_t len;
	struct outmsg *out;
	const struct adapter *a;

	if (request_name(req, &name, &len) != 0)
		return;
	a = adapter_find(&req->d->graphs.reg, name, len);
	if (a == NULL) {
		request_fail_code(req, PROTO_E_NOT_FOUND, "name", "no adapter named '%.*s'",
		                  (int)len, name);
		return;
	}
	out = request_begin_result(req, DESCRIBE_BOUNDS + 2 + 1 + 1);
	if (out == NULL)
		return;
	describe_bounds(&out->w, a);
	describe_origin(&out->w, req->d, a);
	writer_str(&out->w, "specializations");
	describe_specs(&out->w, a);
	writer_str(&out->w, "counters");
	msgpack_pack_map(&out->w.pk, DESCRIBE_COUNTERS);
	describe_counters(&out->w, a);
	request_reply(req, out);
}

const struct op_desc op_describe_desc = {"describe", op_describe, 0};

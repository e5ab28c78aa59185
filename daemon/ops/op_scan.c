/* op_scan.c - scan: run (compiling first if needed) one adapter's scan. */
#include "scanrun.h"
#include "shm.h"

static void scan_ready(struct request *req, struct specialization *sp)
{
	struct proto_err err;
	struct run_job *j = scanrun_new(req, sp, &err);

	if (j == NULL)
		request_fail(req, &err);
	else
		scanrun_start(j, req);
}

static void op_scan(struct request *req)
{
	struct adapter *a;
	struct scan_args args = {0};
	struct proto_err err;

	if (scanrun_decode(req, &a, &req->carry, &req->inputs, &err) != 0 ||
	    scanrun_validate(a, &req->carry, req->params, &req->inputs, &args, &err) != 0 ||
	    scanrun_chunk(req, a, &args, &err) != 0 || shm_out_decode(req, &req->out, &err) != 0) {
		request_fail(req, &err);
		return;
	}
	request_acquire(req, a, &args, scan_ready);
}

const struct op_desc op_scan_desc = {"scan", op_scan, 0};

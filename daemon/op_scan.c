/* op_scan.c - scan: run (compiling first if needed) one adapter's scan. */
#include "scanrun.h"
#include "shm.h"

static void scan_ready(struct request *req, struct specialization *sp)
{
	struct proto_err err;
	struct run_job *j = run_job_new(req, sp, &err);

	if (j == NULL) {
		request_fail(req, &err);
		return;
	}
	run_job_add(j, &req->carry);
	run_job_add(j, &req->inputs);
	run_job_start(j);
}

static void op_scan(struct request *req)
{
	struct adapter *a;
	struct scan_args args = {0};
	struct proto_err err;

	if (scan_decode(req, &a, &req->carry, &req->inputs, &err) != 0 ||
	    scan_validate(a, &req->carry, &req->inputs, &args, &err) != 0 ||
	    shm_out_decode(req, &req->out, &err) != 0) {
		request_fail(req, &err);
		return;
	}
	specs_acquire(req->d, a, &args, req, scan_ready);
}

const struct op_desc op_scan_desc = {"scan", op_scan, 0};

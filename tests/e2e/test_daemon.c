/*
 * test_daemon.c - torchloopd as a service: every op, every validation error
 * (with its code, its leaf path, and the next request still served), budgets
 * and replacement, concurrency (32 client processes, single flight),
 * disconnects, a killed worker, SIGTERM with requests in flight, restarts on
 * a warm cache, socket handling and access control.
 *
 * Most tests reuse one cheap specialization (t4.cumsum, float64, T=3,
 * carry [4]) so the whole file compiles only a handful of graphs per run.
 */
#include "harness.h"

#include "frame.h"
#include "params.h"
#include "tree.h"
#include "writer.h"
#include <dirent.h>
#include <fcntl.h>
#include <jansson.h>
#include <msgpack.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

TestSuite(daemon, .timeout = 900);

static const char *const NO_PROBE[] = {"--no-probe", "--socket-mode", "0666", NULL};
#define CUMSUM "examples/bodies/cumsum.py"

struct fixture {
	struct hd d;
	struct tl_client *c;
	struct tl_builder *b;
	double carry[4], xs[12];
	struct tl_tree *carry_t, *inputs_t;
};

static void setup(struct fixture *f, const char *const *args)
{
	int64_t cs[] = {4}, xs[] = {3, 4};

	hd_start(&f->d, NULL, args ? args : NO_PROBE);
	hd_wait_ready(&f->d, 120);
	f->c = hd_connect(&f->d);
	hd_register(f->c, "t4.cumsum", CUMSUM, "body", 12, 64, 3);
	f->b = tl_builder_new();
	h_fill(f->carry, TL_FLOAT64, 4, 11);
	h_fill(f->xs, TL_FLOAT64, 12, 12);
	f->carry_t = tl_tensor(f->b, TL_FLOAT64, 1, cs, f->carry);
	f->inputs_t = tl_tensor(f->b, TL_FLOAT64, 2, xs, f->xs);
}

static void teardown(struct fixture *f)
{
	tl_builder_free(f->b);
	tl_close(f->c);
	cr_assert_eq(hd_stop(&f->d), 0, "clean exit; log %s", f->d.log);
}

/* The reference scan, checked by hand: carry + running sums of x. */
static void scan_ok(struct fixture *f, struct tl_client *c)
{
	struct tl_reply *r;
	struct tl_error err;
	const double *y, *fin;

	cr_assert_eq(tl_scan(c, "t4.cumsum", f->carry_t, f->inputs_t, &r, &err), 0, "%s %s",
	             err.code, err.message);
	y = tl_tree_data(tl_reply_tree(r, "outputs"));
	fin = tl_tree_data(tl_reply_tree(r, "carry"));
	for (int k = 0; k < 4; k++) {
		double acc = f->carry[k];
		for (int s = 0; s < 3; s++) {
			acc += f->xs[4 * s + k];
			cr_assert_float_eq(y[4 * s + k], acc, 1e-12);
		}
		cr_assert_float_eq(fin[k], acc, 1e-12);
	}
	tl_reply_free(r);
}

static void write_adapter(const char *dir, const char *name)
{
	char path[600];
	FILE *fp;

	snprintf(path, sizeof path, "%s/%s.adapter", dir, name);
	fp = fopen(path, "w");
	fprintf(fp, "# test\nname = %s\nbody = %s/%s\nentry = body\nmax_steps = 12\n", name,
	        h_root(), CUMSUM);
	fclose(fp);
}

/* ---- every op ------------------------------------------------------------------ */

Test(daemon, every_op_answers)
{
	struct fixture f;
	struct tl_error err;
	struct tl_reply *r;
	json_t *j;
	int ready;

	setup(&f, NULL);
	cr_assert_eq(tl_health(f.c, &ready, &err), 0);
	cr_assert(ready);
	j = h_call_json(f.c, "list", NULL);
	cr_assert_eq(json_array_size(json_object_get(j, "adapters")), 1);
	json_decref(j);
	scan_ok(&f, f.c);
	j = h_call_json(f.c, "describe", "t4.cumsum");
	cr_assert_eq(json_integer_value(json_object_get(j, "max_steps")), 12);
	cr_assert_eq(json_integer_value(json_object_get(j, "budget_used")), 1);
	cr_assert_str_eq(
	    json_string_value(json_object_get(
	        json_array_get(json_object_get(j, "specializations"), 0), "signature")),
	    "float64 T=3 carry=[4] inputs=[3,4]");
	json_decref(j);
	cr_assert_eq(tl_compile(f.c, "t4.cumsum", f.carry_t, f.inputs_t, TL_FLOAT64, 0, &r, &err),
	             0, "%s", err.message);
	tl_reply_free(r);
	j = h_call_json(f.c, "stats", NULL);
	cr_assert_geq(json_integer_value(json_object_get(j, "requests")), 5);
	json_decref(j);
	cr_assert_eq(tl_unregister(f.c, "t4.cumsum", &err), 0);
	cr_assert_eq(tl_unregister(f.c, "t4.cumsum", &err), -1);
	cr_assert_str_eq(err.code, "NOT_FOUND");
	j = h_call_json(f.c, "shutdown", NULL);
	cr_assert(json_is_true(json_object_get(j, "stopping")));
	json_decref(j);
	tl_builder_free(f.b);
	tl_close(f.c);
	cr_assert_eq(hd_stop(&f.d), 0);
}

Test(daemon, a_protocol_mismatch_is_refused_naming_both_versions)
{
	struct fixture f;
	char code[64], msg[1024];
	long long id;
	int fd;

	setup(&f, NULL);
	fd = raw_connect(f.d.sock);
	{
		static const char hello99[] = "\x83\xa2id\x01\xa2op\xa5hello\xa8protocol\x63";
		raw_send_frame(fd, hello99, sizeof hello99 - 1);
	}
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
	cr_assert_str_eq(code, "VERSION_MISMATCH");
	cr_assert(strstr(msg, "protocol 99") && strstr(msg, "protocol 1"), "%s", msg);
	close(fd);
	teardown(&f);
}

/* ---- validation: code, leaf path, and the next request is served ------------------ */

enum bad {
	B_NOT_FOUND,
	B_DTYPE,
	B_NO_INPUTS,
	B_RANK0,
	B_LENGTHS,
	B_TOO_MANY_STEPS,
	B_ZERO_STEPS,
	B_INPUT_ELEMENTS,
	B_CARRY_ELEMENTS,
	B_OUTPUT_ELEMENTS,
	N_BAD
};

static const struct bad_case {
	const char *code, *path;
} BAD[N_BAD] = {
    [B_NOT_FOUND] = {"NOT_FOUND", "adapter"},
    [B_DTYPE] = {"DTYPE_MISMATCH", "inputs"},
    [B_NO_INPUTS] = {"NO_INPUTS", "inputs"},
    [B_RANK0] = {"BAD_RANK", "inputs[\"b\"]"},
    [B_LENGTHS] = {"LENGTH_MISMATCH", "inputs[\"b\"]"},
    [B_TOO_MANY_STEPS] = {"TOO_MANY_STEPS", "inputs"},
    [B_ZERO_STEPS] = {"TOO_MANY_STEPS", "inputs"},
    [B_INPUT_ELEMENTS] = {"TOO_MANY_ELEMENTS", "inputs"},
    [B_CARRY_ELEMENTS] = {"TOO_MANY_ELEMENTS", "carry[1]"},
    [B_OUTPUT_ELEMENTS] = {"TOO_MANY_ELEMENTS", "outputs"},
};

INDEX_PARAMS(daemon, each_bad_scan_gets_its_code_and_leaf_path, N_BAD)

ParameterizedTest(int *i, daemon, each_bad_scan_gets_its_code_and_leaf_path)
{
	static float f32[4];
	static double big[200], x1[12];
	struct fixture f;
	struct tl_reply *r;
	struct tl_error err;
	struct tl_tree *carry, *inputs, *items[2];
	const char *ab[] = {"a", "b"};
	const char *adapter = "t4.cumsum";
	int64_t s4[] = {4}, s34[] = {3, 4}, s24[] = {2, 4}, s0[] = {0, 4}, s13[] = {13, 4},
	        s20[] = {12, 6}, s100[] = {100}, s121[] = {12, 1};

	setup(&f, NULL);
	carry = f.carry_t;
	inputs = f.inputs_t;
	switch (*i) {
	case B_NOT_FOUND:
		adapter = "no.such";
		break;
	case B_DTYPE:
		carry = tl_tensor(f.b, TL_FLOAT32, 1, s4, f32);
		break;
	case B_NO_INPUTS:
		inputs = tl_none(f.b);
		break;
	case B_RANK0:
		items[0] = f.inputs_t;
		items[1] = tl_tensor(f.b, TL_FLOAT64, 0, NULL, big);
		inputs = tl_dict(f.b, 2, ab, items);
		break;
	case B_LENGTHS:
		items[0] = f.inputs_t;
		items[1] = tl_tensor(f.b, TL_FLOAT64, 2, s24, big);
		inputs = tl_dict(f.b, 2, ab, items);
		break;
	case B_TOO_MANY_STEPS:
		inputs = tl_tensor(f.b, TL_FLOAT64, 2, s13, big);
		break;
	case B_ZERO_STEPS:
		inputs = tl_tensor(f.b, TL_FLOAT64, 2, s0, big);
		break;
	case B_INPUT_ELEMENTS:
		inputs = tl_tensor(f.b, TL_FLOAT64, 2, s20, big);
		break;
	case B_CARRY_ELEMENTS:
		items[0] = f.carry_t;
		items[1] = tl_tensor(f.b, TL_FLOAT64, 1, s100, big);
		carry = tl_list(f.b, 2, items);
		break;
	case B_OUTPUT_ELEMENTS: /* inputs 12 elements, stacked outputs 12 x 4 = 48 > 40 */
		hd_register(f.c, "t4.small", CUMSUM, "body", 12, 40, 3);
		adapter = "t4.small";
		inputs = tl_tensor(f.b, TL_FLOAT64, 2, s121, x1);
		break;
	}
	(void)s34;
	cr_assert_eq(tl_scan(f.c, adapter, carry, inputs, &r, &err), -1, "accepted");
	cr_assert_str_eq(err.code, BAD[*i].code, "got %s: %s", err.code, err.message);
	cr_assert_str_eq(err.path, BAD[*i].path, "path of %s: %s", err.code, err.message);
	cr_assert(strstr(err.message, BAD[*i].path) != NULL, "the message names the leaf: %s",
	          err.message);
	scan_ok(&f, f.c); /* the same connection still serves */
	teardown(&f);
}

struct reg_case {
	const char *field;
	int kind; /* 0 int, 1 bool, 2 float, 3 string name */
	long long value;
	const char *name;
	const char *code, *message;
};

static const struct reg_case REGS[] = {
    {"max_steps", 0, 0, NULL, "INVALID_BOUNDS", "max_steps must be an integer in [1, 128]"},
    {"max_steps", 0, 129, NULL, "INVALID_BOUNDS", "max_steps must be an integer in [1, 128]"},
    {"max_steps", 1, 1, NULL, "INVALID_BOUNDS", "max_steps must be an integer in [1, 128]"},
    {"max_steps", 2, 16, NULL, "INVALID_BOUNDS", "max_steps must be an integer in [1, 128]"},
    {"max_elements", 0, 0, NULL, "INVALID_BOUNDS",
     "max_elements must be an integer in [1, 1048576]"},
    {"max_elements", 0, 1048577, NULL, "INVALID_BOUNDS",
     "max_elements must be an integer in [1, 1048576]"},
    {"max_elements", 1, 0, NULL, "INVALID_BOUNDS",
     "max_elements must be an integer in [1, 1048576]"},
    {"recompile_budget", 0, 0, NULL, "INVALID_BOUNDS",
     "recompile_budget must be an integer in [1, 64]"},
    {"recompile_budget", 0, 65, NULL, "INVALID_BOUNDS",
     "recompile_budget must be an integer in [1, 64]"},
    {"name", 3, 0, "", "INVALID_NAME", "Loop adapter namespace must not be empty"},
    {"name", 3, 0, "has space", "INVALID_NAME", "adapter name must match [A-Za-z0-9._-]{1,64}"},
    {"name", 3, 0, "x/../y", "INVALID_NAME", "adapter name must match [A-Za-z0-9._-]{1,64}"},
    {"name", 3, 0, "a1234567890123456789012345678901234567890123456789012345678901234",
     "INVALID_NAME", "adapter name must match [A-Za-z0-9._-]{1,64}"},
};

#define N_REGS (sizeof REGS / sizeof REGS[0])

INDEX_PARAMS(daemon, register_validation_uses_the_reference_messages, N_REGS)

ParameterizedTest(int *i, daemon, register_validation_uses_the_reference_messages)
{
	const struct reg_case *rc = &REGS[*i];
	struct fixture f;
	msgpack_sbuffer sb;
	msgpack_packer pk;
	char code[64], msg[1024];
	long long id;
	int fd;

	setup(&f, NULL);
	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	msgpack_pack_map(&pk, rc->kind == 3 ? 4 : 5);
	msgpack_pack_str_with_body(&pk, "id", 2);
	msgpack_pack_uint64(&pk, 5);
	msgpack_pack_str_with_body(&pk, "op", 2);
	msgpack_pack_str_with_body(&pk, "register", 8);
	msgpack_pack_str_with_body(&pk, "body_source", 11);
	msgpack_pack_str_with_body(&pk, "def body(c, x):\n    return c, c\n", 33);
	if (rc->kind != 3) {
		msgpack_pack_str_with_body(&pk, "name", 4);
		msgpack_pack_str_with_body(&pk, "ok.name", 7);
	}
	msgpack_pack_str_with_body(&pk, rc->field, strlen(rc->field));
	if (rc->kind == 0)
		msgpack_pack_int64(&pk, rc->value);
	else if (rc->kind == 1)
		rc->value ? msgpack_pack_true(&pk) : msgpack_pack_false(&pk);
	else if (rc->kind == 2)
		msgpack_pack_double(&pk, (double)rc->value);
	else
		msgpack_pack_str_with_body(&pk, rc->name, strlen(rc->name));
	fd = raw_connect(f.d.sock);
	raw_send_frame(fd, sb.data, sb.size);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
	cr_assert_eq(id, 5);
	cr_assert_str_eq(code, rc->code, "%s: %s", code, msg);
	cr_assert_str_eq(msg, rc->message);
	close(fd);
	msgpack_sbuffer_destroy(&sb);
	scan_ok(&f, f.c);
	teardown(&f);
}

/* ---- hostile frames on the socket ---------------------------------------------------- */

struct frame_case {
	const char *bytes;
	size_t len;
	const char *code;
	bool closes;
};

#define FR(lit, code, closes)                                                                      \
	{                                                                                          \
		lit, sizeof(lit) - 1, code, closes                                                 \
	}

static const struct frame_case FRAMES[] = {
    FR("\x7f\xff\xff\xff", "FRAME_TOO_LARGE", true),
    FR("\x00\x00\x00\x01\xc1", "MSGPACK_INVALID", false),
    FR("\x00\x00\x00\x05\xdd\xff\xff\xff\xff", "MSGPACK_COUNT_TOO_LARGE", false),
    FR("\x00\x00\x00\x04\x93\x01\x02\x03", "NOT_A_MAP", false),
    FR("\x00\x00\x00\x08\x81\xa2op\xa3"
       "abc",
       "BAD_ENVELOPE", false),
    FR("\x00\x00\x00\x0d\x82\xa2id\x07\xa2op\xa4"
       "frob",
       "UNKNOWN_OP", false),
};

#define N_FRAMES (sizeof FRAMES / sizeof FRAMES[0])

INDEX_PARAMS(daemon, hostile_frames_get_their_code_and_only_broken_framing_closes, N_FRAMES)

ParameterizedTest(int *i, daemon, hostile_frames_get_their_code_and_only_broken_framing_closes)
{
	const struct frame_case *fc = &FRAMES[*i];
	static const char health[] = "\x82\xa2id\x09\xa2op\xa6"
	                             "health";
	struct fixture f;
	char code[64], msg[1024];
	long long id;
	int fd;

	setup(&f, NULL);
	fd = raw_connect(f.d.sock);
	raw_send(fd, fc->bytes, fc->len);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
	cr_assert_str_eq(code, fc->code, "%s", msg);
	if (fc->closes) {
		cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), -1,
		             "closed after");
	} else {
		raw_send_frame(fd, health, sizeof health - 1);
		cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
		cr_assert_str_eq(code, "", "the connection still serves: %s", msg);
		cr_assert_eq(id, 9);
	}
	close(fd);
	scan_ok(&f, f.c); /* other clients never noticed */
	teardown(&f);
}

/* ---- budgets, replacement, identity ------------------------------------------------------- */

static int scan_shape(struct fixture *f, const char *adapter, int64_t n, struct tl_error *err)
{
	static double buf[64];
	int64_t cs[] = {n}, xs[] = {1, n};
	struct tl_reply *r;
	int rc = tl_scan(f->c, adapter, tl_tensor(f->b, TL_FLOAT64, 1, cs, buf),
	                 tl_tensor(f->b, TL_FLOAT64, 2, xs, buf), &r, err);

	if (rc == 0)
		tl_reply_free(r);
	return rc;
}

Test(daemon, the_budget_is_per_adapter_and_replacement_resets_it)
{
	struct fixture f;
	struct tl_error err;
	char src[] = "def body(c, x):\n    c = c + x\n    return c, c\n";
	struct tl_adapter_def def = {"t4.budget", src, "inline", "body", NULL, 4, 64, 2};
	char cache[512];

	/* a private cache, so that "compiled" below cannot mean "left by an earlier run" */
	h_tmpdir(cache, sizeof cache, "budget");
	hd_start(&f.d, cache, NO_PROBE);
	hd_wait_ready(&f.d, 120);
	f.c = hd_connect(&f.d);
	f.b = tl_builder_new();
	cr_assert_eq(tl_register(f.c, &def, &err), 0);
	cr_assert_eq(scan_shape(&f, "t4.budget", 1, &err), 0, "%s", err.message);
	cr_assert_eq(scan_shape(&f, "t4.budget", 2, &err), 0, "%s", err.message);
	cr_assert_eq(scan_shape(&f, "t4.budget", 3, &err), -1);
	cr_assert_str_eq(err.code, "RECOMPILE_BUDGET_EXHAUSTED");
	cr_assert(strstr(err.message, "carry=[1]") && strstr(err.message, "carry=[2]"),
	          "lists what it holds: %s", err.message);
	cr_assert_eq(scan_shape(&f, "t4.budget", 1, &err), 0, "held graphs still serve");
	/* another adapter with the same body has its own budget and graphs */
	def.name = "t4.budget2";
	cr_assert_eq(tl_register(f.c, &def, &err), 0);
	cr_assert_eq(scan_shape(&f, "t4.budget2", 1, &err), 0, "%s", err.message);
	cr_assert_eq(hd_counter(f.c, "t4.budget2", "compiles"), 1, "not shared with t4.budget");
	/* re-registering the same definition keeps the graphs; a new one replaces */
	def.name = "t4.budget";
	cr_assert_eq(tl_register(f.c, &def, &err), 0);
	cr_assert_eq(scan_shape(&f, "t4.budget", 3, &err), -1);
	def.max_steps = 5;
	cr_assert_eq(tl_register(f.c, &def, &err), 0);
	cr_assert_eq(hd_counter(f.c, "t4.budget", "graphs"), 0, "graphs dropped on replace");
	cr_assert_eq(scan_shape(&f, "t4.budget", 3, &err), 0, "budget starts again: %s",
	             err.message);
	teardown(&f);
}

/* ---- concurrency ---------------------------------------------------------------------- */

static void child_scans(struct fixture *f, int n, const void *want_carry, const void *want_y,
                        int out_fd)
{
	struct tl_client *c;
	struct tl_error err;
	int bad = 0;

	if (tl_connect(f->d.sock, 5000, &c, &err) != 0)
		_exit(2);
	for (int k = 0; k < n; k++) {
		struct tl_reply *r;
		if (tl_scan(c, "t4.cumsum", f->carry_t, f->inputs_t, &r, &err) != 0) {
			bad++;
			continue;
		}
		if (memcmp(tl_tree_data(tl_reply_tree(r, "carry")), want_carry, 32) != 0 ||
		    memcmp(tl_tree_data(tl_reply_tree(r, "outputs")), want_y, 96) != 0)
			bad++;
		tl_reply_free(r);
	}
	tl_close(c);
	if (write(out_fd, &bad, sizeof bad) != sizeof bad)
		_exit(3);
	_exit(0);
}

Test(daemon, thirty_two_client_processes_get_identical_results)
{
	struct fixture f;
	struct tl_reply *r;
	struct tl_error err;
	double want_carry[4], want_y[12];
	int fds[2], total_bad = 0;

	setup(&f, NULL);
	cr_assert_eq(tl_scan(f.c, "t4.cumsum", f.carry_t, f.inputs_t, &r, &err), 0);
	memcpy(want_carry, tl_tree_data(tl_reply_tree(r, "carry")), sizeof want_carry);
	memcpy(want_y, tl_tree_data(tl_reply_tree(r, "outputs")), sizeof want_y);
	tl_reply_free(r);
	cr_assert_eq(pipe(fds), 0);
	for (int p = 0; p < 32; p++)
		if (fork() == 0)
			child_scans(&f, 200, want_carry, want_y, fds[1]);
	close(fds[1]); /* a child that dies without writing gives EOF, not a hang */
	for (int p = 0; p < 32; p++) {
		int bad = -1, status;
		cr_assert_eq(read(fds[0], &bad, sizeof bad), (ssize_t)sizeof bad, "a child died");
		total_bad += bad;
		wait(&status);
		cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	}
	cr_assert_eq(total_bad, 0, "%d of 6400 scans failed or differed", total_bad);
	cr_assert_eq(hd_counter(f.c, "t4.cumsum", "runs"), 6401);
	teardown(&f);
}

static void child_one_scan(const char *sock, int64_t n, int out_fd)
{
	static double buf[64];
	int64_t cs[] = {n}, xs[] = {2, n};
	struct tl_builder *b = tl_builder_new();
	struct tl_client *c;
	struct tl_reply *r;
	struct tl_error err;
	int ok = 0;

	if (tl_connect(sock, 5000, &c, &err) == 0 &&
	    tl_scan(c, "t4.flight", tl_tensor(b, TL_FLOAT64, 1, cs, buf),
	            tl_tensor(b, TL_FLOAT64, 2, xs, buf), &r, &err) == 0) {
		ok = 1;
		tl_reply_free(r);
	}
	if (write(out_fd, &ok, sizeof ok) != sizeof ok)
		_exit(3);
	_exit(0);
}

Test(daemon, sixteen_simultaneous_requests_for_a_new_signature_compile_once)
{
	struct fixture f;
	char cache[512];
	int fds[2], oks = 0;

	h_tmpdir(cache, sizeof cache, "flight"); /* a private cache: the compile really happens */
	hd_start(&f.d, cache, NO_PROBE);
	hd_wait_ready(&f.d, 120);
	f.c = hd_connect(&f.d);
	f.b = tl_builder_new();
	hd_register(f.c, "t4.flight", CUMSUM, "body", 12, 64, 3);
	cr_assert_eq(pipe(fds), 0);
	for (int p = 0; p < 16; p++)
		if (fork() == 0)
			child_one_scan(f.d.sock, 5, fds[1]);
	close(fds[1]);
	for (int p = 0; p < 16; p++) {
		int ok = 0;
		cr_assert_eq(read(fds[0], &ok, sizeof ok), (ssize_t)sizeof ok, "a client died");
		oks += ok;
		wait(NULL);
	}
	cr_assert_eq(oks, 16);
	cr_assert_eq(hd_counter(f.c, "t4.flight", "compiles"), 1, "single flight");
	cr_assert_eq(hd_counter(f.c, "t4.flight", "runs"), 16);
	tl_builder_free(f.b);
	tl_close(f.c);
	cr_assert_eq(hd_stop(&f.d), 0);
}

/* ---- disconnects, a killed worker, shutdown ---------------------------------------------- */

Test(daemon, clients_that_vanish_mid_frame_or_mid_compile_harm_no_one)
{
	static const char partial[] = "\x00\x00\x03\xe8\x82\xa2id\x01";
	struct fixture f;
	struct tl_builder *b;
	int fd;

	setup(&f, NULL);
	fd = raw_connect(f.d.sock);
	raw_send(fd, partial, sizeof partial - 1);
	close(fd);
	/* mid-compile: a child asks for a new signature and dies at once */
	b = tl_builder_new();
	if (fork() == 0) {
		static double buf[16]; /* carry [6] and inputs [2, 6] */
		int64_t cs[] = {6}, xs[] = {2, 6};
		struct tl_client *c;
		struct tl_error err;
		struct tl_reply *r;
		tl_connect(f.d.sock, 5000, &c, &err);
		alarm(1);
		tl_scan(c, "t4.cumsum", tl_tensor(b, TL_FLOAT64, 1, cs, buf),
		        tl_tensor(b, TL_FLOAT64, 2, xs, buf), &r, &err);
		_exit(0);
	}
	wait(NULL);
	scan_ok(&f, f.c);
	{
		static double buf[16]; /* carry [6] and inputs [2, 6] */
		int64_t cs[] = {6}, xs[] = {2, 6};
		struct tl_reply *r;
		struct tl_error err;
		cr_assert_eq(tl_scan(f.c, "t4.cumsum", tl_tensor(b, TL_FLOAT64, 1, cs, buf),
		                     tl_tensor(b, TL_FLOAT64, 2, xs, buf), &r, &err),
		             0, "the abandoned compile still completes: %s", err.message);
		tl_reply_free(r);
	}
	tl_builder_free(b);
	teardown(&f);
}

struct bg_scan {
	const char *sock;
	int64_t n;
	struct tl_error err;
	int rc;
};

static void *bg_scan_thread(void *arg)
{
	struct bg_scan *s = arg;
	static double buf[16];
	int64_t cs[] = {s->n}, xs[] = {2, s->n};
	struct tl_builder *b = tl_builder_new();
	struct tl_client *c;
	struct tl_reply *r = NULL;

	s->rc = tl_connect(s->sock, 5000, &c, &s->err);
	if (s->rc == 0) {
		s->rc = tl_scan(c, "t4.kill", tl_tensor(b, TL_FLOAT64, 1, cs, buf),
		                tl_tensor(b, TL_FLOAT64, 2, xs, buf), &r, &s->err);
		tl_reply_free(r);
		tl_close(c);
	}
	tl_builder_free(b);
	return NULL;
}

Test(daemon, a_worker_killed_mid_compile_fails_that_compile_and_is_replaced)
{
	struct fixture f;
	struct bg_scan s;
	pthread_t th;
	pid_t w;
	char cache[512];

	h_tmpdir(cache, sizeof cache, "kill");
	hd_start(&f.d, cache, NO_PROBE);
	hd_wait_ready(&f.d, 120);
	f.c = hd_connect(&f.d);
	hd_register(f.c, "t4.kill", CUMSUM, "body", 12, 64, 3);
	s = (struct bg_scan){f.d.sock, 7, {{0}}, 0};
	pthread_create(&th, NULL, bg_scan_thread, &s);
	sleep(2); /* the compile is under way */
	w = h_child_of(f.d.pid);
	cr_assert_gt(w, 0, "found the worker");
	kill(-w, SIGKILL);
	pthread_join(th, NULL);
	cr_assert_eq(s.rc, -1);
	cr_assert_str_eq(s.err.code, "WORKER_CRASHED", "%s", s.err.message);
	s.rc = 0;
	bg_scan_thread(&s); /* the next request recompiles on a new worker */
	cr_assert_eq(s.rc, 0, "%s %s", s.err.code, s.err.message);
	cr_assert_neq(h_child_of(f.d.pid), w);
	tl_close(f.c);
	cr_assert_eq(hd_stop(&f.d), 0);
}

Test(daemon, sigterm_with_requests_in_flight_sends_no_truncated_reply)
{
	struct fixture f;
	int fds[8];
	struct stat st;

	setup(&f, NULL);
	scan_ok(&f, f.c);
	for (int k = 0; k < 8; k++) {
		static const char health[] = "\x82\xa2id\x01\xa2op\xa6"
		                             "health";
		fds[k] = raw_connect(f.d.sock);
		for (int m = 0; m < 50; m++)
			raw_send_frame(fds[k], health, sizeof health - 1);
	}
	kill(f.d.pid, SIGTERM);
	for (int k = 0; k < 8; k++) {
		char code[64], msg[512];
		long long id;
		int n = 0;
		while (raw_recv(fds[k], code, sizeof code, &id, msg, sizeof msg) == 0) {
			cr_assert(code[0] == '\0' || strcmp(code, "SHUTTING_DOWN") == 0, "%s",
			          code);
			n++;
		}
		cr_assert_leq(n, 50); /* every frame read was whole (raw_recv asserts) */
		close(fds[k]);
	}
	tl_builder_free(f.b);
	tl_close(f.c);
	cr_assert_eq(hd_stop(&f.d), 0);
	cr_assert_neq(stat(f.d.sock, &st), 0, "the socket file is removed");
}

/*
 * A supervisor may repeat its stop request, and a harness may follow the
 * `shutdown` op with SIGTERM: no signal may kill a daemon that is stopping.  (libuv restores
 * SIG_DFL when a uv_signal_t closes; the daemon used to close its handles during shutdown, and a
 * SIGTERM in the gap killed it: seen once under ASan.  Its signals now go to one sigwait thread.)
 * Graph runs first, so that the pool and OpenMP threads exist.
 */
Test(daemon, signals_flooding_a_stopping_daemon_never_kill_it)
{
	static const int sigs[] = {SIGTERM, SIGINT, SIGHUP};
	struct fixture f;
	int status = 0;
	pid_t got = 0, flooder;
	time_t end;

	setup(&f, NULL);
	scan_ok(&f, f.c);
	scan_ok(&f, f.c);
	kill(f.d.pid, SIGHUP); /* no --adapters: a reload that has nothing to do */
	scan_ok(&f, f.c);      /* and the daemon still serves */
	/* a child floods while this thread reaps: the first SIGTERM starts the
	 * shutdown and the rest land during it (a few µs wide, before the fix) */
	flooder = fork();
	cr_assert_neq(flooder, -1);
	if (flooder == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		for (long k = 0;; k++)
			if (kill(f.d.pid, k % 8 == 7 ? sigs[1 + k % 2] : SIGTERM) != 0)
				_exit(0);
	}
	end = time(NULL) + 120;
	while ((got = waitpid(f.d.pid, &status, WNOHANG)) == 0 && time(NULL) < end)
		usleep(1000);
	kill(flooder, SIGKILL);
	waitpid(flooder, NULL, 0);
	cr_assert_eq(got, f.d.pid, "the daemon did not stop within 120 s; log %s", f.d.log);
	f.d.pid = 0;
	cr_assert(WIFEXITED(status), "torchloopd died of signal %d; log %s",
	          WIFSIGNALED(status) ? WTERMSIG(status) : 0, f.d.log);
	cr_assert_eq(WEXITSTATUS(status), 0, "log %s", f.d.log);
	tl_builder_free(f.b);
	tl_close(f.c);
}

Test(daemon, a_restart_on_a_warm_cache_scans_without_compiling)
{
	struct fixture f;

	setup(&f, NULL);
	scan_ok(&f, f.c);
	teardown(&f);
	setup(&f, NULL);
	scan_ok(&f, f.c);
	cr_assert_eq(hd_counter(f.c, "t4.cumsum", "compiles"), 0);
	cr_assert_eq(hd_counter(f.c, "t4.cumsum", "cache_hits"), 1);
	teardown(&f);
}

Test(daemon, preloaded_adapters_have_their_cached_graphs_loaded_before_ready)
{
	char cache[512], dir[512];
	const char *args[] = {"--no-probe", "--adapters", dir, NULL};
	struct fixture f;
	json_t *j, *sp;

	h_tmpdir(cache, sizeof cache, "warm");
	h_tmpdir(dir, sizeof dir, "warmdir");
	write_adapter(dir, "t4.cumsum");
	hd_start(&f.d, cache, args);
	hd_wait_ready(&f.d, 120);
	f.c = hd_connect(&f.d);
	f.b = tl_builder_new();
	h_fill(f.carry, TL_FLOAT64, 4, 11);
	h_fill(f.xs, TL_FLOAT64, 12, 12);
	f.carry_t = tl_tensor(f.b, TL_FLOAT64, 1, (int64_t[]){4}, f.carry);
	f.inputs_t = tl_tensor(f.b, TL_FLOAT64, 2, (int64_t[]){3, 4}, f.xs);
	scan_ok(&f, f.c); /* compiles into the private cache */
	tl_close(f.c);
	cr_assert_eq(hd_stop(&f.d), 0);
	hd_start(&f.d, cache, args);
	hd_wait_ready(&f.d, 120);
	f.c = hd_connect(&f.d);
	j = h_call_json(f.c, "describe", "t4.cumsum"); /* before any scan */
	sp = json_array_get(json_object_get(j, "specializations"), 0);
	cr_assert_not_null(sp, "the graph was loaded at start");
	cr_assert_str_eq(json_string_value(json_object_get(sp, "state")), "ready");
	cr_assert(json_is_true(json_object_get(sp, "from_cache")));
	json_decref(j);
	scan_ok(&f, f.c);
	cr_assert_eq(hd_counter(f.c, "t4.cumsum", "compiles"), 0);
	teardown(&f);
}

Test(daemon, a_compile_request_warms_a_specialization_from_shapes_alone)
{
	struct fixture f;
	struct tl_reply *r;
	struct tl_error err;
	int64_t cs[] = {4}, xs[] = {3, 4};

	setup(&f, NULL);
	cr_assert_eq(tl_compile(f.c, "t4.cumsum", tl_tensor(f.b, TL_FLOAT64, 1, cs, NULL),
	                        tl_tensor(f.b, TL_FLOAT64, 2, xs, NULL), TL_FLOAT64, 0, &r, &err),
	             0, "%s", err.message);
	tl_reply_free(r);
	scan_ok(&f, f.c);
	cr_assert_eq(hd_counter(f.c, "t4.cumsum", "graphs"), 1, "the scan used the warmed graph");
	teardown(&f);
}

/* ---- the socket ------------------------------------------------------------------------- */

Test(daemon, a_second_instance_on_a_live_socket_exits_nonzero_and_unlinks_nothing)
{
	struct fixture f;
	struct hd second;
	const char *args[] = {"--no-probe", "--socket", NULL, NULL};
	struct stat st;
	int status;

	setup(&f, NULL);
	args[2] = f.d.sock;
	hd_start(&second, NULL, args);
	cr_assert_eq(waitpid(second.pid, &status, 0), second.pid);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0);
	cr_assert_eq(stat(f.d.sock, &st), 0, "the live socket is still there");
	scan_ok(&f, f.c);
	teardown(&f);
}

Test(daemon, a_stale_socket_is_replaced_but_a_regular_file_is_not)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	char dir[512], path[600];
	const char *args[] = {"--no-probe", "--socket", path, NULL};
	struct hd d;
	int fd, status;

	h_tmpdir(dir, sizeof dir, "stale");
	snprintf(path, sizeof path, "%s/s.sock", dir);
	cr_assert_lt(strlen(path), sizeof sa.sun_path);
	memcpy(sa.sun_path, path, strlen(path) + 1);
	fd = socket(AF_UNIX, SOCK_STREAM, 0);
	cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
	close(fd); /* bound, never listening: stale */
	hd_start(&d, NULL, args);
	memcpy(d.sock, path, strlen(path) + 1);
	hd_wait_ready(&d, 120);
	cr_assert_eq(hd_stop(&d), 0);
	fd = open(path, O_CREAT | O_WRONLY, 0644);
	close(fd);
	hd_start(&d, NULL, args);
	cr_assert_eq(waitpid(d.pid, &status, 0), d.pid);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0, "refuses a non-socket file");
	cr_assert_eq(access(path, F_OK), 0, "and leaves it alone");
}

Test(daemon, a_socket_path_over_107_bytes_is_a_clear_error)
{
	char path[200];
	const char *args[] = {"--no-probe", "--socket", path, NULL};
	struct hd d;
	int status;
	FILE *log;
	char line[4096];
	bool said = false;

	memset(path, 'x', sizeof path);
	path[0] = '/';
	path[150] = '\0';
	hd_start(&d, NULL, args);
	cr_assert_eq(waitpid(d.pid, &status, 0), d.pid);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0);
	log = fopen(d.log, "r");
	while (log && fgets(line, sizeof line, log))
		said |= strstr(line, "at most 107") != NULL;
	if (log)
		fclose(log);
	cr_assert(said, "the log says why");
}

/* ---- access control --------------------------------------------------------------------- */

Test(daemon, admin_ops_from_another_uid_are_refused_but_scans_work)
{
	struct fixture f;
	int fds[2];
	char results[4][48];

	if (getuid() != 0)
		cr_skip_test("needs root to switch uid");
	setup(&f, NULL);
	chmod(f.d.dir, 0755);
	cr_assert_eq(pipe(fds), 0);
	if (fork() == 0) {
		struct tl_client *c;
		struct tl_error err;
		struct tl_reply *r;
		struct tl_adapter_def def = {
		    "t4.evil", "def body(c, x):\n    return c, c\n", NULL, NULL, NULL, 0, 0, 0};
		struct tl_builder *b = tl_builder_new();
		char out[4][48] = {"", "", "", ""};
		if (setgid(65534) != 0 || setuid(65534) != 0)
			_exit(2);
		if (tl_connect(f.d.sock, 5000, &c, &err) != 0)
			_exit(3);
		snprintf(out[0], 48, "%s", tl_register(c, &def, &err) ? err.code : "OK");
		snprintf(out[1], 48, "%s", tl_unregister(c, "t4.cumsum", &err) ? err.code : "OK");
		snprintf(out[2], 48, "%s",
		         tl_scan(c, "t4.cumsum", f.carry_t, f.inputs_t, &r, &err) ? err.code
		                                                                  : "OK");
		/* compile spends budget without data: admin only */
		snprintf(out[3], 48, "%s",
		         tl_compile(c, "t4.cumsum",
		                    tl_tensor(b, TL_FLOAT64, 1, (int64_t[]){5}, NULL),
		                    tl_tensor(b, TL_FLOAT64, 2, (int64_t[]){3, 5}, NULL),
		                    TL_FLOAT64, 0, &r, &err)
		             ? err.code
		             : "OK");
		if (write(fds[1], out, sizeof out) != sizeof out)
			_exit(4);
		_exit(0);
	}
	close(fds[1]);
	cr_assert_eq(read(fds[0], results, sizeof results), (ssize_t)sizeof results,
	             "the uid-65534 child could not connect (is the scratch dir traversable?)");
	wait(NULL);
	cr_assert_str_eq(results[0], "PERMISSION_DENIED");
	cr_assert_str_eq(results[1], "PERMISSION_DENIED");
	cr_assert_str_eq(results[2], "OK", "a non-admin peer can still scan");
	cr_assert_str_eq(results[3], "PERMISSION_DENIED");
	cr_assert_eq(hd_counter(f.c, "t4.cumsum", "graphs"), 1, "no budget was spent");
	scan_ok(&f, f.c);
	teardown(&f);
}

/* ---- the adapters directory -------------------------------------------------------------- */

Test(daemon, the_adapters_directory_is_registered_at_start_and_reloaded_on_sighup)
{
	char dir[512], path[600];
	const char *args[] = {"--no-probe", "--adapters", dir, NULL};
	struct hd d;
	struct tl_client *c;
	json_t *j;

	h_tmpdir(dir, sizeof dir, "adapters");
	write_adapter(dir, "dir.one");
	hd_start(&d, NULL, args);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	j = h_call_json(c, "list", NULL);
	cr_assert_eq(json_array_size(json_object_get(j, "adapters")), 1);
	json_decref(j);
	write_adapter(dir, "dir.two");
	snprintf(path, sizeof path, "%s/dir.one.adapter", dir);
	unlink(path);
	kill(d.pid, SIGHUP);
	for (int k = 0; k < 50; k++) {
		j = h_call_json(c, "list", NULL);
		if (json_array_size(json_object_get(j, "adapters")) == 1 &&
		    strcmp(json_string_value(json_object_get(
		               json_array_get(json_object_get(j, "adapters"), 0), "name")),
		           "dir.two") == 0) {
			json_decref(j);
			break;
		}
		json_decref(j);
		cr_assert_lt(k, 49, "reload did not happen");
		usleep(100000);
	}
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
}

/* ---- the request path: inline runs, pipelining, backpressure --------------------- */

/* The bytes of one scan request frame (header included) for t4.cumsum. */
static uint8_t *scan_frame_bytes(struct fixture *f, uint64_t id, size_t *len)
{
	struct tree_node carry = {.kind = TREE_TENSOR}, inputs = {.kind = TREE_TENSOR};
	struct writer w;
	struct iovec iov[16];
	struct proto_err err;
	uint8_t *out;
	int n;

	carry.tensor = (struct tree_tensor){PROTO_DTYPE_F64, 1, {4}, 0, 0, f->carry};
	inputs.tensor = (struct tree_tensor){PROTO_DTYPE_F64, 2, {3, 4}, 0, 0, f->xs};
	cr_assert_eq(tree_tensor_sizes(&carry.tensor), 0);
	cr_assert_eq(tree_tensor_sizes(&inputs.tensor), 0);
	cr_assert_eq(writer_init(&w), 0);
	msg_begin_request(&w, id, "scan", 3);
	writer_key_str(&w, "adapter", "t4.cumsum");
	writer_str(&w, "carry");
	tree_encode(&w, &carry);
	writer_str(&w, "inputs");
	tree_encode(&w, &inputs);
	n = writer_finish(&w, iov, 16, PROTO_FRAME_MAX, &err);
	cr_assert_gt(n, 0, "%s", err.message);
	*len = 0;
	for (int i = 0; i < n; i++)
		*len += iov[i].iov_len;
	out = malloc(*len);
	for (size_t i = 0, at = 0; i < (size_t)n; at += iov[i].iov_len, i++)
		memcpy(out + at, iov[i].iov_base, iov[i].iov_len);
	writer_destroy(&w);
	return out;
}

/* Checks one raw scan reply by hand (carry + running sums); returns its id. */
static uint64_t check_scan_reply(struct fixture *f, int fd)
{
	uint8_t *body;
	struct msg m;
	struct tree_node fin;
	struct proto_err err;
	const double *got;

	uint64_t id;

	cr_assert_eq(raw_recv_msg(fd, &body, &m), 0, "a reply is missing");
	cr_assert(!m.is_error && m.has_id, "error reply (%d) or no id", m.is_error);
	id = m.id;
	cr_assert_eq(tree_decode(msg_obj_field(msg_field(&m, "result"), "carry"), m.up.zone,
	                         "carry", &fin, &err),
	             0, "%s", err.message);
	got = fin.tensor.data;
	for (int k = 0; k < 4; k++)
		cr_assert_float_eq(got[k], f->carry[k] + f->xs[k] + f->xs[4 + k] + f->xs[8 + k],
		                   1e-12);
	msg_destroy(&m);
	frame_free(body);
	return id;
}

/*
 * Thousands of small scans pipelined on one connection whose client does not
 * read: the replies pile up past --write-queue-cap, the daemon stops reading
 * that connection (with requests still staged from its last read) and serves
 * others; once the client drains its replies every one arrives whole, once,
 * with the right numbers (replies may overtake each other: match by id).  The graph is µs-scale, so
 * after its first runs it runs on the loop thread (stats.inline_runs).
 */
Test(daemon, pipelined_scans_past_the_write_queue_cap_pause_then_all_arrive)
{
	/* --inline-run-us at its maximum: whether these µs-scale runs stay on the
	 * loop must not depend on how fast this machine (or ASan) runs them */
	static const char *const args[] = {"--no-probe", "--socket-mode",
	                                   "0666",       "--write-queue-cap",
	                                   "1048576",    "--max-inflight",
	                                   "4096",       "--inline-run-us",
	                                   "100000",     NULL};
	enum { N_REQ = 12000 };
	struct fixture f;
	size_t one;
	uint8_t *frame;
	int fd;
	pid_t writer;
	uint64_t breaches0;
	static bool seen[N_REQ + 1];

	setup(&f, args);
	scan_ok(&f, f.c);
	breaches0 = h_stat(f.c, "limit_breaches");
	fd = raw_connect(f.d.sock);
	frame = scan_frame_bytes(&f, 1, &one);
	writer = fork();
	if (writer == 0) { /* blocks once the daemon stops reading; ids 1..N_REQ */
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		for (uint64_t id = 1; id <= N_REQ; id++) {
			free(frame);
			frame = scan_frame_bytes(&f, id, &one);
			raw_send(fd, frame, one);
		}
		_exit(0);
	}
	for (int i = 0; i < 600 && h_stat(f.c, "limit_breaches") == breaches0; i++)
		usleep(50 * 1000);
	cr_assert_gt(h_stat(f.c, "limit_breaches"), breaches0,
	             "the write queue passed its cap and the connection's reads paused");
	scan_ok(&f, f.c); /* other connections are served meanwhile */
	for (int i = 0; i < N_REQ; i++) {
		uint64_t id = check_scan_reply(&f, fd);
		cr_assert(id >= 1 && id <= N_REQ && !seen[id], "id %llu unexpected or repeated",
		          (unsigned long long)id);
		seen[id] = true;
	}
	cr_assert_eq(waitpid(writer, NULL, 0), writer);
	cr_assert_gt(h_stat(f.c, "inline_runs"), N_REQ / 2, "µs-scale runs stay on the loop");
	close(fd);
	free(frame);
	scan_ok(&f, f.c);
	teardown(&f);
}

/* --inline-run-us 0 keeps every run on the pool; the numbers are the same. */
Test(daemon, inline_runs_can_be_switched_off)
{
	static const char *const args[] = {"--no-probe", "--inline-run-us", "0", NULL};
	struct fixture f;

	setup(&f, args);
	for (int i = 0; i < 20; i++)
		scan_ok(&f, f.c);
	cr_assert_eq(h_stat(f.c, "inline_runs"), 0);
	teardown(&f);
}

/*
 * Frames staged from one read: two good requests, then a header announcing a
 * frame over --max-frame, all in one write.  Both requests are answered, then
 * FRAME_TOO_LARGE (no id), then the connection closes; others are served.
 */
Test(daemon, a_broken_frame_after_good_ones_in_one_read_answers_them_then_closes)
{
	static const char h1[] = "\x82\xa2id\x01\xa2op\xa6"
	                         "health",
	                  h2[] = "\x82\xa2id\x02\xa2op\xa6"
	                         "health";
	uint8_t bytes[2 * (4 + sizeof h1) + 4], *p = bytes;
	struct fixture f;
	char code[64], msg[1024];
	long long id;
	int fd;

	setup(&f, NULL);
	frame_put_header(p, sizeof h1 - 1);
	memcpy(p + 4, h1, sizeof h1 - 1);
	p += 4 + sizeof h1 - 1;
	frame_put_header(p, sizeof h2 - 1);
	memcpy(p + 4, h2, sizeof h2 - 1);
	p += 4 + sizeof h2 - 1;
	frame_put_header(p, 0x7fffffff); /* over the default 64 MiB max-frame */
	p += 4;
	fd = raw_connect(f.d.sock);
	raw_send(fd, bytes, (size_t)(p - bytes));
	for (long long want = 1; want <= 2; want++) {
		cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
		cr_assert_str_eq(code, "", "%s", msg);
		cr_assert_eq(id, want);
	}
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
	cr_assert_str_eq(code, "FRAME_TOO_LARGE", "%s", msg);
	cr_assert_eq(id, -1);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), -1, "closed after");
	close(fd);
	scan_ok(&f, f.c);
	teardown(&f);
}

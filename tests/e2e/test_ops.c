/*
 * test_ops.c - torchloopd's ops: every op answers, every validation error (with its code,
 * its leaf path, and the next request still served), hostile frames, budgets
 * and replacement, and the compile op.
 *
 * Most tests reuse one cheap specialization (t4.cumsum, float64, T=3,
 * carry [4]; fixture.h) so the file compiles only a handful of graphs per run.
 */
#include "fixture.h"
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

TestSuite(ops, .timeout = 900);

/* ---- every op ------------------------------------------------------------------ */

Test(ops, every_op_answers)
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
	/* a kind outside enum tl_graph_kind is refused before anything is sent */
	cr_assert_eq(tl_compile(f.c, "t4.cumsum", f.carry_t, f.inputs_t, TL_FLOAT64,
	                        (enum tl_graph_kind)7, &r, &err),
	             -1);
	cr_assert_str_eq(err.code, "INVALID_ARGUMENT");
	cr_assert_str_eq(err.path, "kind");
	cr_assert_eq(tl_compile(f.c, "t4.cumsum", f.carry_t, f.inputs_t, TL_FLOAT64, TL_GRAPH_SCAN,
	                        &r, &err),
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

Test(ops, a_protocol_mismatch_is_refused_naming_both_versions)
{
	struct fixture f;
	char code[64], msg[1024];
	long long id;
	int fd;

	fd = setup_raw(&f, NULL);
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

/* The required fields request.c reads for several ops (request_adapter,
 * request_i64): missing, mistyped or naming nothing, each gets its code and
 * message, and the same connection and the daemon serve on. */
#define REQ(lit, code, text)                                                                       \
	{                                                                                          \
		lit, sizeof lit - 1, code, text                                                    \
	}
static const struct {
	const char *frame;
	size_t len;
	const char *code, *text;
} REQUIRED[] = {
    REQ("\x82\xa2id\x01\xa2op\xa7"
        "compile",
        "INVALID_ARGUMENT", "request has no adapter"),
    REQ("\x83\xa2id\x02\xa2op\xa7"
        "compile\xa7"
        "adapter\x05",
        "INVALID_ARGUMENT", "adapter must be a string"),
    REQ("\x83\xa2id\x03\xa2op\xa7"
        "compile\xa7"
        "adapter\xa4nope",
        "NOT_FOUND", "no adapter named 'nope'"),
    REQ("\x82\xa2id\x04\xa2op\xa5hello", "INVALID_ARGUMENT", "hello needs protocol (an integer)"),
    REQ("\x83\xa2id\x05\xa2op\xa5hello\xa8protocol\xa1x", "INVALID_ARGUMENT",
        "protocol must be an integer"),
    REQ("\x82\xa2id\x06\xa2op\xa6"
        "attach",
        "INVALID_ARGUMENT", "attach needs size (bytes, an integer)"),
};

Test(ops, required_fields_missing_or_mistyped_get_their_code_and_the_daemon_serves_on)
{
	static const char hello[] = "\x83\xa2id\x07\xa2op\xa5hello\xa8protocol\x01";
	struct fixture f;
	char code[64], msg[1024];
	long long id;
	int fd = setup_raw(&f, NULL);

	for (size_t i = 0; i < sizeof REQUIRED / sizeof REQUIRED[0]; i++) {
		raw_send_frame(fd, REQUIRED[i].frame, REQUIRED[i].len);
		cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0, "case %zu",
		             i);
		cr_assert_eq(id, (long long)i + 1);
		cr_assert_str_eq(code, REQUIRED[i].code, "case %zu: %s", i, msg);
		cr_assert_str_eq(msg, REQUIRED[i].text, "case %zu", i);
	}
	raw_send_frame(fd, hello, sizeof hello - 1);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
	cr_assert_eq(id, 7);
	cr_assert_str_eq(code, "", "the same connection is served: %s", msg);
	close(fd);
	scan_ok(&f, f.c);
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

/* One bad scan on the fixture's daemon: its code and leaf path, then the
 * same connection still serves. */
static void check_bad_scan(struct fixture *f, int i)
{
	static float f32[4];
	static double big[200], x1[12];
	struct tl_reply *r;
	struct tl_error err;
	struct tl_tree *carry, *inputs, *items[2];
	const char *ab[] = {"a", "b"};
	const char *adapter = "t4.cumsum";
	int64_t s4[] = {4}, s34[] = {3, 4}, s24[] = {2, 4}, s0[] = {0, 4}, s13[] = {13, 4},
	        s20[] = {12, 6}, s100[] = {100}, s121[] = {12, 1};

	carry = f->carry_t;
	inputs = f->inputs_t;
	switch (i) {
	case B_NOT_FOUND:
		adapter = "no.such";
		break;
	case B_DTYPE:
		carry = tl_tensor(f->b, TL_FLOAT32, 1, s4, f32);
		break;
	case B_NO_INPUTS:
		inputs = tl_none(f->b);
		break;
	case B_RANK0:
		items[0] = f->inputs_t;
		items[1] = tl_tensor(f->b, TL_FLOAT64, 0, NULL, big);
		inputs = tl_dict(f->b, 2, ab, items);
		break;
	case B_LENGTHS:
		items[0] = f->inputs_t;
		items[1] = tl_tensor(f->b, TL_FLOAT64, 2, s24, big);
		inputs = tl_dict(f->b, 2, ab, items);
		break;
	case B_TOO_MANY_STEPS:
		inputs = tl_tensor(f->b, TL_FLOAT64, 2, s13, big);
		break;
	case B_ZERO_STEPS:
		inputs = tl_tensor(f->b, TL_FLOAT64, 2, s0, big);
		break;
	case B_INPUT_ELEMENTS:
		inputs = tl_tensor(f->b, TL_FLOAT64, 2, s20, big);
		break;
	case B_CARRY_ELEMENTS:
		items[0] = f->carry_t;
		items[1] = tl_tensor(f->b, TL_FLOAT64, 1, s100, big);
		carry = tl_list(f->b, 2, items);
		break;
	case B_OUTPUT_ELEMENTS: /* inputs 12 elements, stacked outputs 12 x 4 = 48 > 40 */
		hd_register(f->c, "t4.small", CUMSUM, "body", 12, 40, 3);
		adapter = "t4.small";
		inputs = tl_tensor(f->b, TL_FLOAT64, 2, s121, x1);
		break;
	}
	(void)s34;
	cr_assert_eq(tl_scan(f->c, adapter, carry, inputs, &r, &err), -1, "case %d accepted", i);
	cr_assert_str_eq(err.code, BAD[i].code, "case %d: got %s: %s", i, err.code, err.message);
	cr_assert_str_eq(err.path, BAD[i].path, "path of %s: %s", err.code, err.message);
	cr_assert(strstr(err.message, BAD[i].path) != NULL, "the message names the leaf: %s",
	          err.message);
	scan_ok(f, f->c); /* the same connection still serves */
}

/* Every bad scan in turn on one daemon. */
Test(ops, each_bad_scan_gets_its_code_and_leaf_path)
{
	struct fixture f;

	setup(&f, NULL);
	for (int i = 0; i < N_BAD; i++)
		check_bad_scan(&f, i);
	teardown(&f);
}

struct reg_case {
	const char *field;
	int kind; /* 0 int, 1 bool, 2 float, 3 string name, 4 another string field */
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
    {"strategy", 4, 0, "while", "INVALID_ARGUMENT",
     "strategy must be \"unroll\", \"scan\" or \"chunk\""},
};

#define N_REGS (sizeof REGS / sizeof REGS[0])

/* One bad register on its own connection: the reference's code and message. */
static void check_bad_register(struct fixture *f, const struct reg_case *rc)
{
	msgpack_sbuffer sb;
	msgpack_packer pk;
	char code[64], msg[1024];
	long long id;
	int fd;

	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	msgpack_pack_map(&pk, rc->kind == 3 ? 4 : 5);
	msgpack_pack_str_with_body(&pk, "id", 2);
	msgpack_pack_uint64(&pk, 5);
	msgpack_pack_str_with_body(&pk, "op", 2);
	msgpack_pack_str_with_body(&pk, "register", 8);
	msgpack_pack_str_with_body(&pk, "body_source", 11);
	msgpack_pack_str_with_body(&pk, "def body(c, x):\n    return c, c\n", 32);
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
	fd = raw_connect(f->d.sock);
	raw_send_frame(fd, sb.data, sb.size);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
	cr_assert_eq(id, 5);
	cr_assert_str_eq(code, rc->code, "%s: %s: %s", rc->field, code, msg);
	cr_assert_str_eq(msg, rc->message);
	close(fd);
	msgpack_sbuffer_destroy(&sb);
	scan_ok(f, f->c);
}

/* Every bad register in turn on one daemon, which serves on after each. */
Test(ops, register_validation_uses_the_reference_messages)
{
	struct fixture f;

	setup(&f, NULL);
	for (size_t i = 0; i < N_REGS; i++)
		check_bad_register(&f, &REGS[i]);
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

/* One hostile frame on its own connection; other clients never notice. */
static void check_hostile_frame(struct fixture *f, const struct frame_case *fc)
{
	static const char health[] = "\x82\xa2id\x09\xa2op\xa6"
	                             "health";
	char code[64], msg[1024];
	long long id;
	int fd;

	fd = raw_connect(f->d.sock);
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
	scan_ok(f, f->c); /* other clients never noticed */
}

/* Every hostile frame in turn on one daemon. */
Test(ops, hostile_frames_get_their_code_and_only_broken_framing_closes)
{
	struct fixture f;

	setup(&f, NULL);
	for (size_t i = 0; i < N_FRAMES; i++)
		check_hostile_frame(&f, &FRAMES[i]);
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

Test(ops, the_budget_is_per_adapter_and_replacement_resets_it)
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

Test(ops, a_compile_request_warms_a_specialization_from_shapes_alone)
{
	struct fixture f;
	struct tl_reply *r;
	struct tl_error err;
	int64_t cs[] = {4}, xs[] = {3, 4};

	setup(&f, NULL);
	cr_assert_eq(tl_compile(f.c, "t4.cumsum", tl_tensor(f.b, TL_FLOAT64, 1, cs, NULL),
	                        tl_tensor(f.b, TL_FLOAT64, 2, xs, NULL), TL_FLOAT64, TL_GRAPH_SCAN,
	                        &r, &err),
	             0, "%s", err.message);
	tl_reply_free(r);
	scan_ok(&f, f.c);
	cr_assert_eq(hd_counter(f.c, "t4.cumsum", "graphs"), 1, "the scan used the warmed graph");
	teardown(&f);
}

/* ---- log lines -------------------------------------------------------------------- */

/* The daemon's log: whether a line starts with head, and whether one holds
 * needle; *raw: whether any byte is a CR or an ESC. */
static void scan_log(const char *path, const char *head, const char *needle, bool *starts,
                     bool *holds, bool *raw)
{
	char *text = h_slurp(path);

	*starts = *holds = false;
	*raw = strchr(text, '\r') != NULL || strchr(text, '\x1b') != NULL;
	for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
		*starts |= strncmp(line, head, strlen(head)) == 0;
		*holds |= strstr(line, needle) != NULL;
	}
	free(text);
}

Test(ops, request_text_and_worker_output_cannot_forge_a_log_line)
{
	/* an op name (echoed by UNKNOWN_OP's message, logged) and a body whose
	 * import writes to the worker's stderr: each with a line of its own */
	static const char op[] = "x\ntorchloopd: warn forged\r\x1b[";
	static const char *const src = "import sys\n"
	                               "sys.stderr.write('noise\\ntorchloopd: warn forged too"
	                               "\\r\\x1b[2J\\n')\n"
	                               "sys.stderr.flush()\n"
	                               "def body(c, x):\n"
	                               "    return c + x, c\n";
	char text[512]; /* imported at this register: a text no check remembers */
	struct tl_adapter_def def = {"t4.noisy", text, NULL, NULL, NULL, 12, 64, 3, NULL};
	struct fixture f;
	struct writer w;
	struct proto_err perr;
	struct tl_error err;
	char code[64], msg[1024];
	uint8_t *frame;
	size_t len;
	long long id;
	bool starts, holds, raw;
	int fd = setup_raw(&f, NULL);

	h_unchecked_src(text, sizeof text, src);
	cr_assert_eq(writer_init(&w), 0);
	msg_begin_request(&w, 5, op, 0);
	frame = writer_flatten(&w, &len, PROTO_FRAME_MAX, &perr);
	writer_destroy(&w);
	raw_send(fd, frame, len);
	free(frame);
	cr_assert_eq(raw_recv(fd, code, sizeof code, &id, msg, sizeof msg), 0);
	cr_assert_str_eq(code, "UNKNOWN_OP", "%s", msg);
	close(fd);
	cr_assert_eq(tl_register(f.c, &def, &err), 0, "%s %s", err.code, err.message);
	/* the worker's stderr is read on the loop, beside its reply: wait for it */
	for (int k = 0; k < 200; k++) {
		scan_log(f.d.log, "torchloopd: warn forged", "forged too\\x0d\\x1b[2J\"", &starts,
		         &holds, &raw);
		if (holds)
			break;
		usleep(50000);
	}
	cr_assert(holds, "the worker's line is relayed, quoted and escaped; log %s", f.d.log);
	cr_assert_not(starts, "no line of the log starts with the forged text; log %s", f.d.log);
	cr_assert_not(raw, "no CR or ESC byte reaches the log; log %s", f.d.log);
	scan_log(f.d.log, "torchloopd: info compile worker ",
	         "UNKNOWN_OP: unknown op 'x\\x0atorchloopd: warn forged\\x0d\\x1b['", &starts,
	         &holds, &raw);
	cr_assert(starts, "worker lines are relayed under the daemon's prefix; log %s", f.d.log);
	cr_assert(holds, "the refused op is logged on its line, escaped; log %s", f.d.log);
	scan_ok(&f, f.c);
	teardown(&f);
}

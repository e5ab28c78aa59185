/*
 * test_proto_msg.c - the envelope: malformed bodies (one code per class),
 * unknown ops, typed getters that refuse bools and floats as integers, error
 * replies and notifications round-tripping, and a stream that stays usable
 * after a malformed (but well-framed) message.
 */
#include "helpers.h"

#include <criterion/criterion.h>
#include "params.h"
#include "utf8.h"
#include <string.h>

TestSuite(msg, .timeout = 30);

struct raw_case {
	const char *name;
	const char *bytes;
	size_t len;
	enum proto_code code;
};

#define RAW(name, lit, code)                                                                       \
	{                                                                                          \
		name, lit, sizeof(lit) - 1, PROTO_E_##code                                         \
	}

/* Criterion re-executes the binary per test, so parameters carry indices. */
static const struct raw_case RAWS[] = {
    RAW("array top level", "\x93\x01\x02\x03", NOT_A_MAP),
    RAW("string top level", "\xa2hi", NOT_A_MAP),
    RAW("reserved byte", "\xc1", MSGPACK_INVALID),
    RAW("truncated map", "\x81\xa2id", MSGPACK_INVALID),
    RAW("truncated str", "\x82\xa2id\x07\xa2o", MSGPACK_INVALID),
    RAW("trailing bytes", "\x80\x00", MSGPACK_INVALID),
    RAW("5-byte array32 bomb", "\xdd\xff\xff\xff\xff", MSGPACK_COUNT_TOO_LARGE),
    RAW("map16 over the bytes", "\xde\x00\x10\xc0\xc0", MSGPACK_COUNT_TOO_LARGE),
    RAW("bin32 over the bytes", "\x81\xa1x\xc6\x7f\xff\xff\xff", MSGPACK_INVALID),
    RAW("missing id", "\x81\xa2op\xa4scan", BAD_ENVELOPE),
    RAW("string id", "\x82\xa2id\xa1x\xa2op\xa4scan", BAD_ENVELOPE),
    RAW("negative id", "\x82\xa2id\xff\xa2op\xa4scan", BAD_ENVELOPE),
    RAW("float id", "\x82\xa2id\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00\xa2op\xa4scan", BAD_ENVELOPE),
    RAW("bool id", "\x82\xa2id\xc3\xa2op\xa4scan", BAD_ENVELOPE),
    RAW("missing op", "\x81\xa2id\x07", BAD_ENVELOPE),
    RAW("integer op", "\x82\xa2id\x07\xa2op\x05", BAD_ENVELOPE),
    RAW("empty op", "\x82\xa2id\x07\xa2op\xa0", BAD_ENVELOPE),
};

TABLE_TEST(msg, malformed_envelopes_get_their_own_code, RAWS)
{
	const struct raw_case *c = &RAWS[*i];
	struct msg m;
	struct proto_err err;
	uint8_t *body = frame_alloc(c->len);

	memcpy(body, c->bytes, c->len);
	cr_assert_eq(msg_parse(&m, body, c->len, MSG_REQUEST, &err), -1, "%s: accepted", c->name);
	cr_assert_eq(err.code, c->code, "%s: got %s (%s)", c->name, proto_code_name(err.code),
	             err.message);
	msg_destroy(&m);
	frame_free(body);
}

/* ---- text: well-formed UTF-8 only (proto/utf8.c) ---------------------------- */

struct utf8_case {
	const char *name;
	const char *bytes;
	size_t len;
	size_t bad_at; /* len when well-formed */
};

#define U8(name, lit, at)                                                                          \
	{                                                                                          \
		name, lit, sizeof(lit) - 1, at                                                     \
	}
#define U8_OK(name, lit) U8(name, lit, sizeof(lit) - 1)

static const struct utf8_case UTF8S[] = {
    U8_OK("empty", ""),
    U8_OK("ascii with controls", "a\n\r\x1b\x7f"),
    U8_OK("two bytes, smallest", "\xc2\x80"),
    U8_OK("three bytes, after the surrogates", "x\xee\x80\x80"),
    U8_OK("U+D7FF, the last before the surrogates", "\xed\x9f\xbf"),
    U8_OK("U+FFFF", "\xef\xbf\xbf"),
    U8_OK("U+10000, the first four-byte", "\xf0\x90\x80\x80"),
    U8_OK("U+10FFFF, the last", "\xf4\x8f\xbf\xbf"),
    U8("lone continuation", "ab\x80", 2),
    U8("0xff", "\xff", 0),
    U8("0xfe", "a\xfe", 1),
    U8("overlong NUL (c0 80)", "\xc0\x80", 0),
    U8("overlong two-byte (c1 bf)", "\xc1\xbf", 0),
    U8("overlong three-byte (e0 9f bf)", "\xe0\x9f\xbf", 0),
    U8("overlong four-byte (f0 8f bf bf)", "\xf0\x8f\xbf\xbf", 0),
    U8("surrogate U+D800", "ok\xed\xa0\x80", 2),
    U8("surrogate U+DFFF", "\xed\xbf\xbf", 0),
    U8("U+110000", "\xf4\x90\x80\x80", 0),
    U8("five-byte lead", "\xf8\x88\x80\x80\x80", 0),
    U8("cut two-byte at the end", "abc\xc3", 3),
    U8("cut three-byte at the end", "\xe2\x82", 0),
    U8("cut four-byte before ascii",
       "\xf0\x9f\x98"
       "A",
       0),
    U8("ascii after a bad third byte", "\xe2\x28\xa1", 0),
    U8("latin-1 text", "caf\xe9!", 3),
};

TABLE_TEST(msg, utf8_accepts_well_formed_text_and_finds_the_first_bad_byte, UTF8S)
{
	const struct utf8_case *c = &UTF8S[*i];

	cr_assert_eq(utf8_check(c->bytes, c->len), c->bad_at, "%s: got %zu", c->name,
	             utf8_check(c->bytes, c->len));
}

/* A register whose field `bad` (or a key of its carry tree, "carry") holds
 * the bytes \xc0\x80 (an overlong NUL): BAD_REQUEST naming the field. */
static void bad_text_request(const char *bad, struct proto_err *err)
{
	static const char *const fields[] = {"name",  "body_graph", "body_file",
	                                     "entry", "strategy",   "dynamic"};
	struct tbuf b;
	struct msg m;
	uint8_t *body;

	tbuf_init(&b);
	msgpack_pack_map(&b.pk, 3 + 6);
	tbuf_str(&b, "id");
	msgpack_pack_uint64(&b.pk, 9);
	tbuf_str(&b, "op");
	tbuf_str(&b, "register");
	for (size_t k = 0; k < 6; k++) {
		tbuf_str(&b, fields[k]);
		if (strcmp(bad, fields[k]) == 0) {
			msgpack_pack_str(&b.pk, 4);
			msgpack_pack_str_body(&b.pk, "x\xc0\x80y", 4);
		} else {
			tbuf_str(&b, "fine \xc3\xa9");
		}
	}
	tbuf_str(&b, "carry");
	msgpack_pack_map(&b.pk, 1);
	if (strcmp(bad, "carry") == 0) {
		msgpack_pack_str(&b.pk, 2);
		msgpack_pack_str_body(&b.pk, "\xed\xa0", 2);
	} else {
		tbuf_str(&b, "k");
	}
	msgpack_pack_nil(&b.pk);
	body = tbuf_body(&b);
	cr_assert_eq(msg_parse(&m, body, b.sb.size, MSG_REQUEST, err), strcmp(bad, "") ? -1 : 0,
	             "%s: %s", bad, err->message);
	cr_assert(m.has_id, "the id is read first, so the error can answer it");
	msg_destroy(&m);
	frame_free(body);
	tbuf_destroy(&b);
}

Test(msg, a_request_string_that_is_not_utf8_is_bad_request_naming_its_field)
{
	static const char *const bad[] = {"name",     "body_graph", "body_file", "entry",
	                                  "strategy", "dynamic",    "carry"};
	struct proto_err err;

	bad_text_request("", &err); /* the same request, well-formed: parsed */
	for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
		bad_text_request(bad[k], &err);
		cr_assert_eq(err.code, PROTO_E_BAD_REQUEST, "%s: %s", bad[k],
		             proto_code_name(err.code));
		cr_assert_str_eq(err.path, bad[k]);
		cr_assert_not_null(strstr(err.message, bad[k]), "%s", err.message);
		cr_assert_eq(utf8_check(err.message, strlen(err.message)), strlen(err.message),
		             "the message itself is UTF-8");
	}
}

Test(msg, an_op_name_that_is_not_utf8_is_bad_request_not_echoed)
{
	static const char raw[] = "\x82\xa2id\x0b\xa2op\xa4"
	                          "ab\xff\n";
	struct msg m;
	struct proto_err err;
	uint8_t *body = frame_alloc(sizeof raw - 1);

	memcpy(body, raw, sizeof raw - 1);
	cr_assert_eq(msg_parse(&m, body, sizeof raw - 1, MSG_REQUEST, &err), -1);
	cr_assert_eq(err.code, PROTO_E_BAD_REQUEST);
	cr_assert_str_eq(err.path, "op");
	cr_assert_eq(m.id, 11);
	msg_destroy(&m);
	frame_free(body);
}

Test(msg, a_frame_of_many_tiny_objects_hits_the_object_limit)
{
	struct tbuf b;
	struct msg m;
	struct proto_err err;
	uint8_t *body;

	tbuf_init(&b);
	tbuf_request(&b, "carry");
	msgpack_pack_array(&b.pk, 70000);
	for (int i = 0; i < 70000; i++)
		msgpack_pack_array(&b.pk, 0);
	body = tbuf_body(&b);
	cr_assert_eq(msg_parse(&m, body, b.sb.size, MSG_REQUEST, &err), -1);
	cr_assert_eq(err.code, PROTO_E_OBJECT_LIMIT, "%s", err.message);
	msg_destroy(&m);
	frame_free(body);
	tbuf_destroy(&b);
}

Test(msg, an_unknown_op_parses_so_the_reply_can_carry_the_id)
{
	static const char raw[] = "\x82\xa2id\x0b\xa2op\xa5"
	                          "frobn";
	struct msg m;
	struct proto_err err;
	uint8_t *body = frame_alloc(sizeof raw - 1);

	memcpy(body, raw, sizeof raw - 1);
	cr_assert_eq(msg_parse(&m, body, sizeof raw - 1, MSG_REQUEST, &err), 0);
	cr_assert_eq(m.op, -1);
	cr_assert_eq(m.id, 11);
	cr_assert_eq(m.op_len, 5);
	msg_destroy(&m);
	frame_free(body);
}

Test(msg, integers_exclude_bools_and_floats_as_in_the_reference)
{
	struct tbuf b;
	struct msg m;
	struct proto_err err;
	uint8_t *body;
	int64_t v = 0;
	bool flag = false;

	tbuf_init(&b);
	msgpack_pack_map(&b.pk, 6);
	tbuf_str(&b, "id");
	msgpack_pack_uint64(&b.pk, 1);
	tbuf_str(&b, "op");
	tbuf_str(&b, "register");
	tbuf_str(&b, "max_steps");
	msgpack_pack_true(&b.pk);
	tbuf_str(&b, "max_elements");
	msgpack_pack_double(&b.pk, 16.0);
	tbuf_str(&b, "recompile_budget");
	msgpack_pack_int64(&b.pk, -3);
	tbuf_str(&b, "force");
	msgpack_pack_true(&b.pk);
	body = tbuf_body(&b);
	cr_assert_eq(msg_parse(&m, body, b.sb.size, MSG_REQUEST, &err), 0);
	cr_assert_eq(msg_get_i64(&m.up.data, "max_steps", &v, &err), -1);
	cr_assert_eq(err.code, PROTO_E_INVALID_ARGUMENT);
	cr_assert_str_eq(err.path, "max_steps");
	cr_assert_eq(msg_get_i64(&m.up.data, "max_elements", &v, &err), -1);
	cr_assert_eq(msg_get_i64(&m.up.data, "recompile_budget", &v, &err), 0);
	cr_assert_eq(v, -3);
	cr_assert_eq(msg_get_i64(&m.up.data, "absent", &v, &err), 1);
	cr_assert_eq(msg_get_bool(&m.up.data, "force", &flag, &err), 0);
	cr_assert(flag);
	msg_destroy(&m);
	frame_free(body);
	tbuf_destroy(&b);
}

/* sent, written as an error reply (with id when has_id) and parsed back:
 * the reply's message, got from it */
static void error_round_trip(const struct proto_err *sent, bool has_id, uint64_t id, struct msg *m,
                             struct proto_err *got)
{
	struct writer w;
	size_t len;
	uint8_t *bytes, *body;

	cr_assert_eq(writer_init(&w), 0);
	msg_write_error(&w, has_id, id, sent);
	bytes = writer_to_bytes(&w, &len);
	writer_destroy(&w);
	body = frame_alloc(len - 4);
	memcpy(body, bytes + 4, len - 4);
	free(bytes);
	cr_assert_eq(msg_parse(m, body, len - 4, MSG_REPLY, got), 0);
	cr_assert(m->is_error);
	cr_assert_eq(m->has_id, has_id);
	msg_reply_error(m, got);
	msg_destroy(m);
	frame_free(body);
}

Test(msg, an_error_reply_round_trips_code_message_and_path)
{
	struct proto_err sent, got;
	struct msg m;

	proto_fail(&sent, PROTO_E_TOO_MANY_STEPS, "inputs[\"f\"][1]",
	           "inputs[\"f\"][1]: T=200 exceeds max_steps=128");
	error_round_trip(&sent, true, 77, &m, &got);
	cr_assert_eq(m.id, 77);
	cr_assert_eq(got.code, PROTO_E_TOO_MANY_STEPS);
	cr_assert_str_eq(got.path, sent.path);
	cr_assert_str_eq(got.message, sent.message);
}

Test(msg, an_error_without_an_id_carries_nil)
{
	struct proto_err sent, got;
	struct msg m;

	proto_fail(&sent, PROTO_E_NOT_A_MAP, NULL, "frame body must be a msgpack map");
	error_round_trip(&sent, false, 0, &m, &got);
	cr_assert_eq(got.code, PROTO_E_NOT_A_MAP);
	cr_assert_str_eq(got.path, "");
}

Test(msg, a_stream_stays_usable_after_a_malformed_but_framed_message)
{
	static const char bad[] = "\x00\x00\x00\x01\xc1";
	static const char good[] = "\x00\x00\x00\x0f\x82\xa2id\x05\xa2op\xa6"
	                           "health";
	uint8_t stream[sizeof bad - 1 + sizeof good - 1];
	struct frame_reader r;
	struct proto_err err;
	struct msg m;
	size_t off = 0, used;
	int seen = 0;

	memcpy(stream, bad, sizeof bad - 1);
	memcpy(stream + sizeof bad - 1, good, sizeof good - 1);
	frame_reader_init(&r, PROTO_FRAME_DEFAULT);
	while (off < sizeof stream) {
		enum frame_status st =
		    frame_reader_feed(&r, stream + off, sizeof stream - off, &used, &err);
		off += used;
		if (st == FRAME_READY) {
			uint32_t len;
			uint8_t *body = frame_reader_take(&r, &len);
			int rc = msg_parse(&m, body, len, MSG_REQUEST, &err);
			if (seen++ == 0) {
				cr_assert_eq(rc, -1);
				cr_assert_eq(err.code, PROTO_E_MSGPACK_INVALID);
			} else {
				cr_assert_eq(rc, 0, "%s", err.message);
				cr_assert_eq(m.op, PROTO_OP_HEALTH);
				cr_assert_eq(m.id, 5);
			}
			msg_destroy(&m);
			frame_free(body);
		}
	}
	cr_assert_eq(seen, 2);
	frame_reader_free(&r);
}

Test(msg, every_code_and_op_name_maps_back_to_itself)
{
	for (int c = 0; c < PROTO_E__COUNT; c++) {
		const char *n = proto_code_name(c);
		cr_assert_eq(proto_code_from_name(n, strlen(n)), c, "%s", n);
	}
	for (int o = 0; o < PROTO_OP__COUNT; o++) {
		const char *n = proto_op_name(o);
		cr_assert_eq(proto_op_from_name(n, strlen(n)), o, "%s", n);
	}
}

/* ---- the daemon's op table (daemon/ops/ops.c, generated from PROTO_OPS) -------- */

#include "daemon.h"

Test(msg, the_op_table_has_a_handler_under_each_wire_name)
{
	for (int o = 0; o < PROTO_OP__COUNT; o++) {
		const struct op_desc *op = OP_TABLE[o];
		cr_assert_not_null(op, "op %d has no descriptor", o);
		cr_assert_not_null(op->handler, "%s", proto_op_name(o));
		cr_assert_str_eq(op->name, proto_op_name(o));
	}
	/* only the answers a client needs while the daemon drains */
	cr_assert(OP_TABLE[PROTO_OP_HEALTH]->flags & OP_WHILE_STOPPING);
	cr_assert(OP_TABLE[PROTO_OP_HELLO]->flags & OP_WHILE_STOPPING);
	cr_assert_not(OP_TABLE[PROTO_OP_SCAN]->flags & OP_WHILE_STOPPING);
	cr_assert(OP_TABLE[PROTO_OP_UNREGISTER]->flags & OP_ADMIN);
	cr_assert(OP_TABLE[PROTO_OP_SHUTDOWN]->flags & OP_ADMIN);
	/* register checks itself: source is admin-only, captured graphs are not
	 * (tests/python/test_capture.py, tests/e2e/test_service.c) */
	cr_assert_not(OP_TABLE[PROTO_OP_REGISTER]->flags & OP_ADMIN);
	cr_assert_not(OP_TABLE[PROTO_OP_SCAN]->flags & OP_ADMIN);
}

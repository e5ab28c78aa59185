/*
 * msg.c - envelope parsing and building.  Validation happens here once, at
 * the edge; handlers get typed values.  Any thread; no global state.
 */
#include "msg.h"

#include "mpguard.h"
#include "utf8.h"

#include <stdio.h>
#include <string.h>

#define MSG_OP_MAX 32

const msgpack_object *msg_obj_field(const msgpack_object *map, const char *key)
{
	size_t klen = strlen(key);

	if (map == NULL || map->type != MSGPACK_OBJECT_MAP)
		return NULL;
	for (uint32_t i = 0; i < map->via.map.size; i++) {
		const msgpack_object *k = &map->via.map.ptr[i].key;
		if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == klen &&
		    memcmp(k->via.str.ptr, key, klen) == 0)
			return &map->via.map.ptr[i].val;
	}
	return NULL;
}

const msgpack_object *msg_field(const struct msg *m, const char *key)
{
	return msg_obj_field(&m->up.data, key);
}

static int parse_id(struct msg *m, enum msg_kind kind, struct proto_err *err)
{
	const msgpack_object *id = msg_field(m, "id");

	if (id != NULL && id->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
		m->has_id = true;
		m->id = id->via.u64;
		return 0;
	}
	if (kind == MSG_REPLY && id != NULL && id->type == MSGPACK_OBJECT_NIL)
		return 0; /* an error about a frame whose id could not be read */
	return proto_fail(err, PROTO_E_BAD_ENVELOPE, NULL,
	                  id ? "id must be an unsigned integer" : "request has no id");
}

static int parse_op(struct msg *m, struct proto_err *err)
{
	const msgpack_object *op = msg_field(m, "op");

	if (op == NULL)
		return proto_fail(err, PROTO_E_BAD_ENVELOPE, NULL, "request has no op");
	if (op->type != MSGPACK_OBJECT_STR || op->via.str.size == 0 ||
	    op->via.str.size > MSG_OP_MAX)
		return proto_fail(err, PROTO_E_BAD_ENVELOPE, NULL,
		                  "op must be a non-empty string of at most %d bytes", MSG_OP_MAX);
	m->op_name = op->via.str.ptr;
	m->op_len = op->via.str.size;
	m->op = proto_op_from_name(m->op_name, m->op_len);
	return 0;
}

/*
 * Every string of o (map keys too) is well-formed UTF-8, else BAD_REQUEST
 * naming field (the request's top-level key it lies under).  Depth is
 * bounded by mpguard already.
 */
static int check_text(const msgpack_object *o, const char *field, struct proto_err *err)
{
	size_t bad;

	switch (o->type) {
	case MSGPACK_OBJECT_STR:
		bad = utf8_check(o->via.str.ptr, o->via.str.size);
		if (bad == o->via.str.size)
			return 0;
		return proto_fail(err, PROTO_E_BAD_REQUEST, field,
		                  "%s holds a string that is not well-formed UTF-8 (byte %zu)",
		                  field, bad);
	case MSGPACK_OBJECT_ARRAY:
		for (uint32_t i = 0; i < o->via.array.size; i++)
			if (check_text(&o->via.array.ptr[i], field, err) != 0)
				return -1;
		return 0;
	case MSGPACK_OBJECT_MAP:
		for (uint32_t i = 0; i < o->via.map.size; i++)
			if (check_text(&o->via.map.ptr[i].key, field, err) != 0 ||
			    check_text(&o->via.map.ptr[i].val, field, err) != 0)
				return -1;
		return 0;
	default:
		return 0;
	}
}

/* The request's strings, under the top-level key each lies under. */
static int check_request_text(const struct msg *m, struct proto_err *err)
{
	for (uint32_t i = 0; i < m->map->size; i++) {
		const msgpack_object *k = &m->map->ptr[i].key;
		char field[PROTO_MAX_KEY_BYTES + 1] = "a request key";
		if (k->type == MSGPACK_OBJECT_STR &&
		    utf8_check(k->via.str.ptr, k->via.str.size) != k->via.str.size)
			return proto_fail(err, PROTO_E_BAD_REQUEST, NULL,
			                  "a request key is not well-formed UTF-8");
		if (k->type == MSGPACK_OBJECT_STR && k->via.str.size < sizeof field)
			snprintf(field, sizeof field, "%.*s", (int)k->via.str.size, k->via.str.ptr);
		if (check_text(&m->map->ptr[i].val, field, err) != 0)
			return -1;
	}
	return 0;
}

int msg_parse(struct msg *m, const uint8_t *body, size_t len, enum msg_kind kind,
              struct proto_err *err)
{
	size_t off = 0;
	msgpack_unpack_return rc;

	memset(m, 0, sizeof *m);
	m->op = -1;
	msgpack_unpacked_init(&m->up);
	if (mpguard_check(body, len, err) != 0)
		return -1;
	rc = msgpack_unpack_next(&m->up, (const char *)body, len, &off);
	if (rc == MSGPACK_UNPACK_NOMEM_ERROR)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory unpacking");
	if (rc != MSGPACK_UNPACK_SUCCESS || off != len)
		return proto_fail(err, PROTO_E_MSGPACK_INVALID, NULL,
		                  "body is not one msgpack value");
	if (m->up.data.type != MSGPACK_OBJECT_MAP)
		return proto_fail(err, PROTO_E_NOT_A_MAP, NULL, "frame body must be a msgpack map");
	m->map = &m->up.data.via.map;
	if (kind == MSG_ANY)
		return 0;
	if (parse_id(m, kind, err) != 0)
		return -1;
	if (kind == MSG_REQUEST && check_request_text(m, err) != 0)
		return -1; /* before op: its name is echoed in UNKNOWN_OP's message */
	if (kind == MSG_REQUEST)
		return parse_op(m, err);
	m->is_error = msg_field(m, "error") != NULL;
	m->is_event = msg_field(m, "event") != NULL;
	return 0;
}

void msg_destroy(struct msg *m)
{
	msgpack_unpacked_destroy(&m->up);
}

/* The field key of map in *o: 0, 1 when it is missing, -1 (INVALID_ARGUMENT)
 * when it is not of the type (what: "a string", ...). */
static int typed_field(const msgpack_object *map, const char *key, msgpack_object_type type,
                       const char *what, const msgpack_object **o, struct proto_err *err)
{
	*o = msg_obj_field(map, key);
	if (*o == NULL)
		return 1;
	if ((*o)->type != type)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, key, "%s must be %s", key, what);
	return 0;
}

int msg_get_str(const msgpack_object *map, const char *key, const char **s, uint32_t *len,
                struct proto_err *err)
{
	const msgpack_object *o;
	int rc = typed_field(map, key, MSGPACK_OBJECT_STR, "a string", &o, err);

	if (rc != 0)
		return rc;
	*s = o->via.str.ptr;
	*len = o->via.str.size;
	return 0;
}

int msg_get_i64(const msgpack_object *map, const char *key, int64_t *v, struct proto_err *err)
{
	const msgpack_object *o = msg_obj_field(map, key);

	if (o == NULL)
		return 1;
	if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
		*v = o->via.i64;
		return 0;
	}
	if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= INT64_MAX) {
		*v = (int64_t)o->via.u64;
		return 0;
	}
	return proto_fail(err, PROTO_E_INVALID_ARGUMENT, key, "%s must be an integer", key);
}

int msg_get_bool(const msgpack_object *map, const char *key, bool *v, struct proto_err *err)
{
	const msgpack_object *o;
	int rc = typed_field(map, key, MSGPACK_OBJECT_BOOLEAN, "a boolean", &o, err);

	if (rc != 0)
		return rc;
	*v = o->via.boolean;
	return 0;
}

int msg_get_tree(const struct msg *m, const char *key, bool required, struct tree_node *out,
                 struct proto_err *err)
{
	const msgpack_object *o = msg_field(m, key);

	if (o == NULL) {
		if (!required)
			return 1;
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, key, "request has no %s tree",
		                  key);
	}
	return tree_decode_in(o, m->up.zone, key, m->region, out, err);
}

static void copy_str(char *dst, size_t size, const msgpack_object *o)
{
	size_t n = 0;

	if (o != NULL && o->type == MSGPACK_OBJECT_STR)
		n = o->via.str.size < size - 1 ? o->via.str.size : size - 1;
	if (n)
		memcpy(dst, o->via.str.ptr, n);
	dst[n] = '\0';
}

int msg_reply_error(const struct msg *m, struct proto_err *err)
{
	const msgpack_object *e = msg_field(m, "error");
	const msgpack_object *code = msg_obj_field(e, "code");
	const msgpack_object *transient = msg_obj_field(e, "transient");
	int c = -1;

	if (code != NULL && code->type == MSGPACK_OBJECT_STR)
		c = proto_code_from_name(code->via.str.ptr, code->via.str.size);

	err->code = c < 0 ? PROTO_E_INTERNAL : (enum proto_code)c;
	err->flags =
	    transient && transient->type == MSGPACK_OBJECT_BOOLEAN && transient->via.boolean
	        ? PROTO_ERR_TRANSIENT
	        : 0;
	copy_str(err->message, sizeof err->message, msg_obj_field(e, "message"));
	copy_str(err->path, sizeof err->path, msg_obj_field(e, "path"));
	return 0;
}

void msg_begin_request(struct writer *w, uint64_t id, const char *op, uint32_t nfields)
{
	msgpack_pack_map(&w->pk, nfields + 2);
	writer_key_u64(w, "id", id);
	writer_key_str(w, "op", op);
}

static void begin_id(struct writer *w, bool has_id, uint64_t id, uint32_t entries)
{
	msgpack_pack_map(&w->pk, entries);
	writer_str(w, "id");
	if (has_id)
		msgpack_pack_uint64(&w->pk, id);
	else
		msgpack_pack_nil(&w->pk);
}

void msg_begin_result(struct writer *w, bool has_id, uint64_t id, uint32_t nfields)
{
	begin_id(w, has_id, id, 2);
	writer_str(w, "result");
	msgpack_pack_map(&w->pk, nfields);
}

void msg_begin_event(struct writer *w, uint64_t id, const char *event, uint32_t nfields)
{
	begin_id(w, true, id, nfields + 2);
	writer_key_str(w, "event", event);
}

void msg_write_error(struct writer *w, bool has_id, uint64_t id, const struct proto_err *err)
{
	int with_path = err->path[0] != '\0';

	begin_id(w, has_id, id, 2);
	writer_str(w, "error");
	msgpack_pack_map(&w->pk, 2 + with_path);
	writer_key_str(w, "code", proto_code_name(err->code));
	writer_key_str(w, "message", err->message);
	if (with_path)
		writer_key_str(w, "path", err->path);
}

/* shapes.c - see shapes.h. */
#include "shapes.h"

#include "msg.h"

#include <string.h>

void shapes_write(struct writer *w, const struct tree_node *n)
{
	static const char *const kinds[] = {
	    [TREE_TUPLE] = "tuple", [TREE_LIST] = "list", [TREE_DICT] = "dict"};

	if (n->kind == TREE_NONE) {
		msgpack_pack_nil(&w->pk);
		return;
	}
	if (n->kind == TREE_TENSOR) {
		msgpack_pack_map(&w->pk, 2);
		writer_key_str(w, "k", "T");
		writer_str(w, "s");
		msgpack_pack_array(&w->pk, n->tensor.ndim);
		for (uint32_t i = 0; i < n->tensor.ndim; i++)
			msgpack_pack_int64(&w->pk, n->tensor.shape[i]);
		return;
	}
	msgpack_pack_map(&w->pk, n->kind == TREE_DICT ? 3 : 2);
	writer_key_str(w, "k", kinds[n->kind]);
	if (n->kind == TREE_DICT) {
		writer_str(w, "keys");
		msgpack_pack_array(&w->pk, n->count);
		for (uint32_t i = 0; i < n->count; i++)
			writer_strn(w, n->keys[i].ptr, n->keys[i].len);
	}
	writer_str(w, "c");
	msgpack_pack_array(&w->pk, n->count);
	for (uint32_t i = 0; i < n->count; i++)
		shapes_write(w, &n->items[i]);
}

int shapes_sizes(struct tree_tensor *t, int64_t batch)
{
	struct tree_tensor bound = *t;

	for (uint32_t i = 0; i < bound.ndim; i++)
		if (bound.shape[i] == SHAPES_BATCH)
			bound.shape[i] = batch;
	if (tree_tensor_sizes(&bound) != 0)
		return -1;
	t->numel = bound.numel;
	t->nbytes = bound.nbytes;
	return 0;
}

static int bad_spec(struct proto_err *err, const char *what)
{
	return proto_fail(err, PROTO_E_COMPILE_FAILED, NULL, "malformed spec tree: %s", what);
}

static int read_tensor_spec(const msgpack_object *s, enum proto_dtype dtype, bool allow_batch,
                            struct tree_node *out, struct proto_err *err)
{
	if (s == NULL || s->type != MSGPACK_OBJECT_ARRAY || s->via.array.size > PROTO_MAX_NDIM)
		return bad_spec(err, "tensor shape");
	out->kind = TREE_TENSOR;
	out->tensor.dtype = dtype;
	out->tensor.ndim = s->via.array.size;
	for (uint32_t i = 0; i < out->tensor.ndim; i++) {
		const msgpack_object *d = &s->via.array.ptr[i];
		if (allow_batch && d->type == MSGPACK_OBJECT_NEGATIVE_INTEGER &&
		    d->via.i64 == SHAPES_BATCH) {
			out->tensor.shape[i] = SHAPES_BATCH;
			continue;
		}
		if (d->type != MSGPACK_OBJECT_POSITIVE_INTEGER || d->via.u64 > INT64_MAX)
			return bad_spec(err, "dimension");
		out->tensor.shape[i] = (int64_t)d->via.u64;
	}
	return shapes_sizes(&out->tensor, 1) == 0 ? 0 : bad_spec(err, "size overflow");
}

static int read_keys(const msgpack_object *keys, msgpack_zone *zone, struct tree_node *out,
                     struct proto_err *err)
{
	if (keys == NULL || keys->type != MSGPACK_OBJECT_ARRAY ||
	    keys->via.array.size != out->count)
		return bad_spec(err, "dict keys");
	out->keys = msgpack_zone_malloc(zone, (out->count ? out->count : 1) * sizeof *out->keys);
	if (out->keys == NULL)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
	for (uint32_t i = 0; i < out->count; i++) {
		const msgpack_object *k = &keys->via.array.ptr[i];
		char *copy;
		if (k->type != MSGPACK_OBJECT_STR)
			return bad_spec(err, "dict key");
		if (k->via.str.size > PROTO_MAX_KEY_BYTES)
			return bad_spec(err, "dict key longer than 256 bytes");
		for (uint32_t p = 0; p < i; p++)
			if (out->keys[p].len == k->via.str.size &&
			    (k->via.str.size == 0 ||
			     memcmp(out->keys[p].ptr, k->via.str.ptr, k->via.str.size) == 0))
				return proto_fail(
				    err, PROTO_E_DUPLICATE_KEY, NULL,
				    "duplicate dict key \"%.*s\" in a spec tree",
				    (int)(k->via.str.size > 64 ? 64 : k->via.str.size),
				    k->via.str.ptr);
		copy = msgpack_zone_malloc(zone, k->via.str.size + 1);
		if (copy == NULL)
			return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
		if (k->via.str.size) /* an empty string's pointer may be NULL */
			memcpy(copy, k->via.str.ptr, k->via.str.size);
		copy[k->via.str.size] = '\0';
		out->keys[i].ptr = copy;
		out->keys[i].len = k->via.str.size;
	}
	return 0;
}

int shapes_read(const msgpack_object *o, msgpack_zone *zone, enum proto_dtype dtype,
                bool allow_batch, struct tree_node *out, struct proto_err *err)
{
	const char *k;
	uint32_t klen;
	const msgpack_object *c;

	memset(out, 0, sizeof *out);
	if (o->type == MSGPACK_OBJECT_NIL)
		return 0; /* TREE_NONE */
	if (msg_get_str(o, "k", &k, &klen, err) != 0)
		return bad_spec(err, "node kind");
	if (klen == 1 && k[0] == 'T')
		return read_tensor_spec(msg_obj_field(o, "s"), dtype, allow_batch, out, err);
	c = msg_obj_field(o, "c");
	if (c == NULL || c->type != MSGPACK_OBJECT_ARRAY)
		return bad_spec(err, "children");
	if (klen == 5 && memcmp(k, "tuple", 5) == 0)
		out->kind = TREE_TUPLE;
	else if (klen == 4 && memcmp(k, "list", 4) == 0)
		out->kind = TREE_LIST;
	else if (klen == 4 && memcmp(k, "dict", 4) == 0)
		out->kind = TREE_DICT;
	else
		return bad_spec(err, "node kind");
	out->count = c->via.array.size;
	out->items = msgpack_zone_malloc(zone, (out->count ? out->count : 1) * sizeof *out->items);
	if (out->items == NULL)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
	if (out->kind == TREE_DICT && read_keys(msg_obj_field(o, "keys"), zone, out, err) != 0)
		return -1;
	for (uint32_t i = 0; i < out->count; i++)
		if (shapes_read(&c->via.array.ptr[i], zone, dtype, allow_batch, &out->items[i],
		                err) != 0)
			return -1;
	return 0;
}

/*
 * tree.c - tensor-tree decode (msgpack object -> view nodes) and encode
 * (nodes -> msgpack through a writer).  Decoding recurses at most
 * PROTO_MAX_TREE_DEPTH levels, checked before each descent; the msgpack it
 * reads has already passed mpguard.  Pure functions; any thread.
 */
#include "tree.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct dec {
	msgpack_zone *zone;
	const struct tree_region *region;
	struct proto_err *err;
	uint32_t leaves;
	char path[PROTO_PATH_MAX];
	size_t path_len;
};

static int dec_fail(struct dec *d, enum proto_code code, const char *fmt, const char *detail)
{
	return proto_fail(d->err, code, d->path, fmt, d->path, detail ? detail : "");
}

size_t tree_fmt_uint(char out[20], uint64_t v)
{
	char tmp[20];
	size_t n = 0, len;

	do
		tmp[n++] = (char)('0' + v % 10);
	while ((v /= 10) != 0);
	for (len = n; n > 0;)
		*out++ = tmp[--n];
	return len;
}

size_t tree_path_root(char *buf, size_t size, const char *root)
{
	size_t n = strnlen(root, size - 1);

	memcpy(buf, root, n);
	buf[n] = '\0';
	return n;
}

/* Appends a quoted, escaped dict key or an index to a bounded path. */
void tree_path_push(char *buf, size_t size, size_t *len, const struct tree_node *n, uint32_t i)
{
	size_t at = *len;

	if (at + 1 >= size)
		return;
	if (n->kind != TREE_DICT) { /* "[i]" */
		char digits[20];
		size_t nd = tree_fmt_uint(digits, i);

		if (at + nd + 2 >= size) {
			*len = size - 1;
			buf[*len] = '\0';
			return;
		}
		buf[at++] = '[';
		memcpy(buf + at, digits, nd);
		at += nd;
		buf[at++] = ']';
		buf[at] = '\0';
		*len = at;
		return;
	}
	buf[at++] = '[';
	if (at < size - 1)
		buf[at++] = '"';
	for (uint32_t k = 0; k < n->keys[i].len && at + 4 < size; k++) {
		unsigned char c = (unsigned char)n->keys[i].ptr[k];
		if (c == '"' || c == '\\') {
			buf[at++] = '\\';
			buf[at++] = (char)c;
		} else if (c < 0x20 || c == 0x7f) {
			at += (size_t)snprintf(buf + at, size - at, "\\x%02x", c);
		} else {
			buf[at++] = (char)c;
		}
	}
	if (at + 2 < size) {
		buf[at++] = '"';
		buf[at++] = ']';
	}
	buf[at] = '\0';
	*len = at;
}

int tree_tensor_sizes(struct tree_tensor *t)
{
	uint64_t numel = 1, item = proto_dtype_size(t->dtype);

	for (uint32_t i = 0; i < t->ndim; i++) {
		uint64_t dim = (uint64_t)t->shape[i];
		if (dim != 0 && numel > (uint64_t)INT64_MAX / dim)
			return -1;
		numel *= dim;
	}
	if (numel > (uint64_t)INT64_MAX / item)
		return -1;
	t->numel = numel;
	t->nbytes = numel * item;
	return 0;
}

static uint64_t get_le64(const uint8_t *p)
{
	uint64_t v = 0;

	for (int i = 7; i >= 0; i--)
		v = (v << 8) | p[i];
	return v;
}

static int check_dtype(struct dec *d, uint8_t code)
{
	char detail[32];

	if (code == PROTO_DTYPE_F32 || code == PROTO_DTYPE_F64)
		return 0;
	snprintf(detail, sizeof detail, " (dtype code %u)", code);
	return dec_fail(d, PROTO_E_BAD_DTYPE, "%s: dtype must be float32 or float64%s", detail);
}

/* Reads t->ndim little-endian dims at p, then numel and nbytes. */
static int read_dims(struct dec *d, struct tree_tensor *t, const uint8_t *p)
{
	char detail[64];

	for (uint32_t i = 0; i < t->ndim; i++) {
		t->shape[i] = (int64_t)get_le64(p + 8 * i);
		if (t->shape[i] < 0) {
			snprintf(detail, sizeof detail, " %u is %lld", i, (long long)t->shape[i]);
			return dec_fail(d, PROTO_E_BAD_SHAPE, "%s: negative dimension%s", detail);
		}
	}
	if (tree_tensor_sizes(t) != 0)
		return dec_fail(d, PROTO_E_SHAPE_OVERFLOW, "%s: element count overflows int64%s",
		                NULL);
	return 0;
}

static int check_nbytes(struct dec *d, const struct tree_tensor *t, uint64_t nbytes)
{
	char detail[96];

	if (nbytes == t->nbytes)
		return 0;
	snprintf(detail, sizeof detail, " (%llu bytes, shape and dtype need %llu)",
	         (unsigned long long)nbytes, (unsigned long long)t->nbytes);
	return dec_fail(d, PROTO_E_BYTE_LENGTH_MISMATCH, "%s: tensor byte length mismatch%s",
	                detail);
}

static int decode_tensor(struct dec *d, const msgpack_object_ext *ext, struct tree_node *out)
{
	const uint8_t *p = (const uint8_t *)ext->ptr;
	struct tree_tensor *t = &out->tensor;
	uint64_t head;
	char detail[96];

	if (ext->size < 4)
		return dec_fail(d, PROTO_E_BYTE_LENGTH_MISMATCH,
		                "%s: tensor payload shorter than its 4-byte header%s", NULL);
	if (check_dtype(d, p[0]) != 0)
		return -1;
	if (p[1] > PROTO_MAX_NDIM) {
		snprintf(detail, sizeof detail, "%u > %d", p[1], PROTO_MAX_NDIM);
		return dec_fail(d, PROTO_E_BAD_SHAPE, "%s: tensor rank %s", detail);
	}
	if (p[3] != 0 || p[2] >= PROTO_TENSOR_ALIGN)
		return dec_fail(d, PROTO_E_BAD_SHAPE, "%s: bad tensor header flags%s", NULL);
	t->dtype = p[0];
	t->ndim = p[1];
	head = 4 + 8ull * t->ndim + p[2];
	if (ext->size < head)
		return dec_fail(d, PROTO_E_BYTE_LENGTH_MISMATCH,
		                "%s: tensor payload shorter than its header%s", NULL);
	if (read_dims(d, t, p + 4) != 0 || check_nbytes(d, t, ext->size - head) != 0)
		return -1;
	t->data = p + head;
	out->kind = TREE_TENSOR;
	return 0;
}

/* A reference into the connection's region: header checks as for inline
 * tensors, then bounds and alignment against the region. */
static int decode_shm(struct dec *d, const msgpack_object_ext *ext, struct tree_node *out)
{
	const uint8_t *p = (const uint8_t *)ext->ptr;
	struct tree_tensor *t = &out->tensor;
	uint64_t off, nbytes;
	char detail[96];

	if (ext->size < PROTO_SHM_HEAD)
		return dec_fail(d, PROTO_E_BAD_SHAPE,
		                "%s: shared-memory reference shorter than its 24-byte header%s",
		                NULL);
	if (check_dtype(d, p[0]) != 0)
		return -1;
	if (p[1] > PROTO_MAX_NDIM || ext->size != PROTO_SHM_HEAD + 8ull * p[1]) {
		snprintf(detail, sizeof detail, " (rank %u, %u payload bytes)", p[1], ext->size);
		return dec_fail(d, PROTO_E_BAD_SHAPE, "%s: bad shared-memory reference header%s",
		                detail);
	}
	for (int i = 2; i < 8; i++)
		if (p[i] != 0)
			return dec_fail(d, PROTO_E_BAD_SHAPE,
			                "%s: reserved bytes of a reference are not zero%s", NULL);
	t->dtype = p[0];
	t->ndim = p[1];
	off = get_le64(p + 8);
	nbytes = get_le64(p + 16);
	if (read_dims(d, t, p + PROTO_SHM_HEAD) != 0 || check_nbytes(d, t, nbytes) != 0)
		return -1;
	if (d->region == NULL)
		return dec_fail(d, PROTO_E_SHM_NOT_ATTACHED,
		                "%s references shared memory, but no region is attached to this "
		                "connection%s",
		                NULL);
	if (off > d->region->size || nbytes > d->region->size - off) {
		snprintf(detail, sizeof detail, " (offset %llu + %llu bytes > region of %llu)",
		         (unsigned long long)off, (unsigned long long)nbytes,
		         (unsigned long long)d->region->size);
		return dec_fail(d, PROTO_E_SHM_OUT_OF_BOUNDS,
		                "%s: reference outside the shared region%s", detail);
	}
	if (off % PROTO_TENSOR_ALIGN != 0) {
		snprintf(detail, sizeof detail, " (offset %llu)", (unsigned long long)off);
		return dec_fail(d, PROTO_E_SHM_MISALIGNED,
		                "%s: reference not aligned to 64 bytes%s", detail);
	}
	t->data = d->region->base + off;
	out->kind = TREE_TENSOR;
	return 0;
}

static int decode_node(struct dec *d, const msgpack_object *o, int depth, struct tree_node *out);

static int key_cmp(const void *a, const void *b)
{
	const struct tree_key *x = a, *y = b;

	if (x->len != y->len)
		return x->len < y->len ? -1 : 1;
	/* msgpack-c gives an empty string a NULL pointer: memcmp must not see it */
	return x->len == 0 ? 0 : memcmp(x->ptr, y->ptr, x->len);
}

/* Duplicate keys: sort a scratch copy; O(n log n) even for hostile dicts. */
static int check_duplicates(struct dec *d, const struct tree_key *keys, uint32_t n)
{
	struct tree_key *tmp;
	char detail[PROTO_MAX_KEY_BYTES + 8];

	if (n < 2)
		return 0;
	tmp = malloc(n * sizeof *tmp);
	if (tmp == NULL)
		return dec_fail(d, PROTO_E_INTERNAL, "%s: out of memory%s", NULL);
	memcpy(tmp, keys, n * sizeof *tmp);
	qsort(tmp, n, sizeof *tmp, key_cmp);
	for (uint32_t i = 1; i < n; i++) {
		if (key_cmp(&tmp[i - 1], &tmp[i]) == 0) {
			snprintf(detail, sizeof detail, " \"%.*s\"", (int)tmp[i].len,
			         tmp[i].len ? tmp[i].ptr : "");
			free(tmp);
			return dec_fail(d, PROTO_E_DUPLICATE_KEY, "%s: duplicate dict key%s",
			                detail);
		}
	}
	free(tmp);
	return 0;
}

static int decode_children(struct dec *d, const msgpack_object *objs, uint32_t n, int depth,
                           struct tree_node *out)
{
	size_t saved = d->path_len;

	out->count = n;
	out->items = n ? msgpack_zone_malloc(d->zone, n * sizeof *out->items) : NULL;
	if (n && out->items == NULL)
		return dec_fail(d, PROTO_E_INTERNAL, "%s: out of memory%s", NULL);
	for (uint32_t i = 0; i < n; i++) {
		tree_path_push(d->path, sizeof d->path, &d->path_len, out, i);
		if (decode_node(d, &objs[i], depth + 1, &out->items[i]) != 0)
			return -1;
		d->path_len = saved;
		d->path[saved] = '\0';
	}
	return 0;
}

static int decode_dict(struct dec *d, const msgpack_object_map *map, int depth,
                       struct tree_node *out)
{
	msgpack_object *vals;
	char detail[32];

	out->kind = TREE_DICT;
	out->keys = map->size ? msgpack_zone_malloc(d->zone, map->size * sizeof *out->keys) : NULL;
	vals = map->size ? msgpack_zone_malloc(d->zone, map->size * sizeof *vals) : NULL;
	if (map->size && (out->keys == NULL || vals == NULL))
		return dec_fail(d, PROTO_E_INTERNAL, "%s: out of memory%s", NULL);
	for (uint32_t i = 0; i < map->size; i++) {
		const msgpack_object *k = &map->ptr[i].key;
		if (k->type != MSGPACK_OBJECT_STR) {
			snprintf(detail, sizeof detail, " (key %u)", i);
			return dec_fail(d, PROTO_E_NON_STRING_KEY,
			                "%s: dict keys must be strings%s", detail);
		}
		if (k->via.str.size > PROTO_MAX_KEY_BYTES) {
			snprintf(detail, sizeof detail, " (%u > %d bytes)", k->via.str.size,
			         PROTO_MAX_KEY_BYTES);
			return dec_fail(d, PROTO_E_KEY_TOO_LONG, "%s: dict key too long%s", detail);
		}
		out->keys[i].ptr = k->via.str.ptr;
		out->keys[i].len = k->via.str.size;
		vals[i] = map->ptr[i].val;
	}
	if (check_duplicates(d, out->keys, map->size) != 0)
		return -1;
	return decode_children(d, vals, map->size, depth, out);
}

static int is_tuple_marker(const msgpack_object *o)
{
	return o->type == MSGPACK_OBJECT_EXT && o->via.ext.type == PROTO_EXT_TUPLE &&
	       o->via.ext.size == 0;
}

static int count_leaf(struct dec *d)
{
	if (++d->leaves > PROTO_MAX_LEAVES)
		return dec_fail(d, PROTO_E_TOO_MANY_LEAVES, "%s: tree has more than 4096 leaves%s",
		                NULL);
	return 0;
}

static int decode_node(struct dec *d, const msgpack_object *o, int depth, struct tree_node *out)
{
	memset(out, 0, sizeof *out);
	switch (o->type) {
	case MSGPACK_OBJECT_NIL:
		out->kind = TREE_NONE;
		return count_leaf(d);
	case MSGPACK_OBJECT_EXT:
		if (o->via.ext.type != PROTO_EXT_TENSOR && o->via.ext.type != PROTO_EXT_SHM)
			return dec_fail(d, PROTO_E_UNKNOWN_TYPE,
			                "%s: unknown ext type tag in a tree%s", NULL);
		if (count_leaf(d) != 0)
			return -1;
		if (o->via.ext.type == PROTO_EXT_SHM)
			return decode_shm(d, &o->via.ext, out);
		return decode_tensor(d, &o->via.ext, out);
	case MSGPACK_OBJECT_ARRAY:
	case MSGPACK_OBJECT_MAP:
		break;
	default:
		return dec_fail(d, PROTO_E_UNKNOWN_TYPE,
		                "%s: tree nodes are tensors, None, tuples, lists or dicts%s", NULL);
	}
	if (depth >= PROTO_MAX_TREE_DEPTH)
		return dec_fail(d, PROTO_E_DEPTH_EXCEEDED,
		                "%s: tree nested deeper than 16 containers%s", NULL);
	if (o->type == MSGPACK_OBJECT_MAP)
		return decode_dict(d, &o->via.map, depth, out);
	if (o->via.array.size > 0 && is_tuple_marker(&o->via.array.ptr[0])) {
		out->kind = TREE_TUPLE;
		return decode_children(d, o->via.array.ptr + 1, o->via.array.size - 1, depth, out);
	}
	out->kind = TREE_LIST;
	return decode_children(d, o->via.array.ptr, o->via.array.size, depth, out);
}

int tree_decode_in(const msgpack_object *o, msgpack_zone *zone, const char *root,
                   const struct tree_region *region, struct tree_node *out, struct proto_err *err)
{
	struct dec d = {.zone = zone, .region = region, .err = err};

	d.path_len = tree_path_root(d.path, sizeof d.path, root);
	return decode_node(&d, o, 0, out);
}

int tree_decode(const msgpack_object *o, msgpack_zone *zone, const char *root,
                struct tree_node *out, struct proto_err *err)
{
	return tree_decode_in(o, zone, root, NULL, out, err);
}

static void put_le64(uint8_t *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

/* A leaf's first 8 bytes: its ext32 header (always ext32, so the header
 * size and the tensor's padding are known upfront), dtype and rank. */
static void leaf_head(uint8_t *head, uint32_t len, uint8_t type, uint8_t dtype, uint8_t ndim)
{
	head[0] = 0xc9;
	head[1] = (uint8_t)(len >> 24);
	head[2] = (uint8_t)(len >> 16);
	head[3] = (uint8_t)(len >> 8);
	head[4] = (uint8_t)len;
	head[5] = type;
	head[6] = dtype;
	head[7] = ndim;
}

static void encode_tensor(struct writer *w, const struct tree_tensor *t)
{
	uint8_t head[6 + 4 + 8 * PROTO_MAX_NDIM + PROTO_TENSOR_ALIGN] = {0};
	size_t meta = 4 + 8 * (size_t)t->ndim;
	size_t pad =
	    (PROTO_TENSOR_ALIGN - (w->pos + 6 + meta) % PROTO_TENSOR_ALIGN) % PROTO_TENSOR_ALIGN;
	uint64_t len = meta + pad + t->nbytes;

	leaf_head(head, (uint32_t)len, PROTO_EXT_TENSOR, (uint8_t)t->dtype, (uint8_t)t->ndim);
	head[8] = (uint8_t)pad;
	for (uint32_t i = 0; i < t->ndim; i++)
		put_le64(head + 10 + 8 * i, (uint64_t)t->shape[i]);
	writer_raw(w, head, 6 + meta + pad);
	writer_ref(w, t->data, t->nbytes);
}

void tree_put_shm_ref(struct writer *w, uint8_t dtype, uint32_t ndim, const int64_t *shape,
                      uint64_t offset, uint64_t nbytes)
{
	uint8_t head[6 + PROTO_SHM_HEAD + 8 * PROTO_MAX_NDIM] = {0};
	uint32_t len = PROTO_SHM_HEAD + 8 * ndim;

	leaf_head(head, len, PROTO_EXT_SHM, dtype, (uint8_t)ndim);
	put_le64(head + 6 + 8, offset);
	put_le64(head + 6 + 16, nbytes);
	for (uint32_t i = 0; i < ndim; i++)
		put_le64(head + 6 + PROTO_SHM_HEAD + 8 * i, (uint64_t)shape[i]);
	writer_raw(w, head, 6 + len);
}

void tree_encode_placed(struct writer *w, const struct tree_node *n, tree_place_fn place, void *ctx)
{
	uint64_t offset;

	switch (n->kind) {
	case TREE_NONE:
		msgpack_pack_nil(&w->pk);
		return;
	case TREE_TENSOR:
		if (place && place(&n->tensor, &offset, ctx) == 1)
			tree_put_shm_ref(w, (uint8_t)n->tensor.dtype, n->tensor.ndim,
			                 n->tensor.shape, offset, n->tensor.nbytes);
		else
			encode_tensor(w, &n->tensor);
		return;
	case TREE_TUPLE:
		msgpack_pack_array(&w->pk, n->count + 1);
		msgpack_pack_ext(&w->pk, 0, PROTO_EXT_TUPLE);
		break;
	case TREE_LIST:
		msgpack_pack_array(&w->pk, n->count);
		break;
	case TREE_DICT:
		msgpack_pack_map(&w->pk, n->count);
		break;
	}
	for (uint32_t i = 0; i < n->count; i++) {
		if (n->kind == TREE_DICT)
			writer_strn(w, n->keys[i].ptr, n->keys[i].len);
		tree_encode_placed(w, &n->items[i], place, ctx);
	}
}

void tree_encode(struct writer *w, const struct tree_node *n)
{
	tree_encode_placed(w, n, NULL, NULL);
}

uint32_t tree_count_tensors(const struct tree_node *n)
{
	uint32_t c = n->kind == TREE_TENSOR;

	for (uint32_t i = 0; i < n->count; i++)
		c += tree_count_tensors(&n->items[i]);
	return c;
}

uint32_t tree_count_leaves(const struct tree_node *n)
{
	uint32_t c = n->kind == TREE_TENSOR || n->kind == TREE_NONE;

	for (uint32_t i = 0; i < n->count; i++)
		c += tree_count_leaves(&n->items[i]);
	return c;
}

static int same_node(const struct tree_node *a, const struct tree_node *b, char *path, size_t size,
                     size_t len)
{
	if (a->kind != b->kind || a->count != b->count)
		return 0;
	if (a->kind == TREE_TENSOR)
		return a->tensor.dtype == b->tensor.dtype && a->tensor.ndim == b->tensor.ndim &&
		       memcmp(a->tensor.shape, b->tensor.shape,
		              a->tensor.ndim * sizeof a->tensor.shape[0]) == 0;
	for (uint32_t i = 0; i < a->count; i++) {
		size_t l = len;
		if (a->kind == TREE_DICT && key_cmp(&a->keys[i], &b->keys[i]) != 0)
			return 0;
		tree_path_push(path, size, &l, a, i);
		if (!same_node(&a->items[i], &b->items[i], path, size, l))
			return 0;
		path[len] = '\0';
	}
	return 1;
}

int tree_same_structure(const struct tree_node *a, const struct tree_node *b, const char *root,
                        char *path, size_t path_size)
{
	return same_node(a, b, path, path_size, tree_path_root(path, path_size, root));
}

static int visit(const struct tree_node *n, char *path, size_t size, size_t len, int with_none,
                 tree_visit_fn fn, void *ctx)
{
	if (n->kind == TREE_TENSOR || (with_none && n->kind == TREE_NONE))
		return fn(n, path, ctx);
	for (uint32_t i = 0; i < n->count; i++) {
		size_t l = len;
		int rc;
		tree_path_push(path, size, &l, n, i);
		rc = visit(&n->items[i], path, size, l, with_none, fn, ctx);
		path[len] = '\0';
		if (rc != 0)
			return rc;
	}
	return 0;
}

int tree_visit(const struct tree_node *n, const char *root, int with_none, tree_visit_fn fn,
               void *ctx)
{
	char path[PROTO_PATH_MAX];

	return visit(n, path, sizeof path, tree_path_root(path, sizeof path, root), with_none, fn,
	             ctx);
}

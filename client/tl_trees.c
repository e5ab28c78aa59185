/*
 * tl_trees.c - libtorchloop's trees: built by the caller (a zone per builder; tensors
 * point at the caller's buffers) and read from replies (views into them).
 */
#include "tl_internal.h"

#include "busypoll.h"
#include "frame.h"
#include "msg.h"
#include "shapes.h"
#include "shmalloc.h"
#include "tree.h"
#include "writer.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
/* ---- builders -------------------------------------------------------------- */

struct tl_builder *tl_builder_new(void)
{
	struct tl_builder *b = calloc(1, sizeof *b);

	if (b && (b->zone = msgpack_zone_new(4096)) == NULL) {
		free(b);
		return NULL;
	}
	return b;
}

void tl_builder_free(struct tl_builder *b)
{
	if (b) {
		msgpack_zone_free(b->zone);
		free(b);
	}
}

static struct tree_node *node(struct tl_builder *b, enum tree_kind kind, size_t n)
{
	struct tree_node *t = msgpack_zone_malloc(b->zone, sizeof *t);

	if (t == NULL || n > UINT32_MAX)
		return NULL;
	memset(t, 0, sizeof *t);
	t->kind = kind;
	t->count = (uint32_t)n;
	if (n && (t->items = msgpack_zone_malloc(b->zone, n * sizeof *t->items)) == NULL)
		return NULL;
	return t;
}

struct tl_tree *tl_tensor(struct tl_builder *b, enum tl_dtype dtype, int ndim, const int64_t *shape,
                          const void *data)
{
	struct tree_node *t;

	if (ndim < 0 || ndim > PROTO_MAX_NDIM || (dtype != TL_FLOAT32 && dtype != TL_FLOAT64))
		return NULL;
	t = node(b, TREE_TENSOR, 0);
	if (t == NULL)
		return NULL;
	t->tensor.dtype = (enum proto_dtype)dtype;
	t->tensor.ndim = (uint32_t)ndim;
	for (int i = 0; i < ndim; i++) {
		if (shape[i] < 0)
			return NULL;
		t->tensor.shape[i] = shape[i];
	}
	if (tree_tensor_sizes(&t->tensor) != 0)
		return NULL;
	t->tensor.data = data;
	return (struct tl_tree *)t;
}

struct tl_tree *tl_none(struct tl_builder *b)
{
	return (struct tl_tree *)node(b, TREE_NONE, 0);
}

static struct tl_tree *seq(struct tl_builder *b, enum tree_kind kind, size_t n,
                           struct tl_tree *const *items)
{
	struct tree_node *t = node(b, kind, n);

	for (size_t i = 0; t && i < n; i++) {
		if (items[i] == NULL)
			return NULL;
		t->items[i] = *NODE(items[i]);
	}
	return (struct tl_tree *)t;
}

struct tl_tree *tl_tuple(struct tl_builder *b, size_t n, struct tl_tree *const *items)
{
	return seq(b, TREE_TUPLE, n, items);
}

struct tl_tree *tl_list(struct tl_builder *b, size_t n, struct tl_tree *const *items)
{
	return seq(b, TREE_LIST, n, items);
}

struct tl_tree *tl_dict(struct tl_builder *b, size_t n, const char *const *keys,
                        struct tl_tree *const *items)
{
	struct tree_node *t = (struct tree_node *)seq(b, TREE_DICT, n, items);

	if (t == NULL ||
	    (n && (t->keys = msgpack_zone_malloc(b->zone, n * sizeof *t->keys)) == NULL))
		return NULL;
	for (size_t i = 0; i < n; i++) {
		size_t len = strlen(keys[i]);
		char *copy = msgpack_zone_malloc(b->zone, len + 1);
		if (copy == NULL || len > PROTO_MAX_KEY_BYTES)
			return NULL;
		memcpy(copy, keys[i], len + 1);
		t->keys[i] = (struct tree_key){copy, (uint32_t)len};
	}
	return (struct tl_tree *)t;
}

/* ---- reading trees ------------------------------------------------------------- */

enum tl_kind tl_tree_kind(const struct tl_tree *t)
{
	return (enum tl_kind)CNODE(t)->kind;
}
size_t tl_tree_len(const struct tl_tree *t)
{
	return CNODE(t)->count;
}
enum tl_dtype tl_tree_dtype(const struct tl_tree *t)
{
	return (enum tl_dtype)CNODE(t)->tensor.dtype;
}
int tl_tree_ndim(const struct tl_tree *t)
{
	return (int)CNODE(t)->tensor.ndim;
}
const int64_t *tl_tree_shape(const struct tl_tree *t)
{
	return CNODE(t)->tensor.shape;
}
const void *tl_tree_data(const struct tl_tree *t)
{
	return CNODE(t)->tensor.data;
}
size_t tl_tree_nbytes(const struct tl_tree *t)
{
	return (size_t)CNODE(t)->tensor.nbytes;
}

const struct tl_tree *tl_tree_item(const struct tl_tree *t, size_t i)
{
	return i < CNODE(t)->count ? (const struct tl_tree *)&CNODE(t)->items[i] : NULL;
}

const char *tl_tree_key(const struct tl_tree *t, size_t i, size_t *len)
{
	if (CNODE(t)->kind != TREE_DICT || i >= CNODE(t)->count)
		return NULL;
	*len = CNODE(t)->keys[i].len;
	return CNODE(t)->keys[i].ptr;
}

const struct tl_tree *tl_tree_get(const struct tl_tree *t, const char *key)
{
	size_t n = strlen(key);

	for (size_t i = 0; CNODE(t)->kind == TREE_DICT && i < CNODE(t)->count; i++)
		if (CNODE(t)->keys[i].len == n && memcmp(CNODE(t)->keys[i].ptr, key, n) == 0)
			return (const struct tl_tree *)&CNODE(t)->items[i];
	return NULL;
}

/* ---- reading replies ---------------------------------------------------------- */

static const msgpack_object *result_field(const struct tl_reply *r, const char *key)
{
	return msg_obj_field(msg_field(&r->msg, "result"), key);
}

const char *tl_reply_string(const struct tl_reply *r, const char *key, size_t *len)
{
	const msgpack_object *o = result_field(r, key);

	if (o == NULL || o->type != MSGPACK_OBJECT_STR)
		return NULL;
	*len = o->via.str.size;
	return o->via.str.ptr;
}

double tl_reply_number(const struct tl_reply *r, const char *key)
{
	const msgpack_object *o = result_field(r, key);

	if (o == NULL)
		return NAN;
	switch (o->type) {
	case MSGPACK_OBJECT_BOOLEAN:
		return o->via.boolean;
	case MSGPACK_OBJECT_POSITIVE_INTEGER:
		return (double)o->via.u64;
	case MSGPACK_OBJECT_NEGATIVE_INTEGER:
		return (double)o->via.i64;
	case MSGPACK_OBJECT_FLOAT32:
	case MSGPACK_OBJECT_FLOAT64:
		return o->via.f64;
	default:
		return NAN;
	}
}

/* After a successful scan/grad: decode the result's trees (views). */
int tlc_read_trees(struct tl_reply *r, struct tl_error *err)
{
	static const char *const keys[TL_REPLY_TREES] = {"carry", "outputs", "grad_carry",
	                                                 "grad_inputs", "saved"};
	const msgpack_object *res = msg_field(&r->msg, "result");
	struct proto_err perr;
	struct tree_region region = {0};

	if (r->shm) {
		region.base = r->shm->base;
		region.size = r->shm->size;
	}
	for (size_t i = 0; i < TL_REPLY_TREES; i++) {
		const msgpack_object *o = msg_obj_field(res, keys[i]);
		if (o == NULL)
			continue;
		if (tree_decode_in(o, r->msg.up.zone, keys[i], r->shm ? &region : NULL,
		                   &r->trees[r->n], &perr) != 0)
			return tlc_fail(err, proto_code_name(perr.code), perr.path, "%s",
			                perr.message);
		r->names[r->n++] = keys[i];
	}
	return 0;
}

const struct tl_tree *tl_reply_tree(const struct tl_reply *r, const char *key)
{
	for (int i = 0; i < r->n; i++)
		if (strcmp(r->names[i], key) == 0)
			return (const struct tl_tree *)&r->trees[i];
	return NULL;
}

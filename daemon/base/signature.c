/*
 * signature.c - signatures and flat/tree conversions.  Pure functions over
 * caller-owned trees and zones; any thread.
 */
#include "signature.h"

#include "shapes.h"

#include <stdio.h>
#include <string.h>

struct sbuf {
	char *p;
	size_t size, len;
	int overflow;
};

static void put(struct sbuf *b, const char *s, size_t n)
{
	if (b->len + n + 1 > b->size) {
		b->overflow = 1;
		return;
	}
	memcpy(b->p + b->len, s, n);
	b->len += n;
	b->p[b->len] = '\0';
}

/* Decimal of a shape, T or key length (never negative once validated). */
static void put_int(struct sbuf *b, long long v)
{
	char tmp[20];

	put(b, tmp, tree_fmt_uint(tmp, v < 0 ? 0 : (uint64_t)v));
}

/* batch_axis: the dimension that reads "B" (-1: none but SHAPES_BATCH ones) */
static void sig_node(struct sbuf *b, const struct tree_node *n, int batch_axis)
{
	static const char open[] = {[TREE_TUPLE] = 't', [TREE_LIST] = 'l', [TREE_DICT] = 'd'};

	if (n->kind == TREE_NONE) {
		put(b, "N", 1);
		return;
	}
	if (n->kind == TREE_TENSOR) {
		put(b, "[", 1);
		for (uint32_t i = 0; i < n->tensor.ndim; i++) {
			if (i)
				put(b, ",", 1);
			if ((int)i == batch_axis || n->tensor.shape[i] == SHAPES_BATCH)
				put(b, "B", 1);
			else
				put_int(b, (long long)n->tensor.shape[i]);
		}
		put(b, "]", 1);
		return;
	}
	put(b, &open[n->kind], 1);
	put(b, "(", 1);
	for (uint32_t i = 0; i < n->count; i++) {
		if (i)
			put(b, ",", 1);
		if (n->kind == TREE_DICT) {
			put_int(b, (long long)n->keys[i].len);
			put(b, ":", 1);
			put(b, n->keys[i].ptr, n->keys[i].len);
			put(b, "=", 1);
		}
		sig_node(b, &n->items[i], batch_axis);
	}
	put(b, ")", 1);
}

int signature_of(const struct tree_node *carry, const struct tree_node *inputs,
                 enum proto_dtype dtype, int64_t steps, bool batch, char *buf, size_t size)
{
	struct sbuf b = {buf, size, 0, 0};

	buf[0] = '\0';
	put(&b, proto_dtype_name(dtype), strlen(proto_dtype_name(dtype)));
	put(&b, " T=", 3);
	put_int(&b, (long long)steps);
	put(&b, " carry=", 7);
	sig_node(&b, carry, batch ? 0 : -1);
	put(&b, " inputs=", 8);
	sig_node(&b, inputs, batch ? 1 : -1);
	return b.overflow ? -1 : 0;
}

static void mark_axis(struct tree_node *n, uint32_t axis)
{
	if (n->kind == TREE_TENSOR) {
		if (axis < n->tensor.ndim)
			n->tensor.shape[axis] = SHAPES_BATCH;
		shapes_sizes(&n->tensor, 1);
		return;
	}
	for (uint32_t i = 0; i < n->count; i++)
		mark_axis(&n->items[i], axis);
}

void signature_mark_batch(struct tree_node *carry, struct tree_node *inputs)
{
	mark_axis(carry, 0);
	mark_axis(inputs, 1);
}

void signature_bind(struct engine_tensor *t, size_t n, int64_t batch)
{
	for (size_t i = 0; i < n; i++) {
		uint64_t bytes = proto_dtype_size(t[i].dtype);
		for (uint32_t k = 0; k < t[i].ndim; k++) {
			if (t[i].shape[k] == SHAPES_BATCH)
				t[i].shape[k] = batch;
			bytes *= (uint64_t)t[i].shape[k];
		}
		t[i].nbytes = bytes;
	}
}

int signature_copy(const struct tree_node *src, msgpack_zone *zone, struct tree_node *out)
{
	*out = *src;
	out->tensor.data = NULL;
	if (src->count == 0)
		return 0;
	out->items = msgpack_zone_malloc(zone, src->count * sizeof *out->items);
	if (out->items == NULL)
		return -1;
	if (src->kind == TREE_DICT) {
		out->keys = msgpack_zone_malloc(zone, src->count * sizeof *out->keys);
		if (out->keys == NULL)
			return -1;
		for (uint32_t i = 0; i < src->count; i++) {
			char *copy = msgpack_zone_malloc(zone, src->keys[i].len + 1);
			if (copy == NULL)
				return -1;
			memcpy(copy, src->keys[i].ptr, src->keys[i].len);
			copy[src->keys[i].len] = '\0';
			out->keys[i] = (struct tree_key){copy, src->keys[i].len};
		}
	}
	for (uint32_t i = 0; i < src->count; i++)
		if (signature_copy(&src->items[i], zone, &out->items[i]) != 0)
			return -1;
	return 0;
}

void signature_flatten(const struct tree_node *n, struct engine_tensor *out, size_t *count)
{
	if (n->kind == TREE_TENSOR) {
		struct engine_tensor *t = &out[(*count)++];
		t->dtype = n->tensor.dtype;
		t->ndim = n->tensor.ndim;
		memcpy(t->shape, n->tensor.shape, sizeof t->shape);
		t->data = (void *)n->tensor.data;
		t->nbytes = n->tensor.nbytes;
		return;
	}
	for (uint32_t i = 0; i < n->count; i++)
		signature_flatten(&n->items[i], out, count);
}

int signature_fill(const struct tree_node *spec, const struct engine_tensor *flat, size_t n_flat,
                   size_t *pos, msgpack_zone *zone, struct tree_node *out)
{
	*out = *spec;
	if (spec->kind == TREE_TENSOR) {
		const struct engine_tensor *t;
		if (*pos >= n_flat)
			return -1;
		t = &flat[(*pos)++];
		out->tensor.dtype = t->dtype;
		out->tensor.ndim = t->ndim;
		memcpy(out->tensor.shape, t->shape, sizeof t->shape);
		out->tensor.data = t->data;
		return tree_tensor_sizes(&out->tensor);
	}
	if (spec->count == 0)
		return 0;
	out->items = msgpack_zone_malloc(zone, spec->count * sizeof *out->items);
	if (out->items == NULL)
		return -1;
	for (uint32_t i = 0; i < spec->count; i++)
		if (signature_fill(&spec->items[i], flat, n_flat, pos, zone, &out->items[i]) != 0)
			return -1;
	return 0;
}

static bool leaves_have_data(const struct tree_node *n, uint32_t *count)
{
	if (n->kind == TREE_TENSOR) {
		++*count;
		return n->tensor.data != NULL || n->tensor.nbytes == 0;
	}
	for (uint32_t i = 0; i < n->count; i++)
		if (!leaves_have_data(&n->items[i], count))
			return false;
	return true;
}

static int pack_leaves(msgpack_packer *pk, const struct tree_node *n)
{
	int rc = 0;

	if (n->kind == TREE_TENSOR) {
		rc |= msgpack_pack_bin(pk, (size_t)n->tensor.nbytes);
		rc |= msgpack_pack_bin_body(pk, n->tensor.data, (size_t)n->tensor.nbytes);
	}
	for (uint32_t i = 0; i < n->count; i++)
		rc |= pack_leaves(pk, &n->items[i]);
	return rc;
}

uint8_t *signature_sample(const struct tree_node *carry, const struct tree_node *inputs,
                          size_t *len)
{
	msgpack_sbuffer sb;
	msgpack_packer pk;
	uint32_t count = 0;

	if (!leaves_have_data(carry, &count) || !leaves_have_data(inputs, &count))
		return NULL;
	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	if ((msgpack_pack_array(&pk, count) | pack_leaves(&pk, carry) | pack_leaves(&pk, inputs)) !=
	    0) {
		msgpack_sbuffer_destroy(&sb);
		return NULL;
	}
	*len = sb.size;
	return (uint8_t *)sb.data;
}

#define WRT_TAG ";wrt="

int signature_wrt(char *buf, size_t size, const char *wrt)
{
	size_t n = strlen(buf);

	if (wrt == NULL)
		return 0;
	if (n + strlen(WRT_TAG) + strlen(wrt) >= size)
		return -1;
	snprintf(buf + n, size - n, "%s%s", WRT_TAG, wrt);
	return 0;
}

const char *signature_wrt_of(const char *sig)
{
	const char *p = strstr(sig, WRT_TAG);

	return p ? p + strlen(WRT_TAG) : NULL;
}

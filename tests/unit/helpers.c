/* helpers.c - see helpers.h. */
#include "helpers.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void tbuf_init(struct tbuf *b)
{
	msgpack_sbuffer_init(&b->sb);
	msgpack_packer_init(&b->pk, &b->sb, msgpack_sbuffer_write);
}

void tbuf_destroy(struct tbuf *b)
{
	msgpack_sbuffer_destroy(&b->sb);
}

void tbuf_raw(struct tbuf *b, const void *p, size_t n)
{
	msgpack_sbuffer_write(&b->sb, p, n);
}

void tbuf_str(struct tbuf *b, const char *s)
{
	msgpack_pack_str_with_body(&b->pk, s, strlen(s));
}

void tbuf_tensor(struct tbuf *b, uint8_t dtype, uint8_t ndim, const int64_t *shape, uint8_t pad,
                 size_t data_bytes)
{
	size_t len = 4 + 8 * (size_t)ndim + pad + data_bytes;
	uint8_t head[6] = {
	    0xc9,         (uint8_t)(len >> 24), (uint8_t)(len >> 16), (uint8_t)(len >> 8),
	    (uint8_t)len, PROTO_EXT_TENSOR};
	uint8_t meta[4] = {dtype, ndim, pad, 0};

	tbuf_raw(b, head, sizeof head);
	tbuf_raw(b, meta, sizeof meta);
	for (int i = 0; i < ndim; i++) {
		uint8_t le[8];
		for (int k = 0; k < 8; k++)
			le[k] = (uint8_t)((uint64_t)shape[i] >> (8 * k));
		tbuf_raw(b, le, 8);
	}
	for (size_t i = 0; i < pad + data_bytes; i++)
		tbuf_raw(b, "\0", 1);
}

void tbuf_nil_map(struct tbuf *b, int n, const char *const *keys)
{
	msgpack_pack_map(&b->pk, (uint32_t)n);
	for (int i = 0; i < n; i++) {
		tbuf_str(b, keys[i]);
		msgpack_pack_nil(&b->pk);
	}
}

void tbuf_request(struct tbuf *b, const char *key)
{
	msgpack_pack_map(&b->pk, 3);
	tbuf_str(b, "id");
	msgpack_pack_uint64(&b->pk, 7);
	tbuf_str(b, "op");
	tbuf_str(b, "scan");
	tbuf_str(b, key);
}

uint8_t *tbuf_body(const struct tbuf *b)
{
	uint8_t *body = frame_alloc(b->sb.size);

	cr_assert_not_null(body);
	memcpy(body, b->sb.data, b->sb.size);
	return body;
}

char *slurp(const char *path)
{
	FILE *f = fopen(path, "rb");
	char *buf;
	long n;

	cr_assert_not_null(f, "%s: %s", path, strerror(errno));
	fseek(f, 0, SEEK_END);
	n = ftell(f);
	fseek(f, 0, SEEK_SET);
	buf = calloc(1, (size_t)n + 1);
	cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
	fclose(f);
	return buf;
}

int parse_tree(struct parsed *p, size_t len, const char *key, const struct tree_region *region)
{
	if (msg_parse(&p->m, p->body, len, MSG_REQUEST, &p->err) != 0)
		return -1;
	p->m.region = region;
	return msg_get_tree(&p->m, key, true, &p->out, &p->err);
}

void parsed_free(struct parsed *p)
{
	msg_destroy(&p->m);
	frame_free(p->body);
}

uint8_t *writer_to_bytes(struct writer *w, size_t *len)
{
	struct proto_err err;
	uint8_t *out = writer_flatten(w, len, PROTO_FRAME_MAX, &err);

	cr_assert_not_null(out, "writer_flatten: %s", err.message);
	return out;
}

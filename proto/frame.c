/*
 * frame.c - the incremental frame reader.  Owns only the body buffer of the
 * frame being read; frame_reader_take passes it to the caller.  Pure state
 * machine with no I/O, usable from any one thread at a time.
 */
#include "frame.h"

#include <stdlib.h>
#include <string.h>

void frame_reader_init(struct frame_reader *r, uint32_t max_body)
{
	memset(r, 0, sizeof *r);
	r->max_body = max_body;
}

void frame_reader_free(struct frame_reader *r)
{
	frame_free(r->body);
	r->body = NULL;
}

uint8_t *frame_alloc(size_t len)
{
	size_t rounded = (len + PROTO_TENSOR_ALIGN - 1) & ~(size_t)(PROTO_TENSOR_ALIGN - 1);

	return aligned_alloc(PROTO_TENSOR_ALIGN, rounded ? rounded : PROTO_TENSOR_ALIGN);
}

void frame_free(uint8_t *body)
{
	free(body);
}

void frame_put_header(uint8_t out[PROTO_FRAME_HEADER], uint32_t len)
{
	out[0] = (uint8_t)(len >> 24);
	out[1] = (uint8_t)(len >> 16);
	out[2] = (uint8_t)(len >> 8);
	out[3] = (uint8_t)len;
}

/* Header just completed: check the limit, allocate the body. */
static enum frame_status header_done(struct frame_reader *r, struct proto_err *err)
{
	uint32_t len = ((uint32_t)r->header[0] << 24) | ((uint32_t)r->header[1] << 16) |
	               ((uint32_t)r->header[2] << 8) | r->header[3];

	if (len > r->max_body) {
		r->failed = 1;
		proto_fail(err, PROTO_E_FRAME_TOO_LARGE, NULL,
		           "frame of %u bytes exceeds the frame limit of %u bytes", len,
		           r->max_body);
		return FRAME_ERROR;
	}
	r->body = frame_alloc(len);
	if (r->body == NULL) {
		r->failed = 1;
		proto_fail(err, PROTO_E_INTERNAL, NULL, "cannot allocate %u bytes", len);
		return FRAME_ERROR;
	}
	r->body_len = len;
	r->body_have = 0;
	return len == 0 ? FRAME_READY : FRAME_NEED_MORE;
}

enum frame_status frame_reader_want(struct frame_reader *r, uint8_t **ptr, size_t *len,
                                    struct proto_err *err)
{
	if (r->failed) {
		proto_fail(err, PROTO_E_FRAME_TOO_LARGE, NULL, "framing is broken");
		return FRAME_ERROR;
	}
	if (r->header_have < PROTO_FRAME_HEADER) {
		*ptr = r->header + r->header_have;
		*len = PROTO_FRAME_HEADER - r->header_have;
	} else {
		*ptr = r->body + r->body_have;
		*len = r->body_len - r->body_have;
	}
	return FRAME_NEED_MORE;
}

enum frame_status frame_reader_commit(struct frame_reader *r, size_t n, struct proto_err *err)
{
	if (r->header_have < PROTO_FRAME_HEADER) {
		r->header_have += n;
		if (r->header_have == PROTO_FRAME_HEADER)
			return header_done(r, err);
		return FRAME_NEED_MORE;
	}
	r->body_have += n;
	return r->body_have == r->body_len ? FRAME_READY : FRAME_NEED_MORE;
}

enum frame_status frame_reader_feed(struct frame_reader *r, const uint8_t *data, size_t len,
                                    size_t *used, struct proto_err *err)
{
	enum frame_status st = FRAME_NEED_MORE;

	*used = 0;
	if (r->body != NULL && r->header_have == PROTO_FRAME_HEADER && r->body_have == r->body_len)
		return FRAME_READY; /* previous frame not taken yet */
	while (*used < len) {
		uint8_t *dst;
		size_t want, n;

		st = frame_reader_want(r, &dst, &want, err);
		if (st == FRAME_ERROR)
			return st;
		n = len - *used < want ? len - *used : want;
		memcpy(dst, data + *used, n);
		*used += n;
		st = frame_reader_commit(r, n, err);
		if (st != FRAME_NEED_MORE)
			return st;
	}
	return st;
}

uint8_t *frame_reader_take(struct frame_reader *r, uint32_t *len)
{
	uint8_t *body = r->body;

	*len = r->body_len;
	r->body = NULL;
	r->body_len = 0;
	r->body_have = 0;
	r->header_have = 0;
	return body;
}

int frame_reader_eof(const struct frame_reader *r, struct proto_err *err)
{
	if (r->header_have == 0)
		return 0;
	return proto_fail(err, PROTO_E_FRAME_TRUNCATED, NULL,
	                  "stream ended after %zu of %zu header bytes and %zu of %u body bytes",
	                  r->header_have, (size_t)PROTO_FRAME_HEADER, r->body_have, r->body_len);
}

/*
 * writer.c - frame assembly over msgpack_vrefbuffer.  One writer per frame,
 * used by one thread; writer_destroy frees its chunks (never the caller's
 * referenced buffers).
 */
#include "writer.h"

#include <stdlib.h>
#include <string.h>

/* Chunks at least this large are referenced rather than copied. */
#define WRITER_REF_SIZE   1024
#define WRITER_CHUNK_SIZE 8192

static int writer_cb(void *data, const char *buf, size_t len)
{
	struct writer *w = data;

	if (msgpack_vrefbuffer_write(&w->vbuf, buf, len) != 0) {
		w->oom = 1;
		return -1;
	}
	w->pos += len;
	return 0;
}

int writer_init(struct writer *w)
{
	memset(w, 0, sizeof *w);
	if (!msgpack_vrefbuffer_init(&w->vbuf, WRITER_REF_SIZE, WRITER_CHUNK_SIZE))
		return -1;
	msgpack_packer_init(&w->pk, w, writer_cb);
	return 0;
}

void writer_destroy(struct writer *w)
{
	msgpack_vrefbuffer_destroy(&w->vbuf);
}

void writer_strn(struct writer *w, const char *s, size_t n)
{
	msgpack_pack_str_with_body(&w->pk, s, n);
}

void writer_str(struct writer *w, const char *s)
{
	writer_strn(w, s, strlen(s));
}

void writer_key_str(struct writer *w, const char *key, const char *value)
{
	writer_str(w, key);
	writer_str(w, value);
}

void writer_key_u64(struct writer *w, const char *key, uint64_t value)
{
	writer_str(w, key);
	msgpack_pack_uint64(&w->pk, value);
}

void writer_key_i64(struct writer *w, const char *key, int64_t value)
{
	writer_str(w, key);
	msgpack_pack_int64(&w->pk, value);
}

void writer_key_f64(struct writer *w, const char *key, double value)
{
	writer_str(w, key);
	msgpack_pack_double(&w->pk, value);
}

void writer_key_bool(struct writer *w, const char *key, bool value)
{
	writer_str(w, key);
	if (value)
		msgpack_pack_true(&w->pk);
	else
		msgpack_pack_false(&w->pk);
}

void writer_raw(struct writer *w, const void *data, size_t len)
{
	if (len == 0)
		return;
	if (msgpack_vrefbuffer_append_copy(&w->vbuf, data, len) != 0)
		w->oom = 1;
	w->pos += len;
}

void writer_ref(struct writer *w, const void *data, size_t len)
{
	if (len == 0)
		return;
	writer_cb(w, data, len);
}

size_t writer_iovcnt(const struct writer *w)
{
	return 1 + msgpack_vrefbuffer_veclen(&w->vbuf);
}

static int writer_seal(struct writer *w, uint32_t max_frame, struct proto_err *err)
{
	if (w->oom)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory building a frame");
	if (w->pos > max_frame)
		return proto_fail(err, PROTO_E_FRAME_TOO_LARGE, NULL,
		                  "reply of %llu bytes exceeds the frame limit of %u bytes",
		                  (unsigned long long)w->pos, max_frame);
	w->header[0] = (uint8_t)(w->pos >> 24);
	w->header[1] = (uint8_t)(w->pos >> 16);
	w->header[2] = (uint8_t)(w->pos >> 8);
	w->header[3] = (uint8_t)w->pos;
	return 0;
}

int writer_finish(struct writer *w, struct iovec *iov, size_t cap, uint32_t max_frame,
                  struct proto_err *err)
{
	const msgpack_iovec *vec = msgpack_vrefbuffer_vec(&w->vbuf);
	size_t n = msgpack_vrefbuffer_veclen(&w->vbuf);

	if (writer_seal(w, max_frame, err) != 0)
		return -1;
	if (cap < n + 1)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "iovec array too small");
	iov[0].iov_base = w->header;
	iov[0].iov_len = PROTO_FRAME_HEADER;
	for (size_t i = 0; i < n; i++)
		iov[i + 1] = vec[i];
	return (int)(n + 1);
}

uint8_t *writer_flatten(struct writer *w, size_t *len, uint32_t max_frame, struct proto_err *err)
{
	const msgpack_iovec *vec = msgpack_vrefbuffer_vec(&w->vbuf);
	size_t n = msgpack_vrefbuffer_veclen(&w->vbuf);
	uint8_t *out, *p;

	if (writer_seal(w, max_frame, err) != 0)
		return NULL;
	out = malloc(PROTO_FRAME_HEADER + w->pos);
	if (out == NULL) {
		proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
		return NULL;
	}
	memcpy(out, w->header, PROTO_FRAME_HEADER);
	p = out + PROTO_FRAME_HEADER;
	for (size_t i = 0; i < n; i++) {
		memcpy(p, vec[i].iov_base, vec[i].iov_len);
		p += vec[i].iov_len;
	}
	*len = PROTO_FRAME_HEADER + w->pos;
	return out;
}

/*
 * writer.h - builds one outgoing frame: a msgpack packer over a
 * vectored-referencing buffer, so large tensor payloads are referenced from
 * the caller's memory instead of copied, and a 4-byte length header in
 * front.  The writer tracks the body offset so tensors can be padded to land
 * PROTO_TENSOR_ALIGN-aligned in the receiver's (aligned) frame buffer.
 *
 * Ownership: buffers handed to writer_tensor_bytes must stay alive and
 * unchanged until the frame's iovecs have been written out.
 */
#ifndef TORCHLOOP_WRITER_H
#define TORCHLOOP_WRITER_H

#include "protocol.h"

#include <msgpack.h>
#include <stdbool.h>
#include <sys/uio.h>

struct writer {
	msgpack_vrefbuffer vbuf;
	msgpack_packer pk;
	uint64_t pos; /* body bytes written so far */
	uint8_t header[PROTO_FRAME_HEADER];
	int oom;
};

/* Returns 0, or -1 when out of memory. */
int writer_init(struct writer *w);
void writer_destroy(struct writer *w);

void writer_str(struct writer *w, const char *s);
void writer_strn(struct writer *w, const char *s, size_t n);
void writer_key_str(struct writer *w, const char *key, const char *value);
void writer_key_u64(struct writer *w, const char *key, uint64_t value);
void writer_key_i64(struct writer *w, const char *key, int64_t value);
void writer_key_f64(struct writer *w, const char *key, double value);
void writer_key_bool(struct writer *w, const char *key, bool value);
/* Writes raw, already-encoded msgpack bytes (copied). */
void writer_raw(struct writer *w, const void *data, size_t len);
/* Writes bytes by reference when large (see ownership above). */
void writer_ref(struct writer *w, const void *data, size_t len);

/* Number of iovecs writer_finish fills (header included). */
size_t writer_iovcnt(const struct writer *w);
/*
 * Seals the frame: checks the body against max_frame and fills iov (cap
 * entries, at least writer_iovcnt) with the header and the body pieces.
 * Returns the iovec count, or -1 with err filled.
 */
int writer_finish(struct writer *w, struct iovec *iov, size_t cap, uint32_t max_frame,
                  struct proto_err *err);
/* Seals and copies header + body into one malloc'ed buffer (*len bytes). */
uint8_t *writer_flatten(struct writer *w, size_t *len, uint32_t max_frame, struct proto_err *err);

#endif

/*
 * helpers.h - shared test helpers: building raw msgpack bodies (valid and
 * hostile) and frames, and parsing them back.  Test-only code.
 */
#ifndef TORCHLOOP_TEST_HELPERS_H
#define TORCHLOOP_TEST_HELPERS_H

#include "frame.h"
#include "msg.h"
#include "tree.h"
#include "writer.h"

#include <msgpack.h>
#include <stdint.h>

/* A growable byte buffer with a msgpack packer on it. */
struct tbuf {
	msgpack_sbuffer sb;
	msgpack_packer pk;
};

void tbuf_init(struct tbuf *b);
void tbuf_destroy(struct tbuf *b);
void tbuf_raw(struct tbuf *b, const void *p, size_t n);
void tbuf_str(struct tbuf *b, const char *s);
/* Raw tensor ext (ext32), with full control for hostile cases. */
void tbuf_tensor(struct tbuf *b, uint8_t dtype, uint8_t ndim, const int64_t *shape, uint8_t pad,
                 size_t data_bytes);
/* Begins {id: 7, op: "scan", <key>: ...} ; the caller writes the value. */
void tbuf_request(struct tbuf *b, const char *key);

/* Copies b into a fresh aligned frame body (as the reader would produce). */
uint8_t *tbuf_body(const struct tbuf *b);

/* Seals a writer into a flat buffer header+body; asserts success. */
uint8_t *writer_to_bytes(struct writer *w, size_t *len);

#endif

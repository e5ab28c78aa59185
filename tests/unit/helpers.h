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
/* A map of n keys, each to None (keys may repeat: hostile cases). */
void tbuf_nil_map(struct tbuf *b, int n, const char *const *keys);
/* Begins {id: 7, op: "scan", <key>: ...} ; the caller writes the value. */
void tbuf_request(struct tbuf *b, const char *key);

/* Copies b into a fresh aligned frame body (as the reader would produce). */
uint8_t *tbuf_body(const struct tbuf *b);

/*
 * A built request parsed as the daemon would: the frame body, the message,
 * and (once tbuf_parse_tree ran) the decoded tree under `key`.
 */
struct parsed {
	struct msg m;
	uint8_t *body;
	struct tree_node out;
	struct proto_err err;
};

/* Parses p->body (tbuf_body of a request of len bytes), then decodes `key`
 * unless the parse failed; region, if non-NULL, is the shared region the
 * message may refer to.  0 or -1 with p->err set; parsed_free is due either
 * way. */
int parse_tree(struct parsed *p, size_t len, const char *key, const struct tree_region *region);
void parsed_free(struct parsed *p);

/* A file's whole text, NUL-terminated (asserts it can be read); free it.
 * The e2e harness links this file too (h_slurp). */
char *slurp(const char *path);

/* Seals a writer into a flat buffer header+body; asserts success. */
uint8_t *writer_to_bytes(struct writer *w, size_t *len);

#endif

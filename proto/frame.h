/*
 * frame.h - length-prefixed framing: a 4-byte big-endian body length, then
 * the body.  The reader is incremental (bytes may arrive split at any
 * offset) and checks the limit from the prefix alone, before any body byte
 * is buffered.  Bodies are allocated PROTO_TENSOR_ALIGN-aligned so tensor
 * views into them can be used without copying.
 */
#ifndef TORCHLOOP_FRAME_H
#define TORCHLOOP_FRAME_H

#include "protocol.h"

#include <stddef.h>
#include <stdint.h>

enum frame_status { FRAME_NEED_MORE = 0, FRAME_READY = 1, FRAME_ERROR = -1 };

struct frame_reader {
	uint32_t max_body; /* frame limit, checked against each prefix */
	uint8_t header[PROTO_FRAME_HEADER];
	size_t header_have;
	uint8_t *body; /* owned; aligned */
	uint32_t body_len;
	size_t body_have;
	int failed; /* sticky: framing is broken, nothing more is accepted */
};

void frame_reader_init(struct frame_reader *r, uint32_t max_body);
void frame_reader_free(struct frame_reader *r);

/*
 * Consumes bytes from data until one frame is complete or data runs out.
 * *used tells how many bytes were consumed (the rest belong to the next
 * frame).  Returns FRAME_READY when a body can be taken, FRAME_NEED_MORE, or
 * FRAME_ERROR with err filled (FRAME_TOO_LARGE); an error is sticky.
 */
enum frame_status frame_reader_feed(struct frame_reader *r, const uint8_t *data, size_t len,
                                    size_t *used, struct proto_err *err);

/*
 * Where the next bytes should be read to: the rest of the header or of the
 * body.  Lets a socket read land straight in the body buffer (no copy).
 * Returns FRAME_ERROR when the prefix just completed is over the limit.
 */
enum frame_status frame_reader_want(struct frame_reader *r, uint8_t **ptr, size_t *len,
                                    struct proto_err *err);
/* Records that n bytes were written at the pointer frame_reader_want gave. */
enum frame_status frame_reader_commit(struct frame_reader *r, size_t n, struct proto_err *err);

/*
 * After FRAME_READY: hands over the body (caller frees with frame_free) and
 * resets the reader for the next frame.
 */
uint8_t *frame_reader_take(struct frame_reader *r, uint32_t *len);

/* End of stream: returns 0 if no partial frame is pending, else -1 and
 * FRAME_TRUNCATED in err. */
int frame_reader_eof(const struct frame_reader *r, struct proto_err *err);

uint8_t *frame_alloc(size_t len);
void frame_free(uint8_t *body);
void frame_put_header(uint8_t out[PROTO_FRAME_HEADER], uint32_t len);

#endif

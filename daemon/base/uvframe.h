/*
 * uvframe.h - libuv reads straight into a frame reader: the alloc callback
 * hands libuv the rest of the current header or body, so frame bytes are
 * never copied.  Used by the compile worker's pipe (client connections
 * stage small frames instead: see conn.c).
 */
#ifndef TORCHLOOP_UVFRAME_H
#define TORCHLOOP_UVFRAME_H

#include "frame.h"

#include <uv.h>

/* Fills buf with the reader's next region (empty once framing broke). */
static inline void uvframe_alloc(struct frame_reader *r, uv_buf_t *buf)
{
	struct proto_err err;
	uint8_t *p = NULL;
	size_t n = 0;

	if (frame_reader_want(r, &p, &n, &err) == FRAME_ERROR)
		n = 0;
	*buf = uv_buf_init((char *)p, (unsigned)n);
}

#endif

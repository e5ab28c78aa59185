/*
 * test_proto_frame.c - the incremental frame reader: whole frames, one byte
 * at a time, split at every offset, the limit checked from the prefix alone,
 * truncation at end of stream, and aligned bodies.
 */
#include "helpers.h"

#include <criterion/criterion.h>
#include <string.h>

TestSuite(frame, .timeout = 30);

/* A real request frame with tensors, so splits cross every field kind. */
static uint8_t *sample_frame(size_t *len)
{
	static double data[6] = {1, 2, 3, 4, 5, 6};
	struct tree_node leaf = {
	    .kind = TREE_TENSOR,
	    .tensor = {.dtype = PROTO_DTYPE_F64, .ndim = 2, .shape = {2, 3}, .data = data}};
	struct writer w;
	uint8_t *out;

	tree_tensor_sizes(&leaf.tensor);
	cr_assert_eq(writer_init(&w), 0);
	msg_begin_request(&w, 42, "scan", 1);
	writer_str(&w, "inputs");
	tree_encode(&w, &leaf);
	out = writer_to_bytes(&w, len);
	writer_destroy(&w);
	return out;
}

static void expect_body(uint8_t *body, uint32_t len, const uint8_t *frame, size_t flen)
{
	cr_assert_eq(len + 4, flen);
	cr_assert_eq(memcmp(body, frame + 4, len), 0);
	cr_assert_eq((uintptr_t)body % PROTO_TENSOR_ALIGN, 0, "frame bodies are aligned");
	frame_free(body);
}

/* Feeds one sample frame in pieces of `piece` bytes: every piece is taken
 * whole, the frame is ready exactly after its last byte, and the stream ends
 * cleanly after it. */
static void feed_in_pieces(size_t piece)
{
	struct frame_reader r;
	struct proto_err err;
	size_t len, used;
	uint8_t *f = sample_frame(&len);
	uint32_t blen;

	frame_reader_init(&r, PROTO_FRAME_DEFAULT);
	for (size_t i = 0; i < len; i += piece) {
		size_t n = len - i < piece ? len - i : piece;
		enum frame_status st = frame_reader_feed(&r, f + i, n, &used, &err);
		cr_assert_eq(used, n);
		cr_assert_eq(st, i + n == len ? FRAME_READY : FRAME_NEED_MORE, "byte %zu", i);
	}
	{
		uint8_t *body = frame_reader_take(&r, &blen);
		expect_body(body, blen, f, len);
	}
	cr_assert_eq(frame_reader_eof(&r, &err), 0);
	frame_reader_free(&r);
	free(f);
}

Test(frame, a_whole_frame_is_ready_at_once)
{
	feed_in_pieces(SIZE_MAX);
}

Test(frame, bytes_fed_one_at_a_time_make_the_same_frame)
{
	feed_in_pieces(1);
}

Test(frame, two_frames_split_at_every_offset_both_arrive_intact)
{
	size_t len;
	uint8_t *f = sample_frame(&len);
	uint8_t *two = malloc(2 * len);

	memcpy(two, f, len);
	memcpy(two + len, f, len);
	for (size_t split = 0; split <= 2 * len; split++) {
		struct frame_reader r;
		struct proto_err err;
		size_t off = 0, used;
		int frames = 0;

		frame_reader_init(&r, PROTO_FRAME_DEFAULT);
		while (off < 2 * len) {
			size_t end = off < split ? split : 2 * len;
			enum frame_status st =
			    frame_reader_feed(&r, two + off, end - off, &used, &err);
			cr_assert_neq(st, FRAME_ERROR);
			off += used;
			if (st == FRAME_READY) {
				uint32_t blen;
				{
					uint8_t *body = frame_reader_take(&r, &blen);
					expect_body(body, blen, f, len);
				}
				frames++;
			}
		}
		cr_assert_eq(frames, 2, "split at %zu", split);
		cr_assert_eq(frame_reader_eof(&r, &err), 0);
		frame_reader_free(&r);
	}
	free(two);
	free(f);
}

Test(frame, an_oversize_prefix_is_refused_before_any_body_byte)
{
	struct frame_reader r;
	struct proto_err err;
	uint8_t prefix[4];
	size_t used;

	frame_put_header(prefix, PROTO_FRAME_DEFAULT + 1);
	frame_reader_init(&r, PROTO_FRAME_DEFAULT);
	cr_assert_eq(frame_reader_feed(&r, prefix, 4, &used, &err), FRAME_ERROR);
	cr_assert_eq(err.code, PROTO_E_FRAME_TOO_LARGE);
	cr_assert_null(r.body, "no body buffer was allocated");
	cr_assert(strstr(err.message, "67108865") != NULL, "%s", err.message);
	/* sticky: framing is broken */
	cr_assert_eq(frame_reader_feed(&r, prefix, 1, &used, &err), FRAME_ERROR);
	frame_reader_free(&r);
}

Test(frame, a_configured_limit_up_to_one_gib_is_honoured)
{
	struct frame_reader r;
	struct proto_err err;
	uint8_t prefix[4];
	size_t used;

	frame_put_header(prefix, 2048);
	frame_reader_init(&r, 2047);
	cr_assert_eq(frame_reader_feed(&r, prefix, 4, &used, &err), FRAME_ERROR);
	cr_assert_eq(err.code, PROTO_E_FRAME_TOO_LARGE);
	frame_reader_free(&r);
	frame_reader_init(&r, 2048);
	cr_assert_eq(frame_reader_feed(&r, prefix, 4, &used, &err), FRAME_NEED_MORE);
	frame_reader_free(&r);
}

Test(frame, a_stream_ending_inside_a_frame_is_truncated)
{
	struct frame_reader r;
	struct proto_err err;
	size_t len, used;
	uint8_t *f = sample_frame(&len);

	for (size_t cut = 1; cut < len; cut++) {
		frame_reader_init(&r, PROTO_FRAME_DEFAULT);
		cr_assert_eq(frame_reader_feed(&r, f, cut, &used, &err), FRAME_NEED_MORE);
		cr_assert_eq(frame_reader_eof(&r, &err), -1);
		cr_assert_eq(err.code, PROTO_E_FRAME_TRUNCATED, "cut at %zu", cut);
		frame_reader_free(&r);
	}
	free(f);
}

Test(frame, an_empty_body_is_a_frame_but_not_a_message)
{
	struct frame_reader r;
	struct proto_err err;
	uint8_t zero[4] = {0, 0, 0, 0};
	size_t used;
	uint32_t blen;
	struct msg m;
	uint8_t *body;

	frame_reader_init(&r, PROTO_FRAME_DEFAULT);
	cr_assert_eq(frame_reader_feed(&r, zero, 4, &used, &err), FRAME_READY);
	body = frame_reader_take(&r, &blen);
	cr_assert_eq(blen, 0);
	cr_assert_eq(msg_parse(&m, body, blen, MSG_REQUEST, &err), -1);
	cr_assert_eq(err.code, PROTO_E_MSGPACK_INVALID);
	msg_destroy(&m);
	frame_free(body);
	frame_reader_free(&r);
}

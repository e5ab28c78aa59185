/*
 * mpguard.c - iterative walk over msgpack bytes; an explicit stack of
 * "items left" per open container replaces recursion, so hostile nesting
 * costs nothing.  No allocation, no global state; any thread.
 */
#include "mpguard.h"

struct walk {
	const uint8_t *p;
	size_t len;
	size_t pos;
	struct proto_err *err;
};

static int truncated(struct walk *w)
{
	return proto_fail(w->err, PROTO_E_MSGPACK_INVALID, NULL,
	                  "msgpack value truncated at byte %zu of %zu", w->pos, w->len);
}

/* Reads an n-byte big-endian unsigned integer at pos. */
static int read_be(struct walk *w, int n, uint64_t *out)
{
	uint64_t v = 0;

	if (w->len - w->pos < (size_t)n)
		return truncated(w);
	for (int i = 0; i < n; i++)
		v = (v << 8) | w->p[w->pos++];
	*out = v;
	return 0;
}

static int skip(struct walk *w, uint64_t n)
{
	if (w->len - w->pos < n)
		return truncated(w);
	w->pos += (size_t)n;
	return 0;
}

/*
 * Classifies the object whose type byte was just read.  Sets *count to the
 * number of child objects (0 for scalars) after skipping any payload.
 */
static int object(struct walk *w, uint8_t b, uint64_t *count)
{
	uint64_t n = 0;

	*count = 0;
	if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
		return 0;
	if (b >= 0xa0 && b <= 0xbf)
		return skip(w, b & 0x1f);
	if (b >= 0x90 && b <= 0x9f)
		return *count = b & 0x0f, 0;
	if (b >= 0x80 && b <= 0x8f)
		return *count = 2u * (b & 0x0f), 0;
	/* uint 8/16/32/64 (cc-cf), int 8/16/32/64 (d0-d3), float 32/64 (ca, cb) */
	if (b >= 0xcc && b <= 0xd3)
		return skip(w, 1u << ((b - 0xcc) % 4));
	if (b == 0xca || b == 0xcb)
		return skip(w, b == 0xca ? 4 : 8);
	/* fixext 1/2/4/8/16 (d4-d8): a type byte and 2^k bytes */
	if (b >= 0xd4 && b <= 0xd8)
		return skip(w, 1 + (1u << (b - 0xd4)));
	/* bin (c4-c6), ext (c7-c9, a type byte after the payload's length) and
	 * str (d9-db) of 8/16/32: a length of 1, 2 or 4 bytes, then the payload */
	if ((b >= 0xc4 && b <= 0xc9) || (b >= 0xd9 && b <= 0xdb)) {
		unsigned k = b >= 0xd9 ? b - 0xd9u : (b - 0xc4u) % 3;
		return read_be(w, 1 << k, &n) || skip(w, n + (b >= 0xc7 && b <= 0xc9));
	}
	/* array 16/32 (dc, dd), map 16/32 (de, df): a count of 2 or 4 bytes */
	if (b >= 0xdc && b <= 0xdf) {
		if (read_be(w, b & 1 ? 4 : 2, &n) != 0)
			return -1;
		*count = b >= 0xde ? 2 * n : n;
		return 0;
	}
	return proto_fail(w->err, PROTO_E_MSGPACK_INVALID, NULL,
	                  "reserved msgpack type byte 0x%02x at byte %zu", b, w->pos - 1);
}

int mpguard_check(const uint8_t *data, size_t len, struct proto_err *err)
{
	uint64_t left[PROTO_MAX_MSGPACK_DEPTH + 1];
	struct walk w = {data, len, 0, err};
	uint64_t objects = 0, count;
	int depth = 0;

	left[0] = 1; /* the one top-level value */
	for (;;) {
		while (depth >= 0 && left[depth] == 0)
			depth--;
		if (depth < 0)
			break;
		left[depth]--;
		if (w.pos >= w.len)
			return truncated(&w);
		if (++objects > PROTO_MAX_OBJECTS)
			return proto_fail(err, PROTO_E_OBJECT_LIMIT, NULL,
			                  "frame holds more than %d msgpack objects",
			                  PROTO_MAX_OBJECTS);
		if (object(&w, w.p[w.pos++], &count) != 0)
			return -1;
		if (count == 0)
			continue;
		if (count > w.len - w.pos)
			return proto_fail(
			    err, PROTO_E_MSGPACK_COUNT_TOO_LARGE, NULL,
			    "container of %llu items at byte %zu, but only %zu bytes are left",
			    (unsigned long long)count, w.pos, w.len - w.pos);
		if (depth + 1 > PROTO_MAX_MSGPACK_DEPTH)
			return proto_fail(err, PROTO_E_DEPTH_EXCEEDED, NULL,
			                  "msgpack nesting exceeds %d levels",
			                  PROTO_MAX_MSGPACK_DEPTH);
		left[++depth] = count;
	}
	if (w.pos != w.len)
		return proto_fail(err, PROTO_E_MSGPACK_INVALID, NULL,
		                  "%zu trailing bytes after the msgpack value", w.len - w.pos);
	return 0;
}

/*
 * utf8.c - see utf8.h.  The second byte's range decides overlongs,
 * surrogates and the U+10FFFF ceiling (Unicode's table 3-7, "well-formed
 * UTF-8 byte sequences"); the bytes after it are plain continuations.
 * Pure functions: any thread.
 */
#include "utf8.h"

static int cont(uint8_t b)
{
	return (b & 0xc0) == 0x80;
}

size_t utf8_seq_len(const uint8_t *s, size_t n)
{
	uint8_t b = n ? s[0] : 0xff, lo = 0x80, hi = 0xbf;
	size_t len;

	if (n == 0)
		return 0;
	if (b < 0x80)
		return 1;
	if (b < 0xc2 || b > 0xf4) /* continuation, overlong 2-byte lead, past U+10FFFF */
		return 0;
	len = b < 0xe0 ? 2 : b < 0xf0 ? 3 : 4;
	if (b == 0xe0)
		lo = 0xa0; /* overlong 3-byte */
	else if (b == 0xed)
		hi = 0x9f; /* surrogates */
	else if (b == 0xf0)
		lo = 0x90; /* overlong 4-byte */
	else if (b == 0xf4)
		hi = 0x8f; /* past U+10FFFF */
	if (n < len || s[1] < lo || s[1] > hi)
		return 0;
	for (size_t k = 2; k < len; k++)
		if (!cont(s[k]))
			return 0;
	return len;
}

size_t utf8_check(const void *s, size_t n)
{
	const uint8_t *p = s;
	size_t off = 0;

	while (off < n) {
		size_t k;
		while (off < n && p[off] < 0x80) /* the common case: ASCII */
			off++;
		if (off == n)
			break;
		k = utf8_seq_len(p + off, n - off);
		if (k == 0)
			return off;
		off += k;
	}
	return n;
}

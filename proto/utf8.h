/*
 * utf8.h - the one UTF-8 validator (RFC 3629).  Request text the daemon
 * forwards to a compile worker or keeps must be well-formed UTF-8: the
 * worker's msgpack decoder refuses anything else, and log lines escape
 * what is not.  Overlong forms, surrogates (U+D800..U+DFFF), code points
 * past U+10FFFF, stray continuation bytes and cut sequences are ill-formed.
 */
#ifndef TORCHLOOP_UTF8_H
#define TORCHLOOP_UTF8_H

#include <stddef.h>
#include <stdint.h>

/* The length (1 to 4) of the well-formed sequence s starts with, or 0 when
 * it is ill-formed (or n is 0). */
size_t utf8_seq_len(const uint8_t *s, size_t n);

/* n when s[0..n) is well-formed UTF-8, else the offset of the first byte
 * of the first ill-formed sequence. */
size_t utf8_check(const void *s, size_t n);

#endif

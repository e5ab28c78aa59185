/* sha256.h - FIPS 180-4 SHA-256, for cache keys and artifact checksums. */
#ifndef TORCHLOOP_SHA256_H
#define TORCHLOOP_SHA256_H

#include <stddef.h>
#include <stdint.h>

struct sha256 {
	uint32_t h[8];
	uint64_t len;
	uint8_t buf[64];
	size_t fill;
};

void sha256_init(struct sha256 *s);
void sha256_update(struct sha256 *s, const void *data, size_t len);
void sha256_final(struct sha256 *s, uint8_t out[32]);
/* Lower-case hex of the digest into out (65 bytes with the NUL). */
void sha256_hex(const uint8_t digest[32], char out[65]);
/* Hashes a whole file; returns 0, or -1 with errno set. size gets its length. */
/* Hashes what is left to read of fd (the caller closes it); 0 or -1. */
int sha256_fd(int fd, char hex[65], uint64_t *size);
int sha256_file(const char *path, char hex[65], uint64_t *size);
/* One digest over several files' digests, in order; a file that does not
 * exist counts as absent (its absence is part of the digest). -1 with errno
 * when one cannot be read. */
int sha256_files(const char *const *paths, int n, char hex[65]);

#endif

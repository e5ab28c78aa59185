/*
 * mpguard.h - a bounds pre-scan of raw msgpack bytes.
 *
 * msgpack-c's C unpacker trusts container counts (a 5-byte array32 header
 * makes it allocate ~96 GB, msgpack-c issue 1013) and fails past 32 nesting
 * levels.  mpguard_check walks the bytes without allocating and accepts them
 * only if they hold exactly one complete value whose every container count
 * fits in the bytes left, whose nesting is at most PROTO_MAX_MSGPACK_DEPTH and
 * whose object count is at most PROTO_MAX_OBJECTS.  Only then may the
 * unpacker see them.
 */
#ifndef TORCHLOOP_MPGUARD_H
#define TORCHLOOP_MPGUARD_H

#include "protocol.h"

#include <stddef.h>
#include <stdint.h>

/* Returns 0 when data is safe to unpack, else -1 with err filled. */
int mpguard_check(const uint8_t *data, size_t len, struct proto_err *err);

#endif

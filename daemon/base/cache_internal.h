/*
 * cache_internal.h - what cache.c and cache_lock.c share: an entry's path
 * and the I/O failure.  Inline, so that neither file calls the other back.
 */
#ifndef TORCHLOOP_CACHE_INTERNAL_H
#define TORCHLOOP_CACHE_INTERNAL_H
#include "cache.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

/* <dir>/objects/<key>.<ext> */
static inline void cache_entry_path(const struct cache *c, const char *key, const char *ext,
                                    char *out, size_t size)
{
	snprintf(out, size, "%s/objects/%s.%s", c->dir, key, ext);
}

/* An I/O failure: the machine's, never remembered against a graph. */
static inline int cache_sys_fail(struct proto_err *err, const char *what, const char *path)
{
	int e = errno;

	proto_fail(err, PROTO_E_INTERNAL, NULL, "%s: %s %s", strerror(e), what, path);
	err->flags = PROTO_ERR_TRANSIENT;
	return -1;
}
#endif

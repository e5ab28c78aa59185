/*
 * shapes.h - shape trees: a tree's structure and tensor shapes without data,
 * as the compile op carries them and the compile worker reads them:
 *   None | {"k": "T", "s": [dims]} | {"k": "tuple"|"list", "c": [...]}
 *        | {"k": "dict", "keys": [...], "c": [...]}
 * (docs/protocol.md).  Pure functions; any thread.
 */
#ifndef TORCHLOOP_SHAPES_H
#define TORCHLOOP_SHAPES_H

#include "tree.h"
#include "writer.h"

#include <msgpack.h>

/* Writes the shape tree of n (data ignored). */
void shapes_write(struct writer *w, const struct tree_node *n);
/*
 * Reads a shape tree into nodes allocated in zone, every tensor of dtype.
 * Returns 0 or -1 with err (COMPILE_FAILED: malformed).  The msgpack must
 * have passed mpguard (nesting is bounded by it).
 */
int shapes_read(const msgpack_object *o, msgpack_zone *zone, enum proto_dtype dtype,
                struct tree_node *out, struct proto_err *err);

#endif

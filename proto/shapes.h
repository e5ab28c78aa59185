/*
 * shapes.h - shape trees: a tree's structure and tensor shapes without data,
 * as the compile op carries them and the compile worker reads them:
 *   None | {"k": "T", "s": [dims]} | {"k": "tuple"|"list", "c": [...]}
 *        | {"k": "dict", "keys": [...], "c": [...]}
 * (docs/protocol.md).  A dimension may be SHAPES_BATCH: the batch size of a
 * specialization compiled for every batch size (adapter option
 * dynamic = batch).  Pure functions; any thread.
 */
#ifndef TORCHLOOP_SHAPES_H
#define TORCHLOOP_SHAPES_H

#include "tree.h"
#include "writer.h"

#include <msgpack.h>
#include <stdbool.h>

#define SHAPES_BATCH (-1)

/* Sets numel and nbytes with each SHAPES_BATCH dimension taken as batch;
 * -1 on overflow. */
int shapes_sizes(struct tree_tensor *t, int64_t batch);

/* Writes the shape tree of n (data ignored). */
void shapes_write(struct writer *w, const struct tree_node *n);
/*
 * Reads a shape tree into nodes allocated in zone, every tensor of dtype.
 * SHAPES_BATCH dimensions only with allow_batch (the daemon's own trees,
 * never a client's); sizes are then those at batch size 1.  Returns 0 or -1 with err
 * (COMPILE_FAILED: malformed).  The msgpack must have passed mpguard (nesting is bounded by it).
 */
int shapes_read(const msgpack_object *o, msgpack_zone *zone, enum proto_dtype dtype,
                bool allow_batch, struct tree_node *out, struct proto_err *err);

#endif

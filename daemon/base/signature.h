/*
 * signature.h - specializations: (tree structure, leaf shapes, dtype, T) of a
 * scan request, and the mapping between trees and a graph's flat tensors.
 *
 * A spec is a struct tree_node whose tensors carry dtype and shape but no
 * data.  Specs that outlive a request live in a msgpack_zone owned by their
 * specialization.  The canonical signature string is unambiguous (keys are
 * length-prefixed) and is what cache keys and `describe` use.
 */
#ifndef TORCHLOOP_SIGNATURE_H
#define TORCHLOOP_SIGNATURE_H

#include "engine.h"
#include "shapes.h"
#include "msg.h"
#include "tree.h"
#include "writer.h"

#include <msgpack.h>
#include <stdbool.h>

#define SPEC_SIG_MAX 8192

/*
 * Writes the canonical form of a request's trees (shapes only) to buf; -1 if
 * too long.  With batch, the batch dimensions (dimension 0 of carry leaves,
 * 1 of input leaves) read "B", as does any SHAPES_BATCH dimension.
 */
int signature_of(const struct tree_node *carry, const struct tree_node *inputs,
                 enum proto_dtype dtype, int64_t steps, bool batch, char *buf, size_t size);

/* Appends ";wrt=" and wrt (a saved kind's gradient mask) when not NULL. */
int signature_wrt(char *buf, size_t size, const char *wrt);
/* The mask a signature ends with (signature_wrt), or NULL. */
const char *signature_wrt_of(const char *sig);

/*
 * Symbolic batch (adapter option dynamic = batch): marks the batch
 * dimensions of a specialization's own trees SHAPES_BATCH, their sizes then
 * those at batch size 1.
 */
void signature_mark_batch(struct tree_node *carry, struct tree_node *inputs);
/* Sets each SHAPES_BATCH dimension of t[0..n) to batch and recomputes nbytes. */
void signature_bind(struct engine_tensor *t, size_t n, int64_t batch);

/* Deep copy of a tree's structure and shapes (no data) into zone. */
int signature_copy(const struct tree_node *src, msgpack_zone *zone, struct tree_node *out);

/* Appends a tree's tensor leaves, depth-first, to out[*n]; out must fit. */
void signature_flatten(const struct tree_node *n, struct engine_tensor *out, size_t *count);
/*
 * Builds a tree of spec's structure whose tensors point at flat[*pos...]
 * (advancing *pos), nodes in zone.  Returns 0, or -1 when flat runs out.
 */
int signature_fill(const struct tree_node *spec, const struct engine_tensor *flat, size_t n_flat,
                   size_t *pos, msgpack_zone *zone, struct tree_node *out);

/*
 * A request's own inputs, kept for the parity check of the compile it
 * starts: a msgpack array of one bin per tensor leaf of carry then inputs
 * (depth-first), copied into a malloc'ed buffer (*len bytes).  NULL when a
 * leaf has no data (a `compile` request's shapes) or out of memory.
 */
uint8_t *signature_sample(const struct tree_node *carry, const struct tree_node *inputs,
                          size_t *len);

#endif

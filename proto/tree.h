/*
 * tree.h - tensor trees: tensor | None | tuple | list | dict (string keys,
 * order kept).
 *
 * Wire form (docs/protocol.md has the bytes):
 *   None   -> msgpack nil
 *   list   -> msgpack array
 *   tuple  -> msgpack array whose first item is ext(PROTO_EXT_TUPLE, 0 bytes)
 *   dict   -> msgpack map with str keys, in order
 *   tensor -> ext32(PROTO_EXT_TENSOR): u8 dtype, u8 ndim, u8 pad, u8 0,
 *             ndim x int64 LE dims, pad zero bytes, C-order LE data
 *          or ext32(PROTO_EXT_SHM): u8 dtype, u8 ndim, 6 x 0, u64 LE offset,
 *             u64 LE nbytes, ndim x int64 LE dims -- the bytes lie at offset
 *             in the connection's shared region (docs/protocol.md)
 *
 * Decoded trees are views: tensor data and dict keys point into the frame
 * body, nodes live in the msgpack zone of the message they came from, so a
 * tree lives exactly as long as its message.  Trees built by callers for
 * encoding point at caller-owned buffers; tree_encode never copies tensor
 * bytes that are large enough to reference (see writer.h).
 */
#ifndef TORCHLOOP_TREE_H
#define TORCHLOOP_TREE_H

#include "protocol.h"
#include "writer.h"

#include <msgpack.h>
#include <stdint.h>

enum tree_kind { TREE_NONE, TREE_TENSOR, TREE_TUPLE, TREE_LIST, TREE_DICT };

struct tree_tensor {
	enum proto_dtype dtype;
	uint32_t ndim;
	int64_t shape[PROTO_MAX_NDIM];
	uint64_t numel;
	uint64_t nbytes;
	const void *data;
};

struct tree_key {
	const char *ptr;
	uint32_t len;
};

struct tree_node {
	enum tree_kind kind;
	uint32_t count;            /* children of a tuple, list or dict */
	struct tree_node *items;   /* count children */
	struct tree_key *keys;     /* count keys, dicts only */
	struct tree_tensor tensor; /* tensors only */
};

/* A connection's shared-memory region as the decoder sees it. */
struct tree_region {
	uint8_t *base;
	uint64_t size;
};

/*
 * Decodes o into out, allocating nodes in zone.  root names the tree in
 * error paths (e.g. "inputs" gives inputs["f"][1]).  Enforces depth, leaf,
 * key, dtype, shape and byte-length limits.  Returns 0 or -1 with err.
 */
int tree_decode(const msgpack_object *o, msgpack_zone *zone, const char *root,
                struct tree_node *out, struct proto_err *err);
/*
 * As tree_decode, and PROTO_EXT_SHM leaves resolve into region (NULL: the
 * connection has none, SHM_NOT_ATTACHED): in bounds (SHM_OUT_OF_BOUNDS),
 * offset a multiple of PROTO_TENSOR_ALIGN (SHM_MISALIGNED), nbytes equal
 * to the shape's (BYTE_LENGTH_MISMATCH).  Their data points into region.
 */
int tree_decode_in(const msgpack_object *o, msgpack_zone *zone, const char *root,
                   const struct tree_region *region, struct tree_node *out, struct proto_err *err);

/* Encodes a tree; tensor bytes are padded to align in the receiver. */
void tree_encode(struct writer *w, const struct tree_node *n);
/*
 * As tree_encode, asking place for each tensor leaf in depth-first order:
 * a return of 1 with *offset set encodes the leaf as a PROTO_EXT_SHM
 * reference (its bytes are at *offset in the receiver's region), 0 inline.
 */
/* One PROTO_EXT_SHM leaf as given (the tests forge hostile ones with it). */
void tree_put_shm_ref(struct writer *w, uint8_t dtype, uint32_t ndim, const int64_t *shape,
                      uint64_t offset, uint64_t nbytes);
typedef int (*tree_place_fn)(const struct tree_tensor *t, uint64_t *offset, void *ctx);
void tree_encode_placed(struct writer *w, const struct tree_node *n, tree_place_fn place,
                        void *ctx);

/* Tensor leaves in depth-first order (None leaves are skipped). */
uint32_t tree_count_tensors(const struct tree_node *n);
/* Tensor + None leaves. */
uint32_t tree_count_leaves(const struct tree_node *n);

/*
 * Structural equality (kinds, counts, keys; tensors by dtype and shape; data
 * ignored).  Returns 1 when equal; else 0 and writes the first differing
 * path below root into path.
 */
int tree_same_structure(const struct tree_node *a, const struct tree_node *b, const char *root,
                        char *path, size_t path_size);

/*
 * Paths and signatures are built on every request, so without printf:
 * tree_path_root starts a bounded path (a copy of root, truncated to fit) and
 * returns its length; tree_fmt_uint writes v in decimal (no NUL) and returns
 * the number of digits.
 */
size_t tree_path_root(char *buf, size_t size, const char *root);
size_t tree_fmt_uint(char out[20], uint64_t v);

/* Bytes of path text for child i of n appended to buf at *len (bounded). */
void tree_path_push(char *buf, size_t size, size_t *len, const struct tree_node *n, uint32_t i);

/* Fills a tensor's numel and nbytes from dtype and shape; -1 on overflow. */
int tree_tensor_sizes(struct tree_tensor *t);

/*
 * Calls fn for every tensor leaf (and, when with_none, every None leaf) in
 * depth-first order with its path below root.  Stops at the first non-zero
 * return of fn and returns it.
 */
typedef int (*tree_visit_fn)(const struct tree_node *leaf, const char *path, void *ctx);
int tree_visit(const struct tree_node *n, const char *root, int with_none, tree_visit_fn fn,
               void *ctx);
#endif

/*
 * treejson.h - trees as JSON documents whose leaves are .npy files:
 * "file.npy" is a tensor, null is None, [..] a list, {..} a dict and
 * {"__tuple__": [..]} a tuple (docs/cli.md).  Used by the CLI and tests.
 */
#ifndef TORCHLOOP_TREEJSON_H
#define TORCHLOOP_TREEJSON_H

#include "npy.h"
#include "torchloop.h"

#include <jansson.h>
#include <stdbool.h>

struct treejson {
	struct tl_builder *builder;
	struct npy *arrays; /* loaded leaves, owned */
	int n_arrays, cap;
	const char *base; /* directory relative paths resolve against, or NULL */
	bool shapes_only; /* leaves may be "shape:AxB" (data NULL) */
	bool have_dtype;
	enum tl_dtype dtype;
};

void treejson_init(struct treejson *t, struct tl_builder *b, const char *base);
void treejson_free(struct treejson *t);
/* Builds a tree from JSON; NULL with msg on error (bad leaf, mixed dtypes...). */
struct tl_tree *treejson_load(struct treejson *t, json_t *j, char *msg, size_t size);
/* Parses text as JSON, or takes it as a bare leaf path when it is not JSON. */
struct tl_tree *treejson_parse(struct treejson *t, const char *text, char *msg, size_t size);
/* Writes each tensor of tree as DIR/ROOT_<n>.npy; returns the JSON (NULL on error). */
json_t *treejson_save(const struct tl_tree *tree, const char *dir, const char *root, char *msg,
                      size_t size);

#endif

/* treejson.c - see treejson.h. */
#include "treejson.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define TREEJSON_MAX_ITEMS 4096

void treejson_init(struct treejson *t, struct tl_builder *b, const char *base)
{
	memset(t, 0, sizeof *t);
	t->builder = b;
	t->base = base;
}

void treejson_free(struct treejson *t)
{
	for (int i = 0; i < t->n_arrays; i++)
		npy_free(&t->arrays[i]);
	free(t->arrays);
	t->arrays = NULL;
	t->n_arrays = t->cap = 0;
}

static struct tl_tree *shape_leaf(struct treejson *t, const char *s, char *msg, size_t size)
{
	int64_t shape[8];
	int ndim = 0;

	for (const char *p = s + 6; *p;) {
		char *end;
		if (ndim == 8)
			return snprintf(msg, size, "shape '%s' has over 8 dims", s), NULL;
		shape[ndim++] = strtoll(p, &end, 10);
		if (end == p || shape[ndim - 1] < 0 || (*end && *end != 'x'))
			return snprintf(msg, size, "bad shape '%s' (want shape:AxB)", s), NULL;
		p = *end ? end + 1 : end;
	}
	return tl_tensor(t->builder, t->have_dtype ? t->dtype : TL_FLOAT64, ndim, shape, NULL);
}

static struct tl_tree *npy_leaf(struct treejson *t, const char *s, char *msg, size_t size)
{
	char path[4096];
	struct npy *n;

	if (t->n_arrays == t->cap) {
		int cap = t->cap ? 2 * t->cap : 16;
		struct npy *a =
		    cap > TREEJSON_MAX_ITEMS ? NULL : realloc(t->arrays, (size_t)cap * sizeof *a);
		if (a == NULL)
			return snprintf(msg, size, "too many leaves"), NULL;
		t->arrays = a;
		t->cap = cap;
	}
	snprintf(path, sizeof path, "%s%s%s", t->base && s[0] != '/' ? t->base : "",
	         t->base && s[0] != '/' ? "/" : "", s);
	n = &t->arrays[t->n_arrays];
	if (npy_read(path, n, msg, size) != 0)
		return NULL;
	t->n_arrays++;
	if (!t->shapes_only && t->have_dtype && n->dtype != t->dtype)
		return snprintf(msg, size, "%s: dtype differs from the other leaves", s), NULL;
	t->dtype = n->dtype;
	t->have_dtype = true;
	return tl_tensor(t->builder, n->dtype, n->ndim, n->shape, n->data);
}

static struct tl_tree *load(struct treejson *t, json_t *j, char *msg, size_t size, int depth);

static struct tl_tree *load_items(struct treejson *t, json_t *j, enum tl_kind kind, char *msg,
                                  size_t size, int depth)
{
	size_t n = json_is_array(j) ? json_array_size(j) : json_object_size(j), i = 0;
	struct tl_tree **items = calloc(n ? n : 1, sizeof *items);
	const char **keys = calloc(n ? n : 1, sizeof *keys);
	struct tl_tree *out = NULL;
	const char *k;
	json_t *v;

	if (items == NULL || keys == NULL || n > TREEJSON_MAX_ITEMS) {
		snprintf(msg, size, "a container of %zu items is too large", n);
		goto done;
	}
	if (json_is_array(j)) {
		json_array_foreach(j, i, v) if ((items[i] = load(t, v, msg, size, depth + 1)) ==
		                                NULL) goto done;
	} else {
		json_object_foreach(j, k, v)
		{
			keys[i] = k;
			if ((items[i++] = load(t, v, msg, size, depth + 1)) == NULL)
				goto done;
		}
	}
	out = kind == TL_TUPLE  ? tl_tuple(t->builder, n, items)
	      : kind == TL_LIST ? tl_list(t->builder, n, items)
	                        : tl_dict(t->builder, n, keys, items);
	if (out == NULL)
		snprintf(msg, size, "cannot build the tree (dict key over 256 bytes?)");
done:
	free(items);
	free(keys);
	return out;
}

static struct tl_tree *load(struct treejson *t, json_t *j, char *msg, size_t size, int depth)
{
	json_t *tup =
	    json_is_object(j) && json_object_size(j) == 1 ? json_object_get(j, "__tuple__") : NULL;

	if (depth > 16)
		return snprintf(msg, size, "tree nested deeper than 16"), NULL;
	if (json_is_null(j))
		return tl_none(t->builder);
	if (json_is_string(j)) {
		const char *s = json_string_value(j);
		if (t->shapes_only && strncmp(s, "shape:", 6) == 0)
			return shape_leaf(t, s, msg, size);
		return npy_leaf(t, s, msg, size);
	}
	if (tup != NULL) {
		if (!json_is_array(tup))
			return snprintf(msg, size, "__tuple__ takes a JSON array"), NULL;
		return load_items(t, tup, TL_TUPLE, msg, size, depth);
	}
	if (json_is_array(j))
		return load_items(t, j, TL_LIST, msg, size, depth);
	if (json_is_object(j))
		return load_items(t, j, TL_DICT, msg, size, depth);
	snprintf(msg, size, "tree leaves are .npy paths (strings) or null");
	return NULL;
}

struct tl_tree *treejson_load(struct treejson *t, json_t *j, char *msg, size_t size)
{
	return load(t, j, msg, size, 0);
}

struct tl_tree *treejson_parse(struct treejson *t, const char *text, char *msg, size_t size)
{
	json_error_t jerr;
	json_t *j = json_loads(text, JSON_DECODE_ANY | JSON_PRESERVE_ORDER, &jerr);
	struct tl_tree *out;
	const char *first = text + strspn(text, " \t\r\n");

	if (j == NULL && (*first == '{' || *first == '[' || *first == '"')) {
		/* meant as a JSON tree, not a bare .npy path: say what is wrong and where */
		snprintf(msg, size, "invalid JSON tree at line %d, column %d: %s", jerr.line,
		         jerr.column, jerr.text);
		return NULL;
	}
	if (j == NULL)
		j = json_string(text); /* a bare path */
	out = load(t, j, msg, size, 0);
	json_decref(j);
	return out;
}

static json_t *save(const struct tl_tree *tree, const char *dir, const char *root, int *counter,
                    char *msg, size_t size)
{
	char file[300], path[4096];
	json_t *j, *v;

	switch (tl_tree_kind(tree)) {
	case TL_NONE:
		return json_null();
	case TL_TENSOR:
		snprintf(file, sizeof file, "%s_%d.npy", root, (*counter)++);
		snprintf(path, sizeof path, "%s/%s", dir, file);
		if (npy_write(path, tl_tree_dtype(tree), tl_tree_ndim(tree), tl_tree_shape(tree),
		              tl_tree_data(tree), msg, size) != 0)
			return NULL;
		return json_string(file);
	case TL_DICT:
		j = json_object();
		for (size_t i = 0; i < tl_tree_len(tree); i++) {
			size_t len;
			const char *k = tl_tree_key(tree, i, &len);
			if ((v = save(tl_tree_item(tree, i), dir, root, counter, msg, size)) ==
			    NULL)
				return json_decref(j), NULL;
			json_object_setn_new_nocheck(j, k, len, v);
		}
		return j;
	default:
		j = json_array();
		for (size_t i = 0; i < tl_tree_len(tree); i++) {
			if ((v = save(tl_tree_item(tree, i), dir, root, counter, msg, size)) ==
			    NULL)
				return json_decref(j), NULL;
			json_array_append_new(j, v);
		}
		if (tl_tree_kind(tree) == TL_TUPLE)
			return json_pack("{s:o}", "__tuple__", j);
		return j;
	}
}

json_t *treejson_save(const struct tl_tree *tree, const char *dir, const char *root, char *msg,
                      size_t size)
{
	int counter = 0;

	if (mkdir(dir, 0777) != 0 && errno != EEXIST)
		return snprintf(msg, size, "%s: %s", dir, strerror(errno)), NULL;
	return save(tree, dir, root, &counter, msg, size);
}

/*
 * test_proto_tree.c - tensor trees through the full path (tree -> writer ->
 * frame -> msg_parse -> tree_decode): every node kind, both dtypes, 0-d and
 * zero-size tensors, empty containers, None at root and nested, dict order,
 * zero-copy aligned views; then one table row per malformed class, each with
 * its own code and the offending leaf path.
 */
#include "helpers.h"

#include <criterion/criterion.h>
#include "params.h"
#include <string.h>

TestSuite(tree, .timeout = 30);

static const float F32[6] = {1.5f, -2.0f, 3.25f, 0.0f, 1e-3f, 7.0f};
static const double F64[4] = {3.141592653589793, -1e300, 2.5e-310, 42.0};
static const double SCALAR = 0.125;

static struct tree_node tensor(enum proto_dtype dt, uint32_t ndim, const int64_t *shape,
                               const void *data)
{
	struct tree_node n = {.kind = TREE_TENSOR,
	                      .tensor = {.dtype = dt, .ndim = ndim, .data = data}};

	if (ndim)
		memcpy(n.tensor.shape, shape, ndim * sizeof *shape);
	tree_tensor_sizes(&n.tensor);
	return n;
}

/* Encodes root as the `carry` field of a request and decodes it back. */
static void round_trip(const struct tree_node *root, struct msg *m, uint8_t **body,
                       struct tree_node *out)
{
	struct writer w;
	struct proto_err err;
	size_t len;
	uint8_t *bytes;

	cr_assert_eq(writer_init(&w), 0);
	msg_begin_request(&w, 9, "scan", 1);
	writer_str(&w, "carry");
	tree_encode(&w, root);
	bytes = writer_to_bytes(&w, &len);
	writer_destroy(&w);
	*body = frame_alloc(len - 4);
	memcpy(*body, bytes + 4, len - 4);
	free(bytes);
	cr_assert_eq(msg_parse(m, *body, len - 4, MSG_REQUEST, &err), 0, "%s", err.message);
	cr_assert_eq(m->op, PROTO_OP_SCAN);
	cr_assert_eq(m->id, 9);
	cr_assert_eq(msg_get_tree(m, "carry", true, out, &err), 0, "%s: %s", err.path, err.message);
}

static void assert_same(const struct tree_node *a, const struct tree_node *b)
{
	cr_assert_eq(a->kind, b->kind);
	cr_assert_eq(a->count, b->count);
	if (a->kind == TREE_TENSOR) {
		cr_assert_eq(a->tensor.dtype, b->tensor.dtype);
		cr_assert_eq(a->tensor.ndim, b->tensor.ndim);
		for (uint32_t i = 0; i < a->tensor.ndim; i++)
			cr_assert_eq(a->tensor.shape[i], b->tensor.shape[i]);
		cr_assert_eq(a->tensor.nbytes, b->tensor.nbytes);
		if (a->tensor.nbytes) /* a zero-size tensor may have no buffer at all */
			cr_assert_eq(memcmp(a->tensor.data, b->tensor.data, a->tensor.nbytes), 0);
		cr_assert_eq((uintptr_t)b->tensor.data % PROTO_TENSOR_ALIGN, 0, "aligned view");
	}
	for (uint32_t i = 0; i < a->count; i++) {
		if (a->kind == TREE_DICT) {
			cr_assert_eq(a->keys[i].len, b->keys[i].len);
			cr_assert_eq(memcmp(a->keys[i].ptr, b->keys[i].ptr, a->keys[i].len), 0,
			             "key %u in order", i);
		}
		assert_same(&a->items[i], &b->items[i]);
	}
}

Test(tree, every_node_kind_round_trips_with_order_and_bytes_kept)
{
	static const int64_t s23[] = {2, 3}, s4[] = {4}, s0[] = {3, 0, 2};
	struct tree_node empty_tuple = {.kind = TREE_TUPLE}, empty_list = {.kind = TREE_LIST},
	                 empty_dict = {.kind = TREE_DICT}, none = {.kind = TREE_NONE};
	struct tree_node tuple_items[] = {tensor(PROTO_DTYPE_F64, 1, s4, F64), none, empty_tuple};
	struct tree_node list_items[] = {tensor(PROTO_DTYPE_F32, 2, s23, F32), empty_list,
	                                 tensor(PROTO_DTYPE_F64, 3, s0, NULL)};
	struct tree_node dict_items[6];
	struct tree_key keys[6] = {{"zeta", 4}, {"alpha", 5},  {"t", 1},
	                           {"l", 1},    {"scalar", 6}, {"", 0}};
	struct tree_node root, out;
	struct msg m;
	uint8_t *body;

	dict_items[0] = none;
	dict_items[1] = empty_dict;
	dict_items[2] = (struct tree_node){.kind = TREE_TUPLE, .count = 3, .items = tuple_items};
	dict_items[3] = (struct tree_node){.kind = TREE_LIST, .count = 3, .items = list_items};
	dict_items[4] = tensor(PROTO_DTYPE_F64, 0, NULL, &SCALAR);
	dict_items[5] = empty_list;
	root = (struct tree_node){.kind = TREE_DICT, .count = 6, .items = dict_items, .keys = keys};
	round_trip(&root, &m, &body, &out);
	assert_same(&root, &out);
	cr_assert_eq(out.items[4].tensor.numel, 1, "0-d tensor has one element");
	cr_assert_eq(out.items[3].items[2].tensor.numel, 0, "zero-size dim");
	cr_assert_eq(tree_count_leaves(&out), 6);
	cr_assert_eq(tree_count_tensors(&out), 4);
	msg_destroy(&m);
	frame_free(body);
}

Test(tree, none_at_the_root_round_trips)
{
	struct tree_node root = {.kind = TREE_NONE}, out;
	struct msg m;
	uint8_t *body;

	round_trip(&root, &m, &body, &out);
	cr_assert_eq(out.kind, TREE_NONE);
	msg_destroy(&m);
	frame_free(body);
}

Test(tree, a_tuple_and_a_list_with_the_same_items_stay_distinct)
{
	static const int64_t s4[] = {4};
	struct tree_node items[] = {tensor(PROTO_DTYPE_F64, 1, s4, F64)};
	struct tree_node tup = {.kind = TREE_TUPLE, .count = 1, .items = items};
	struct tree_node lst = {.kind = TREE_LIST, .count = 1, .items = items};
	struct tree_node out;
	struct msg m;
	uint8_t *body;
	char path[64];

	round_trip(&tup, &m, &body, &out);
	cr_assert_eq(out.kind, TREE_TUPLE);
	cr_assert_eq(tree_same_structure(&lst, &out, "carry", path, sizeof path), 0);
	msg_destroy(&m);
	frame_free(body);
	round_trip(&lst, &m, &body, &out);
	cr_assert_eq(out.kind, TREE_LIST);
	msg_destroy(&m);
	frame_free(body);
}

Test(tree, a_nested_path_names_dict_keys_and_indices)
{
	struct tree_node inner[] = {{.kind = TREE_NONE}, {.kind = TREE_NONE}};
	struct tree_node list = {.kind = TREE_LIST, .count = 2, .items = inner};
	struct tree_key k = {"for\"cing", 8};
	struct tree_node root = {.kind = TREE_DICT, .count = 1, .items = &list, .keys = &k};
	char buf[64] = "inputs";
	size_t len = 6;

	tree_path_push(buf, sizeof buf, &len, &root, 0);
	tree_path_push(buf, sizeof buf, &len, &list, 1);
	cr_assert_str_eq(buf, "inputs[\"for\\\"cing\"][1]");
}

/* ---- malformed trees: one row per class ------------------------------- */

/* A case builds its tree with build(b), or with build_n(b, n) where the
 * builder makes a tree of a given size (depth, leaves, key length). */
struct bad_case {
	const char *name;
	void (*build)(struct tbuf *b);
	enum proto_code code;
	const char *path;
	void (*build_n)(struct tbuf *b, int n);
	int n;
};

static const int64_t S4[] = {4};

static void nest(struct tbuf *b, int depth)
{
	for (int i = 0; i < depth; i++)
		msgpack_pack_array(&b->pk, 1);
	msgpack_pack_nil(&b->pk);
}
static void leaves(struct tbuf *b, int n)
{
	msgpack_pack_array(&b->pk, (uint32_t)n);
	for (int i = 0; i < n; i++)
		msgpack_pack_nil(&b->pk);
}
static void byte_length_short(struct tbuf *b)
{
	msgpack_pack_map(&b->pk, 1);
	tbuf_str(b, "f");
	msgpack_pack_array(&b->pk, 2);
	msgpack_pack_nil(&b->pk);
	tbuf_tensor(b, PROTO_DTYPE_F64, 1, S4, 0, 31);
}
static void byte_length_long(struct tbuf *b)
{
	tbuf_tensor(b, PROTO_DTYPE_F32, 1, S4, 0, 17);
}
static void shape_overflow(struct tbuf *b)
{
	static const int64_t s[] = {INT64_C(1) << 32, INT64_C(1) << 32};
	tbuf_tensor(b, PROTO_DTYPE_F64, 2, s, 0, 0);
}
static void nbytes_overflow(struct tbuf *b)
{
	static const int64_t s[] = {INT64_C(1) << 62};
	tbuf_tensor(b, PROTO_DTYPE_F64, 1, s, 0, 0);
}
static void bad_dtype(struct tbuf *b)
{
	tbuf_tensor(b, 3, 1, S4, 0, 32);
}
static void rank_9(struct tbuf *b)
{
	static const int64_t s[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
	tbuf_tensor(b, PROTO_DTYPE_F64, 9, s, 0, 8);
}
static void negative_dim(struct tbuf *b)
{
	static const int64_t s[] = {-1};
	tbuf_tensor(b, PROTO_DTYPE_F64, 1, s, 0, 0);
}
static void short_header(struct tbuf *b)
{
	tbuf_raw(b, "\xc7\x02\x01\x02\x01", 5);
}
static void duplicate_key(struct tbuf *b)
{
	tbuf_nil_map(b, 3, (const char *[]){"x", "y", "x"});
}
/* Empty strings decode with a NULL pointer: the comparison must not pass it
 * to memcmp (UBSan found this through the fuzzer). */
static void empty_key_twice(struct tbuf *b)
{
	tbuf_nil_map(b, 2, (const char *[]){"", ""});
}
static void many_keys_one_duplicate(struct tbuf *b)
{
	char k[16];
	msgpack_pack_map(&b->pk, 1001);
	for (int i = 0; i < 1000; i++) {
		snprintf(k, sizeof k, "k%d", i);
		tbuf_str(b, k);
		msgpack_pack_nil(&b->pk);
	}
	tbuf_str(b, "k500");
	msgpack_pack_nil(&b->pk);
}
static void int_key(struct tbuf *b)
{
	msgpack_pack_map(&b->pk, 1);
	msgpack_pack_int(&b->pk, 1);
	msgpack_pack_nil(&b->pk);
}
/* {"kkk…": None} with a key of n bytes */
static void key_of(struct tbuf *b, int n)
{
	char k[258];
	memset(k, 'k', (size_t)n);
	k[n] = '\0';
	tbuf_nil_map(b, 1, (const char *[]){k});
}
static void unknown_ext(struct tbuf *b)
{
	msgpack_pack_array(&b->pk, 1);
	msgpack_pack_ext_with_body(&b->pk, "abcd", 4, 9);
}
static void int_leaf(struct tbuf *b)
{
	msgpack_pack_array(&b->pk, 2);
	msgpack_pack_nil(&b->pk);
	msgpack_pack_int(&b->pk, 3);
}
static void string_leaf(struct tbuf *b)
{
	tbuf_str(b, "x0.npy");
}
static void tuple_marker_late(struct tbuf *b)
{
	msgpack_pack_array(&b->pk, 2);
	msgpack_pack_nil(&b->pk);
	msgpack_pack_ext(&b->pk, 0, PROTO_EXT_TUPLE);
}
static void array32_bomb(struct tbuf *b)
{
	tbuf_raw(b, "\xdd\xff\xff\xff\xff", 5);
}
static void map32_bomb(struct tbuf *b)
{
	tbuf_raw(b, "\xdf\x7f\xff\xff\xff", 5);
}

/* Criterion re-executes the binary per test, so parameters carry indices. */
static const struct bad_case BAD[] = {
    {"depth 17", NULL, PROTO_E_DEPTH_EXCEEDED,
     "carry[0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0]", nest, 17},
    {"depth 33", NULL, PROTO_E_DEPTH_EXCEEDED, "", nest, 33},
    {"4097 leaves", NULL, PROTO_E_TOO_MANY_LEAVES, "carry[4096]", leaves, 4097},
    {"257-byte key", NULL, PROTO_E_KEY_TOO_LONG, "carry", key_of, 257},
    {"byte length short", byte_length_short, PROTO_E_BYTE_LENGTH_MISMATCH, "carry[\"f\"][1]"},
    {"byte length long", byte_length_long, PROTO_E_BYTE_LENGTH_MISMATCH, "carry"},
    {"shape overflow", shape_overflow, PROTO_E_SHAPE_OVERFLOW, "carry"},
    {"nbytes overflow", nbytes_overflow, PROTO_E_SHAPE_OVERFLOW, "carry"},
    {"bad dtype", bad_dtype, PROTO_E_BAD_DTYPE, "carry"},
    {"rank 9", rank_9, PROTO_E_BAD_SHAPE, "carry"},
    {"negative dim", negative_dim, PROTO_E_BAD_SHAPE, "carry"},
    {"short tensor header", short_header, PROTO_E_BYTE_LENGTH_MISMATCH, "carry"},
    {"duplicate key", duplicate_key, PROTO_E_DUPLICATE_KEY, "carry"},
    {"duplicate among many", many_keys_one_duplicate, PROTO_E_DUPLICATE_KEY, "carry"},
    {"the empty key twice", empty_key_twice, PROTO_E_DUPLICATE_KEY, "carry"},
    {"non-string key", int_key, PROTO_E_NON_STRING_KEY, "carry"},
    {"unknown ext tag", unknown_ext, PROTO_E_UNKNOWN_TYPE, "carry[0]"},
    {"integer leaf", int_leaf, PROTO_E_UNKNOWN_TYPE, "carry[1]"},
    {"string leaf", string_leaf, PROTO_E_UNKNOWN_TYPE, "carry"},
    {"tuple marker not first", tuple_marker_late, PROTO_E_UNKNOWN_TYPE, "carry[1]"},
    {"array32 header of 5 bytes", array32_bomb, PROTO_E_MSGPACK_COUNT_TOO_LARGE, ""},
    {"map32 header of 5 bytes", map32_bomb, PROTO_E_MSGPACK_COUNT_TOO_LARGE, ""},
};

/* Trees exactly at each limit: depth 16, 4096 leaves, a 256-byte key. */
static const struct bad_case GOOD[] = {
    {"depth 16", NULL, PROTO_E_OK, "", nest, 16},
    {"4096 leaves", NULL, PROTO_E_OK, "", leaves, 4096},
    {"256-byte key", NULL, PROTO_E_OK, "", key_of, 256},
};

/* Builds c's request and parses it as the daemon would; parsed_free and
 * tbuf_destroy are due. */
static int parse_case(const struct bad_case *c, struct tbuf *b, struct parsed *p)
{
	tbuf_init(b);
	tbuf_request(b, "carry");
	if (c->build)
		c->build(b);
	else
		c->build_n(b, c->n);
	p->body = tbuf_body(b);
	return parse_tree(p, b->sb.size, "carry", NULL);
}

TABLE_TEST(tree, malformed_trees_get_their_own_code_and_path, BAD)
{
	struct tbuf b;
	struct parsed p;
	const struct bad_case *c = &BAD[*i];

	cr_assert_eq(parse_case(c, &b, &p), -1, "%s: accepted", c->name);
	cr_assert_eq(p.err.code, c->code, "%s: got %s (%s)", c->name, proto_code_name(p.err.code),
	             p.err.message);
	cr_assert_str_eq(p.err.path, c->path, "%s: path", c->name);
	if (c->path[0])
		cr_assert(strstr(p.err.message, c->path) != NULL, "%s: message names the path: %s",
		          c->name, p.err.message);
	parsed_free(&p);
	tbuf_destroy(&b);
}

TABLE_TEST(tree, trees_at_the_limits_are_accepted, GOOD)
{
	struct tbuf b;
	struct parsed p;

	cr_assert_eq(parse_case(&GOOD[*i], &b, &p), 0, "%s: %s", GOOD[*i].name, p.err.message);
	parsed_free(&p);
	tbuf_destroy(&b);
}

/* ---- shared-memory references (PROTO_EXT_SHM) ------------------------------ */

static void put64(uint8_t *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

struct shm_case {
	const char *name;
	uint8_t dtype, ndim, reserved;
	int64_t dim0;
	uint64_t off, nbytes;
	int region; /* 0: the connection has none */
	int short_by;
	enum proto_code code; /* OK: accepted */
};

#define RSIZE 4096u

static const struct shm_case SHM[] = {
    {"in bounds", 2, 1, 0, 4, 64, 32, 1, 0, PROTO_E_OK},
    {"ends at the region's end", 2, 1, 0, 8, RSIZE - 64, 64, 1, 0, PROTO_E_OK},
    {"empty tensor at the end", 2, 1, 0, 0, RSIZE, 0, 1, 0, PROTO_E_OK},
    {"no region", 2, 1, 0, 4, 0, 32, 0, 0, PROTO_E_SHM_NOT_ATTACHED},
    {"past the end", 2, 1, 0, 16, RSIZE - 64, 128, 1, 0, PROTO_E_SHM_OUT_OF_BOUNDS},
    {"offset past the end", 2, 1, 0, 0, RSIZE + 64, 0, 1, 0, PROTO_E_SHM_OUT_OF_BOUNDS},
    {"offset + nbytes wraps", 2, 1, 0, 8, UINT64_MAX - 63, 64, 1, 0, PROTO_E_SHM_OUT_OF_BOUNDS},
    {"misaligned", 2, 1, 0, 4, 8, 32, 1, 0, PROTO_E_SHM_MISALIGNED},
    {"nbytes disagrees with shape", 2, 1, 0, 4, 0, 24, 1, 0, PROTO_E_BYTE_LENGTH_MISMATCH},
    {"bad dtype", 7, 1, 0, 4, 0, 32, 1, 0, PROTO_E_BAD_DTYPE},
    {"rank 9", 2, 9, 0, 4, 0, 32, 1, 0, PROTO_E_BAD_SHAPE},
    {"negative dim", 2, 1, 0, -4, 0, 32, 1, 0, PROTO_E_BAD_SHAPE},
    {"reserved byte set", 2, 1, 1, 4, 0, 32, 1, 0, PROTO_E_BAD_SHAPE},
    {"header cut short", 2, 1, 0, 4, 0, 32, 1, 8, PROTO_E_BAD_SHAPE},
};

TABLE_TEST(tree, shared_memory_references_are_checked_against_the_region, SHM)
{
	const struct shm_case *c = &SHM[*i];
	uint8_t *mem = aligned_alloc(64, RSIZE), ext[6 + PROTO_SHM_HEAD + 8 * 9] = {0};
	struct tree_region region = {mem, RSIZE};
	uint32_t len = PROTO_SHM_HEAD + 8u * c->ndim - (uint32_t)c->short_by;
	struct tbuf b;
	struct parsed p;
	int rc;

	ext[0] = 0xc9;
	ext[4] = (uint8_t)len;
	ext[5] = PROTO_EXT_SHM;
	ext[6] = c->dtype;
	ext[7] = c->ndim;
	ext[9] = c->reserved;
	put64(ext + 6 + 8, c->off);
	put64(ext + 6 + 16, c->nbytes);
	for (int k = 0; k < c->ndim; k++)
		put64(ext + 6 + PROTO_SHM_HEAD + 8 * k, (uint64_t)(k == 0 ? c->dim0 : 1));
	tbuf_init(&b);
	tbuf_request(&b, "carry");
	tbuf_raw(&b, ext, 6 + len);
	p.body = tbuf_body(&b);
	rc = parse_tree(&p, b.sb.size, "carry", c->region ? &region : NULL);
	if (c->code == PROTO_E_OK) {
		cr_assert_eq(rc, 0, "%s: %s", c->name, p.err.message);
		cr_assert_eq(p.out.kind, TREE_TENSOR);
		cr_assert_eq(p.out.tensor.data, mem + c->off, "%s: data in the region", c->name);
		cr_assert_eq(p.out.tensor.nbytes, c->nbytes);
	} else {
		cr_assert_eq(rc, -1, "%s: accepted", c->name);
		cr_assert_eq(p.err.code, c->code, "%s: got %s (%s)", c->name,
		             proto_code_name(p.err.code), p.err.message);
		cr_assert_str_eq(p.err.path, "carry", "%s: path", c->name);
	}
	parsed_free(&p);
	tbuf_destroy(&b);
	free(mem);
}

static int place_at_128(const struct tree_tensor *t, uint64_t *offset, void *ctx)
{
	int *calls = ctx;

	(*calls)++;
	if (t->nbytes < 32)
		return 0; /* small ones inline */
	*offset = 128;
	return 1;
}

/* tree_encode_placed writes references where the placer says, inline elsewhere. */
Test(tree, placed_leaves_encode_as_references_and_decode_into_the_region)
{
	const int64_t s4[] = {4}, s1[] = {1};
	uint8_t *mem = aligned_alloc(64, RSIZE);
	struct tree_region region = {mem, RSIZE};
	struct tree_node items[2] = {tensor(PROTO_DTYPE_F64, 1, s4, F64),
	                             tensor(PROTO_DTYPE_F64, 1, s1, &SCALAR)};
	struct tree_node root = {.kind = TREE_LIST, .count = 2, .items = items}, out;
	struct writer w;
	struct msg m;
	struct proto_err err;
	size_t len;
	uint8_t *bytes, *body;
	int calls = 0;

	cr_assert_eq(writer_init(&w), 0);
	msg_begin_request(&w, 1, "scan", 1);
	writer_str(&w, "carry");
	tree_encode_placed(&w, &root, place_at_128, &calls);
	bytes = writer_to_bytes(&w, &len);
	cr_assert_eq(calls, 2);
	body = frame_alloc((uint32_t)(len - 4));
	memcpy(body, bytes + 4, len - 4);
	cr_assert_eq(msg_parse(&m, body, len - 4, MSG_REQUEST, &err), 0);
	m.region = &region;
	cr_assert_eq(msg_get_tree(&m, "carry", true, &out, &err), 0, "%s", err.message);
	cr_assert_eq(out.items[0].tensor.data, mem + 128, "the big leaf is a reference");
	cr_assert_eq(out.items[0].tensor.nbytes, 32);
	cr_assert_eq(*(const double *)out.items[1].tensor.data, SCALAR, "the small one inline");
	msg_destroy(&m);
	frame_free(body);
	free(bytes);
	writer_destroy(&w);
	free(mem);
}

/* ---- symbolic batch: signatures and shape trees (daemon/base/signature.c, proto/shapes.c) -- */

#include "shapes.h"
#include "signature.h"

Test(tree, batch_dimensions_read_B_and_shape_trees_keep_the_marker)
{
	static const int64_t c_shape[] = {3, 8}, x_shape[] = {5, 3, 2};
	struct tree_node items[2] = {tensor(PROTO_DTYPE_F64, 2, c_shape, NULL),
	                             {.kind = TREE_NONE}};
	struct tree_node carry = {.kind = TREE_TUPLE, .count = 2, .items = items};
	struct tree_node inputs = tensor(PROTO_DTYPE_F64, 3, x_shape, NULL);
	struct tree_node back;
	msgpack_zone *zone = msgpack_zone_new(1024);
	msgpack_unpacked up;
	struct proto_err err;
	struct writer w;
	struct engine_tensor e[2] = {0};
	size_t len, n = 0;
	uint8_t *bytes;
	char sig[256];

	cr_assert_eq(signature_of(&carry, &inputs, PROTO_DTYPE_F64, 5, false, sig, sizeof sig), 0);
	cr_assert_str_eq(sig, "float64 T=5 carry=t([3,8],N) inputs=[5,3,2]");
	cr_assert_eq(signature_of(&carry, &inputs, PROTO_DTYPE_F64, 5, true, sig, sizeof sig), 0);
	cr_assert_str_eq(sig, "float64 T=5 carry=t([B,8],N) inputs=[5,B,2]");

	/* marked: the dimension is SHAPES_BATCH, sizes those at batch size 1 */
	signature_mark_batch(&carry, &inputs);
	cr_assert_eq(items[0].tensor.shape[0], SHAPES_BATCH);
	cr_assert_eq(inputs.tensor.shape[1], SHAPES_BATCH);
	cr_assert_eq(inputs.tensor.numel, 10);
	cr_assert_eq(items[0].tensor.nbytes, 64);
	/* the marked tree reads the same without the batch flag (the cache index) */
	cr_assert_eq(signature_of(&carry, &inputs, PROTO_DTYPE_F64, 5, false, sig, sizeof sig), 0);
	cr_assert_str_eq(sig, "float64 T=5 carry=t([B,8],N) inputs=[5,B,2]");

	/* through a shape tree (the worker's job, its reply, the index) and back */
	cr_assert_eq(writer_init(&w), 0);
	shapes_write(&w, &inputs);
	bytes = writer_to_bytes(&w, &len);
	writer_destroy(&w);
	msgpack_unpacked_init(&up);
	cr_assert_eq(msgpack_unpack_next(&up, (const char *)bytes + 4, len - 4, NULL),
	             MSGPACK_UNPACK_SUCCESS);
	cr_assert_eq(shapes_read(&up.data, zone, PROTO_DTYPE_F64, true, &back, &err), 0, "%s",
	             err.message);
	cr_assert_eq(back.tensor.shape[1], SHAPES_BATCH);
	cr_assert_eq(back.tensor.numel, 10);
	msgpack_unpacked_destroy(&up);
	free(bytes);

	/* bound to a request's batch size: shapes and byte counts */
	signature_flatten(&carry, e, &n);
	signature_flatten(&inputs, e, &n);
	signature_bind(e, n, 7);
	cr_assert_eq(e[0].shape[0], 7);
	cr_assert_eq(e[0].nbytes, 7 * 8 * 8);
	cr_assert_eq(e[1].shape[1], 7);
	cr_assert_eq(e[1].nbytes, 5 * 7 * 2 * 8);
	msgpack_zone_free(zone);
}

Test(tree, a_negative_dimension_other_than_the_batch_marker_is_refused)
{
	struct tbuf b;
	msgpack_unpacked up;
	msgpack_zone *zone = msgpack_zone_new(1024);
	struct tree_node out;
	struct proto_err err;

	tbuf_init(&b);
	msgpack_pack_map(&b.pk, 2);
	tbuf_str(&b, "k");
	tbuf_str(&b, "T");
	tbuf_str(&b, "s");
	msgpack_pack_array(&b.pk, 2);
	msgpack_pack_int64(&b.pk, -2);
	msgpack_pack_int64(&b.pk, 4);
	msgpack_unpacked_init(&up);
	cr_assert_eq(msgpack_unpack_next(&up, b.sb.data, b.sb.size, NULL), MSGPACK_UNPACK_SUCCESS);
	cr_assert_eq(shapes_read(&up.data, zone, PROTO_DTYPE_F32, true, &out, &err), -1);
	cr_assert_eq(err.code, PROTO_E_COMPILE_FAILED);
	cr_assert(strstr(err.message, "dimension") != NULL, "%s", err.message);
	msgpack_unpacked_destroy(&up);
	tbuf_destroy(&b);
	msgpack_zone_free(zone);
}

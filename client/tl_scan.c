/*
 * tl_scan.c - libtorchloop's scan, grad and compile, and the shared-memory region
 * their tensors and results may travel through.
 */
#include "tl_internal.h"

#include "busypoll.h"
#include "frame.h"
#include "msg.h"
#include "shapes.h"
#include "shmalloc.h"
#include "tree.h"
#include "writer.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
/* ---- shared memory ------------------------------------------------------------ */

/* Below this many bytes a tensor travels inline: measured with
 * `build/bench_c --threshold` (docs/performance.md). */
#define TL_SHM_THRESHOLD_DEFAULT (8u << 10)

int tl_shm_attach(struct tl_client *c, size_t bytes, struct tl_error *err)
{
	struct shm_region *r;
	struct writer w;
	uint64_t id = 0;
	int rc;

	if (c->shm != NULL)
		return tlc_fail(err, "SHM_ALREADY_ATTACHED", NULL,
		                "this client has a region already; connect again for another");
	r = shm_region_new(bytes);
	if (r == NULL)
		return tlc_fail(err, "IO", NULL, "memfd of %zu bytes: %s", bytes, strerror(errno));
	if (tlc_begin(c, &w, "attach", 1, &id, err) != 0) {
		shm_region_unref(r);
		return -1;
	}
	writer_key_u64(&w, "size", r->size);
	rc = tlc_roundtrip_fd(c, &w, r->fd, id, NULL, err);
	writer_destroy(&w);
	close(r->fd); /* the daemon holds its own mapping now */
	r->fd = -1;
	if (rc != 0) {
		shm_region_unref(r);
		return -1;
	}
	c->shm = r;
	if (c->shm_threshold == 0)
		c->shm_threshold = TL_SHM_THRESHOLD_DEFAULT;
	return 0;
}

size_t tl_shm_size(const struct tl_client *c)
{
	return c->shm ? (size_t)c->shm->size : 0;
}

void tl_shm_set_threshold(struct tl_client *c, size_t bytes)
{
	c->shm_threshold = bytes ? bytes : 1;
}

void *tl_shm_alloc(struct tl_client *c, size_t nbytes)
{
	uint64_t off = c->shm ? shm_region_alloc(c->shm, nbytes) : UINT64_MAX;

	return off == UINT64_MAX ? NULL : c->shm->base + off;
}

void tl_shm_free(struct tl_client *c, void *p)
{
	uint64_t off;

	if (p && c->shm && shm_region_contains(c->shm, p, 0, &off))
		shm_region_free(c->shm, off);
}

/* Request tensors of at least the threshold go by reference: in place when
 * the caller's buffer lies in the region, else copied into a staged block. */
struct stage {
	struct tl_client *c;
	uint64_t *blocks;
	size_t n, cap;
	uint64_t bytes; /* of tensors sent by reference */
};

static int stage_place(const struct tree_tensor *t, uint64_t *offset, void *arg)
{
	struct stage *st = arg;
	struct shm_region *r = st->c->shm;
	uint64_t off;

	if (r == NULL || t->nbytes < st->c->shm_threshold || t->data == NULL)
		return 0;
	if (!shm_region_contains(r, t->data, t->nbytes, &off) || off % PROTO_TENSOR_ALIGN) {
		if (st->n == st->cap) {
			size_t cap = st->cap ? st->cap * 2 : 8;
			uint64_t *b = realloc(st->blocks, cap * sizeof *b);
			if (b == NULL)
				return 0;
			st->blocks = b;
			st->cap = cap;
		}
		off = shm_region_alloc(r, t->nbytes);
		if (off == UINT64_MAX)
			return 0; /* region full: inline */
		memcpy(r->base + off, t->data, t->nbytes);
		st->blocks[st->n++] = off;
	}
	st->bytes += t->nbytes;
	*offset = off;
	return 1;
}

static struct out_hint *find_hint(struct tl_client *c, const char *adapter, int kind)
{
	for (unsigned i = 0; i < TL_HINTS; i++)
		if (c->hints[i].adapter[0] && c->hints[i].kind == kind &&
		    strncmp(c->hints[i].adapter, adapter, sizeof c->hints[i].adapter) == 0)
			return &c->hints[i];
	return NULL;
}

static void remember_hint(struct tl_client *c, const char *adapter, int kind, uint64_t needed)
{
	struct out_hint *h = find_hint(c, adapter, kind);

	if (strlen(adapter) >= sizeof h->adapter)
		return;
	if (h == NULL)
		h = &c->hints[c->next_hint++ % TL_HINTS];
	snprintf(h->adapter, sizeof h->adapter, "%s", adapter);
	h->kind = kind;
	h->needed = needed;
}

/* A scan's or grad's fields besides its trees (docs/protocol.md). */
struct op_fields {
	bool checkpoint;       /* grad: the checkpointed VJP */
	bool save;             /* scan: keep saved for the backward (the saved pair) */
	const char *saved_key; /* grad: the pair's key, with a "saved" tree */
};

/* Output-area hints are per adapter and per kind of reply. */
static int hint_kind(const char *op, const struct op_fields *f)
{
	return (strcmp(op, "grad") == 0) + 2 * (f->save || f->saved_key != NULL);
}

/*
 * The request's "out" field: an area of the region for the reply's tensors,
 * as large as the daemon said this adapter's replies need, else like the
 * inputs (staged bytes).  Returns its offset (*size its bytes), or UINT64_MAX
 * when the region has no room (the field is nil: the reply comes inline).
 */
static uint64_t write_out_area(struct tl_client *c, struct writer *w, const char *adapter, int hint,
                               uint64_t staged, uint64_t *size)
{
	const struct out_hint *h = find_hint(c, adapter, hint);
	uint64_t area;

	*size = h ? h->needed : (hint ? 2 : 1) * (staged ? staged : 1);
	area = *size ? shm_region_alloc(c->shm, *size) : UINT64_MAX;
	writer_str(w, "out");
	if (area == UINT64_MAX) {
		msgpack_pack_nil(&w->pk);
	} else {
		msgpack_pack_map(&w->pk, 3);
		writer_key_u64(w, "offset", area);
		writer_key_u64(w, "size", *size);
		writer_key_u64(w, "min_bytes", c->shm_threshold);
	}
	return area;
}

/* A reply came: it holds the region (its tensors may lie in the area, which
 * it frees), and the daemon's "out_needed" sizes this adapter's next area. */
static void keep_out_area(struct tl_client *c, struct tl_reply *out, const char *adapter, int hint,
                          uint64_t area, uint64_t area_size)
{
	double needed = tl_reply_number(out, "out_needed");

	out->shm = c->shm;
	shm_region_ref(c->shm);
	out->area = area;
	if (!isnan(needed) && (uint64_t)needed != area_size)
		remember_hint(c, adapter, hint, (uint64_t)needed);
}

/* op ("scan", "grad") over trees named keys, with f's fields. */
static int run_op(struct tl_client *c, const char *op, const char *adapter,
                  const struct tl_tree *const *trees, const char *const *keys, uint32_t n,
                  const struct op_fields *f, struct tl_reply **out, struct tl_error *err)
{
	struct writer w;
	struct stage st = {.c = c};
	uint64_t id = 0, area = UINT64_MAX, area_size = 0;
	int hint = hint_kind(op, f), rc;
	uint32_t more = f->checkpoint + f->save + (f->saved_key != NULL);

	if (tlc_begin(c, &w, op, 1 + n + (c->shm != NULL) + more, &id, err) != 0)
		return -1;
	writer_key_str(&w, "adapter", adapter);
	if (f->checkpoint)
		writer_key_bool(&w, "checkpoint", true);
	if (f->save)
		writer_key_bool(&w, "save", true);
	if (f->saved_key)
		writer_key_str(&w, "saved_key", f->saved_key);
	for (uint32_t i = 0; i < n; i++) {
		writer_str(&w, keys[i]);
		if (trees[i] == NULL)
			msgpack_pack_nil(&w.pk);
		else
			tree_encode_placed(&w, CNODE(trees[i]), stage_place, &st);
	}
	if (c->shm)
		area = write_out_area(c, &w, adapter, hint, st.bytes, &area_size);
	c->poll_reply = w.pos + st.bytes < BUSYPOLL_MAX_REQUEST;
	rc = tlc_roundtrip(c, &w, id, out, err);
	c->poll_reply = true;
	for (size_t i = 0; i < st.n; i++)
		shm_region_free(c->shm, st.blocks[i]);
	free(st.blocks);
	if (rc == 0 && c->shm)
		keep_out_area(c, *out, adapter, hint, area, area_size);
	else if (area != UINT64_MAX)
		shm_region_free(c->shm, area);
	if (rc == 0 && tlc_read_trees(*out, err) != 0) {
		tl_reply_free(*out);
		*out = NULL;
		return -1;
	}
	return rc;
}

/* A scan: with f->save, the forward of the saved pair. */
static int scan_op(struct tl_client *c, const char *adapter, const struct tl_tree *carry,
                   const struct tl_tree *inputs, const struct op_fields *f, struct tl_reply **out,
                   struct tl_error *err)
{
	const struct tl_tree *trees[] = {carry, inputs};
	const char *keys[] = {"carry", "inputs"};

	if (carry == NULL || inputs == NULL)
		return tlc_fail(err, "INVALID_ARGUMENT", NULL,
		                "carry and inputs are required (use tl_none)");
	return run_op(c, "scan", adapter, trees, keys, 2, f, out, err);
}

int tl_scan(struct tl_client *c, const char *adapter, const struct tl_tree *carry,
            const struct tl_tree *inputs, struct tl_reply **out, struct tl_error *err)
{
	return scan_op(c, adapter, carry, inputs, &(struct op_fields){0}, out, err);
}

int tl_scan_save(struct tl_client *c, const char *adapter, const struct tl_tree *carry,
                 const struct tl_tree *inputs, struct tl_reply **out, struct tl_error *err)
{
	return scan_op(c, adapter, carry, inputs, &(struct op_fields){.save = true}, out, err);
}

int tl_grad_saved(struct tl_client *c, const char *adapter, const struct tl_tree *carry,
                  const struct tl_tree *inputs, const struct tl_reply *fwd,
                  const struct tl_tree *cot_carry, const struct tl_tree *cot_outputs,
                  struct tl_reply **out, struct tl_error *err)
{
	const struct tl_tree *trees[] = {carry, inputs, cot_carry, cot_outputs, NULL};
	const char *keys[] = {"carry", "inputs", "cot_carry", "cot_outputs", "saved"};
	char key[65];
	size_t len = 0;
	const char *k = fwd ? tl_reply_string(fwd, "saved_key", &len) : NULL;

	if (carry == NULL || inputs == NULL)
		return tlc_fail(err, "INVALID_ARGUMENT", NULL,
		                "carry and inputs are required (use tl_none)");
	trees[4] = fwd ? tl_reply_tree(fwd, "saved") : NULL;
	if (trees[4] == NULL || k == NULL || len >= sizeof key)
		return tlc_fail(err, "INVALID_ARGUMENT", "saved",
		                "fwd is not the reply of a tl_scan_save");
	memcpy(key, k, len);
	key[len] = '\0';
	return run_op(c, "grad", adapter, trees, keys, 5, &(struct op_fields){.saved_key = key},
	              out, err);
}

static int grad_op(struct tl_client *c, const char *adapter, const struct tl_tree *carry,
                   const struct tl_tree *inputs, const struct tl_tree *cot_carry,
                   const struct tl_tree *cot_outputs, bool checkpoint, struct tl_reply **out,
                   struct tl_error *err)
{
	const struct tl_tree *trees[] = {carry, inputs, cot_carry, cot_outputs};
	const char *keys[] = {"carry", "inputs", "cot_carry", "cot_outputs"};

	if (carry == NULL || inputs == NULL)
		return tlc_fail(err, "INVALID_ARGUMENT", NULL,
		                "carry and inputs are required (use tl_none)");
	return run_op(c, "grad", adapter, trees, keys, 4,
	              &(struct op_fields){.checkpoint = checkpoint}, out, err);
}

int tl_grad(struct tl_client *c, const char *adapter, const struct tl_tree *carry,
            const struct tl_tree *inputs, const struct tl_tree *cot_carry,
            const struct tl_tree *cot_outputs, struct tl_reply **out, struct tl_error *err)
{
	return grad_op(c, adapter, carry, inputs, cot_carry, cot_outputs, false, out, err);
}

int tl_grad_checkpoint(struct tl_client *c, const char *adapter, const struct tl_tree *carry,
                       const struct tl_tree *inputs, const struct tl_tree *cot_carry,
                       const struct tl_tree *cot_outputs, struct tl_reply **out,
                       struct tl_error *err)
{
	return grad_op(c, adapter, carry, inputs, cot_carry, cot_outputs, true, out, err);
}

int tl_compile(struct tl_client *c, const char *adapter, const struct tl_tree *carry,
               const struct tl_tree *inputs, enum tl_dtype dtype, enum tl_graph_kind kind,
               struct tl_reply **out, struct tl_error *err)
{
	static const char *const kinds[] = {"scan", "grad", "grad_checkpoint", "scan_save",
	                                    "grad_saved"};

	struct writer w;
	uint64_t id = 0;

	if ((unsigned)kind >= sizeof kinds / sizeof kinds[0])
		return tlc_fail(err, "INVALID_ARGUMENT", "kind", "kind must be a tl_graph_kind");
	if (tlc_begin(c, &w, "compile", 5, &id, err) != 0)
		return -1;
	writer_key_str(&w, "adapter", adapter);
	writer_key_str(&w, "dtype", dtype == TL_FLOAT32 ? "float32" : "float64");
	writer_key_str(&w, "kind", kinds[kind]);
	writer_str(&w, "carry");
	shapes_write(&w, CNODE(carry));
	writer_str(&w, "inputs");
	shapes_write(&w, CNODE(inputs));
	return tlc_roundtrip(c, &w, id, out, err);
}

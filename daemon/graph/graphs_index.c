/*
 * graphs_index.c - the warm-start index.
 *
 * index/<identity>.idx lists, one msgpack record per line of history, the
 * specializations compiled for one adapter identity (name, body, bounds,
 * strategy).  At start-up, a preloaded adapter's graphs are loaded from the
 * cache before the daemon declares itself ready.
 */
#include "graphs_internal.h"

#include "frame.h"
#include "signature.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#pragma GCC poison request conn outmsg daemon

void graphs_index_path(const struct graphs *g, const struct adapter *a, char *out, size_t size)
{
	char bounds[128], id[CACHE_KEY_HEX];
	const char *parts[4];

	snprintf(bounds, sizeof bounds, "%lld;%lld;%s%s", (long long)a->def.max_steps,
	         (long long)a->def.max_elements, a->def.strategy,
	         adapter_batched(a) ? ";dynamic=batch" : "");
	parts[0] = a->def.name;
	parts[1] = a->body_sha;
	parts[2] = bounds;
	parts[3] = TORCHLOOP_VERSION;
	cache_key(parts, 4, id);
	snprintf(out, size, "%s/index/%s.idx", g->cache->dir, id);
}

/* Pool: appends one record (a length-prefixed msgpack map). */
void index_append(struct graphs *g, struct specialization *sp)
{
	char path[PATH_MAX];
	struct writer w;
	struct proto_err err;
	uint8_t *bytes;
	size_t len;
	FILE *f;

	graphs_index_path(g, sp->adapter, path, sizeof path);
	if (writer_init(&w) != 0)
		return;
	msgpack_pack_map(&w.pk, sp->wrt ? 5 : 4);
	writer_key_str(&w, "kind", spec_kinds[sp->kind].name);
	if (sp->wrt)
		writer_key_str(&w, "wrt", sp->wrt);
	writer_key_str(&w, "dtype", proto_dtype_name(sp->dtype));
	writer_str(&w, "carry");
	shapes_write(&w, &sp->carry);
	writer_str(&w, "inputs");
	shapes_write(&w, &sp->inputs);
	bytes = writer_flatten(&w, &len, PROTO_FRAME_MAX, &err);
	writer_destroy(&w);
	f = bytes ? fopen(path, "ae") : NULL;
	if (f) {
		fwrite(bytes, 1, len, f); /* the frame header is the record's length */
		fclose(f);
	}
	free(bytes);
}

static int index_record(const struct msg *m, msgpack_zone *zone, bool batch,
                        struct prewarm_rec *rec);

/* Reads the index (at start-up, before the loop serves requests). */
int index_read(struct graphs *g, struct adapter *a, msgpack_zone *zone, struct prewarm_rec *recs,
               int max)
{
	char path[PATH_MAX];
	struct frame_reader r;
	struct proto_err err;
	uint8_t buf[65536];
	size_t n, off, used;
	int count = 0;
	FILE *f;

	graphs_index_path(g, a, path, sizeof path);
	f = fopen(path, "re");
	if (f == NULL)
		return 0;
	frame_reader_init(&r, 1 << 20);
	while (count < max && (n = fread(buf, 1, sizeof buf, f)) > 0) {
		for (off = 0; off < n && count < max; off += used) {
			enum frame_status st =
			    frame_reader_feed(&r, buf + off, n - off, &used, &err);
			uint32_t len;
			uint8_t *body;
			struct msg m;
			if (st == FRAME_ERROR)
				goto done;
			if (st != FRAME_READY)
				continue;
			body = frame_reader_take(&r, &len);
			/* a record that does not parse is skipped, never counted */
			if (msg_parse(&m, body, len, MSG_ANY, &err) == 0 &&
			    index_record(&m, zone, adapter_batched(a), &recs[count]) == 0)
				count++;
			msg_destroy(&m);
			frame_free(body);
		}
	}
done:
	frame_reader_free(&r);
	fclose(f);
	return count;
}

static int index_record(const struct msg *m, msgpack_zone *zone, bool batch,
                        struct prewarm_rec *rec)
{
	const char *s;
	uint32_t n;
	struct proto_err err;

	bool grad = false; /* the index before kinds had names */
	int kind;

	if (msg_get_str(&m->up.data, "kind", &s, &n, NULL) == 0) {
		if ((kind = spec_kind_parse(s, n)) < 0)
			return -1;
		rec->kind = (enum spec_kind)kind;
	} else {
		msg_get_bool(&m->up.data, "grad", &grad, NULL);
		rec->kind = grad ? SPEC_GRAD : SPEC_SCAN;
	}
	rec->wrt = NULL;
	if (msg_get_str(&m->up.data, "wrt", &s, &n, NULL) == 0) {
		char *w = msgpack_zone_malloc(zone, n + 1);
		if (w == NULL)
			return -1;
		memcpy(w, s, n);
		w[n] = '\0';
		rec->wrt = w;
	}
	if (msg_get_str(&m->up.data, "dtype", &s, &n, NULL) != 0)
		return -1;
	rec->dtype = n == 7 && memcmp(s, "float32", 7) == 0 ? PROTO_DTYPE_F32 : PROTO_DTYPE_F64;
	if (msg_field(m, "carry") == NULL || msg_field(m, "inputs") == NULL ||
	    shapes_read(msg_field(m, "carry"), zone, rec->dtype, batch, &rec->carry, &err) != 0 ||
	    shapes_read(msg_field(m, "inputs"), zone, rec->dtype, batch, &rec->inputs, &err) != 0)
		return -1;
	return 0;
}

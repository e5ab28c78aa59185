/*
 * fuzz_proto.c - libFuzzer harness: arbitrary bytes through the frame
 * reader (split at a data-chosen offset), then every complete frame through
 * the envelope parser and, for every map value, the tensor-tree decoder and
 * the shape-tree reader (the `compile` op's carry and inputs).  Trees are
 * decoded a second time against a 4 KiB heap region, and every byte of every
 * tensor they yield is read: a shared-memory reference (PROTO_EXT_SHM) that
 * escaped its bounds check would read past the region (ASan).  Any
 * sanitizer report or leak is a finding.
 */
#include "frame.h"
#include "msg.h"
#include "shapes.h"

#include <stdint.h>
#include <stdlib.h>

#define REGION 4096

static int touch(const struct tree_node *leaf, const char *path, void *arg)
{
	const uint8_t *p = leaf->tensor.data;
	unsigned *sum = arg;

	(void)path;
	for (uint64_t i = 0; i < leaf->tensor.nbytes; i++)
		*sum += p[i];
	return 0;
}

static void decode_body(const uint8_t *body, size_t len)
{
	static uint8_t *region_bytes;
	struct tree_region region;
	struct proto_err err;
	struct msg m;
	unsigned sum = 0;

	if (region_bytes == NULL)
		region_bytes = calloc(1, REGION);
	region.base = region_bytes;
	region.size = REGION;

	for (int kind = MSG_REQUEST; kind <= MSG_ANY; kind++) {
		if (msg_parse(&m, body, len, kind, &err) == 0) {
			for (uint32_t i = 0; i < m.map->size; i++) {
				struct tree_node n;
				if (tree_decode(&m.map->ptr[i].val, m.up.zone, "f", &n, &err) ==
				    0) {
					(void)tree_count_leaves(&n);
				}
				if (tree_decode_in(&m.map->ptr[i].val, m.up.zone, "f", &region, &n,
				                   &err) == 0)
					(void)tree_visit(&n, "f", 0, touch, &sum);
				if (shapes_read(&m.map->ptr[i].val, m.up.zone, PROTO_DTYPE_F64,
				                i % 2 == 0, &n, &err) == 0)
					(void)tree_count_tensors(&n);
			}
		}
		msg_destroy(&m);
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct frame_reader r;
	struct proto_err err;
	size_t off = 0, split = size ? data[0] % (size + 1) : 0;

	/* The whole input as one frame body (the common path)... */
	decode_body(data, size);
	/* ...and as a byte stream cut at a data-chosen offset. */
	frame_reader_init(&r, 1u << 20);
	while (off < size) {
		size_t end = off < split ? split : size, used;
		enum frame_status st = frame_reader_feed(&r, data + off, end - off, &used, &err);
		off += used;
		if (st == FRAME_ERROR)
			break;
		if (st == FRAME_READY) {
			uint32_t len;
			uint8_t *body = frame_reader_take(&r, &len);
			decode_body(body, len);
			frame_free(body);
		}
	}
	(void)frame_reader_eof(&r, &err);
	frame_reader_free(&r);
	return 0;
}

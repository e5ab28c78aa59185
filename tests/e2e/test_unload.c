/*
 * test_unload.c - graphs the daemon drops are unmapped (issue 31, item 6).
 *
 * Before, every artifact stayed mapped for the daemon's life: AOTI's
 * generated code had STB_GNU_UNIQUE symbols and a thread_local std::string
 * whose destructor, registered by each thread that ran the graph, pinned the
 * library until that thread exited (the daemon's never do).  An adapter
 * replaced by a new body each time (a new artifact, a new inode: glibc would
 * hand back a still-loaded image of the same file) shows it: 5 mappings and
 * ~0.3 MiB per graph, never released.
 */
#include "harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

TestSuite(unload, .timeout = 900);

#define ROUNDS 4

/* Mappings of the process, and those of files under dir. */
static int count_maps(pid_t pid, const char *dir, int *under)
{
	char path[64], line[1024];
	int n = 0;
	FILE *f;

	snprintf(path, sizeof path, "/proc/%d/maps", (int)pid);
	f = fopen(path, "r");
	cr_assert_not_null(f);
	*under = 0;
	while (fgets(line, sizeof line, f)) {
		n++;
		*under += strstr(line, dir) != NULL;
	}
	fclose(f);
	return n;
}

/* c' = k c + x by hand, T = 3, carry [4]. */
static void scan_checked(struct tl_client *c, double k)
{
	double carry[4] = {1, 2, 3, 4}, xs[12], want[4];
	int64_t cs[] = {4}, xsh[] = {3, 4};
	struct tl_builder *b = tl_builder_new();
	struct tl_reply *r;
	struct tl_error err;
	const double *got;

	h_fill(xs, TL_FLOAT64, 12, 7);
	memcpy(want, carry, sizeof want);
	for (int t = 0; t < 3; t++)
		for (int j = 0; j < 4; j++)
			want[j] = k * want[j] + xs[4 * t + j];
	cr_assert_eq(tl_scan(c, "ul.body", tl_tensor(b, TL_FLOAT64, 1, cs, carry),
	                     tl_tensor(b, TL_FLOAT64, 2, xsh, xs), &r, &err),
	             0, "%s %s", err.code, err.message);
	got = tl_tree_data(tl_reply_tree(r, "carry"));
	for (int j = 0; j < 4; j++)
		cr_assert_float_eq(got[j], want[j], 1e-12, "k=%g: the replaced body's graph ran",
		                   k);
	tl_reply_free(r);
	tl_builder_free(b);
}

Test(unload, a_replaced_adapters_graph_is_unmapped)
{
	const char *const args[] = {"--no-probe", NULL};
	char src[256], objects[1100];
	struct tl_adapter_def def = {"ul.body", src, NULL, "body", "unroll", 8, 64, 8, NULL};
	int maps[ROUNDS], cache_maps[ROUNDS];
	struct tl_error err;
	struct tl_client *c;
	struct hd d;

	hd_start(&d, NULL, args);
	hd_wait_ready(&d, 120);
	c = hd_connect(&d);
	snprintf(objects, sizeof objects, "%s/", d.cache);
	for (int i = 0; i < ROUNDS; i++) {
		double k = 0.5 + 0.125 * i; /* a new body: a new artifact */
		snprintf(src, sizeof src,
		         "import torch\n\ndef body(c, x):\n    c = %.3f * c + x\n    return c, c\n",
		         k);
		cr_assert_eq(tl_register(c, &def, &err), 0, "%s", err.message);
		scan_checked(c, k);
		maps[i] = count_maps(d.pid, objects, &cache_maps[i]);
	}
	for (int i = 1; i < ROUNDS; i++)
		cr_assert_leq(cache_maps[i], cache_maps[0],
		              "graph %d: %d mappings of cache files, %d with the first graph (the "
		              "replaced ones stay mapped)",
		              i, cache_maps[i], cache_maps[0]);
	cr_assert_leq(maps[ROUNDS - 1] - maps[0], 4, "mappings grew %d -> %d over %d graphs",
	              maps[0], maps[ROUNDS - 1], ROUNDS);
	hd_wait_ready(&d, 60); /* and it still serves */
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
}

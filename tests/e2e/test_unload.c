/*
 * test_unload.c - graphs the daemon drops are unmapped (issue 31, item 6).
 *
 * Before, every artifact stayed mapped for the daemon's life: AOTI's
 * generated code had STB_GNU_UNIQUE symbols and a thread_local std::string
 * whose destructor, registered by each thread that ran the graph, pinned the
 * library until that thread exited (the daemon's never do).  An adapter
 * replaced by a new body each time (a new artifact, a new inode: glibc would
 * hand back a still-loaded image of the same file) shows it: 5 mappings and
 * ~0.3 MiB per graph, never released.  And 2 000 replacements between
 * two bodies (each load from the cache through a link of its own) leave
 * the mapping count and the RSS where they were.
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

static void body_of(char *src, size_t size, double k)
{
	snprintf(src, size,
	         "import torch\n\ndef body(c, x):\n    c = %.3f * c + x\n    return c, c\n", k);
}

static struct tl_client *start(struct hd *d, const char *const *args)
{
	hd_start(d, NULL, args);
	hd_wait_ready(d, 120);
	return hd_connect(d);
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

	c = start(&d, args);
	snprintf(objects, sizeof objects, "%s/", d.cache);
	for (int i = 0; i < ROUNDS; i++) {
		double k = 0.5 + 0.125 * i; /* a new body: a new artifact */
		body_of(src, sizeof src, k);
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

/*
 * 2 000 replacements, alternating two bodies compiled once: each one drops
 * the replaced adapter's graph (unloaded) and loads the other's from the
 * cache.  Mappings and RSS are read after 100 (the allocator settled) and
 * at the end.  Under the sanitizers (ASan's quarantine holds freed memory)
 * the RSS is not checked, and 400 replacements do.
 */
Test(unload, two_thousand_replacements_keep_mappings_and_rss_flat)
{
	const char *const args[] = {"--no-probe", "--log-level", "warn", NULL};
	bool san = getenv("TORCHLOOP_TEST_SAN") != NULL;
	int rounds = san ? 400 : 2000, under, maps0 = 0;
	long rss0 = 0, rss;
	char src[256];
	struct tl_adapter_def def = {"ul.body", src, NULL, "body", "unroll", 8, 64, 8, NULL};
	struct tl_error err;
	struct tl_client *c;
	struct hd d;

	c = start(&d, args);
	for (int i = 0; i < rounds; i++) {
		double k = i % 2 ? 0.625 : 0.5; /* the first test's first two bodies */
		body_of(src, sizeof src, k);
		cr_assert_eq(tl_register(c, &def, &err), 0, "%d: %s", i, err.message);
		scan_checked(c, k);
		if (i == 100) {
			maps0 = count_maps(d.pid, d.cache, &under);
			rss0 = h_rss_kib(d.pid);
		}
	}
	cr_assert_leq(count_maps(d.pid, d.cache, &under) - maps0, 4,
	              "mappings grew over %d replacements", rounds - 100);
	rss = h_rss_kib(d.pid);
	cr_log_info("%d replacements: RSS %ld -> %ld KiB", rounds - 100, rss0, rss);
	if (san)
		h_not_checked("unload: the RSS under the sanitizers (%ld -> %ld KiB)", rss0, rss);
	else
		cr_assert_lt(rss - rss0, 8 * 1024, "RSS grew %ld -> %ld KiB over %d replacements",
		             rss0, rss, rounds - 100);
	tl_close(c);
	cr_assert_eq(hd_stop(&d), 0);
}

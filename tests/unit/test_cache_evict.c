/*
 * test_cache_evict.c - the cache's size cap (daemon/base/cache_evict.c) on a
 * real directory: entries committed with cache_commit, their ages set by
 * hand.  Over the cap the oldest unpinned entries go first and the directory
 * ends within it; a pinned entry (a loaded graph's flock) and one touched in
 * the grace period stay whatever their age; quarantined files go before any
 * entry; a lookup hit makes an entry the newest; quarantine/ keeps at most
 * CACHE_QUARANTINE_MAX files; no cap (0) evicts nothing.
 */
#include "cache.h"

#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ENTRY_BYTES (64 * 1024)

static struct cache c;
static time_t NOW; /* the test's start: entries are dated before it */
static char root[] = "/tmp/tl-evict.XXXXXX";

static void setup(void)
{
	struct proto_err err;

	NOW = time(NULL);
	cr_assert_not_null(mkdtemp(root));
	cr_assert_eq(cache_open(&c, root, &err), 0, "%s", err.message);
}

static void teardown(void)
{
	char cmd[128];

	snprintf(cmd, sizeof cmd, "rm -rf %s", root);
	cr_assert_eq(system(cmd), 0);
}

TestSuite(cache_evict, .init = setup, .fini = teardown, .timeout = 60);

static void key_of(int i, char key[CACHE_KEY_HEX])
{
	snprintf(key, CACHE_KEY_HEX, "%064d", i);
}

/* Commits entry i (ENTRY_BYTES of artifact) and dates it `age` seconds before NOW. */
static void commit(int i, time_t age)
{
	char key[CACHE_KEY_HEX], tmp[PATH_MAX], meta_path[PATH_MAX];
	static uint8_t bytes[ENTRY_BYTES];
	uint8_t y[] = {0xc0}; /* nil */
	struct cache_meta m = {.y_spec = y, .y_spec_len = 1};
	struct proto_err err;
	struct timespec t[2] = {{NOW - age, 0}, {NOW - age, 0}};
	int fd;

	key_of(i, key);
	memset(bytes, i, sizeof bytes);
	cache_tmp_path(&c, key, tmp, sizeof tmp);
	fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0600);
	cr_assert(fd >= 0);
	cr_assert_eq(write(fd, bytes, sizeof bytes), (ssize_t)sizeof bytes);
	close(fd);
	cr_assert_eq(cache_commit(&c, key, tmp, &m, &err), 0, "%s", err.message);
	snprintf(meta_path, sizeof meta_path, "%s/objects/%s.meta", root, key);
	cr_assert_eq(utimensat(AT_FDCWD, meta_path, t, 0), 0);
}

static int present(int i)
{
	char key[CACHE_KEY_HEX], path[PATH_MAX];

	key_of(i, key);
	snprintf(path, sizeof path, "%s/objects/%s.meta", root, key);
	return access(path, F_OK) == 0;
}

Test(cache_evict, no_cap_evicts_nothing)
{
	for (int i = 0; i < 4; i++)
		commit(i, 1000 + i);
	cr_assert_eq(cache_evict(&c, NOW), 0);
	for (int i = 0; i < 4; i++)
		cr_assert(present(i));
}

Test(cache_evict, over_the_cap_the_least_recently_used_go_first_until_it_fits)
{
	for (int i = 0; i < 6; i++)
		commit(i, 1000 * (i + 1)); /* entry 5 is the oldest */
	c.max_bytes = 3 * ENTRY_BYTES + ENTRY_BYTES / 2;
	cr_assert_eq(cache_evict(&c, NOW), 3);
	for (int i = 0; i < 3; i++)
		cr_assert(present(i), "entry %d (recent) was evicted", i);
	for (int i = 3; i < 6; i++)
		cr_assert_not(present(i), "entry %d (old) stayed", i);
}

Test(cache_evict, a_pinned_entry_and_one_in_its_grace_period_stay)
{
	char key[CACHE_KEY_HEX];
	int pin;

	commit(0, 10);   /* within CACHE_EVICT_GRACE_S: being loaded */
	commit(1, 5000); /* the oldest, but loaded (pinned) */
	commit(2, 4000);
	key_of(1, key);
	pin = cache_pin(&c, key);
	cr_assert(pin >= 0);
	c.max_bytes = ENTRY_BYTES / 2; /* nothing fits */
	cr_assert_eq(cache_evict(&c, NOW), 1);
	cr_assert(present(0));
	cr_assert(present(1));
	cr_assert_not(present(2));
	close(pin); /* unloaded: it goes at the next eviction */
	cr_assert_eq(cache_evict(&c, NOW), 1);
	cr_assert_not(present(1));
}

Test(cache_evict, a_lookup_hit_makes_an_entry_the_newest)
{
	char key[CACHE_KEY_HEX];
	struct cache_meta m;
	struct proto_err err;
	int q;

	commit(0, 1000);
	commit(1, 2000); /* older, but looked up now: newest */
	key_of(1, key);
	cr_assert_eq(cache_lookup(&c, key, &m, &q, &err), 1);
	cache_meta_free(&m);
	c.max_bytes = ENTRY_BYTES + ENTRY_BYTES / 2;
	cr_assert_eq(cache_evict(&c, NOW + 2 * CACHE_EVICT_GRACE_S), 1);
	cr_assert(present(1));
	cr_assert_not(present(0));
}

static unsigned quarantined_files(void)
{
	char cmd[PATH_MAX];
	unsigned n = 0;
	FILE *p;

	snprintf(cmd, sizeof cmd, "ls %s/quarantine | wc -l", root);
	p = popen(cmd, "r");
	cr_assert_not_null(p);
	cr_assert_eq(fscanf(p, "%u", &n), 1);
	pclose(p);
	return n;
}

Test(cache_evict, quarantined_files_go_before_any_entry_and_are_bounded_in_number)
{
	char key[CACHE_KEY_HEX];

	for (int i = 0; i < CACHE_QUARANTINE_MAX; i++) {
		commit(100 + i, 100);
		key_of(100 + i, key);
		cache_quarantine(&c, key, "a test");
	}
	cr_assert_leq(quarantined_files(), CACHE_QUARANTINE_MAX);
	cr_assert_geq(quarantined_files(), CACHE_QUARANTINE_MAX - 1);
	commit(0, 9000); /* older than every quarantined file */
	c.max_bytes = ENTRY_BYTES + ENTRY_BYTES / 2;
	cr_assert_eq(cache_evict(&c, NOW), 0);
	cr_assert(present(0), "an entry went while quarantined files were left");
	cr_assert_leq(quarantined_files(), 2);
}

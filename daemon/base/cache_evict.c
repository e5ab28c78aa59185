/*
 * cache_evict.c - the cache's size cap (--cache-max-bytes) and the pins that
 * keep a loaded artifact from being evicted.
 *
 * Every registered graph may add artifacts (about 1.6 MB each), so the cache
 * directory is bounded like everything else a client can make the daemon
 * hold.  After each commit (thread pool) the directory is measured: objects/
 * entries, index/ files and quarantine/ files.  Over the cap, what goes first
 * is what nothing needs: quarantined files (kept only for a look), then the
 * least recently used artifacts that no daemon has loaded, then the oldest
 * warm-start index files.  "Recently used" is the .meta's mtime, which
 * cache_lookup sets on every verified hit; "loaded" is a shared flock on the
 * .so that the loading daemon holds for as long as the graph is mapped
 * (cache_pin), so several daemons on one directory see each other's pins.
 * An entry touched in the last CACHE_EVICT_GRACE_S seconds is never evicted:
 * it is being loaded (between its lookup and its pin) or was just built.
 *
 * quarantine/ is also bounded by count (CACHE_QUARANTINE_MAX files), pruned
 * oldest first whenever an entry is moved there.
 *
 * One eviction runs at a time per process (a second caller returns at once:
 * the running one measures again); the counters are process-wide atomics.
 */
#include "cache.h"
#include "cache_internal.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

struct evict_file {
	char name[128]; /* a key (objects: the entry's two files) or a file name */
	time_t mtime;
	uint64_t bytes;
};

struct evict_list {
	struct evict_file *v;
	size_t n, cap;
	uint64_t bytes;
};

/* a keep_after no file's mtime reaches: every file may go */
#define NEVER_KEPT ((time_t)1 << 62)

static atomic_flag evicting = ATOMIC_FLAG_INIT;
static _Atomic uint64_t evicted_entries, evicted_bytes;

static int list_add(struct evict_list *l, const char *name, size_t len, time_t mtime,
                    uint64_t bytes)
{
	if (len >= sizeof l->v[0].name)
		return 0; /* not a name this cache writes */
	if (l->n == l->cap) {
		size_t cap = l->cap ? l->cap * 2 : 64;
		struct evict_file *v = realloc(l->v, cap * sizeof *v);
		if (v == NULL)
			return -1;
		l->v = v;
		l->cap = cap;
	}
	memcpy(l->v[l->n].name, name, len);
	l->v[l->n].name[len] = '\0';
	l->v[l->n].mtime = mtime;
	l->v[l->n].bytes = bytes;
	l->n++;
	l->bytes += bytes;
	return 0;
}

static int by_age(const void *a, const void *b)
{
	const struct evict_file *x = a, *y = b;

	return (x->mtime > y->mtime) - (x->mtime < y->mtime);
}

/* Oldest first (qsort must not see the NULL of an empty list). */
static void sort_by_age(struct evict_list *l)
{
	if (l->n > 1)
		qsort(l->v, l->n, sizeof *l->v, by_age);
}

static uint64_t file_bytes(int dfd, const char *name, time_t *mtime)
{
	struct stat st;

	if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
		return 0;
	if (mtime)
		*mtime = st.st_mtime;
	return (uint64_t)st.st_blocks * 512;
}

/* Lists sub/'s files; for objects/, one row per committed entry (<key>.meta,
 * its .so counted with it).  0, or -1 (out of memory, unreadable). */
static int scan_dir(const struct cache *c, const char *sub, struct evict_list *l)
{
	char path[PATH_MAX];
	DIR *dir;
	struct dirent *e;
	int rc = 0;

	snprintf(path, sizeof path, "%s/%s", c->dir, sub);
	dir = opendir(path);
	if (dir == NULL)
		return errno == ENOENT ? 0 : -1;
	while (rc == 0 && (e = readdir(dir)) != NULL) {
		const char *dot = strrchr(e->d_name, '.');
		time_t mtime = 0;
		uint64_t bytes;
		if (e->d_name[0] == '.' || dot == NULL)
			continue;
		bytes = file_bytes(dirfd(dir), e->d_name, &mtime);
		if (strcmp(sub, "objects") != 0) {
			rc = list_add(l, e->d_name, strlen(e->d_name), mtime, bytes);
		} else if (strcmp(dot, ".meta") == 0) {
			/* the .so counts with its .meta; a stray one is replaced on commit */
			char so[PATH_MAX];
			snprintf(so, sizeof so, "%.*s.so", (int)(dot - e->d_name), e->d_name);
			bytes += file_bytes(dirfd(dir), so, NULL);
			rc = list_add(l, e->d_name, (size_t)(dot - e->d_name), mtime, bytes);
		}
	}
	closedir(dir);
	return rc;
}

/* 1 when some process holds the entry's pin (or its compile lock). */
static int entry_busy(const struct cache *c, const char *key)
{
	char so[PATH_MAX];
	int fd, busy;

	cache_entry_path(c, key, "so", so, sizeof so);
	fd = open(so, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
	if (fd < 0)
		return 0;
	busy = flock(fd, LOCK_EX | LOCK_NB) != 0;
	/* the entry goes while we hold it exclusively: no one pins it meanwhile */
	if (!busy) {
		char meta[PATH_MAX];
		cache_entry_path(c, key, "meta", meta, sizeof meta);
		unlink(meta); /* uncommitted first: a lookup now misses */
		unlink(so);
	}
	close(fd);
	return busy;
}

static void drop_files(const struct cache *c, const char *sub, struct evict_list *l,
                       uint64_t *total, uint64_t cap, time_t keep_after)
{
	char path[PATH_MAX];

	for (size_t i = 0; i<l->n && * total> cap; i++) {
		if (l->v[i].mtime >= keep_after)
			continue;
		snprintf(path, sizeof path, "%s/%s/%s", c->dir, sub, l->v[i].name);
		if (unlink(path) == 0)
			*total -= l->v[i].bytes;
	}
}

static void drop_entries(const struct cache *c, struct evict_list *l, uint64_t *total, uint64_t cap,
                         time_t keep_after)
{
	for (size_t i = 0; i<l->n && * total> cap; i++) {
		if (l->v[i].mtime >= keep_after || entry_busy(c, l->v[i].name))
			continue;
		*total -= l->v[i].bytes;
		atomic_fetch_add(&evicted_entries, 1);
		atomic_fetch_add(&evicted_bytes, l->v[i].bytes);
		fprintf(stderr,
		        "torchloopd: info cache: evicted %.16s (%llu bytes, over "
		        "--cache-max-bytes %llu)\n",
		        l->v[i].name, (unsigned long long)l->v[i].bytes, (unsigned long long)cap);
	}
}

unsigned cache_evict(const struct cache *c, time_t now)
{
	struct evict_list lists[3] = {{0}};
	static const char *const subs[3] = {"quarantine", "objects", "index"};
	uint64_t total = 0, before = atomic_load(&evicted_entries);
	time_t keep_after = now - CACHE_EVICT_GRACE_S;

	if (c->max_bytes <= 0 || atomic_flag_test_and_set(&evicting))
		return 0;
	for (size_t i = 0; i < 3; i++) {
		if (scan_dir(c, subs[i], &lists[i]) != 0)
			goto out; /* out of memory or an unreadable directory: next commit */
		sort_by_age(&lists[i]);
		total += lists[i].bytes;
	}
	if (total > (uint64_t)c->max_bytes) {
		/* quarantined files have no grace: nothing loads them */
		drop_files(c, "quarantine", &lists[0], &total, (uint64_t)c->max_bytes, NEVER_KEPT);
		drop_entries(c, &lists[1], &total, (uint64_t)c->max_bytes, keep_after);
		drop_files(c, "index", &lists[2], &total, (uint64_t)c->max_bytes, keep_after);
	}
out:
	for (size_t i = 0; i < 3; i++)
		free(lists[i].v);
	atomic_flag_clear(&evicting);
	return (unsigned)(atomic_load(&evicted_entries) - before);
}

void cache_prune_quarantine(const struct cache *c)
{
	struct evict_list l = {0};

	if (scan_dir(c, "quarantine", &l) == 0 && l.n > CACHE_QUARANTINE_MAX) {
		uint64_t total = l.n, cap = CACHE_QUARANTINE_MAX;
		sort_by_age(&l);
		for (size_t i = 0; i < l.n; i++)
			l.v[i].bytes = 1; /* counted in files here, not bytes */
		drop_files(c, "quarantine", &l, &total, cap, NEVER_KEPT);
	}
	free(l.v);
}

int cache_pin(const struct cache *c, const char *key)
{
	char so[PATH_MAX];
	int fd;

	cache_entry_path(c, key, "so", so, sizeof so);
	fd = open(so, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
	if (fd >= 0 && flock(fd, LOCK_SH | LOCK_NB) != 0) {
		close(fd); /* being evicted this instant: the mapped image lives on */
		fd = -1;
	}
	return fd;
}

void cache_touch(const struct cache *c, const char *key)
{
	char meta[PATH_MAX];

	cache_entry_path(c, key, "meta", meta, sizeof meta);
	utimensat(AT_FDCWD, meta, NULL, AT_SYMLINK_NOFOLLOW);
}

void cache_evict_counts(uint64_t *entries, uint64_t *bytes)
{
	*entries = atomic_load(&evicted_entries);
	*bytes = atomic_load(&evicted_bytes);
}

/*
 * cache.h - the content-addressed on-disk artifact cache.
 *
 * Layout under the cache directory (mode 0700):
 *   objects/<key>.so    the artifact; never rewritten in place
 *   objects/<key>.meta  msgpack record: size, sha256, graph signature; its
 *                       presence is what commits an entry
 *   objects/<key>.lock  exists (flock'ed) only while one process compiles that key
 *   tmp/                artifacts being written (temp name, fsync, rename),
 *                       the daemon's load links, and each compile worker's
 *                       scratch directory w.<pid>.<n>/ (sandbox.h: the only
 *                       place it may write); entries of dead daemons are
 *                       removed at start (names carry the daemon's pid)
 *   quarantine/         entries that failed verification, kept for a look
 *   checked             register checks passed (cache_checked.c), fixed size
 *
 * A lookup verifies size and sha256 of the .so against its .meta before the
 * caller may dlopen it; anything that fails is moved to quarantine and
 * reported as a miss, so it gets rebuilt.  Safe with several daemons on one
 * directory: commits are renames, compiles of one key are serialised by
 * flock.  Blocking calls (hashing, flock, fsync): thread pool only.
 */
#ifndef TORCHLOOP_CACHE_H
#define TORCHLOOP_CACHE_H

#include "protocol.h"

#include <limits.h>
#include <stdbool.h>
#include <msgpack.h>
#include <stdint.h>
#include <sys/stat.h>
#include <time.h>

#define CACHE_KEY_HEX 65

struct cache {
	char dir[PATH_MAX / 2];
	long long max_bytes; /* --cache-max-bytes; 0: no cap */
};

struct cache_meta {
	char sha256[CACHE_KEY_HEX];
	uint64_t size;
	uint32_t n_inputs, n_outputs;
	double compile_seconds;
	char strategy[16];
	char lowered[16]; /* compile_result's, "" in entries from before it existed */
	char note[256];
	uint32_t step_ops; /* compile_result's, 0 in entries from before it existed */
	/* the worker's output spec ("y"), msgpack, owned (malloc) */
	uint8_t *y_spec;
	size_t y_spec_len;
};

/*
 * Creates (mode 0700) or opens the directory and its subdirectories, and
 * refuses one that cannot hold loadable code (noexec mount, not writable) or
 * that is not trusted (not owned by the daemon's uid, or group/world
 * writable).  Cleans tmp/ of dead daemons' leftovers.
 */
/* 0 when path is a directory the daemon's uid owns and others cannot write
 * (the cache and the state directory hold code the daemon runs). */
int cache_trusted_dir(const char *path, struct proto_err *err);

int cache_open(struct cache *c, const char *dir, struct proto_err *err);
/* Removes tmp/ entries whose daemon is gone (or is us); returns how many. */
unsigned cache_clean_tmp(const struct cache *c);
/* Removes a compile's temporary artifact and its job directory (<tmp_so>.d). */
void cache_remove_job(const char *tmp_so);
/* open(O_NOFOLLOW | O_NONBLOCK) of a regular file (fstat'ed into st); -1 else. */
int cache_open_file(const char *path, struct stat *st);

/* sha256 over the NUL-separated parts: the content address. */
void cache_key(const char *const *parts, size_t n, char hex[CACHE_KEY_HEX]);

void cache_so_path(const struct cache *c, const char *key, char *out, size_t size);
/*
 * Hard-links the entry's .so to a fresh name in tmp/ (out) for dlopen.
 * While an image is loaded, a dlopen by the same path returns it, even
 * after the entry was rebuilt; a name of its own per load always maps the
 * file that is there.
 * The caller unlinks out once dlopen returned.  0 or -1.
 */
int cache_load_link(const struct cache *c, const char *key, char *out, size_t size,
                    struct proto_err *err);
/* A fresh temporary path for the worker to write an artifact to. */
void cache_tmp_path(const struct cache *c, const char *key, char *out, size_t size);

/*
 * Returns 1 with meta filled when a verified entry exists, 0 when there is
 * none (a corrupt one is quarantined first and *quarantined set), -1 with
 * err on an I/O failure.  Free meta with cache_meta_free.
 */
int cache_lookup(const struct cache *c, const char *key, struct cache_meta *meta, int *quarantined,
                 struct proto_err *err);
void cache_meta_free(struct cache_meta *meta);

/*
 * Commits tmp_so as the entry for key: copies it (a regular file of at most
 * CACHE_ARTIFACT_MAX bytes, never a symlink's target) into a fresh file of
 * the daemon's own while hashing it, fsyncs and renames that into objects/,
 * then writes the .meta the same way.  tmp_so itself is never renamed: a
 * compile worker may still hold it open (the caller removes it).  Fills
 * meta->size and meta->sha256.
 */
#define CACHE_ARTIFACT_MAX (1ULL << 30)
int cache_commit(const struct cache *c, const char *key, const char *tmp_so,
                 struct cache_meta *meta, struct proto_err *err);

/*
 * Register checks passed, remembered (cache_checked.c): find is true only
 * for a key added before and not since displaced; add never fails the
 * caller.  Blocking: thread pool only.
 */
#define CACHE_CHECKED_SLOTS 4096
bool cache_checked_find(const struct cache *c, const char *key);
void cache_checked_add(const struct cache *c, const char *key);

/* Moves an entry to quarantine/. */
void cache_quarantine(const struct cache *c, const char *key, const char *why);

/*
 * flock(LOCK_EX | LOCK_NB) on the key's lock file (held while one process
 * compiles that key).  Returns 0 with *fd for cache_unlock, 1 when another
 * holder has it (*fd = -1; retry later), -1 with err.
 */
int cache_trylock(const struct cache *c, const char *key, int *fd, struct proto_err *err);
/* How long a caller waits before trying a busy lock again (from the loop). */
#define CACHE_LOCK_RETRY_MS 250
/* Removes the key's lock file, then lets go of it. */
void cache_unlock(const struct cache *c, const char *key, int fd);
/* At start: removes lock files no process holds (an older daemon's). */
void cache_clean_locks(const struct cache *c);

/*
 * The size cap (cache_evict.c).  Over max_bytes, removes quarantined files,
 * then the least recently used entries no process has pinned and none
 * touched in the last CACHE_EVICT_GRACE_S seconds, then the oldest index
 * files, until the directory fits.  Thread pool (it reads the directory).
 * Returns how many entries it evicted.
 */
#define CACHE_EVICT_GRACE_S  60
#define CACHE_QUARANTINE_MAX 64
unsigned cache_evict(const struct cache *c, time_t now);
/* Keeps quarantine/ to CACHE_QUARANTINE_MAX files, oldest go first. */
void cache_prune_quarantine(const struct cache *c);
/* A shared flock on the entry's .so, held while its image is loaded: the fd
 * (the caller closes it when it unloads), or -1 (no entry: not pinned). */
int cache_pin(const struct cache *c, const char *key);
/* Marks the entry used now (its .meta's mtime): LRU order. */
void cache_touch(const struct cache *c, const char *key);
/* Entries and bytes evicted by this process so far. */
void cache_evict_counts(uint64_t *entries, uint64_t *bytes);

#endif

/*
 * cache_lock.c - the per-key compile locks in objects/: a non-blocking
 * flock on <key>.lock, the file removed by its holder before it lets go,
 * and stale lock files cleaned at start.  Any thread.
 */
#include "cache_internal.h"

#include "log.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

/* The lock we hold is still the file at p (a holder that was done may
 * have removed it between our open and our flock). */
static bool still_linked(int fd, const char *p)
{
	struct stat held, now;

	return fstat(fd, &held) == 0 && stat(p, &now) == 0 && held.st_ino == now.st_ino &&
	       held.st_dev == now.st_dev;
}

/*
 * A lock file lives only while it is held: its holder removes it before
 * letting go (cache_unlock), so objects/ does not keep one per key ever
 * compiled.  Whoever locked an inode that was removed meanwhile tries again
 * on the path's new file.
 */
int cache_trylock(const struct cache *c, const char *key, int *fd, struct proto_err *err)
{
	char p[PATH_MAX];

	cache_entry_path(c, key, "lock", p, sizeof p);
	for (int tries = 0; tries < 8; tries++) {
		*fd = open(p, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
		if (*fd < 0)
			return cache_sys_fail(err, "cannot open", p);
		/* never blocks: a pool thread waiting here could wedge the whole pool */
		if (flock(*fd, LOCK_EX | LOCK_NB) == 0) {
			if (still_linked(*fd, p))
				return 0;
			close(*fd); /* removed by its last holder: the next open makes a new one */
			continue;
		}
		if (errno == EWOULDBLOCK) {
			close(*fd);
			*fd = -1;
			return 1;
		}
		cache_sys_fail(err, "cannot lock", p);
		close(*fd);
		*fd = -1;
		return -1;
	}
	*fd = -1;
	return 1; /* other daemons keep taking and dropping it: retry later */
}

void cache_unlock(const struct cache *c, const char *key, int fd)
{
	char p[PATH_MAX];

	if (fd < 0)
		return;
	cache_entry_path(c, key, "lock", p, sizeof p);
	if (still_linked(fd, p))
		unlink(p); /* while held: nobody else holds this inode now */
	flock(fd, LOCK_UN);
	close(fd);
}

void cache_clean_locks(const struct cache *c)
{
	char dir[PATH_MAX];
	DIR *d;
	struct dirent *e;
	struct proto_err err;
	size_t removed = 0;

	snprintf(dir, sizeof dir, "%s/objects", c->dir);
	d = opendir(dir);
	while (d && (e = readdir(d)) != NULL) {
		size_t n = strlen(e->d_name);
		char key[CACHE_KEY_HEX];
		int fd;
		if (n != CACHE_KEY_HEX - 1 + 5 || strcmp(e->d_name + n - 5, ".lock") != 0)
			continue;
		memcpy(key, e->d_name, CACHE_KEY_HEX - 1);
		key[CACHE_KEY_HEX - 1] = '\0';
		if (cache_trylock(c, key, &fd, &err) == 0) { /* not held: left by an older daemon */
			cache_unlock(c, key, fd);
			removed++;
		}
	}
	if (d)
		closedir(d);
	if (removed)
		log_info("cache: removed %zu lock file(s) nobody held", removed);
}

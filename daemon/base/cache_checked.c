/*
 * cache_checked.c - the register checks the compile worker passed,
 * remembered across daemons on one cache: <cache>/checked holds
 * CACHE_CHECKED_SLOTS records of a key's 64 hex digits, a key's slot
 * chosen by its first digits.  A hit lets a register skip its check job
 * (and so a worker's import of torch); a miss -- never checked, or the slot
 * since taken by another key, or a record torn by a concurrent write --
 * runs the check as before.  The whole key is compared, so a record never
 * stands for another definition; the file stays at its fixed size whatever
 * clients register.  It sits in the cache directory, which only the
 * daemon's uid writes (compile workers cannot read it).  Blocking: thread
 * pool only.
 */
#include "cache_internal.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define RECORD (CACHE_KEY_HEX - 1)

static int open_checked(const struct cache *c, int flags)
{
	char path[PATH_MAX];

	if (snprintf(path, sizeof path, "%s/checked", c->dir) >= (int)sizeof path)
		return -1;
	return open(path, flags | O_NOFOLLOW | O_CLOEXEC, 0600);
}

static off_t slot_of(const char *key)
{
	char head[5] = {0};

	memcpy(head, key, 4);
	return (off_t)(strtoul(head, NULL, 16) % CACHE_CHECKED_SLOTS) * RECORD;
}

bool cache_checked_find(const struct cache *c, const char *key)
{
	char rec[RECORD];
	int fd = open_checked(c, O_RDONLY);
	bool hit;

	if (fd < 0)
		return false;
	hit = pread(fd, rec, RECORD, slot_of(key)) == RECORD && memcmp(rec, key, RECORD) == 0;
	close(fd);
	return hit;
}

void cache_checked_add(const struct cache *c, const char *key)
{
	int fd = open_checked(c, O_WRONLY | O_CREAT);

	if (fd < 0)
		return; /* remembered or not, the next register is checked correctly */
	if (pwrite(fd, key, RECORD, slot_of(key)) != RECORD) {
		/* a partial record does not compare equal: a miss, nothing worse */
	}
	close(fd);
}

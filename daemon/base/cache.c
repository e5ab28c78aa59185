/*
 * cache.c - see cache.h.  All functions block on disk I/O and belong on the
 * thread pool (or at start-up); none keeps state beyond the directory path.
 *
 * The directory holds code the daemon dlopens, so it is trusted only when
 * the daemon's uid owns it and no one else can write to it; every file is
 * opened O_NOFOLLOW | O_NONBLOCK and must be a regular file (a FIFO or a
 * symlink planted there is refused, never waited on or followed).
 */
#include "cache.h"
#include "cache_internal.h"

#include "log.h"

#include "mpguard.h"
#include "msg.h"
#include "sha256.h"
#include "writer.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

static int mkdir_p(const char *path, mode_t mode)
{
	char tmp[PATH_MAX];

	snprintf(tmp, sizeof tmp, "%s", path);
	for (char *p = tmp + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = '\0';
		if (mkdir(tmp, 0755) != 0 && errno != EEXIST)
			return -1;
		*p = '/';
	}
	if (mkdir(tmp, mode) != 0 && errno != EEXIST)
		return -1;
	return 0;
}

/* Refuses a directory the daemon's uid does not own or others may write. */
int cache_trusted_dir(const char *path, struct proto_err *err)
{
	struct stat st;

	if (lstat(path, &st) != 0)
		return cache_sys_fail(err, "cannot stat", path);
	if (!S_ISDIR(st.st_mode))
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "%s is not a directory", path);
	if (st.st_uid != geteuid())
		return proto_fail(err, PROTO_E_INTERNAL, NULL,
		                  "%s is owned by uid %u, not the daemon's uid %u: compiled graphs "
		                  "are loaded from it as code, so it must be the daemon's own "
		                  "(chown it, or choose another --cache-dir)",
		                  path, (unsigned)st.st_uid, (unsigned)geteuid());
	if (st.st_mode & (S_IWGRP | S_IWOTH))
		return proto_fail(err, PROTO_E_INTERNAL, NULL,
		                  "%s is group- or world-writable (mode %04o): others could plant "
		                  "code the daemon loads; chmod 0700 it",
		                  path, (unsigned)(st.st_mode & 07777));
	return 0;
}

static int sub(const struct cache *c, const char *name, struct proto_err *err)
{
	char p[PATH_MAX];

	snprintf(p, sizeof p, "%s/%s", c->dir, name);
	if (mkdir(p, 0700) != 0 && errno != EEXIST)
		return cache_sys_fail(err, "cannot create", p);
	return cache_trusted_dir(p, err);
}

int cache_open_file(const char *path, struct stat *st)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);

	if (fd < 0)
		return -1;
	if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode)) {
		close(fd);
		errno = EINVAL;
		return -1;
	}
	return fd;
}

int cache_open(struct cache *c, const char *dir, struct proto_err *err)
{
	struct statvfs vfs;
	struct stat st;

	if (strlen(dir) >= sizeof c->dir - 80)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, NULL, "cache path too long: %s",
		                  dir);
	snprintf(c->dir, sizeof c->dir, "%s", dir);
	if (mkdir_p(dir, 0700) != 0)
		return cache_sys_fail(err, "cannot create cache directory", dir);
	if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
		return cache_sys_fail(err, "cache path is not a directory:", dir);
	if (cache_trusted_dir(dir, err) != 0)
		return -1;
	if (access(dir, W_OK | X_OK) != 0)
		return cache_sys_fail(err, "cache directory is not writable:", dir);
	if (statvfs(dir, &vfs) == 0 && (vfs.f_flag & ST_NOEXEC))
		return proto_fail(err, PROTO_E_INTERNAL, NULL,
		                  "cache directory %s is on a noexec mount: compiled graphs could "
		                  "not be loaded; choose another --cache-dir",
		                  dir);
	if (sub(c, "objects", err) || sub(c, "tmp", err) || sub(c, "quarantine", err) ||
	    sub(c, "index", err) || sub(c, "inductor", err))
		return -1;
	cache_clean_tmp(c);
	cache_clean_locks(c);
	return 0;
}

/* Removes path, recursing into directories (never following symlinks). */
static void remove_tree(const char *path)
{
	struct stat st;
	DIR *dir;
	struct dirent *e;

	if (lstat(path, &st) != 0)
		return;
	if (!S_ISDIR(st.st_mode)) {
		unlink(path);
		return;
	}
	dir = opendir(path);
	while (dir && (e = readdir(dir)) != NULL) {
		char child[PATH_MAX];
		size_t n = strlen(path);
		if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0 ||
		    n + 1 + strlen(e->d_name) >= sizeof child)
			continue;
		memcpy(child, path, n);
		child[n] = '/';
		strcpy(child + n + 1, e->d_name);
		remove_tree(child);
	}
	if (dir)
		closedir(dir);
	rmdir(path);
}

void cache_remove_job(const char *tmp_so)
{
	char dir[PATH_MAX];

	unlink(tmp_so);
	snprintf(dir, sizeof dir, "%s.d", tmp_so);
	remove_tree(dir);
}

/* The pid in a tmp/ name "<key16>.<pid>.<n>.so[.d]", or 0. */
static pid_t tmp_owner(const char *name)
{
	const char *dot = strchr(name, '.');
	char *end;
	long pid;

	if (dot == NULL)
		return 0;
	pid = strtol(dot + 1, &end, 10);
	return *end == '.' && pid > 0 ? (pid_t)pid : 0;
}

unsigned cache_clean_tmp(const struct cache *c)
{
	char tmp[PATH_MAX];
	DIR *dir;
	struct dirent *e;
	unsigned removed = 0;

	snprintf(tmp, sizeof tmp, "%s/tmp", c->dir);
	dir = opendir(tmp);
	while (dir && (e = readdir(dir)) != NULL) {
		char path[PATH_MAX];
		pid_t owner = tmp_owner(e->d_name);
		if (e->d_name[0] == '.')
			continue;
		/* another live daemon's compile in progress is left alone */
		if (owner != 0 && owner != getpid() && (kill(owner, 0) == 0 || errno == EPERM))
			continue;
		if (snprintf(path, sizeof path, "%s/%s", c->dir, "tmp/") < 0 ||
		    strlen(path) + strlen(e->d_name) >= sizeof path)
			continue;
		strcat(path, e->d_name);
		remove_tree(path);
		removed++;
	}
	if (dir)
		closedir(dir);
	return removed;
}

void cache_key(const char *const *parts, size_t n, char hex[CACHE_KEY_HEX])
{
	struct sha256 s;
	uint8_t d[32];

	sha256_init(&s);
	sha256_update(&s, "torchloopd-cache-v1", 20);
	for (size_t i = 0; i < n; i++)
		sha256_update(&s, parts[i], strlen(parts[i]) + 1);
	sha256_final(&s, d);
	sha256_hex(d, hex);
}

void cache_so_path(const struct cache *c, const char *key, char *out, size_t size)
{
	cache_entry_path(c, key, "so", out, size);
}

void cache_tmp_path(const struct cache *c, const char *key, char *out, size_t size)
{
	static atomic_uint counter;

	snprintf(out, size, "%s/tmp/%.16s.%ld.%u.so", c->dir, key, (long)getpid(),
	         atomic_fetch_add(&counter, 1));
}

int cache_load_link(const struct cache *c, const char *key, char *out, size_t size,
                    struct proto_err *err)
{
	char so[PATH_MAX];

	cache_so_path(c, key, so, sizeof so);
	cache_tmp_path(c, key, out, size);
	if (link(so, out) != 0)
		return cache_sys_fail(err, "cannot link for loading", so);
	return 0;
}

void cache_meta_free(struct cache_meta *meta)
{
	free(meta->y_spec);
	meta->y_spec = NULL;
}

static uint8_t *slurp(const char *path, size_t *len)
{
	struct stat st;
	int fd = cache_open_file(path, &st);
	uint8_t *buf = NULL;

	if (fd < 0)
		return NULL;
	if (st.st_size > 0 && st.st_size < (1 << 24)) {
		buf = malloc((size_t)st.st_size);
		if (buf && read(fd, buf, (size_t)st.st_size) != st.st_size) {
			free(buf);
			buf = NULL;
		}
		*len = (size_t)st.st_size;
	}
	close(fd);
	return buf;
}

/* Parses a .meta record; 0 or -1 (then the entry is corrupt). */
static int parse_meta(const uint8_t *buf, size_t len, const char *key, struct cache_meta *m)
{
	msgpack_unpacked up;
	size_t off = 0;
	const msgpack_object *o, *y;
	int64_t v;
	const char *s;
	uint32_t slen;
	int rc = -1;

	memset(m, 0, sizeof *m);
	if (mpguard_check(buf, len, NULL) != 0)
		return -1;
	msgpack_unpacked_init(&up);
	if (msgpack_unpack_next(&up, (const char *)buf, len, &off) != MSGPACK_UNPACK_SUCCESS)
		goto out;
	o = &up.data;
	y = msg_obj_field(o, "y");
	if (y == NULL || msg_get_str(o, "sha256", &s, &slen, NULL) != 0 || slen != 64)
		goto out;
	memcpy(m->sha256, s, 64);
	/* an entry renamed (or swapped) under another key is not this graph */
	if (msg_get_str(o, "key", &s, &slen, NULL) != 0 || slen != 64 || memcmp(s, key, 64) != 0)
		goto out;
	if (msg_get_i64(o, "size", &v, NULL) != 0 || v < 0)
		goto out;
	m->size = (uint64_t)v;
	if (msg_get_i64(o, "n_inputs", &v, NULL) != 0 || v < 0 || v > 65536)
		goto out;
	m->n_inputs = (uint32_t)v;
	if (msg_get_i64(o, "n_outputs", &v, NULL) != 0 || v < 0 || v > 65536)
		goto out;
	m->n_outputs = (uint32_t)v;
	if (msg_get_str(o, "strategy", &s, &slen, NULL) == 0 && slen < sizeof m->strategy)
		memcpy(m->strategy, s, slen);
	if (msg_get_str(o, "lowered", &s, &slen, NULL) == 0 && slen < sizeof m->lowered)
		memcpy(m->lowered, s, slen);
	if (msg_get_str(o, "note", &s, &slen, NULL) == 0 && slen < sizeof m->note)
		memcpy(m->note, s, slen);
	if (msg_get_i64(o, "step_ops", &v, NULL) == 0 && v > 0 && v <= UINT32_MAX)
		m->step_ops = (uint32_t)v;
	{
		const msgpack_object *cs = msg_obj_field(o, "compile_seconds");
		if (cs && cs->type == MSGPACK_OBJECT_FLOAT64)
			m->compile_seconds = cs->via.f64;
	}
	rc = 0;
out:
	msgpack_unpacked_destroy(&up);
	return rc;
}

/* The y spec is kept as raw msgpack: re-encode the object. */
static int keep_y(const uint8_t *buf, size_t len, struct cache_meta *m)
{
	msgpack_unpacked up;
	msgpack_sbuffer sb;
	msgpack_packer pk;
	size_t off = 0;
	int rc = -1;

	msgpack_unpacked_init(&up);
	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	if (msgpack_unpack_next(&up, (const char *)buf, len, &off) == MSGPACK_UNPACK_SUCCESS) {
		msgpack_pack_object(&pk, *msg_obj_field(&up.data, "y"));
		m->y_spec = (uint8_t *)sb.data;
		m->y_spec_len = sb.size;
		sb.data = NULL;
		rc = 0;
	}
	msgpack_sbuffer_destroy(&sb);
	msgpack_unpacked_destroy(&up);
	return rc;
}

/* sha256 of a regular file, never following a symlink or blocking on a FIFO. */
static int hash_regular(const char *path, char hex[CACHE_KEY_HEX], uint64_t *size)
{
	struct stat st;
	int fd = cache_open_file(path, &st), rc;

	if (fd < 0)
		return -1;
	rc = sha256_fd(fd, hex, size);
	close(fd);
	return rc;
}

int cache_lookup(const struct cache *c, const char *key, struct cache_meta *meta, int *quarantined,
                 struct proto_err *err)
{
	char so[PATH_MAX], mp[PATH_MAX], hex[CACHE_KEY_HEX];
	uint8_t *buf;
	size_t len = 0;
	uint64_t size;

	*quarantined = 0;
	cache_so_path(c, key, so, sizeof so);
	cache_entry_path(c, key, "meta", mp, sizeof mp);
	errno = 0;
	buf = slurp(mp, &len);
	if (buf == NULL) {
		if (errno == ENOENT)
			return 0; /* no committed entry (a stray .so without .meta is replaced) */
		if (errno == EINVAL || errno == ELOOP || errno == 0) {
			/* not a regular file (FIFO, symlink, directory) or empty: not ours */
			cache_quarantine(c, key, "metadata is not a regular file");
			*quarantined = 1;
			return 0;
		}
		return cache_sys_fail(err, "cannot read", mp);
	}
	if (parse_meta(buf, len, key, meta) != 0 || keep_y(buf, len, meta) != 0) {
		free(buf);
		cache_meta_free(meta);
		cache_quarantine(c, key, "unreadable metadata");
		*quarantined = 1;
		return 0;
	}
	free(buf);
	if (hash_regular(so, hex, &size) != 0 || size != meta->size ||
	    strcmp(hex, meta->sha256) != 0) {
		cache_meta_free(meta);
		cache_quarantine(c, key, "size or sha256 mismatch");
		*quarantined = 1;
		return 0;
	}
	cache_touch(c, key);
	return 1;
}

static int fsync_path(const char *path, int flags)
{
	int fd = open(path, flags | O_CLOEXEC);
	int rc;

	if (fd < 0)
		return -1;
	rc = fsync(fd);
	close(fd);
	return rc;
}

static int write_meta(const struct cache *c, const char *key, const struct cache_meta *m,
                      struct proto_err *err)
{
	char tmp[PATH_MAX], dst[PATH_MAX];
	struct writer w;
	size_t len;
	uint8_t *bytes;
	int fd, rc = -1;

	if (writer_init(&w) != 0)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
	msgpack_pack_map(&w.pk, 12);
	writer_key_u64(&w, "v", 2);
	writer_key_str(&w, "key", key);
	writer_key_str(&w, "sha256", m->sha256);
	writer_key_u64(&w, "size", m->size);
	writer_key_u64(&w, "n_inputs", m->n_inputs);
	writer_key_u64(&w, "n_outputs", m->n_outputs);
	writer_key_f64(&w, "compile_seconds", m->compile_seconds);
	writer_key_str(&w, "strategy", m->strategy);
	writer_key_str(&w, "lowered", m->lowered);
	writer_key_str(&w, "note", m->note);
	writer_key_u64(&w, "step_ops", m->step_ops);
	writer_str(&w, "y");
	writer_raw(&w, m->y_spec, m->y_spec_len);
	bytes = writer_flatten(&w, &len, PROTO_FRAME_MAX, err);
	writer_destroy(&w);
	if (bytes == NULL)
		return -1;
	cache_tmp_path(c, key, tmp, sizeof tmp);
	cache_entry_path(c, key, "meta", dst, sizeof dst);
	fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (fd < 0 || write(fd, bytes + 4, len - 4) != (ssize_t)(len - 4) || fsync(fd) != 0)
		cache_sys_fail(err, "cannot write", tmp);
	else if (rename(tmp, dst) != 0)
		cache_sys_fail(err, "cannot rename to", dst);
	else
		rc = 0;
	if (fd >= 0)
		close(fd);
	if (rc != 0)
		unlink(tmp);
	free(bytes);
	return rc;
}

/* Copies in to out while hashing what it copies, at most CACHE_ARTIFACT_MAX bytes. */
static int copy_hashed(int in, int out, struct cache_meta *meta)
{
	static _Thread_local uint8_t buf[1 << 16];
	struct sha256 s;
	uint8_t digest[32];
	ssize_t n;

	sha256_init(&s);
	while ((n = read(in, buf, sizeof buf)) > 0) {
		if (s.len + (uint64_t)n > CACHE_ARTIFACT_MAX) {
			errno = EFBIG;
			return -1;
		}
		sha256_update(&s, buf, (size_t)n);
		if (write(out, buf, (size_t)n) != n)
			return -1;
	}
	if (n < 0 || fsync(out) != 0 || fchmod(out, 0500) != 0)
		return -1;
	meta->size = s.len;
	sha256_final(&s, digest);
	sha256_hex(digest, meta->sha256);
	return 0;
}

/*
 * The artifact a compile left at src (a regular file, not followed if a
 * symlink) copied into a fresh file of the daemon's own under tmp/ (dst),
 * hashed as it is copied: what is committed is what was hashed, and no
 * process that could write src can write dst.
 */
static int copy_in(const struct cache *c, const char *key, const char *src, char *dst, size_t size,
                   struct cache_meta *meta, struct proto_err *err)
{
	struct stat st;
	int in = cache_open_file(src, &st), out = -1, rc = -1;

	if (in < 0)
		return cache_sys_fail(err, "cannot open the compiled artifact", src);
	cache_tmp_path(c, key, dst, size);
	out = open(dst, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (out < 0 || copy_hashed(in, out, meta) != 0)
		cache_sys_fail(err, "cannot copy the compiled artifact to", dst);
	else
		rc = 0;
	close(in);
	if (out >= 0)
		close(out);
	if (rc != 0)
		unlink(dst);
	return rc;
}

int cache_commit(const struct cache *c, const char *key, const char *tmp_so,
                 struct cache_meta *meta, struct proto_err *err)
{
	char so[PATH_MAX], objects[PATH_MAX], copy[PATH_MAX];

	if (copy_in(c, key, tmp_so, copy, sizeof copy, meta, err) != 0)
		return -1;
	cache_so_path(c, key, so, sizeof so);
	if (rename(copy, so) != 0) {
		cache_sys_fail(err, "cannot rename to", so);
		unlink(copy);
		return -1;
	}
	if (write_meta(c, key, meta, err) != 0)
		return -1;
	snprintf(objects, sizeof objects, "%s/objects", c->dir);
	fsync_path(objects, O_RDONLY | O_DIRECTORY);
	cache_evict(c, time(NULL));
	return 0;
}

void cache_quarantine(const struct cache *c, const char *key, const char *why)
{
	static const char *const exts[] = {"meta", "so"};
	static atomic_uint seq; /* one key quarantined twice in a second keeps both */
	char src[PATH_MAX], dst[PATH_MAX];
	long stamp = (long)time(NULL);
	unsigned n = atomic_fetch_add(&seq, 1);

	for (size_t i = 0; i < 2; i++) {
		cache_entry_path(c, key, exts[i], src, sizeof src);
		snprintf(dst, sizeof dst, "%s/quarantine/%s.%ld.%ld.%u.%s", c->dir, key, stamp,
		         (long)getpid(), n, exts[i]);
		if (rename(src, dst) != 0 && errno != ENOENT)
			unlink(src);
	}
	fprintf(stderr, "torchloopd: warn cache: quarantined %.16s: %s\n", key, why);
	cache_prune_quarantine(c);
}

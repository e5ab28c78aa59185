/*
 * shmalloc.h - the client side of a shared-memory region: the memfd
 * mapping and a first-fit allocator over it (64-byte aligned blocks, free
 * neighbours merged).  Staged request tensors, the output area of a scan
 * and the caller's own tl_shm_alloc blocks all come from here.  Reference
 * counted: the client and every reply whose tensors live in the region hold
 * one, so a reply stays readable after tl_close.  Not thread-safe (one
 * client, one thread).
 */
#ifndef TORCHLOOP_SHMALLOC_H
#define TORCHLOOP_SHMALLOC_H

#include <stddef.h>
#include <stdint.h>

struct shm_extent {
	uint64_t off, len;
};

struct shm_region {
	uint8_t *base;
	uint64_t size;
	int fd; /* closed once sent to the daemon */
	int refs;
	struct shm_extent *free_list; /* sorted by offset, never adjacent */
	size_t n_free, cap_free;
	struct shm_extent *used;
	size_t n_used, cap_used;
};

/* Creates a sealed (F_SEAL_SHRINK | F_SEAL_SEAL) memfd of size bytes (rounded
 * up to a page) and maps it.  Returns NULL with errno set. */
struct shm_region *shm_region_new(uint64_t size);
void shm_region_ref(struct shm_region *r);
void shm_region_unref(struct shm_region *r);

/* A block of at least len bytes; returns its offset or UINT64_MAX when full. */
uint64_t shm_region_alloc(struct shm_region *r, uint64_t len);
/* Frees the block at off (as returned by shm_region_alloc); -1 when unknown. */
int shm_region_free(struct shm_region *r, uint64_t off);
/* 1 when [p, p + len) lies inside the region (*off set), else 0. */
int shm_region_contains(const struct shm_region *r, const void *p, uint64_t len, uint64_t *off);

#endif

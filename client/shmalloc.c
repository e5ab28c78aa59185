/* shmalloc.c - see shmalloc.h. */
#include "shmalloc.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define ALIGN 64u

static uint64_t align_up(uint64_t v, uint64_t a)
{
	return (v + a - 1) / a * a;
}

static int grow(void **arr, size_t *cap, size_t need, size_t item)
{
	void *p;
	size_t n = *cap ? *cap * 2 : 16;

	if (need <= *cap)
		return 0;
	while (n < need)
		n *= 2;
	p = realloc(*arr, n * item);
	if (p == NULL)
		return -1;
	*arr = p;
	*cap = n;
	return 0;
}

struct shm_region *shm_region_new(uint64_t size)
{
	struct shm_region *r = calloc(1, sizeof *r);
	long page = sysconf(_SC_PAGESIZE);
	int e;

	if (r == NULL)
		return NULL;
	size = align_up(size ? size : 1, (uint64_t)(page > 0 ? page : 4096));
	r->fd = memfd_create("torchloop", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (r->fd < 0)
		goto fail;
	if (ftruncate(r->fd, (off_t)size) != 0 ||
	    fcntl(r->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) != 0)
		goto fail;
	r->base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0);
	if (r->base == MAP_FAILED) {
		r->base = NULL;
		goto fail;
	}
	r->size = size;
	r->refs = 1;
	if (grow((void **)&r->free_list, &r->cap_free, 1, sizeof *r->free_list) != 0)
		goto fail;
	r->free_list[0] = (struct shm_extent){0, size};
	r->n_free = 1;
	return r;
fail:
	e = errno;
	if (r->base)
		munmap(r->base, size);
	if (r->fd >= 0)
		close(r->fd);
	free(r->free_list);
	free(r);
	errno = e;
	return NULL;
}

void shm_region_ref(struct shm_region *r)
{
	r->refs++;
}

void shm_region_unref(struct shm_region *r)
{
	if (r == NULL || --r->refs > 0)
		return;
	munmap(r->base, r->size);
	if (r->fd >= 0)
		close(r->fd);
	free(r->free_list);
	free(r->used);
	free(r);
}

uint64_t shm_region_alloc(struct shm_region *r, uint64_t len)
{
	len = align_up(len ? len : 1, ALIGN);
	for (size_t i = 0; i < r->n_free; i++) {
		struct shm_extent *f = &r->free_list[i];
		uint64_t off = f->off;

		if (f->len < len)
			continue;
		if (grow((void **)&r->used, &r->cap_used, r->n_used + 1, sizeof *r->used) != 0)
			return UINT64_MAX;
		f->off += len;
		f->len -= len;
		if (f->len == 0) {
			memmove(f, f + 1, (r->n_free - i - 1) * sizeof *f);
			r->n_free--;
		}
		r->used[r->n_used++] = (struct shm_extent){off, len};
		return off;
	}
	return UINT64_MAX;
}

int shm_region_free(struct shm_region *r, uint64_t off)
{
	struct shm_extent blk;
	size_t i, at;

	for (i = 0; i < r->n_used && r->used[i].off != off; i++)
		;
	if (i == r->n_used)
		return -1;
	blk = r->used[i];
	r->used[i] = r->used[--r->n_used];
	for (at = 0; at < r->n_free && r->free_list[at].off < blk.off; at++)
		;
	/* merge with the free block before and/or after */
	if (at > 0 && r->free_list[at - 1].off + r->free_list[at - 1].len == blk.off) {
		r->free_list[at - 1].len += blk.len;
		if (at < r->n_free && blk.off + blk.len == r->free_list[at].off) {
			r->free_list[at - 1].len += r->free_list[at].len;
			memmove(&r->free_list[at], &r->free_list[at + 1],
			        (r->n_free - at - 1) * sizeof *r->free_list);
			r->n_free--;
		}
		return 0;
	}
	if (at < r->n_free && blk.off + blk.len == r->free_list[at].off) {
		r->free_list[at].off = blk.off;
		r->free_list[at].len += blk.len;
		return 0;
	}
	if (grow((void **)&r->free_list, &r->cap_free, r->n_free + 1, sizeof *r->free_list) != 0)
		return 0; /* the block is lost to the allocator, not to memory safety */
	memmove(&r->free_list[at + 1], &r->free_list[at], (r->n_free - at) * sizeof *r->free_list);
	r->free_list[at] = blk;
	r->n_free++;
	return 0;
}

int shm_region_contains(const struct shm_region *r, const void *p, uint64_t len, uint64_t *off)
{
	const uint8_t *q = p;

	if (r == NULL || q < r->base || q >= r->base + r->size ||
	    len > r->size - (uint64_t)(q - r->base))
		return 0;
	*off = (uint64_t)(q - r->base);
	return 1;
}

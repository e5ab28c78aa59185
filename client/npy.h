/*
 * npy.h - NumPy .npy files (format 1.0-3.0) for the CLI and the tests:
 * float32/float64, little-endian, C order.  Fortran order, other dtypes,
 * big-endian data and damaged headers are refused with a message.
 */
#ifndef TORCHLOOP_NPY_H
#define TORCHLOOP_NPY_H

#include "torchloop.h"

#include <stddef.h>
#include <stdint.h>

struct npy {
	enum tl_dtype dtype;
	int ndim;
	int64_t shape[8];
	void *data; /* owned, 64-byte aligned */
	size_t nbytes;
};

int npy_read(const char *path, struct npy *out, char *msg, size_t msg_size);
int npy_write(const char *path, enum tl_dtype dtype, int ndim, const int64_t *shape,
              const void *data, char *msg, size_t msg_size);
void npy_free(struct npy *n);

#endif

/*
 * npy.c - see npy.h.  The header is a Python dict literal with three known
 * keys; it is parsed strictly rather than evaluated.
 */
#include "npy.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int bad(char *msg, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static int bad(char *msg, size_t size, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, size, fmt, ap);
	va_end(ap);
	return -1;
}

static const char *after_key(const char *h, const char *key)
{
	const char *p = strstr(h, key);

	if (p == NULL)
		return NULL;
	p += strlen(key);
	while (*p == ' ')
		p++;
	if (*p != ':')
		return NULL;
	p++;
	while (*p == ' ')
		p++;
	return p;
}

static int parse_descr(const char *h, struct npy *n, const char *path, char *msg, size_t size)
{
	const char *p = after_key(h, "'descr'");
	char d[16];
	size_t i = 0;

	if (p == NULL || *p != '\'')
		return bad(msg, size, "%s: damaged .npy header (no descr)", path);
	for (p++; *p && *p != '\'' && i < sizeof d - 1; p++)
		d[i++] = *p;
	d[i] = '\0';
	if (strcmp(d, "<f4") == 0)
		n->dtype = TL_FLOAT32;
	else if (strcmp(d, "<f8") == 0)
		n->dtype = TL_FLOAT64;
	else if (strcmp(d, ">f4") == 0 || strcmp(d, ">f8") == 0)
		return bad(msg, size, "%s: big-endian data (%s); save it little-endian", path, d);
	else
		return bad(msg, size, "%s: dtype %s is not float32 or float64", path, d);
	return 0;
}

static int parse_shape(const char *h, struct npy *n, const char *path, char *msg, size_t size)
{
	const char *p = after_key(h, "'shape'");

	if (p == NULL || *p != '(')
		return bad(msg, size, "%s: damaged .npy header (no shape)", path);
	p++;
	n->ndim = 0;
	for (;;) {
		char *end;
		long long v;
		while (*p == ' ' || *p == ',')
			p++;
		if (*p == ')')
			break;
		if (!isdigit((unsigned char)*p) || n->ndim == 8)
			return bad(msg, size, "%s: damaged or unsupported shape in the .npy header",
			           path);
		errno = 0;
		v = strtoll(p, &end, 10);
		if (errno)
			return bad(msg, size, "%s: shape out of range", path);
		n->shape[n->ndim++] = v;
		p = end;
		if (*p == 'L')
			p++;
	}
	return 0;
}

static int parse_header(const char *h, struct npy *n, const char *path, char *msg, size_t size)
{
	const char *f = after_key(h, "'fortran_order'");

	if (h[0] != '{' || strchr(h, '}') == NULL)
		return bad(msg, size, "%s: damaged .npy header", path);
	if (f == NULL)
		return bad(msg, size, "%s: damaged .npy header (no fortran_order)", path);
	if (strncmp(f, "True", 4) == 0)
		return bad(msg, size,
		           "%s: Fortran-order arrays are not supported; save with C order "
		           "(np.ascontiguousarray)",
		           path);
	if (strncmp(f, "False", 5) != 0)
		return bad(msg, size, "%s: damaged .npy header (fortran_order)", path);
	return parse_descr(h, n, path, msg, size) || parse_shape(h, n, path, msg, size) ? -1 : 0;
}

static int read_data(FILE *fp, struct npy *n, const char *path, char *msg, size_t size)
{
	uint64_t count = 1;
	long here = ftell(fp), end;

	for (int i = 0; i < n->ndim; i++) {
		if (n->shape[i] < 0 ||
		    (n->shape[i] && count > UINT64_MAX / 8 / (uint64_t)n->shape[i]))
			return bad(msg, size, "%s: shape too large", path);
		count *= (uint64_t)n->shape[i];
	}
	n->nbytes = count * (n->dtype == TL_FLOAT32 ? 4 : 8);
	fseek(fp, 0, SEEK_END);
	end = ftell(fp);
	fseek(fp, here, SEEK_SET);
	if (end - here != (long)n->nbytes)
		return bad(msg, size, "%s: %ld data bytes, the header's shape needs %zu", path,
		           end - here, n->nbytes);
	n->data =
	    aligned_alloc(64, (n->nbytes + 63) & ~(size_t)63 ? (n->nbytes + 63) & ~(size_t)63 : 64);
	if (n->data == NULL)
		return bad(msg, size, "%s: out of memory", path);
	if (n->nbytes && fread(n->data, 1, n->nbytes, fp) != n->nbytes)
		return bad(msg, size, "%s: short read", path);
	return 0;
}

int npy_read(const char *path, struct npy *n, char *msg, size_t size)
{
	unsigned char pre[12];
	uint32_t hlen;
	char *h;
	FILE *fp = fopen(path, "rb");
	int rc = -1;

	memset(n, 0, sizeof *n);
	if (fp == NULL)
		return bad(msg, size, "%s: %s", path, strerror(errno));
	if (fread(pre, 1, 10, fp) != 10 || memcmp(pre, "\x93NUMPY", 6) != 0 || pre[6] < 1 ||
	    pre[6] > 3) {
		fclose(fp);
		return bad(msg, size, "%s: not a .npy file (bad magic or version)", path);
	}
	hlen = pre[8] | (uint32_t)pre[9] << 8;
	if (pre[6] >= 2) {
		if (fread(pre + 10, 1, 2, fp) != 2) {
			fclose(fp);
			return bad(msg, size, "%s: truncated header", path);
		}
		hlen |= (uint32_t)pre[10] << 16 | (uint32_t)pre[11] << 24;
	}
	if (hlen > 1 << 20 || (h = calloc(1, hlen + 1)) == NULL) {
		fclose(fp);
		return bad(msg, size, "%s: damaged .npy header (length %u)", path, hlen);
	}
	if (fread(h, 1, hlen, fp) != hlen)
		bad(msg, size, "%s: truncated header", path);
	else if (parse_header(h, n, path, msg, size) == 0 && read_data(fp, n, path, msg, size) == 0)
		rc = 0;
	free(h);
	fclose(fp);
	if (rc != 0)
		npy_free(n);
	return rc;
}

int npy_write(const char *path, enum tl_dtype dtype, int ndim, const int64_t *shape,
              const void *data, char *msg, size_t size)
{
	char h[256];
	int len = snprintf(h, sizeof h, "{'descr': '%s', 'fortran_order': False, 'shape': (",
	                   dtype == TL_FLOAT32 ? "<f4" : "<f8");
	uint64_t count = 1;
	FILE *fp;

	for (int i = 0; i < ndim; i++) {
		len += snprintf(h + len, sizeof h - (size_t)len, "%lld,%s", (long long)shape[i],
		                i + 1 < ndim ? " " : "");
		count *= (uint64_t)shape[i];
	}
	len += snprintf(h + len, sizeof h - (size_t)len, "), }");
	while ((10 + len + 1) % 64 != 0)
		h[len++] = ' ';
	h[len++] = '\n';
	fp = fopen(path, "wb");
	if (fp == NULL)
		return bad(msg, size, "%s: %s", path, strerror(errno));
	fwrite("\x93NUMPY\x01\x00", 1, 8, fp);
	fputc(len & 0xff, fp);
	fputc((len >> 8) & 0xff, fp);
	fwrite(h, 1, (size_t)len, fp);
	count *= dtype == TL_FLOAT32 ? 4 : 8;
	if ((count && fwrite(data, 1, count, fp) != count) || fclose(fp) != 0)
		return bad(msg, size, "%s: write failed", path);
	return 0;
}

void npy_free(struct npy *n)
{
	free(n->data);
	n->data = NULL;
}

/*
 * _fast_dec.c - a reply decoded in C (_fast.h; the format is _wire.py's).
 */
#include "_fast.h"

PyObject *TUPLE_MARK;

/* ---- decoding --------------------------------------------------------------- */

struct rd {
	PyObject *body; /* the bytearray: tensors view it */
	PyObject *area; /* the request's output area, or NULL */
	const unsigned char *p;
	size_t len, pos;
};

#define NEED(r, n)                                                                                 \
	do {                                                                                       \
		if ((r)->len - (r)->pos < (size_t)(n))                                             \
			return NULL;                                                               \
	} while (0)

uint64_t be(const unsigned char *p, int n)
{
	uint64_t v = 0;

	for (int i = 0; i < n; i++)
		v = v << 8 | p[i];
	return v;
}

/* Reads a w-byte big-endian length into *n; 0, or -1 when the bytes run out. */
static int take_len(struct rd *r, int w, size_t *n)
{
	if (r->len - r->pos < (size_t)w)
		return -1;
	*n = (size_t)be(r->p + r->pos, w);
	r->pos += (size_t)w;
	return 0;
}

static PyObject *dec_value(struct rd *r, int depth);

static PyObject *dec_tensor(struct rd *r, size_t start, size_t n)
{
	const unsigned char *h = r->p + start;
	PyObject *dtype, *npdtype, *shape, *out = NULL;
	size_t ndim, pad, itemsize, data;
	uint64_t numel = 1;

	if (n < 4)
		return NULL;
	if (h[0] == 1) {
		dtype = G.f32, npdtype = G.np_f32, itemsize = 4;
	} else if (h[0] == 2) {
		dtype = G.f64, npdtype = G.np_f64, itemsize = 8;
	} else {
		return NULL;
	}
	ndim = h[1], pad = h[2];
	if (ndim > MAX_DIMS || 4 + 8 * ndim + pad > n)
		return NULL;
	shape = PyTuple_New((Py_ssize_t)ndim);
	if (shape == NULL)
		return NULL;
	for (size_t i = 0; i < ndim; i++) {
		int64_t d;
		memcpy(&d, h + 4 + 8 * i, 8);
		if (d < 0 || (d && numel > UINT64_MAX / (uint64_t)d)) {
			Py_DECREF(shape);
			return NULL;
		}
		numel *= (uint64_t)d;
		PyObject *di = PyLong_FromLongLong(d);
		if (di == NULL) {
			Py_DECREF(shape);
			return NULL;
		}
		PyTuple_SET_ITEM(shape, (Py_ssize_t)i, di);
	}
	data = start + 4 + 8 * ndim + pad;
	if (numel > (uint64_t)(start + n - data) / itemsize) {
		Py_DECREF(shape);
		return NULL;
	}
	if (numel == 0) {
		PyObject *a = PyTuple_Pack(1, shape), *kw = a ? PyDict_New() : NULL;
		if (kw && PyDict_SetItem(kw, G.k_dtype, dtype) == 0)
			out = PyObject_Call(G.empty, a, kw);
		Py_XDECREF(kw);
		Py_XDECREF(a);
	} else {
		PyObject *off = PyLong_FromSize_t(data);
		PyObject *arr = off ? PyObject_CallFunctionObjArgs(G.ndarray, shape, npdtype,
		                                                   r->body, off, NULL)
		                    : NULL;
		if (arr != NULL)
			out = PyObject_CallOneArg(G.from_numpy, arr);
		Py_XDECREF(arr);
		Py_XDECREF(off);
	}
	Py_DECREF(shape);
	return out;
}

/* A shared-memory reference (ext 3, _wire.py's layout) as a view of the
 * output area, made by area.tensor, which checks the bounds. */
static PyObject *dec_shm(struct rd *r, size_t start, size_t n)
{
	const unsigned char *h = r->p + start;
	uint64_t ref[2], numel = 1;
	size_t ndim, itemsize;
	PyObject *shape, *out = NULL;

	if (r->area == NULL || n < 24)
		return NULL;
	itemsize = h[0] == 1 ? 4 : h[0] == 2 ? 8 : 0;
	ndim = h[1];
	if (itemsize == 0 || ndim > MAX_DIMS || n != 24 + 8 * ndim)
		return NULL;
	memcpy(ref, h + 8, sizeof ref);
	if ((shape = PyTuple_New((Py_ssize_t)ndim)) == NULL)
		return NULL;
	for (size_t i = 0; i < ndim; i++) {
		int64_t d;
		PyObject *di;
		memcpy(&d, h + 24 + 8 * i, 8);
		if (d < 0 || (d && numel > UINT64_MAX / (uint64_t)d) ||
		    (di = PyLong_FromLongLong(d)) == NULL)
			goto out;
		numel *= (uint64_t)d;
		PyTuple_SET_ITEM(shape, (Py_ssize_t)i, di);
	}
	if (numel > UINT64_MAX / itemsize || numel * itemsize != ref[1])
		goto out; /* _wire.py says what is wrong */
	out = PyObject_CallMethod(r->area, "tensor", "KOOK", (unsigned long long)ref[0],
	                          itemsize == 4 ? G.f32 : G.f64, shape, (unsigned long long)ref[1]);
out:
	Py_DECREF(shape);
	return out;
}

static PyObject *dec_ext(struct rd *r, size_t n)
{
	NEED(r, 1 + n);
	int code = (signed char)r->p[r->pos];
	size_t start = r->pos + 1;

	r->pos = start + n;
	if (code == EXT_TUPLE) {
		Py_INCREF(TUPLE_MARK);
		return TUPLE_MARK;
	}
	if (code == EXT_TENSOR)
		return dec_tensor(r, start, n);
	if (code == EXT_SHM)
		return dec_shm(r, start, n);
	return NULL; /* unknown types: _wire.py */
}

static PyObject *dec_array(struct rd *r, size_t n, int depth)
{
	if (n > r->len - r->pos) /* each item takes a byte at least */
		return NULL;
	PyObject *list = PyList_New((Py_ssize_t)n);
	if (list == NULL)
		return NULL;
	for (size_t i = 0; i < n; i++) {
		PyObject *v = dec_value(r, depth + 1);
		if (v == NULL) {
			Py_DECREF(list);
			return NULL;
		}
		PyList_SET_ITEM(list, (Py_ssize_t)i, v);
	}
	if (n && PyList_GET_ITEM(list, 0) == TUPLE_MARK) {
		PyObject *t = PyList_GetSlice(list, 1, (Py_ssize_t)n);
		PyObject *tup = t ? PyList_AsTuple(t) : NULL;
		Py_XDECREF(t);
		Py_DECREF(list);
		return tup;
	}
	for (size_t i = 0; i < n; i++) /* a marker anywhere else is not msgpack we know */
		if (PyList_GET_ITEM(list, (Py_ssize_t)i) == TUPLE_MARK) {
			Py_DECREF(list);
			return NULL;
		}
	return list;
}

static PyObject *dec_map(struct rd *r, size_t n, int depth)
{
	if (n > (r->len - r->pos) / 2)
		return NULL;
	PyObject *d = PyDict_New();
	if (d == NULL)
		return NULL;
	for (size_t i = 0; i < n; i++) {
		PyObject *k = dec_value(r, depth + 1), *v = k ? dec_value(r, depth + 1) : NULL;
		int bad =
		    v == NULL || k == TUPLE_MARK || v == TUPLE_MARK || PyDict_SetItem(d, k, v) != 0;
		Py_XDECREF(k);
		Py_XDECREF(v);
		if (bad) {
			Py_DECREF(d);
			return NULL;
		}
	}
	return d;
}

static PyObject *dec_str(struct rd *r, size_t n)
{
	NEED(r, n);
	PyObject *s = PyUnicode_DecodeUTF8((const char *)r->p + r->pos, (Py_ssize_t)n, NULL);
	r->pos += n;
	return s;
}

/* float 32/64, uint 8..64, int 8..64 (0xca..0xd3). */
static PyObject *dec_number(struct rd *r, unsigned char b)
{
	static const int fixed[] = {4, 8, 1, 2, 4, 8, 1, 2, 4, 8};
	int w = fixed[b - 0xCA];

	NEED(r, w);
	uint64_t u = be(r->p + r->pos, w);
	r->pos += (size_t)w;
	if (b == 0xCA) {
		uint32_t u32 = (uint32_t)u;
		float f;
		memcpy(&f, &u32, sizeof f);
		return PyFloat_FromDouble(f);
	}
	if (b == 0xCB) {
		double d;
		memcpy(&d, &u, sizeof d);
		return PyFloat_FromDouble(d);
	}
	if (b <= 0xCF)
		return PyLong_FromUnsignedLongLong(u);
	int shift = 64 - 8 * w; /* sign-extend */
	return PyLong_FromLongLong((int64_t)(u << shift) >> shift);
}

/* bin, ext, str, array and map with a length after the type byte (0xc4..0xdf
 * but the numbers). */
static PyObject *dec_sized(struct rd *r, unsigned char b, int depth)
{
	size_t n;

	if (b >= 0xD4 && b <= 0xD8)
		return dec_ext(r, (size_t)1 << (b - 0xD4)); /* fixext */
	if (take_len(r,
	             b <= 0xC6                  ? 1 << (b - 0xC4)
	             : b <= 0xC9                ? 1 << (b - 0xC7)
	             : b <= 0xDB                ? 1 << (b - 0xD9)
	             : (b == 0xDC || b == 0xDE) ? 2
	                                        : 4,
	             &n) != 0)
		return NULL;
	if (b <= 0xC6) {
		NEED(r, n);
		PyObject *o = PyBytes_FromStringAndSize((const char *)r->p + r->pos, (Py_ssize_t)n);
		r->pos += n;
		return o;
	}
	if (b <= 0xC9)
		return dec_ext(r, n);
	if (b <= 0xDB)
		return dec_str(r, n);
	return b <= 0xDD ? dec_array(r, n, depth) : dec_map(r, n, depth);
}

static PyObject *dec_value(struct rd *r, int depth)
{
	unsigned char b;

	if (depth > MAX_DEPTH)
		return NULL;
	NEED(r, 1);
	b = r->p[r->pos++];
	if (b <= 0x7F)
		return PyLong_FromLong(b);
	if (b <= 0x8F)
		return dec_map(r, b & 0x0F, depth);
	if (b <= 0x9F)
		return dec_array(r, b & 0x0F, depth);
	if (b <= 0xBF)
		return dec_str(r, b & 0x1F);
	if (b >= 0xE0)
		return PyLong_FromLong((long)b - 0x100);
	if (b == 0xC0)
		Py_RETURN_NONE;
	if (b == 0xC2)
		Py_RETURN_FALSE;
	if (b == 0xC3)
		Py_RETURN_TRUE;
	if (b >= 0xCA && b <= 0xD3)
		return dec_number(r, b);
	if (b >= 0xC4)
		return dec_sized(r, b, depth);
	return NULL; /* 0xc1 */
}

/* The value of a whole reply body (a bytearray); NULL with no error set when
 * _wire.py must parse it (and say what is wrong), NULL with an error set
 * for KeyboardInterrupt and the like. */
PyObject *decode_body(PyObject *body, PyObject *area)
{
	struct rd r;
	PyObject *v;

	r.body = body;
	r.area = area;
	r.p = (const unsigned char *)PyByteArray_AS_STRING(body);
	r.len = (size_t)PyByteArray_GET_SIZE(body);
	r.pos = 0;
	v = dec_value(&r, 0);
	if (v != NULL && (r.pos != r.len || v == TUPLE_MARK)) {
		Py_DECREF(v);
		v = NULL;
	}
	if (v == NULL && PyErr_Occurred()) {
		if (!PyErr_ExceptionMatches(PyExc_Exception))
			return NULL;
		PyErr_Clear();
	}
	return v;
}

PyObject *fast_decode(PyObject *self, PyObject *body)
{
	PyObject *v;

	(void)self;
	if (!PyByteArray_CheckExact(body))
		return PyErr_Format(PyExc_TypeError, "decode takes a bytearray");
	if (!G.ready)
		return PyErr_Format(PyExc_RuntimeError, "torchloop._fast.setup was not called");
	v = decode_body(body, NULL);
	if (v == NULL && !PyErr_Occurred())
		Py_RETURN_NONE;
	return v;
}

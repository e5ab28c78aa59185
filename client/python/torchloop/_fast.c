/*
 * _fast.c - the torchloop Python client's codec in C (optional).
 *
 * The wire format is _wire.py's (docs/protocol.md): a frame is a 4-byte
 * big-endian length and one msgpack map; tensors are ext32 type 1 with their
 * data 64-byte aligned from the body's start; tuples are arrays led by an
 * empty ext type 2.  _wire.py is the reference: this module does the common
 * case faster and hands everything else back to it by returning None (a
 * large tensor, a shared-memory reference, a type it does not know, bytes it
 * cannot parse), so every error message stays _wire.py's.
 *
 *   encode(id, op, fields, limit) -> bytes | None
 *       the whole frame of the request {"id": id, "op": op, **fields}; None
 *       when a tensor has more than `limit` bytes or anything is unusual.
 *   decode(body) -> object | None
 *       a reply body; tensors view body's bytes (numpy over the bytearray,
 *       then torch.from_numpy, as _wire._leaf does).
 *   setup(...) is called once by _wire.py with the torch and numpy objects.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define ALIGN      64
#define FRAME_MAX  ((size_t)1 << 30)
#define MAX_DEPTH  64
#define MAX_DIMS   32
#define EXT_TENSOR 1
#define EXT_TUPLE  2

static struct {
	PyObject *tensor_type, *f32, *f64, *strided;              /* torch */
	PyObject *from_numpy, *empty, *ndarray, *np_f32, *np_f64; /* torch, numpy */
	PyObject *s_dtype, *s_is_cpu, *s_layout, *s_requires_grad, *s_shape;
	PyObject *s_is_contiguous, *s_data_ptr, *s_detach, *s_contiguous;
	PyObject *s_id, *s_op, *k_dtype;
	int ready;
} G;

/* ---- encoding --------------------------------------------------------------- */

struct buf {
	char *p;
	size_t len, cap;
	Py_ssize_t limit; /* largest tensor to copy in */
};

static int grow(struct buf *b, size_t n)
{
	if (b->len + n <= b->cap)
		return 0;
	size_t cap = b->cap ? b->cap : 512;
	while (cap < b->len + n)
		cap *= 2;
	char *p = PyMem_Realloc(b->p, cap);
	if (p == NULL)
		return -1;
	b->p = p;
	b->cap = cap;
	return 0;
}

static int put(struct buf *b, const void *data, size_t n)
{
	if (grow(b, n) != 0)
		return -1;
	memcpy(b->p + b->len, data, n);
	b->len += n;
	return 0;
}

static int put_be(struct buf *b, unsigned char marker, uint64_t v, int bytes)
{
	unsigned char tmp[9];

	tmp[0] = marker;
	for (int i = 0; i < bytes; i++)
		tmp[1 + i] = (unsigned char)(v >> (8 * (bytes - 1 - i)));
	return put(b, tmp, 1 + (size_t)bytes);
}

static int put_header(struct buf *b, unsigned fix, unsigned char marker32, Py_ssize_t n)
{
	unsigned char c = (unsigned char)(fix | (unsigned)n);

	if (n < 16)
		return put(b, &c, 1);
	return put_be(b, marker32, (uint64_t)n, 4);
}

static int put_str(struct buf *b, PyObject *s)
{
	Py_ssize_t n;
	const char *u = PyUnicode_AsUTF8AndSize(s, &n);

	if (u == NULL)
		return -1;
	if (n < 32) {
		unsigned char c = (unsigned char)(0xA0 | n);
		if (put(b, &c, 1) != 0)
			return -1;
	} else if (n <= 0xFFFFFFFF) {
		if (put_be(b, 0xDB, (uint64_t)n, 4) != 0)
			return -1;
	} else {
		return 1;
	}
	return put(b, u, (size_t)n);
}

static int put_int(struct buf *b, PyObject *v)
{
	int overflow;
	long long x = PyLong_AsLongLongAndOverflow(v, &overflow);

	if (overflow != 0 || (x == -1 && PyErr_Occurred())) {
		PyErr_Clear();
		return 1; /* past int64 (or an error): _wire.py's to handle */
	}
	if (x >= 0 && x < 128) {
		unsigned char c = (unsigned char)x;
		return put(b, &c, 1);
	}
	if (x >= 0 && x < (1LL << 32))
		return put_be(b, 0xCE, (uint64_t)x, 4);
	if (x >= 0)
		return put_be(b, 0xCF, (uint64_t)x, 8);
	return put_be(b, 0xD3, (uint64_t)x, 8);
}

/* 1 (and nothing written that matters: the frame is dropped) when _wire.py
 * must take over; -1 with a Python error set; 0 when encoded. */
static int enc_value(struct buf *b, PyObject *v, int depth);

static int attr_true(PyObject *o, PyObject *name)
{
	PyObject *r = PyObject_GetAttr(o, name);
	int t;

	if (r == NULL)
		return -1;
	t = PyObject_IsTrue(r);
	Py_DECREF(r);
	return t;
}

static int enc_tensor(struct buf *b, PyObject *t)
{
	PyObject *dtype = NULL, *layout = NULL, *shape = NULL, *ptr = NULL, *own = NULL;
	int rc = 1, code, t_ok;
	Py_ssize_t ndim, itemsize;
	int64_t dims[MAX_DIMS];
	uint64_t numel = 1;

	dtype = PyObject_GetAttr(t, G.s_dtype);
	if (dtype == NULL)
		goto fail;
	if (dtype == G.f32) {
		code = 1;
		itemsize = 4;
	} else if (dtype == G.f64) {
		code = 2;
		itemsize = 8;
	} else {
		goto out; /* _wire.py says which dtype */
	}
	if ((t_ok = attr_true(t, G.s_is_cpu)) != 1)
		goto check;
	layout = PyObject_GetAttr(t, G.s_layout);
	if (layout == NULL)
		goto fail;
	if (layout != G.strided)
		goto out;
	if ((t_ok = attr_true(t, G.s_requires_grad)) < 0)
		goto fail;
	if (t_ok) {
		own = PyObject_CallMethodNoArgs(t, G.s_detach);
		if (own == NULL)
			goto fail;
		t = own;
	}
	PyObject *c = PyObject_CallMethodNoArgs(t, G.s_is_contiguous);
	if (c == NULL)
		goto fail;
	t_ok = PyObject_IsTrue(c);
	Py_DECREF(c);
	if (t_ok < 0)
		goto fail;
	if (!t_ok) {
		PyObject *cont = PyObject_CallMethodNoArgs(t, G.s_contiguous);
		if (cont == NULL)
			goto fail;
		Py_XDECREF(own);
		own = t = cont;
	}
	shape = PyObject_GetAttr(t, G.s_shape);
	if (shape == NULL)
		goto fail;
	if (!PyTuple_Check(shape) || (ndim = PyTuple_GET_SIZE(shape)) > MAX_DIMS)
		goto out;
	for (Py_ssize_t i = 0; i < ndim; i++) {
		long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
		if (d < 0) {
			PyErr_Clear();
			goto out;
		}
		dims[i] = d;
		if (d && numel > UINT64_MAX / (uint64_t)d)
			goto out;
		numel *= (uint64_t)d;
	}
	if (numel > (uint64_t)b->limit / (uint64_t)itemsize)
		goto out; /* sent by reference or through shared memory by _wire.py */
	size_t nbytes = (size_t)numel * (size_t)itemsize;
	size_t head = 4 + 8 * (size_t)ndim;
	/* the 4-byte frame length precedes the body: offsets count from after it */
	size_t pad = (size_t)(-(int64_t)(b->len - 4 + 6 + head)) % ALIGN;
	unsigned char h[10] = {0xC9,
	                       0,
	                       0,
	                       0,
	                       0,
	                       EXT_TENSOR,
	                       (unsigned char)code,
	                       (unsigned char)ndim,
	                       (unsigned char)pad,
	                       0};
	uint64_t extlen = head + pad + nbytes;

	for (int i = 0; i < 4; i++)
		h[1 + i] = (unsigned char)(extlen >> (8 * (3 - i)));
	if (grow(b, sizeof h + 8 * (size_t)ndim + pad + nbytes) != 0)
		goto nomem;
	memcpy(b->p + b->len, h, sizeof h);
	b->len += sizeof h;
	memcpy(b->p + b->len, dims, 8 * (size_t)ndim); /* little-endian host: checked by _wire.py */
	b->len += 8 * (size_t)ndim;
	memset(b->p + b->len, 0, pad);
	b->len += pad;
	if (nbytes) {
		ptr = PyObject_CallMethodNoArgs(t, G.s_data_ptr);
		if (ptr == NULL)
			goto fail;
		void *data = PyLong_AsVoidPtr(ptr);
		if (data == NULL) {
			PyErr_Clear();
			goto out;
		}
		memcpy(b->p + b->len, data, nbytes);
		b->len += nbytes;
	}
	rc = 0;
	goto out;
check:
	if (t_ok == 0)
		goto out;
fail:
	rc = -1;
	goto out;
nomem:
	PyErr_NoMemory();
	rc = -1;
out:
	Py_XDECREF(dtype);
	Py_XDECREF(layout);
	Py_XDECREF(shape);
	Py_XDECREF(ptr);
	Py_XDECREF(own);
	return rc;
}

static int enc_items(struct buf *b, PyObject *seq, int depth)
{
	Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
	PyObject **items = PySequence_Fast_ITEMS(seq);

	for (Py_ssize_t i = 0; i < n; i++) {
		int rc = enc_value(b, items[i], depth + 1);
		if (rc != 0)
			return rc;
	}
	return 0;
}

static int enc_dict(struct buf *b, PyObject *d, int depth)
{
	PyObject *key, *val;
	Py_ssize_t pos = 0;

	if (put_header(b, 0x80, 0xDF, PyDict_GET_SIZE(d)) != 0)
		return -1;
	while (PyDict_Next(d, &pos, &key, &val)) {
		int rc;
		if (!PyUnicode_CheckExact(key))
			return 1;
		if ((rc = put_str(b, key)) != 0 || (rc = enc_value(b, val, depth + 1)) != 0)
			return rc;
	}
	return 0;
}

static int enc_value(struct buf *b, PyObject *v, int depth)
{
	if (depth > MAX_DEPTH)
		return 1;
	if (PyDict_CheckExact(v))
		return enc_dict(b, v, depth);
	if (PyObject_TypeCheck(v, (PyTypeObject *)G.tensor_type))
		return enc_tensor(b, v);
	if (PyUnicode_CheckExact(v))
		return put_str(b, v);
	if (v == Py_None)
		return put(b, "\xc0", 1);
	if (v == Py_True)
		return put(b, "\xc3", 1);
	if (v == Py_False)
		return put(b, "\xc2", 1);
	if (PyLong_CheckExact(v))
		return put_int(b, v);
	if (PyFloat_CheckExact(v)) {
		double x = PyFloat_AS_DOUBLE(v);
		uint64_t u;
		memcpy(&u, &x, sizeof u);
		return put_be(b, 0xCB, u, 8);
	}
	if (PyTuple_CheckExact(v)) {
		if (put_header(b, 0x90, 0xDD, PyTuple_GET_SIZE(v) + 1) != 0 ||
		    put(b, "\xc7\x00\x02", 3) != 0)
			return -1;
		return enc_items(b, v, depth);
	}
	if (PyList_CheckExact(v)) {
		if (put_header(b, 0x90, 0xDD, PyList_GET_SIZE(v)) != 0)
			return -1;
		return enc_items(b, v, depth);
	}
	return 1; /* subclasses and other types: _wire.py */
}

static PyObject *fast_encode(PyObject *self, PyObject *args)
{
	PyObject *id, *op, *fields, *key, *val;
	Py_ssize_t limit, pos = 0;
	struct buf b = {0};
	int rc;

	(void)self;
	if (!PyArg_ParseTuple(args, "OUO!n", &id, &op, &PyDict_Type, &fields, &limit))
		return NULL;
	if (!G.ready)
		return PyErr_Format(PyExc_RuntimeError, "torchloop._fast.setup was not called");
	b.limit = limit < 0 ? 0 : limit;
	if (PyDict_GetItemWithError(fields, G.s_id) != NULL ||
	    PyDict_GetItemWithError(fields, G.s_op) != NULL)
		Py_RETURN_NONE; /* keys that would repeat: _wire.py's dict merge decides */
	if (PyErr_Occurred())
		return NULL;
	rc = put(&b, "\0\0\0\0", 4);
	rc = rc ? rc : put_header(&b, 0x80, 0xDF, PyDict_GET_SIZE(fields) + 2);
	rc = rc ? rc : put_str(&b, G.s_id);
	rc = rc ? rc : (PyLong_CheckExact(id) ? put_int(&b, id) : 1);
	rc = rc ? rc : put_str(&b, G.s_op);
	rc = rc ? rc : put_str(&b, op);
	while (rc == 0 && PyDict_Next(fields, &pos, &key, &val)) {
		if (!PyUnicode_CheckExact(key)) {
			rc = 1;
			break;
		}
		rc = put_str(&b, key);
		rc = rc ? rc : enc_value(&b, val, 1);
	}
	if (rc != 0) {
		PyMem_Free(b.p);
		if (rc < 0)
			return NULL;
		Py_RETURN_NONE;
	}
	if (b.len - 4 > FRAME_MAX) { /* _wire.py raises its error */
		PyMem_Free(b.p);
		Py_RETURN_NONE;
	}
	uint32_t body = (uint32_t)(b.len - 4);
	for (int i = 0; i < 4; i++)
		b.p[i] = (char)(body >> (8 * (3 - i)));
	PyObject *out = PyBytes_FromStringAndSize(b.p, (Py_ssize_t)b.len);
	PyMem_Free(b.p);
	return out;
}

/* ---- decoding --------------------------------------------------------------- */

struct rd {
	PyObject *body; /* the bytearray: tensors view it */
	const unsigned char *p;
	size_t len, pos;
};

#define NEED(r, n)                                                                                 \
	do {                                                                                       \
		if ((r)->len - (r)->pos < (size_t)(n))                                             \
			return NULL;                                                               \
	} while (0)

static uint64_t be(const unsigned char *p, int n)
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

/* A tuple's leading marker (an empty ext type 2): an object() the module holds. */
static PyObject *TUPLE_MARK;

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
	return NULL; /* shared-memory references and unknown types: _wire.py */
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

static PyObject *dec_value(struct rd *r, int depth)
{
	unsigned char b;
	static const int fixed[] = {4, 8, 1, 2, 4, 8, 1, 2, 4, 8}; /* 0xca..0xd3 */

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
	switch (b) {
	case 0xC0:
		Py_RETURN_NONE;
	case 0xC2:
		Py_RETURN_FALSE;
	case 0xC3:
		Py_RETURN_TRUE;
	case 0xC4:
	case 0xC5:
	case 0xC6: {
		size_t n;
		if (take_len(r, 1 << (b - 0xC4), &n) != 0)
			return NULL;
		NEED(r, n);
		PyObject *o = PyBytes_FromStringAndSize((const char *)r->p + r->pos, (Py_ssize_t)n);
		r->pos += n;
		return o;
	}
	case 0xC7:
	case 0xC8:
	case 0xC9: {
		size_t n;
		if (take_len(r, 1 << (b - 0xC7), &n) != 0)
			return NULL;
		return dec_ext(r, n);
	}
	case 0xD4:
	case 0xD5:
	case 0xD6:
	case 0xD7:
	case 0xD8:
		return dec_ext(r, (size_t)1 << (b - 0xD4));
	case 0xD9:
	case 0xDA:
	case 0xDB: {
		size_t n;
		if (take_len(r, 1 << (b - 0xD9), &n) != 0)
			return NULL;
		return dec_str(r, n);
	}
	case 0xDC:
	case 0xDD:
	case 0xDE:
	case 0xDF: {
		size_t n;
		if (take_len(r, (b == 0xDC || b == 0xDE) ? 2 : 4, &n) != 0)
			return NULL;
		return b <= 0xDD ? dec_array(r, n, depth) : dec_map(r, n, depth);
	}
	default:
		break;
	}
	if (b >= 0xCA && b <= 0xD3) {
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
	return NULL; /* 0xc1 */
}

static PyObject *fast_decode(PyObject *self, PyObject *body)
{
	struct rd r;
	PyObject *v;

	(void)self;
	if (!PyByteArray_CheckExact(body))
		return PyErr_Format(PyExc_TypeError, "decode takes a bytearray");
	if (!G.ready)
		return PyErr_Format(PyExc_RuntimeError, "torchloop._fast.setup was not called");
	r.body = body;
	r.p = (const unsigned char *)PyByteArray_AS_STRING(body);
	r.len = (size_t)PyByteArray_GET_SIZE(body);
	r.pos = 0;
	v = dec_value(&r, 0);
	if (v != NULL && (r.pos != r.len || v == TUPLE_MARK)) {
		Py_DECREF(v);
		v = NULL;
	}
	if (v == NULL) { /* _wire.py parses it again and says what is wrong */
		if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception))
			return NULL; /* KeyboardInterrupt and the like */
		PyErr_Clear();
		Py_RETURN_NONE;
	}
	return v;
}

/* ---- set-up ----------------------------------------------------------------- */

static PyObject *fast_setup(PyObject *self, PyObject *args)
{
	(void)self;
	if (G.ready)
		Py_RETURN_NONE;
	if (!PyArg_ParseTuple(args, "OOOOOOOOO", &G.tensor_type, &G.f32, &G.f64, &G.strided,
	                      &G.from_numpy, &G.empty, &G.ndarray, &G.np_f32, &G.np_f64))
		return NULL;
	if (!PyType_Check(G.tensor_type))
		return PyErr_Format(PyExc_TypeError,
		                    "setup: the first argument must be torch.Tensor");
	PyObject **objs[] = {&G.tensor_type, &G.f32,     &G.f64,    &G.strided, &G.from_numpy,
	                     &G.empty,       &G.ndarray, &G.np_f32, &G.np_f64};
	for (size_t i = 0; i < sizeof objs / sizeof objs[0]; i++)
		Py_INCREF(*objs[i]);
#define INTERN(f, s)                                                                               \
	if ((G.f = PyUnicode_InternFromString(s)) == NULL)                                         \
		return NULL;
	INTERN(s_dtype, "dtype")
	INTERN(s_is_cpu, "is_cpu")
	INTERN(s_layout, "layout")
	INTERN(s_requires_grad, "requires_grad")
	INTERN(s_shape, "shape")
	INTERN(s_is_contiguous, "is_contiguous")
	INTERN(s_data_ptr, "data_ptr")
	INTERN(s_detach, "detach")
	INTERN(s_contiguous, "contiguous")
	INTERN(s_id, "id")
	INTERN(s_op, "op")
	INTERN(k_dtype, "dtype")
#undef INTERN
	G.ready = 1;
	Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"setup", fast_setup, METH_VARARGS,
     "setup(Tensor, float32, float64, strided, from_numpy, empty, ndarray, np_f32, np_f64)"},
    {"encode", fast_encode, METH_VARARGS, "encode(id, op, fields, limit) -> bytes | None"},
    {"decode", fast_decode, METH_O, "decode(body: bytearray) -> object | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fast", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fast(void)
{
	if (TUPLE_MARK == NULL &&
	    (TUPLE_MARK = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type)) == NULL)
		return NULL;
	return PyModule_Create(&module);
}

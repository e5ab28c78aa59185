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
 *   Conn(fd, timeout_ms, lost, busy_poll_us=0): a small request's whole
 *       round trip in one call (encode, send, read, decode; below).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_ULONGLONG, READONLY: Conn.polled */

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "busypoll.h" /* proto/: adaptive busy polling, shared with the daemon and libtorchloop */

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
	PyObject *s_id, *s_op, *s_event, *s_error, *s_result, *k_dtype;
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

/* The frame of {"id": id, "op": op, **fields} into b: 0, 1 (_wire.py must
 * take over: nothing to send) or -1 with a Python error set.  b->limit is
 * the largest tensor to copy in. */
static int encode_request(struct buf *b, PyObject *id, PyObject *op, PyObject *fields)
{
	PyObject *key, *val;
	Py_ssize_t pos = 0;
	int rc;

	if (PyDict_GetItemWithError(fields, G.s_id) != NULL ||
	    PyDict_GetItemWithError(fields, G.s_op) != NULL)
		return 1; /* keys that would repeat: _wire.py's dict merge decides */
	if (PyErr_Occurred())
		return -1;
	rc = put(b, "\0\0\0\0", 4);
	rc = rc ? rc : put_header(b, 0x80, 0xDF, PyDict_GET_SIZE(fields) + 2);
	rc = rc ? rc : put_str(b, G.s_id);
	rc = rc ? rc : (PyLong_CheckExact(id) ? put_int(b, id) : 1);
	rc = rc ? rc : put_str(b, G.s_op);
	rc = rc ? rc : put_str(b, op);
	while (rc == 0 && PyDict_Next(fields, &pos, &key, &val)) {
		if (!PyUnicode_CheckExact(key))
			return 1;
		rc = put_str(b, key);
		rc = rc ? rc : enc_value(b, val, 1);
	}
	if (rc != 0)
		return rc;
	if (b->len - 4 > FRAME_MAX) /* _wire.py raises its error */
		return 1;
	uint32_t body = (uint32_t)(b->len - 4);
	for (int i = 0; i < 4; i++)
		b->p[i] = (char)(body >> (8 * (3 - i)));
	return 0;
}

static PyObject *fast_encode(PyObject *self, PyObject *args)
{
	PyObject *id, *op, *fields, *out = NULL;
	Py_ssize_t limit;
	struct buf b = {0};
	int rc;

	(void)self;
	if (!PyArg_ParseTuple(args, "OUO!n", &id, &op, &PyDict_Type, &fields, &limit))
		return NULL;
	if (!G.ready)
		return PyErr_Format(PyExc_RuntimeError, "torchloop._fast.setup was not called");
	b.limit = limit < 0 ? 0 : limit;
	rc = encode_request(&b, id, op, fields);
	if (rc == 0)
		out = PyBytes_FromStringAndSize(b.p, (Py_ssize_t)b.len);
	else if (rc > 0)
		out = Py_NewRef(Py_None);
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

/* The value of a whole reply body (a bytearray); NULL with no error set when
 * _wire.py must parse it (and say what is wrong), NULL with an error set
 * for KeyboardInterrupt and the like. */
static PyObject *decode_body(PyObject *body)
{
	struct rd r;
	PyObject *v;

	r.body = body;
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

static PyObject *fast_decode(PyObject *self, PyObject *body)
{
	PyObject *v;

	(void)self;
	if (!PyByteArray_CheckExact(body))
		return PyErr_Format(PyExc_TypeError, "decode takes a bytearray");
	if (!G.ready)
		return PyErr_Format(PyExc_RuntimeError, "torchloop._fast.setup was not called");
	v = decode_body(body);
	if (v == NULL && !PyErr_Occurred())
		Py_RETURN_NONE;
	return v;
}

/* ---- the connection ------------------------------------------------------------
 *
 * Conn(fd, timeout_ms, lost, busy_poll_us=0) reads and writes a connected
 * socket it does not own (the Client's socket object keeps it open), so that
 * a small request's whole round trip is one call from Python:
 *
 *   call(id, op, fields, limit, on_event) -> dict | tuple | bytearray | None
 *       None: the request needs _wire.py (nothing was sent).  Otherwise it is
 *       sent and frames are read up to the reply whose "id" is id, or a
 *       frame-level error (an "error" with no id).  Event frames go to
 *       on_event (when not None); replies to other ids are skipped.  The
 *       usual end is the reply's "result" map (a dict); an error reply (or a
 *       result that is not a map) comes back as the 1-tuple (reply,), and a
 *       frame the C decoder cannot parse as its body, for _wire.py to parse
 *       (and to say what is wrong).
 *   recv_body() -> bytearray
 *       the body of the next frame.
 *
 * Both read through one staging buffer: a small frame arrives in one recv,
 * bytes past it stay staged for the next frame; a body of STAGE bytes or
 * more is read straight into its own bytearray.  A socket with a timeout is
 * non-blocking (Python's settimeout): a wait longer than timeout_ms raises
 * lost("IO", "... timed out").  The GIL is released around every system
 * call; a signal (EINTR) runs Python's handlers, and a handler's exception
 * ends the call.  Broken connections raise lost("IO", message), a reply over
 * the frame limit lost("FRAME_TOO_LARGE", message): the Client drops the
 * connection on either.  A wait for bytes polls the socket for up to
 * busy_poll_us first (adaptive, proto/busypoll.h; 0: never). */

#define STAGE 16384

typedef struct {
	PyObject_HEAD
	int fd;
	int timeout_ms; /* -1: block */
	PyObject *lost; /* the exception type raised when the connection is unusable */
	unsigned char *stage;
	size_t off, len;           /* the staged bytes: stage[off, off + len) */
	struct busypoll poll;      /* a wait for a reply polls first */
	int poll_reply;            /* ... when this request is small (call); recv_body: never */
	unsigned long long polled; /* reads of a reply that polling served (Conn.polled) */
	int between; /* sending, or reading the first byte of a frame: no reply half read */
} Conn;

/* Raises lost(code, message); broke: the connection broke (not a timeout),
 * and between frames the exception says unanswered (Client.call retries). */
static int lost(Conn *c, const char *code, int broke, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
	va_end(ap);
	if (msg == NULL)
		return -1;
	PyObject *exc = PyObject_CallFunction(c->lost, "sO", code, msg);
	Py_DECREF(msg);
	if (exc != NULL) {
		if (broke && c->between)
			PyObject_SetAttrString(exc, "unanswered", Py_True);
		PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
		Py_DECREF(exc);
	}
	return -1;
}

static int lost_errno(Conn *c, const char *what, int err)
{
	return lost(c, "IO", 1, "%s torchloopd: [Errno %d] %s", what, err, strerror(err));
}

/* After EAGAIN: waits for the socket (GIL released); 0, or -1 raised. */
static int conn_wait(Conn *c, short events, const char *what)
{
	struct pollfd p = {.fd = c->fd, .events = events};
	int n, err;

	for (;;) {
		PyThreadState *ts = PyEval_SaveThread();
		n = poll(&p, 1, c->timeout_ms);
		err = errno;
		PyEval_RestoreThread(ts);
		if (n > 0)
			return 0;
		if (n == 0)
			return lost(c, "IO", 0, "%s torchloopd: timed out", what);
		if (err != EINTR)
			return lost_errno(c, what, err);
		if (PyErr_CheckSignals() != 0)
			return -1;
	}
}

/* What a failed send/recv means: 0 to try again, or -1 raised. */
static int conn_retry(Conn *c, int err, short events, const char *what)
{
	if (err == EINTR)
		return PyErr_CheckSignals() != 0 ? -1 : 0;
	if (err == EAGAIN || err == EWOULDBLOCK)
		return conn_wait(c, events, what);
	return lost_errno(c, what, err);
}

static int conn_send(Conn *c, const char *p, size_t n)
{
	c->between = 1; /* a frame the daemon did not read whole never runs */
	while (n > 0) {
		ssize_t k;
		int err;
		PyThreadState *ts = PyEval_SaveThread();
		k = send(c->fd, p, n, MSG_NOSIGNAL);
		err = errno;
		PyEval_RestoreThread(ts);
		if (k >= 0) {
			p += k;
			n -= (size_t)k;
		} else if (conn_retry(c, err, POLLOUT, "write to") != 0) {
			return -1;
		}
	}
	return 0;
}

/* One recv into p (at most n bytes): how many came (at least one), or -1
 * raised.  Polls the socket for the busy-poll window first (GIL released). */
static ssize_t conn_recv(Conn *c, void *p, size_t n)
{
	int adapt = c->poll.max_ns > 0 && c->poll_reply;
	uint64_t t0 = adapt ? busypoll_now_ns() : 0;
	int polling = adapt && c->poll.window_ns > 0;

	for (;;) {
		ssize_t k;
		int err;
		PyThreadState *ts = PyEval_SaveThread();
		do
			k = recv(c->fd, p, n, polling ? MSG_DONTWAIT : 0);
		while (polling && k < 0 && errno == EAGAIN &&
		       busypoll_now_ns() - t0 < c->poll.window_ns);
		err = errno;
		PyEval_RestoreThread(ts);
		if (k > 0) {
			if (!polling && adapt)
				busypoll_update(&c->poll, false, busypoll_now_ns() - t0);
			c->polled += polling != 0;
			return k;
		}
		if (k == 0)
			return lost(c, "IO", 1, "torchloopd closed the connection");
		if (polling && err == EAGAIN)
			polling = 0; /* nothing yet: sleep (or wait out the timeout) */
		else if (conn_retry(c, err, POLLIN, "read from") != 0)
			return -1;
	}
}

static PyObject *conn_body(Conn *c)
{
	while (c->len < 4) { /* the length: move what is staged to the front, read more */
		memmove(c->stage, c->stage + c->off, c->len);
		c->off = 0;
		c->between = c->len == 0;
		ssize_t k = conn_recv(c, c->stage + c->len, STAGE - c->len);
		if (k < 0)
			return NULL;
		c->len += (size_t)k;
	}
	const unsigned char *h = c->stage + c->off;
	size_t length = (size_t)h[0] << 24 | (size_t)h[1] << 16 | (size_t)h[2] << 8 | h[3];
	if (length > FRAME_MAX) {
		lost(c, "FRAME_TOO_LARGE", 0, "reply of %zu bytes", length);
		return NULL;
	}
	c->off += 4;
	c->len -= 4;
	c->between = 0;
	PyObject *body = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)length);
	if (body == NULL)
		return NULL;
	unsigned char *dst = (unsigned char *)PyByteArray_AS_STRING(body);
	size_t got = 0;
	for (;;) {
		size_t k = c->len < length - got ? c->len : length - got;
		memcpy(dst + got, c->stage + c->off, k);
		got += k;
		c->off += k;
		c->len -= k;
		if (got == length)
			return body;
		ssize_t n; /* nothing is staged now */
		if (length - got >= STAGE) {
			n = conn_recv(c, dst + got, length - got);
			if (n > 0)
				got += (size_t)n;
		} else {
			n = conn_recv(c, c->stage, STAGE);
			c->off = 0;
			c->len = n > 0 ? (size_t)n : 0;
		}
		if (n < 0) {
			Py_DECREF(body);
			return NULL;
		}
		if (got == length)
			return body;
	}
}

static PyObject *conn_recv_body(PyObject *self, PyObject *unused)
{
	(void)unused;
	((Conn *)self)->poll_reply = 0; /* _wire.py's requests: large tensors, shared memory */
	return conn_body((Conn *)self);
}

static PyObject *conn_call(PyObject *self, PyObject *args)
{
	Conn *c = (Conn *)self;
	PyObject *id, *op, *fields, *on_event;
	Py_ssize_t limit;
	struct buf b = {0};

	if (!PyArg_ParseTuple(args, "OUO!nO", &id, &op, &PyDict_Type, &fields, &limit, &on_event))
		return NULL;
	if (!G.ready)
		return PyErr_Format(PyExc_RuntimeError, "torchloop._fast.setup was not called");
	b.limit = limit < 0 ? 0 : limit;
	int rc = encode_request(&b, id, op, fields);
	c->poll_reply = b.len < BUSYPOLL_MAX_REQUEST;
	if (rc == 0)
		rc = conn_send(c, b.p, b.len);
	PyMem_Free(b.p);
	if (rc != 0)
		return rc > 0 ? Py_NewRef(Py_None) : NULL;
	for (;;) {
		PyObject *body = conn_body(c);
		if (body == NULL)
			return NULL;
		PyObject *msg = decode_body(body);
		if (msg == NULL || !PyDict_CheckExact(msg)) {
			if (msg == NULL && PyErr_Occurred()) {
				Py_DECREF(body);
				return NULL;
			}
			Py_XDECREF(msg);
			return body; /* _wire.py parses it and says what is wrong */
		}
		Py_DECREF(body);
		PyObject *event = PyDict_GetItemWithError(msg, G.s_event);
		if (event == NULL && PyErr_Occurred())
			goto fail;
		if (event != NULL) {
			if (on_event != Py_None) {
				PyObject *r = PyObject_CallOneArg(on_event, msg);
				if (r == NULL)
					goto fail;
				Py_DECREF(r);
			}
			Py_DECREF(msg);
			continue;
		}
		PyObject *rid = PyDict_GetItemWithError(msg, G.s_id);
		if (rid == NULL && PyErr_Occurred())
			goto fail;
		int mine = rid != NULL ? PyObject_RichCompareBool(rid, id, Py_EQ) : 0;
		int err = mine >= 0 ? PyDict_Contains(msg, G.s_error) : -1;
		if (err < 0)
			goto fail;
		if (mine && !err) {
			PyObject *result = PyDict_GetItemWithError(msg, G.s_result);
			if (result == NULL && PyErr_Occurred())
				goto fail;
			if (result == NULL || PyDict_CheckExact(result)) {
				result = result ? Py_NewRef(result) : PyDict_New();
				Py_DECREF(msg);
				return result;
			}
		}
		if (mine || (err && (rid == NULL || rid == Py_None))) {
			/* its error, or a frame-level error, or an odd result: the
			 * Client's to raise or return */
			PyObject *t = PyTuple_Pack(1, msg);
			Py_DECREF(msg);
			return t;
		}
		Py_DECREF(msg); /* a reply to an earlier request: skipped */
		continue;
	fail:
		Py_DECREF(msg);
		return NULL;
	}
}

static int conn_init(PyObject *self, PyObject *args, PyObject *kwds)
{
	Conn *c = (Conn *)self;
	int fd, timeout_ms, busy_poll_us = 0;
	PyObject *exc;
	static char *kwlist[] = {"fd", "timeout_ms", "lost", "busy_poll_us", NULL};

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiO|i", kwlist, &fd, &timeout_ms, &exc,
	                                 &busy_poll_us))
		return -1;
	if (fd < 0) {
		PyErr_SetString(PyExc_ValueError, "Conn needs a connected socket's descriptor");
		return -1;
	}
	if (c->stage == NULL && (c->stage = PyMem_Malloc(STAGE)) == NULL) {
		PyErr_NoMemory();
		return -1;
	}
	c->fd = fd;
	c->timeout_ms = timeout_ms < 0 ? -1 : timeout_ms;
	c->off = c->len = 0;
	busy_poll_us = busy_poll_us < 0 ? 0 : busy_poll_us > 1000 ? 1000 : busy_poll_us;
	busypoll_init(&c->poll, (uint64_t)busy_poll_us * 1000);
	Py_INCREF(exc);
	Py_XSETREF(c->lost, exc);
	return 0;
}

static void conn_dealloc(PyObject *self)
{
	Conn *c = (Conn *)self;

	PyTypeObject *type = Py_TYPE(self); /* a heap type: its instances hold it */

	Py_XDECREF(c->lost);
	PyMem_Free(c->stage);
	type->tp_free(self);
	Py_DECREF(type);
}

static PyMethodDef conn_methods[] = {
    {"call", conn_call, METH_VARARGS,
     "call(id, op, fields, limit, on_event) -> dict | tuple | bytearray | None"},
    {"recv_body", conn_recv_body, METH_NOARGS, "recv_body() -> bytearray: the next frame's body"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef conn_members[] = {
    {"polled", T_ULONGLONG, offsetof(Conn, polled), READONLY,
     "how many reads of a reply busy polling served"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot conn_slots[] = {
    {Py_tp_doc, "One request's round trip on a connected socket (see _fast.c)."},
    {Py_tp_members, conn_members},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, conn_init},
    {Py_tp_dealloc, conn_dealloc},
    {Py_tp_methods, conn_methods},
    {0, NULL},
};

static PyType_Spec conn_spec = {"torchloop._fast.Conn", sizeof(Conn), 0, Py_TPFLAGS_DEFAULT,
                                conn_slots};

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
	INTERN(s_event, "event")
	INTERN(s_error, "error")
	INTERN(s_result, "result")
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
	PyObject *m = PyModule_Create(&module);
	PyObject *conn = m != NULL ? PyType_FromSpec(&conn_spec) : NULL;
	if (conn == NULL || PyModule_AddObject(m, "Conn", conn) < 0) {
		Py_XDECREF(conn);
		Py_XDECREF(m);
		return NULL;
	}
	return m;
}

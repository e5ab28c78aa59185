/*
 * _fast_enc.c - a request encoded in C (_fast.h; the format is _wire.py's).
 */
#include "_fast.h"

/* ---- encoding --------------------------------------------------------------- */

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

int attr_true(PyObject *o, PyObject *name)
{
	PyObject *r = PyObject_GetAttr(o, name);
	int t;

	if (r == NULL)
		return -1;
	t = PyObject_IsTrue(r);
	Py_DECREF(r);
	return t;
}

/*
 * The tensor as the frame carries it: on the CPU, strided, contiguous, not
 * requiring grad (*own: a new reference when it had to be detached or made
 * contiguous).  0: *out is it; 1: left to _wire.py; -1: a Python error.
 */
static int tensor_plain(PyObject *t, PyObject **own)
{
	PyObject *layout, *r;
	int yes;

	if ((yes = attr_true(t, G.s_is_cpu)) != 1)
		return yes == 0 ? 1 : -1;
	if ((layout = PyObject_GetAttr(t, G.s_layout)) == NULL)
		return -1;
	Py_DECREF(layout); /* compared by identity only: torch keeps the singleton */
	if (layout != G.strided)
		return 1;
	if ((yes = attr_true(t, G.s_requires_grad)) < 0)
		return -1;
	if (yes) {
		if ((*own = PyObject_CallMethodNoArgs(t, G.s_detach)) == NULL)
			return -1;
		t = *own;
	}
	if ((r = PyObject_CallMethodNoArgs(t, G.s_is_contiguous)) == NULL)
		return -1;
	yes = PyObject_IsTrue(r);
	Py_DECREF(r);
	if (yes < 0)
		return -1;
	if (!yes) {
		if ((r = PyObject_CallMethodNoArgs(t, G.s_contiguous)) == NULL)
			return -1;
		Py_XDECREF(*own);
		*own = r;
	}
	return 0;
}

/* The shape (at most MAX_DIMS sizes) and element count; 1: left to _wire.py. */
static int tensor_dims(PyObject *t, int64_t *dims, Py_ssize_t *ndim, uint64_t *numel)
{
	PyObject *shape = PyObject_GetAttr(t, G.s_shape);
	int rc = 1;

	if (shape == NULL)
		return -1;
	if (!PyTuple_Check(shape) || (*ndim = PyTuple_GET_SIZE(shape)) > MAX_DIMS)
		goto out;
	*numel = 1;
	for (Py_ssize_t i = 0; i < *ndim; i++) {
		long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
		if (d < 0) {
			PyErr_Clear();
			goto out;
		}
		dims[i] = d;
		if (d && *numel > UINT64_MAX / (uint64_t)d)
			goto out;
		*numel *= (uint64_t)d;
	}
	rc = 0;
out:
	Py_DECREF(shape);
	return rc;
}

/* The ext header (dtype code, rank, padding to ALIGN) and the sizes. */
static int put_tensor_head(struct buf *b, int code, Py_ssize_t ndim, const int64_t *dims,
                           size_t nbytes)
{
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
	if (grow(b, sizeof h + 8 * (size_t)ndim + pad + nbytes) != 0) {
		PyErr_NoMemory();
		return -1;
	}
	memcpy(b->p + b->len, h, sizeof h);
	b->len += sizeof h;
	memcpy(b->p + b->len, dims, 8 * (size_t)ndim); /* little-endian host: checked by _wire.py */
	b->len += 8 * (size_t)ndim;
	memset(b->p + b->len, 0, pad);
	b->len += pad;
	return 0;
}

/* A tensor by reference into the connection's region, where b->place puts
 * it (an ext 3: dtype code, rank, 6 zero bytes, offset and size as uint64,
 * the sizes; little-endian, as _wire.py writes it): 0 sent; 1 place said
 * None (the region is full: inline if it fits); -1 a Python error. */
static int put_tensor_ref(struct buf *b, PyObject *t, int code, Py_ssize_t ndim,
                          const int64_t *dims, uint64_t nbytes)
{
	PyObject *r = PyObject_CallOneArg(b->place, t);
	unsigned long long off;
	unsigned char h[14] = {0xC9, 0, 0, 0, 0, EXT_SHM, (unsigned char)code, (unsigned char)ndim};
	uint32_t extlen = 24 + 8 * (uint32_t)ndim;

	if (r == NULL)
		return -1;
	if (r == Py_None) {
		Py_DECREF(r);
		return 1;
	}
	off = PyLong_AsUnsignedLongLong(r);
	Py_DECREF(r);
	if (off == (unsigned long long)-1 && PyErr_Occurred())
		return -1;
	for (int i = 0; i < 4; i++)
		h[1 + i] = (unsigned char)(extlen >> (8 * (3 - i)));
	uint64_t ref[2] = {off, nbytes}; /* little-endian host: checked by _wire.py */
	if (put(b, h, sizeof h) != 0 || put(b, ref, sizeof ref) != 0 ||
	    put(b, dims, 8 * (size_t)ndim) != 0) {
		PyErr_NoMemory();
		return -1;
	}
	b->ref_bytes += nbytes;
	return 0;
}

/* A float32/float64 tensor inline, or by reference into the region when
 * b->place takes it (1: left to _wire.py: another dtype or device, over the
 * limit, ...). */
static int enc_tensor(struct buf *b, PyObject *t)
{
	PyObject *dtype = PyObject_GetAttr(t, G.s_dtype), *own = NULL, *ptr = NULL;
	int64_t dims[MAX_DIMS];
	Py_ssize_t ndim = 0, itemsize = 8;
	uint64_t numel = 0;
	size_t mark = b->len;
	int rc, code = dtype == G.f32 ? 1 : dtype == G.f64 ? 2 : 0;

	Py_XDECREF(dtype); /* compared by identity only */
	if (dtype == NULL)
		return -1;
	if (code == 0)
		return 1; /* _wire.py says which dtype */
	itemsize = code == 1 ? 4 : 8;
	if ((rc = tensor_plain(t, &own)) != 0 ||
	    (rc = tensor_dims(own ? own : t, dims, &ndim, &numel)) != 0)
		goto out;
	/* place gets the caller's own tensor: a copy it keeps is keyed on that
	 * object (a detached one is new at every call) */
	if (b->place != NULL && numel >= (b->shm_min + (size_t)itemsize - 1) / (size_t)itemsize &&
	    (rc = put_tensor_ref(b, t, code, ndim, dims, numel * (uint64_t)itemsize)) <= 0)
		goto out;
	rc = 1;
	if (numel > (uint64_t)b->limit / (uint64_t)itemsize)
		goto out; /* sent by reference or through shared memory by _wire.py */
	if ((rc = put_tensor_head(b, code, ndim, dims, (size_t)numel * (size_t)itemsize)) != 0)
		goto out;
	if (numel) {
		void *data;
		rc = -1;
		if ((ptr = PyObject_CallMethodNoArgs(own ? own : t, G.s_data_ptr)) == NULL)
			goto out;
		if ((data = PyLong_AsVoidPtr(ptr)) == NULL) {
			PyErr_Clear();
			rc = 1;
			b->len = mark;
			goto out;
		}
		memcpy(b->p + b->len, data, (size_t)numel * (size_t)itemsize);
		b->len += (size_t)numel * (size_t)itemsize;
	}
	rc = 0;
out:
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
int encode_request(struct buf *b, PyObject *id, PyObject *op, PyObject *fields)
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

PyObject *fast_encode(PyObject *self, PyObject *args)
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

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
#include "_fast.h"

struct fast_globals G;

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
 * ends the call.  Broken connections raise lost("IO", message) (or
 * lost("FRAME_TRUNCATED", message) when the stream ends inside a reply
 * frame), a reply over the frame limit lost("FRAME_TOO_LARGE", message): the
 * Client drops the connection on each.  A wait for bytes polls the socket for up to
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
		if (k == 0 && c->between)
			return lost(c, "IO", 1, "torchloopd closed the connection");
		if (k == 0)
			return lost(c, "FRAME_TRUNCATED", 1,
			            "torchloopd closed the connection inside a reply frame");
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

/*
 * What one decoded frame, msg, means to the call waiting for the reply to
 * id: an event (to on_event), a reply to an earlier request (skipped), or
 * the end.  Returns 0 to read on, or 1 with *ret the call's value: the
 * result map (a new dict when there is none), or for an error reply, a
 * frame-level error or an odd result the 1-tuple (msg,); NULL when raised.
 * Borrows msg.
 */
static int conn_reply(PyObject *msg, PyObject *id, PyObject *on_event, PyObject **ret)
{
	PyObject *event = PyDict_GetItemWithError(msg, G.s_event);
	if (event == NULL && PyErr_Occurred())
		return 1;
	if (event != NULL) {
		if (on_event == Py_None)
			return 0;
		PyObject *r = PyObject_CallOneArg(on_event, msg);
		if (r == NULL)
			return 1;
		Py_DECREF(r);
		return 0;
	}
	PyObject *rid = PyDict_GetItemWithError(msg, G.s_id);
	if (rid == NULL && PyErr_Occurred())
		return 1;
	int mine = rid != NULL ? PyObject_RichCompareBool(rid, id, Py_EQ) : 0;
	int err = mine >= 0 ? PyDict_Contains(msg, G.s_error) : -1;
	if (err < 0)
		return 1;
	if (mine && !err) {
		PyObject *result = PyDict_GetItemWithError(msg, G.s_result);
		if (result == NULL && PyErr_Occurred())
			return 1;
		if (result == NULL || PyDict_CheckExact(result)) {
			*ret = result ? Py_NewRef(result) : PyDict_New();
			return 1;
		}
	}
	if (mine || (err && (rid == NULL || rid == Py_None))) {
		/* its error, or a frame-level error, or an odd result: the
		 * Client's to raise or return */
		*ret = PyTuple_Pack(1, msg);
		return 1;
	}
	return 0; /* a reply to an earlier request: skipped */
}

static PyObject *conn_call(PyObject *self, PyObject *args)
{
	Conn *c = (Conn *)self;
	PyObject *id, *op, *fields, *on_event, *place = Py_None, *area = Py_None;
	Py_ssize_t limit, shm_min = 0;
	struct buf b = {0};

	if (!PyArg_ParseTuple(args, "OUO!nO|OnO", &id, &op, &PyDict_Type, &fields, &limit,
	                      &on_event, &place, &shm_min, &area))
		return NULL;
	if (!G.ready)
		return PyErr_Format(PyExc_RuntimeError, "torchloop._fast.setup was not called");
	b.limit = limit < 0 ? 0 : limit;
	b.place = place == Py_None ? NULL : place;
	b.shm_min = shm_min < 1 ? 1 : (size_t)shm_min;
	int rc = encode_request(&b, id, op, fields);
	/* the tensors' bytes decide, in the frame or by reference (busypoll.h) */
	c->poll_reply = b.len + b.ref_bytes < BUSYPOLL_MAX_REQUEST;
	if (rc == 0)
		rc = conn_send(c, b.p, b.len);
	PyMem_Free(b.p);
	if (rc != 0)
		return rc > 0 ? Py_NewRef(Py_None) : NULL;
	for (;;) {
		PyObject *body = conn_body(c);
		if (body == NULL)
			return NULL;
		PyObject *msg = decode_body(body, area == Py_None ? NULL : area);
		if (msg == NULL || !PyDict_CheckExact(msg)) {
			if (msg == NULL && PyErr_Occurred()) {
				Py_DECREF(body);
				return NULL;
			}
			Py_XDECREF(msg);
			return body; /* _wire.py parses it and says what is wrong */
		}
		Py_DECREF(body);
		PyObject *ret = NULL;
		int end = conn_reply(msg, id, on_event, &ret);
		Py_DECREF(msg);
		if (end != 0)
			return ret; /* NULL: raised */
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
	busypoll_stretch(&c->poll); /* one solver's client: proto/busypoll.h */
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

/* ---- the rows a capture is checked against ----------------------------------
 *
 * rows(xs, max_steps, row_of, last) -> list | None: Capturer.rows (capture.py) on
 * a warm scan: each input leaf's stand-in for its row 0, found in row_of by
 * (position, shape, strides, dtype).  None when any leaf is not a plain,
 * strided CPU torch.Tensor, has a key not in row_of, or the
 * leaves' lengths are not one T in [1, max_steps]: capture.py then does it
 * all in Python (stand-ins made, real rows, the checks' errors).  The list
 * is the last call's (kept as last[0]) when its stand-ins are. */

/* leaf i's key; NULL with no error set: a case for capture.py */
static PyObject *row_key(PyObject *t, Py_ssize_t i, long long *steps, long long max_steps)
{
	PyObject *shape = NULL, *stride = NULL, *dtype = NULL, *idx = NULL, *key = NULL;
	long long d;

	/* a layout without strides (sparse) raises in stride(): a case for capture.py */
	if (Py_TYPE(t) != (PyTypeObject *)G.tensor_type || attr_true(t, G.s_is_cpu) != 1)
		goto out;
	if ((shape = PyObject_GetAttr(t, G.s_shape)) == NULL || !PyTuple_Check(shape) ||
	    PyTuple_GET_SIZE(shape) == 0)
		goto out;
	d = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 0));
	if (*steps < 0)
		*steps = d;
	if (d != *steps || d < 1 || d > max_steps)
		goto out;
	if ((stride = PyObject_CallMethodNoArgs(t, G.s_stride)) != NULL &&
	    (dtype = PyObject_GetAttr(t, G.s_dtype)) != NULL &&
	    (idx = PyLong_FromSsize_t(i)) != NULL)
		key = PyTuple_Pack(4, idx, shape, stride, dtype);
out:
	PyErr_Clear();
	Py_XDECREF(shape);
	Py_XDECREF(stride);
	Py_XDECREF(dtype);
	Py_XDECREF(idx);
	return key;
}

/* out, or the list the last call returned (box[0]) when it holds the same
 * stand-ins: capture.py then reuses the row tree it built from it */
static PyObject *same_rows(PyObject *out, PyObject *box)
{
	PyObject *last = PyList_GET_ITEM(box, 0);
	Py_ssize_t n = PyList_GET_SIZE(out), i = 0;

	if (PyList_CheckExact(last) && PyList_GET_SIZE(last) == n)
		while (i < n && PyList_GET_ITEM(last, i) == PyList_GET_ITEM(out, i))
			i++;
	if (PyList_CheckExact(last) && i == n) {
		Py_DECREF(out);
		return Py_NewRef(last);
	}
	if (PyList_SetItem(box, 0, Py_NewRef(out)) != 0) {
		Py_DECREF(out);
		return NULL;
	}
	return out;
}

static PyObject *fast_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
	long long steps = -1, max_steps;
	PyObject *out;
	Py_ssize_t n;

	(void)self;
	if (nargs != 4 || !PyList_CheckExact(args[0]) || !PyDict_CheckExact(args[2]) ||
	    !PyList_CheckExact(args[3]) || PyList_GET_SIZE(args[3]) != 1)
		return PyErr_Format(PyExc_TypeError,
		                    "rows(xs: list, max_steps: int, row_of: dict, last: [list])");
	if ((max_steps = PyLong_AsLongLong(args[1])) == -1 && PyErr_Occurred())
		return NULL;
	n = PyList_GET_SIZE(args[0]);
	if (n == 0 || (out = PyList_New(n)) == NULL)
		return n == 0 ? Py_NewRef(Py_None) : NULL;
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *key = row_key(PyList_GET_ITEM(args[0], i), i, &steps, max_steps);
		PyObject *row = key != NULL ? PyDict_GetItemWithError(args[2], key) : NULL;

		Py_XDECREF(key);
		if (row == NULL) {
			Py_DECREF(out);
			return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
		}
		PyList_SET_ITEM(out, i, Py_NewRef(row));
	}
	return same_rows(out, args[3]);
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
	INTERN(s_stride, "stride")
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
    {"rows", (PyCFunction)(void (*)(void))fast_rows, METH_FASTCALL,
     "rows(xs, max_steps, row_of, last) -> list | None"},
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

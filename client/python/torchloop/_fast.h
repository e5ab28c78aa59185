/*
 * _fast.h - what the C codec's files share: _fast.c (the module, set-up and
 * Conn), _fast_enc.c (requests encoded), _fast_dec.c (replies decoded).
 */
#ifndef TORCHLOOP_FAST_H
#define TORCHLOOP_FAST_H

/* shared between the module's files, not exported by it */
#define FAST_INTERNAL __attribute__((visibility("hidden")))

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
#include "protocol.h" /* proto/: the wire's limits and ext types */

/* The wire's own numbers (proto/protocol.h): what is past them goes to
 * _wire.py, which sends it for the daemon to refuse with the right code. */
#define ALIGN      PROTO_TENSOR_ALIGN
#define FRAME_MAX  ((size_t)PROTO_FRAME_MAX)
#define MAX_DEPTH  PROTO_MAX_MSGPACK_DEPTH
#define MAX_DIMS   PROTO_MAX_NDIM
#define EXT_TENSOR PROTO_EXT_TENSOR
#define EXT_TUPLE  PROTO_EXT_TUPLE
#define EXT_SHM    PROTO_EXT_SHM

struct fast_globals {
	PyObject *tensor_type, *f32, *f64, *strided;              /* torch */
	PyObject *from_numpy, *empty, *ndarray, *np_f32, *np_f64; /* torch, numpy */
	PyObject *s_dtype, *s_is_cpu, *s_layout, *s_requires_grad, *s_shape;
	PyObject *s_is_contiguous, *s_data_ptr, *s_detach, *s_contiguous, *s_stride;
	PyObject *s_id, *s_op, *s_event, *s_error, *s_result, *k_dtype;
	int ready;
};
FAST_INTERNAL extern struct fast_globals
    G; /* _fast.c: the torch and numpy objects, interned names */

/* An encoded frame in the making. */
struct buf {
	char *p;
	size_t len, cap;
	Py_ssize_t limit; /* largest tensor to copy in */
	/* shared memory (Client._shm_call): a tensor of shm_min bytes or more
	 * is offered to place(t), which returns its region offset (staging it
	 * there) or None; ref_bytes sums the tensors sent by reference */
	PyObject *place;
	size_t shm_min, ref_bytes;
};

/* _fast_enc.c */
/* The request {"id": id, "op": op, **fields} as a whole frame in b: 0; 1:
 * left to _wire.py (nothing usable in b); -1: a Python error. */
FAST_INTERNAL int encode_request(struct buf *b, PyObject *id, PyObject *op, PyObject *fields);
FAST_INTERNAL PyObject *fast_encode(PyObject *self, PyObject *args);
/* o.name's truth: 1, 0, or -1 with a Python error set */
FAST_INTERNAL int attr_true(PyObject *o, PyObject *name);

/* _fast_dec.c */
/* A tuple's leading marker (an empty ext type 2): an object() the module holds. */
FAST_INTERNAL extern PyObject *TUPLE_MARK;
/* A big-endian unsigned integer of n bytes. */
FAST_INTERNAL uint64_t be(const unsigned char *p, int n);
/* The value of a whole reply body (a bytearray); NULL with no error set when
 * _wire.py must parse it, NULL with an error set for KeyboardInterrupt and
 * the like.  area (or NULL): the request's output area (_shm.Area), whose
 * tensor(off, dtype, shape, nbytes) makes a shared-memory reference a view. */
FAST_INTERNAL PyObject *decode_body(PyObject *body, PyObject *area);
FAST_INTERNAL PyObject *fast_decode(PyObject *self, PyObject *body);

#endif

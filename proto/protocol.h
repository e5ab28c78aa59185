/*
 * protocol.h - the one header that owns the torchloopd wire protocol.
 *
 * It names the protocol version, the ops, the symbolic error codes and the
 * codec limits.  docs/protocol.md is its prose twin.  BUMP PROTO_VERSION
 * whenever anything here changes the bytes on the wire or their meaning
 * (a new required field, a renamed op or code, a changed tensor layout).
 * Adding an optional field or a new error code does not need a bump.
 */
#ifndef TORCHLOOP_PROTOCOL_H
#define TORCHLOOP_PROTOCOL_H

#include <stddef.h>
#include <stdint.h>

#define PROTO_VERSION 1
/* The release of daemon, client library and CLI (one number for all three). */
#define TORCHLOOP_VERSION "0.1.0"

/*
 * Adapter bounds, the in-process reference adapter's (docs/protocol.md):
 * each an integer in [1, MAX], DEFAULT when a registration leaves it out.
 * The Python client's copies are checked against these by
 * tests/python/test_limits.py.
 */
#define PROTO_MAX_STEPS     128
#define PROTO_DEFAULT_STEPS 128
/* strategy = chunk: a T-step scan with T a multiple of this (and larger)
 * runs a graph of this many steps T / PROTO_CHUNK_STEPS times */
#define PROTO_CHUNK_STEPS      16
#define PROTO_MAX_ELEMENTS     1048576
#define PROTO_DEFAULT_ELEMENTS 65536
#define PROTO_MAX_BUDGET       64
#define PROTO_DEFAULT_BUDGET   8
#define PROTO_MAX_SOURCE       (1 << 20) /* body source bytes */
#define PROTO_STR_(x)          #x
#define PROTO_STR(x)           PROTO_STR_(x)
/* "max_steps must be an integer in [1, 128]": the reference's message */
#define PROTO_BOUND_MESSAGE(field, max) field " must be an integer in [1, " PROTO_STR(max) "]"

/* Framing: 4-byte big-endian body length, then one msgpack map. */
#define PROTO_FRAME_HEADER  4
#define PROTO_FRAME_DEFAULT (64u << 20)
#define PROTO_FRAME_MIN     1024u
#define PROTO_FRAME_MAX     (1u << 30)

/* Tensor-tree limits (min/default/max are the same: they are the contract). */
#define PROTO_MAX_TREE_DEPTH 16   /* nested containers in one tree */
#define PROTO_MAX_LEAVES     4096 /* tensor + None leaves in one tree */
#define PROTO_MAX_KEY_BYTES  256  /* dict key length in bytes */
#define PROTO_MAX_NDIM       8    /* tensor rank */
/*
 * msgpack-level guards, checked on the raw bytes before msgpack-c unpacks
 * anything: nesting (its C unpacker fails past 32), and objects per frame
 * (each costs ~24 bytes in the unpack zone, so a frame of 1-byte empty
 * arrays would otherwise amplify 24x).
 */
#define PROTO_MAX_MSGPACK_DEPTH 24
#define PROTO_MAX_OBJECTS       65536

/* Tensors ride in ext types; tuples are arrays whose first item is a marker. */
#define PROTO_EXT_TENSOR   1
#define PROTO_EXT_TUPLE    2
#define PROTO_EXT_SHM      3  /* a tensor whose bytes lie in the connection's memfd */
#define PROTO_TENSOR_ALIGN 64 /* encoders pad so tensor bytes land aligned */
/* Shared-memory references: offsets are multiples of PROTO_TENSOR_ALIGN. */
#define PROTO_SHM_HEAD 24 /* u8 dtype, u8 ndim, 6 x 0, u64 offset, u64 nbytes */

enum proto_dtype { PROTO_DTYPE_F32 = 1, PROTO_DTYPE_F64 = 2 };

/*
 * The ops: enum name and wire name (the `op` field, #id).  The daemon's op
 * table is generated from this list (daemon/ops/ops.c): each op's descriptor
 * op_<id>_desc lives in daemon/op_<id>.c, so an op listed here without one
 * does not link.
 */
#define PROTO_OPS(X)                                                                               \
	X(HELLO, hello)                                                                            \
	X(HEALTH, health)                                                                          \
	X(REGISTER, register)                                                                      \
	X(UNREGISTER, unregister)                                                                  \
	X(LIST, list)                                                                              \
	X(DESCRIBE, describe)                                                                      \
	X(SCAN, scan)                                                                              \
	X(GRAD, grad)                                                                              \
	X(COMPILE, compile)                                                                        \
	X(STATS, stats)                                                                            \
	X(SHUTDOWN, shutdown)                                                                      \
	X(ATTACH, attach)                                                                          \
	X(ARTIFACT, artifact)                                                                      \
	X(REPORT, report)

/*
 * Error codes: enum name, wire string, one-line meaning.  The wire string
 * is the stable identity; never renumber-dependent, never reused.
 */
#define PROTO_ERRORS(X)                                                                            \
	X(OK, "OK", "no error")                                                                    \
	/* framing and msgpack (frame-level; some close the connection) */                         \
	X(FRAME_TOO_LARGE, "FRAME_TOO_LARGE", "length prefix exceeds frame limit")                 \
	X(FRAME_TRUNCATED, "FRAME_TRUNCATED", "stream ended inside a frame")                       \
	X(FRAME_TIMEOUT, "FRAME_TIMEOUT", "a frame stopped arriving midway (frame-timeout)")       \
	X(MSGPACK_INVALID, "MSGPACK_INVALID", "body is not exactly one msgpack value")             \
	X(MSGPACK_COUNT_TOO_LARGE, "MSGPACK_COUNT_TOO_LARGE",                                      \
	  "container count exceeds the bytes left in the frame")                                   \
	X(OBJECT_LIMIT, "OBJECT_LIMIT", "too many msgpack objects in one frame")                   \
	X(NOT_A_MAP, "NOT_A_MAP", "frame body is not a msgpack map")                               \
	X(BAD_ENVELOPE, "BAD_ENVELOPE", "missing or mistyped id or op")                            \
	X(UNKNOWN_OP, "UNKNOWN_OP", "op is not known to this daemon")                              \
	X(VERSION_MISMATCH, "VERSION_MISMATCH", "protocol versions differ")                        \
	/* tensor trees */                                                                         \
	X(DEPTH_EXCEEDED, "DEPTH_EXCEEDED", "tree nested deeper than the limit")                   \
	X(TOO_MANY_LEAVES, "TOO_MANY_LEAVES", "tree has more leaves than the limit")               \
	X(KEY_TOO_LONG, "KEY_TOO_LONG", "dict key longer than the limit")                          \
	X(DUPLICATE_KEY, "DUPLICATE_KEY", "dict key appears twice")                                \
	X(NON_STRING_KEY, "NON_STRING_KEY", "dict key is not a string")                            \
	X(UNKNOWN_TYPE, "UNKNOWN_TYPE", "tree node of an unknown type or ext tag")                 \
	X(BAD_DTYPE, "BAD_DTYPE", "tensor dtype is not float32 or float64")                        \
	X(BAD_SHAPE, "BAD_SHAPE", "tensor rank or dimension out of range")                         \
	X(SHAPE_OVERFLOW, "SHAPE_OVERFLOW", "element count overflows int64")                       \
	X(BYTE_LENGTH_MISMATCH, "BYTE_LENGTH_MISMATCH",                                            \
	  "tensor byte length differs from its shape and dtype")                                   \
	/* request validation */                                                                   \
	X(INVALID_ARGUMENT, "INVALID_ARGUMENT", "a request field is missing or wrong")             \
	X(BAD_REQUEST, "BAD_REQUEST", "a request string is not well-formed UTF-8")                 \
	X(INVALID_NAME, "INVALID_NAME", "adapter name is empty or malformed")                      \
	X(INVALID_BOUNDS, "INVALID_BOUNDS", "max_steps/max_elements/budget out of range")          \
	X(NOT_FOUND, "NOT_FOUND", "no adapter of that name")                                       \
	X(DTYPE_MISMATCH, "DTYPE_MISMATCH", "leaves of one request differ in dtype")               \
	X(NO_INPUTS, "NO_INPUTS", "the inputs tree has no tensor leaf")                            \
	X(BAD_RANK, "BAD_RANK", "an input leaf is 0-d")                                            \
	X(LENGTH_MISMATCH, "LENGTH_MISMATCH", "input leaves differ in leading length")             \
	X(BATCH_MISMATCH, "BATCH_MISMATCH",                                                        \
	  "leaves differ in batch size, or lack one (dynamic = batch)")                            \
	X(TOO_MANY_STEPS, "TOO_MANY_STEPS", "T is 0 or exceeds max_steps")                         \
	X(TOO_MANY_ELEMENTS, "TOO_MANY_ELEMENTS", "a leaf exceeds max_elements")                   \
	X(SPEC_MISMATCH, "SPEC_MISMATCH", "tensors differ from the compiled signature")            \
	X(COTANGENT_MISMATCH, "COTANGENT_MISMATCH", "cotangent tree does not match")               \
	X(SAVED_MISMATCH, "SAVED_MISMATCH",                                                        \
	  "saved is not what this grad's forward graph kept (length, dtype, or saved_key)")        \
	/* shared memory (the attach op and PROTO_EXT_SHM leaves) */                               \
	X(SHM_NO_FD, "SHM_NO_FD", "attach came without a file descriptor")                         \
	X(SHM_ALREADY_ATTACHED, "SHM_ALREADY_ATTACHED", "the connection has a region already")     \
	X(SHM_BAD_FD, "SHM_BAD_FD", "the descriptor is not a writable memfd")                      \
	X(SHM_NOT_SEALED, "SHM_NOT_SEALED", "the memfd is not sealed against shrinking")           \
	X(SHM_UNDERSIZED, "SHM_UNDERSIZED", "the memfd is smaller than the size attached")         \
	X(SHM_TOO_LARGE, "SHM_TOO_LARGE", "the region exceeds max-shm or max-shm-total")           \
	X(SHM_NOT_ATTACHED, "SHM_NOT_ATTACHED", "a reference names a region the connection lacks") \
	X(SHM_OUT_OF_BOUNDS, "SHM_OUT_OF_BOUNDS", "a reference lies outside the region")           \
	X(SHM_MISALIGNED, "SHM_MISALIGNED", "a reference is not 64-byte aligned")                  \
	X(SHM_OVERLAP, "SHM_OVERLAP", "the output area overlaps a tensor of the request")          \
	/* compile path */                                                                         \
	X(RECOMPILE_BUDGET_EXHAUSTED, "RECOMPILE_BUDGET_EXHAUSTED",                                \
	  "adapter holds recompile_budget specializations already")                                \
	X(BODY_ERROR, "BODY_ERROR", "the body raised while being traced")                          \
	X(GRAPH_BREAK, "GRAPH_BREAK", "the body cannot be captured as one graph")                  \
	X(BAD_GRAPH, "BAD_GRAPH", "a captured graph is malformed or uses a refused op")            \
	X(UNSUPPORTED_OP, "UNSUPPORTED_OP", "the body uses an op Inductor cannot compile")         \
	X(CARRY_MISMATCH, "CARRY_MISMATCH",                                                        \
	  "the body changed the carry's structure, shape or dtype")                                \
	X(PROXY_EXECUTOR_REQUIRED, "PROXY_EXECUTOR_REQUIRED",                                      \
	  "artifact needs AOTI's C++ proxy executor")                                              \
	X(UNSAFE_ARTIFACT, "UNSAFE_ARTIFACT",                                                      \
	  "artifact has an executable stack or text relocations")                                  \
	X(BATCH_SPECIALIZED, "BATCH_SPECIALIZED",                                                  \
	  "the body fixes the batch size (dynamic = batch)")                                       \
	X(MISCOMPILE, "MISCOMPILE", "the compiled graph disagrees with the eager scan")            \
	X(COMPILE_FAILED, "COMPILE_FAILED", "the compile failed for another reason")               \
	X(COMPILE_TIMEOUT, "COMPILE_TIMEOUT", "the compile exceeded its timeout")                  \
	X(WORKER_CRASHED, "WORKER_CRASHED", "the compile worker died")                             \
	X(ARTIFACT_CORRUPT, "ARTIFACT_CORRUPT", "a cached artifact failed verification")           \
	X(ENGINE_ERROR, "ENGINE_ERROR", "the compiled graph failed to load or run")                \
	X(INDEX_OUT_OF_RANGE, "INDEX_OUT_OF_RANGE",                                                \
	  "an index the graph read from its inputs is out of range")                               \
	X(LINALG_ERROR, "LINALG_ERROR",                                                            \
	  "a linear-algebra op of the graph met a singular or non-positive-definite matrix")       \
	/* daemon state */                                                                         \
	X(PERMISSION_DENIED, "PERMISSION_DENIED", "peer may not perform this op")                  \
	X(BUSY, "BUSY", "too many requests in flight on this connection")                          \
	X(SHUTTING_DOWN, "SHUTTING_DOWN", "the daemon is stopping")                                \
	X(INTERNAL, "INTERNAL", "a bug or resource failure inside the daemon")

enum proto_code {
#define PROTO_X_ENUM(e, s, d) PROTO_E_##e,
	PROTO_ERRORS(PROTO_X_ENUM)
#undef PROTO_X_ENUM
	    PROTO_E__COUNT
};

enum proto_op {
#define PROTO_X_OP(e, id) PROTO_OP_##e,
	PROTO_OPS(PROTO_X_OP)
#undef PROTO_X_OP
	    PROTO_OP__COUNT
};

#define PROTO_PATH_MAX    512
#define PROTO_MESSAGE_MAX 1024

/*
 * An error as it travels: code, human text, and the offending leaf path
 * (e.g. inputs["forcing"][1]); path is "" when no leaf is involved.
 * Owned by whoever declared it; functions only fill it.
 */
struct proto_err {
	enum proto_code code;
	unsigned flags; /* PROTO_ERR_*: how the daemon treats it; never on the wire */
	char path[PROTO_PATH_MAX];
	char message[PROTO_MESSAGE_MAX];
};

/* A failure of the machine or of the worker, not of the request: never
 * remembered against a specialization (disk full, timeout, crash). */
#define PROTO_ERR_TRANSIENT 1u
/* The compile worker died while running this very job. */
#define PROTO_ERR_JOB_CRASH 2u

const char *proto_code_name(enum proto_code code);
/* Returns the code for a wire string, or -1 when unknown. */
int proto_code_from_name(const char *name, size_t len);
const char *proto_op_name(enum proto_op op);
/* Returns the op for a wire string, or -1 when unknown. */
int proto_op_from_name(const char *name, size_t len);
size_t proto_dtype_size(enum proto_dtype dtype);
const char *proto_dtype_name(enum proto_dtype dtype);

/* Fills err (code, path, printf-style message) and returns -1. */
int proto_fail(struct proto_err *err, enum proto_code code, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void proto_err_clear(struct proto_err *err);

#endif

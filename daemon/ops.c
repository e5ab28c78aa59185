/*
 * ops.c - the op table, generated from PROTO_OPS (proto/protocol.h).  Each op
 * lives in its own op_<id>.c, which defines op_<id>_desc: adding an op is
 * that file and one line in PROTO_OPS; an op without a descriptor is a link
 * error, never a NULL call.
 */
#include "daemon.h"

#define X(e, id) extern const struct op_desc op_##id##_desc;
PROTO_OPS(X)
#undef X

const struct op_desc *const OP_TABLE[PROTO_OP__COUNT] = {
#define X(e, id) [PROTO_OP_##e] = &op_##id##_desc,
    PROTO_OPS(X)
#undef X
};

/*
 * ops.c - the op table: one line per op, each op in its own op_*.c file.
 * Adding an op: a new file exporting its descriptor, one line in
 * PROTO_OPS (proto/protocol.h) and one line here.
 */
#include "daemon.h"

#define X(e, s) extern const struct op_desc op_##e##_desc;
X(hello, "")
X(health, "")
X(register, "")
X(unregister, "")
X(list, "")
X(describe, "")
X(scan, "")
X(grad, "")
X(compile, "")
X(stats, "")
X(shutdown, "")
X(attach, "")
#undef X

const struct op_desc *const OP_TABLE[PROTO_OP__COUNT] = {
    [PROTO_OP_HELLO] = &op_hello_desc,       [PROTO_OP_HEALTH] = &op_health_desc,
    [PROTO_OP_REGISTER] = &op_register_desc, [PROTO_OP_UNREGISTER] = &op_unregister_desc,
    [PROTO_OP_LIST] = &op_list_desc,         [PROTO_OP_DESCRIBE] = &op_describe_desc,
    [PROTO_OP_SCAN] = &op_scan_desc,         [PROTO_OP_GRAD] = &op_grad_desc,
    [PROTO_OP_COMPILE] = &op_compile_desc,   [PROTO_OP_STATS] = &op_stats_desc,
    [PROTO_OP_SHUTDOWN] = &op_shutdown_desc, [PROTO_OP_ATTACH] = &op_attach_desc,
};

/*
 * protocol.c - tables behind protocol.h: code and op names, dtype sizes,
 * and the error-filling helper every module uses.  Pure functions; any
 * thread.
 */
#include "protocol.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static const char *const code_names[] = {
#define PROTO_X_NAME(e, s, d) s,
    PROTO_ERRORS(PROTO_X_NAME)
#undef PROTO_X_NAME
};

static const char *const op_names[] = {
#define PROTO_X_OPNAME(e, id) #id,
    PROTO_OPS(PROTO_X_OPNAME)
#undef PROTO_X_OPNAME
};

const char *proto_code_name(enum proto_code code)
{
	if ((unsigned)code >= PROTO_E__COUNT)
		return "INTERNAL";
	return code_names[code];
}

static int lookup(const char *const *table, int n, const char *name, size_t len)
{
	for (int i = 0; i < n; i++)
		if (strlen(table[i]) == len && memcmp(table[i], name, len) == 0)
			return i;
	return -1;
}

int proto_code_from_name(const char *name, size_t len)
{
	return lookup(code_names, PROTO_E__COUNT, name, len);
}

const char *proto_op_name(enum proto_op op)
{
	if ((unsigned)op >= PROTO_OP__COUNT)
		return "?";
	return op_names[op];
}

int proto_op_from_name(const char *name, size_t len)
{
	return lookup(op_names, PROTO_OP__COUNT, name, len);
}

size_t proto_dtype_size(enum proto_dtype dtype)
{
	switch (dtype) {
	case PROTO_DTYPE_F32:
		return 4;
	case PROTO_DTYPE_F64:
		return 8;
	}
	return 0;
}

const char *proto_dtype_name(enum proto_dtype dtype)
{
	switch (dtype) {
	case PROTO_DTYPE_F32:
		return "float32";
	case PROTO_DTYPE_F64:
		return "float64";
	}
	return "?";
}

int proto_fail(struct proto_err *err, enum proto_code code, const char *path, const char *fmt, ...)
{
	va_list ap;

	if (err == NULL)
		return -1;
	err->code = code;
	err->flags = 0;
	snprintf(err->path, sizeof err->path, "%s", path ? path : "");
	va_start(ap, fmt);
	vsnprintf(err->message, sizeof err->message, fmt, ap);
	va_end(ap);
	return -1;
}

void proto_err_clear(struct proto_err *err)
{
	err->code = PROTO_E_OK;
	err->flags = 0;
	err->path[0] = '\0';
	err->message[0] = '\0';
}

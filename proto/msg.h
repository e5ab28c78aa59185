/*
 * msg.h - the envelope.  A request is a map {id, op, ...fields}; a reply is
 * {id, result} or {id, error: {code, message, path}}; a notification is
 * {id, event, ...} tied to the request id it concerns.
 *
 * msg_parse runs mpguard on the body, unpacks it with msgpack-c without
 * copying (strings, bins and exts point into the body) and checks the
 * envelope.  A struct msg owns the msgpack zone; trees decoded from it live
 * in that zone, so they die with msg_destroy.  The body must outlive it too.
 */
#ifndef TORCHLOOP_MSG_H
#define TORCHLOOP_MSG_H

#include "protocol.h"
#include "tree.h"
#include "writer.h"

#include <msgpack.h>
#include <stdbool.h>

/* MSG_ANY: any guarded map (records on disk), no envelope fields required. */
enum msg_kind { MSG_REQUEST, MSG_REPLY, MSG_ANY };

struct msg {
	msgpack_unpacked up;
	const msgpack_object_map *map;
	bool has_id;
	uint64_t id;
	int op; /* enum proto_op, or -1 when the name is unknown */
	const char *op_name;
	uint32_t op_len;
	bool is_error; /* replies: has an error map */
	bool is_event; /* replies: a notification, not the final answer */
	/* shared-memory references in its trees resolve here (NULL: none) */
	const struct tree_region *region;
};

/*
 * Parses a frame body.  For MSG_REQUEST, id (unsigned integer) and op
 * (string) must be present; an unknown op name is not an error here (op is
 * -1) so the caller can answer UNKNOWN_OP with the id.  Every string of a
 * request (keys too, at any depth) must be well-formed UTF-8 (utf8.h), else
 * BAD_REQUEST with the top-level field as path: no worker, log line or
 * state file ever sees other bytes as text.  Returns 0, or -1
 * with err; m->has_id/m->id are set whenever the id could be read, so the
 * caller can address its error reply.  msg_destroy is always safe after.
 */
int msg_parse(struct msg *m, const uint8_t *body, size_t len, enum msg_kind kind,
              struct proto_err *err);
void msg_destroy(struct msg *m);

const msgpack_object *msg_field(const struct msg *m, const char *key);
const msgpack_object *msg_obj_field(const msgpack_object *map, const char *key);

/* Typed getters: 0 on success, 1 when absent (out untouched), -1 with err
 * (INVALID_ARGUMENT naming the field) when present with the wrong type. */
int msg_get_str(const msgpack_object *map, const char *key, const char **s, uint32_t *len,
                struct proto_err *err);
/* Integers only: a bool or a float is not an integer (as in the reference). */
int msg_get_i64(const msgpack_object *map, const char *key, int64_t *v, struct proto_err *err);
int msg_get_bool(const msgpack_object *map, const char *key, bool *v, struct proto_err *err);
/* Decodes a tree field; absent gives 1 unless required (then INVALID_ARGUMENT). */
int msg_get_tree(const struct msg *m, const char *key, bool required, struct tree_node *out,
                 struct proto_err *err);

/* Reads error {code, message, path} of a reply into err.  Returns 0. */
int msg_reply_error(const struct msg *m, struct proto_err *err);

/* Writers: a map with the id plus nfields more entries follows. */
void msg_begin_request(struct writer *w, uint64_t id, const char *op, uint32_t nfields);
void msg_begin_result(struct writer *w, bool has_id, uint64_t id, uint32_t nfields);
void msg_begin_event(struct writer *w, uint64_t id, const char *event, uint32_t nfields);
void msg_write_error(struct writer *w, bool has_id, uint64_t id, const struct proto_err *err);

#endif

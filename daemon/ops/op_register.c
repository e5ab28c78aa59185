/*
 * op_register.c - register: name, body, bounds, budget, strategy.  The body
 * is Python source + entry (admin only: the compile worker imports it, as
 * the daemon's user) or a captured step graph, body_graph (any peer: the
 * worker loads it as data, daemon/worker/torchloop_worker/graph_loader.py; it takes no
 * entry).  A non-admin's graph must be named "g." + the hash of its text and
 * of every field adapter_same_def compares (adapter_graph_name: so it cannot
 * take or replace another's), and counts against --max-graphs-per-uid (the uid's
 * least recently used graph adapter is dropped to make room).  The same
 * name with a different definition replaces the adapter.  A new definition
 * is checked in the compile worker first (a "check" job, queued ahead of
 * compiles): a syntax error, an import that raises or a missing entry
 * function is refused with BODY_ERROR, a graph that does not load with
 * BAD_GRAPH, and nothing is registered.  Graphs are not persisted in
 * --state-dir: the client registers them again when the daemon forgot them.
 *
 * The request waits for the check; struct reg_check owns the parsed
 * definition until the worker answers (loop thread, compiler callback).  A
 * check passed before on this cache is not run again (check_key).
 */
#include "daemon.h"

#include "log.h"

#include <stdlib.h>
#include <string.h>

static int get_bound(struct request *req, const char *key, int64_t *v, const char *msg,
                     struct proto_err *err)
{
	int rc = msg_get_i64(&req->msg.up.data, key, v, err);

	if (rc < 0) /* a bool or a float is not an integer */
		return proto_fail(err, PROTO_E_INVALID_BOUNDS, key, "%s", msg);
	return 0;
}

static int copy_str(struct request *req, const char *key, char *dst, size_t size, bool required,
                    struct proto_err *err)
{
	const char *s;
	uint32_t n;
	int rc = msg_get_str(&req->msg.up.data, key, &s, &n, err);

	if (rc < 0)
		return -1;
	if (rc > 0)
		return required ? proto_fail(err, PROTO_E_INVALID_ARGUMENT, key,
		                             "register needs %s", key)
		                : 0;
	if (n >= size)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, key, "%s is longer than %zu bytes",
		                  key, size - 1);
	memcpy(dst, s, n);
	dst[n] = '\0';
	return 0;
}

static int get_name(struct request *req, struct adapter_def *def, struct proto_err *err)
{
	const char *s;
	uint32_t n;
	int rc = msg_get_str(&req->msg.up.data, "name", &s, &n, err);

	if (rc < 0)
		return proto_fail(err, PROTO_E_INVALID_NAME, "name", "name must be a string");
	if (rc > 0 || n == 0)
		return proto_fail(err, PROTO_E_INVALID_NAME, "name",
		                  "Loop adapter namespace must not be empty");
	if (n > ADAPTER_NAME_MAX)
		return proto_fail(err, PROTO_E_INVALID_NAME, "name",
		                  "adapter name must match [A-Za-z0-9._-]{1,64}");
	memcpy(def->name, s, n);
	def->name[n] = '\0';
	return 0;
}

/* body_source or body_graph, exactly one, into def->source. */
static int get_body(struct request *req, struct adapter_def *def, struct proto_err *err)
{
	const char *src, *graph;
	uint32_t n_src, n_graph;
	int rs = msg_get_str(&req->msg.up.data, "body_source", &src, &n_src, err);
	int rg = rs < 0 ? -1 : msg_get_str(&req->msg.up.data, "body_graph", &graph, &n_graph, err);
	const char *key = rg == 0 ? "body_graph" : "body_source";

	if (rs < 0 || rg < 0)
		return -1;
	if ((rs == 0) == (rg == 0))
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "body_source",
		                  "register needs body_source (the body's Python source) or "
		                  "body_graph (a captured step graph), not both");
	def->graph = rg == 0;
	if (def->graph) {
		src = graph;
		n_src = n_graph;
	}
	if (n_src > PROTO_MAX_SOURCE)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, key, "%s is over %d bytes", key,
		                  PROTO_MAX_SOURCE);
	if (memchr(src, '\0', n_src) != NULL)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, key, "%s holds a NUL byte", key);
	def->source = malloc(n_src + 1);
	if (def->source == NULL)
		return proto_fail(err, PROTO_E_INTERNAL, NULL, "out of memory");
	memcpy(def->source, src, n_src);
	def->source[n_src] = '\0';
	return 0;
}

/* A graph has no function for entry to name: refused with body_graph, so a
 * graph's definition has one form (its name hashes entry all the same). */
static int no_graph_entry(struct request *req, const struct adapter_def *def, struct proto_err *err)
{
	const char *s;
	uint32_t n;

	if (!def->graph || msg_get_str(&req->msg.up.data, "entry", &s, &n, err) != 0)
		return 0;
	return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "entry",
	                  "entry names the function of a body_source; a captured graph "
	                  "(body_graph) has none: leave entry out");
}

/* Source runs code: admins only.  A graph is data: anyone, under the name
 * its content gives it. */
static int permitted(struct request *req, const struct adapter_def *def, struct proto_err *err)
{
	char want[ADAPTER_GRAPH_NAME_LEN + 1];

	if (request_is_admin(req))
		return 0;
	if (!def->graph)
		return proto_fail(
		    err, PROTO_E_PERMISSION_DENIED, NULL,
		    "register with body_source is reserved to the daemon's user, root "
		    "and the admin group (peer uid %d): it runs Python in the daemon; "
		    "captured graphs (body_graph) are open to every user",
		    (int)req->conn->uid);
	adapter_graph_name(def, want);
	if (strcmp(def->name, want) != 0)
		return proto_fail(
		    err, PROTO_E_PERMISSION_DENIED, "name",
		    "a captured graph registered by uid %d must be named %s (g. + the "
		    "hash of its text and every field of its definition)",
		    (int)req->conn->uid, want);
	return 0;
}

static int parse_def(struct request *req, struct adapter_def *def, struct proto_err *err)
{
	adapter_def_defaults(def);
	if (get_name(req, def, err) ||
	    get_bound(req, "max_steps", &def->max_steps,
	              PROTO_BOUND_MESSAGE("max_steps", PROTO_MAX_STEPS), err) ||
	    get_bound(req, "max_elements", &def->max_elements,
	              PROTO_BOUND_MESSAGE("max_elements", PROTO_MAX_ELEMENTS), err) ||
	    get_bound(req, "recompile_budget", &def->budget,
	              PROTO_BOUND_MESSAGE("recompile_budget", PROTO_MAX_BUDGET), err) ||
	    copy_str(req, "entry", def->entry, sizeof def->entry, false, err) ||
	    copy_str(req, "strategy", def->strategy, sizeof def->strategy, false, err) ||
	    copy_str(req, "dynamic", def->dynamic, sizeof def->dynamic, false, err) ||
	    copy_str(req, "body_file", def->body_file, sizeof def->body_file, false, err) ||
	    get_body(req, def, err) || no_graph_entry(req, def, err))
		return -1;
	def->owner = req->conn->uid;
	return adapter_def_validate(def, err) || permitted(req, def, err);
}

struct reg_check {
	struct compile_job job;
	struct request *req;
	struct daemon *d;
	struct adapter_def def; /* owns def.source until registered */
	struct worker_info wi;  /* the loop's, copied for the pool's check_key */
	uv_work_t work;         /* the remembered check's lookup, then its record */
	char key[CACHE_KEY_HEX];
	bool remembered;
};

/* A new graph of a uid at its --max-graphs-per-uid: its least recently used
 * graph adapter goes (its runs finish; its clients register it again). */
static void make_room(struct request *req, const struct adapter_def *def)
{
	struct registry *r = &req->d->graphs.reg;
	struct adapter *lru, *old = adapter_find(r, def->name, strlen(def->name));

	if (!def->graph || (old && old->def.graph && old->def.owner == def->owner))
		return;
	while (adapter_count_graphs(r, def->owner, &lru) >=
	       (unsigned)req->d->cfg.max_graphs_per_uid) {
		log_line(LOG_INFO, req->id, lru->def.name,
		         "dropped: uid %d is at max-graphs-per-uid=%lld", (int)def->owner,
		         req->d->cfg.max_graphs_per_uid);
		req->d->stats.graphs_evicted++;
		adapter_unregister(r, lru->def.name, strlen(lru->def.name));
	}
}

static void finish_register(struct request *req, struct adapter_def *def)
{
	struct outmsg *out;
	struct adapter *a;
	struct proto_err err;
	bool replaced, unchanged, persisted;

	make_room(req, def);
	a = adapter_register(&req->d->graphs.reg, def, &replaced, &unchanged);
	if (a == NULL) {
		free(def->source);
		request_fail_code(req, PROTO_E_INTERNAL, NULL, "out of memory");
		return;
	}
	log_line(LOG_INFO, req->id, a->def.name, "%s by uid %d",
	         unchanged  ? "re-registered unchanged"
	         : replaced ? "replaced"
	                    : "registered",
	         (int)req->conn->uid);
	if (unchanged && a->worker_crashes >= 2) { /* what the ban's message says lifts it */
		log_line(LOG_INFO, req->id, a->def.name,
		         "its body killed the compile worker %u times: compiled again from now on",
		         a->worker_crashes);
		a->worker_crashes = 0;
	}
	a->def.origin = ADAPTER_REGISTERED;
	persisted = req->d->cfg.state_dir[0] != '\0' && !a->def.graph;
	if (persisted && persist_save(req->d, &a->def, &err) != 0) {
		log_line(LOG_WARN, req->id, a->def.name, "not persisted: %s", err.message);
		persisted = false;
	}
	out = request_begin_result(req, 4);
	if (out == NULL)
		return;
	writer_key_str(&out->w, "name", a->def.name);
	writer_key_bool(&out->w, "replaced", replaced);
	writer_key_bool(&out->w, "unchanged", unchanged);
	writer_key_bool(&out->w, "persisted", persisted);
	request_reply(req, out);
}

/*
 * A check's outcome is a function of the definition's text and the worker
 * that checks it: a pass is remembered in the cache under that key
 * (cache_checked.c), so the same definition registered again, by this
 * daemon or another on the cache, skips the worker.  A failure is never
 * remembered.  For body_source, what its module imports is read at its
 * compile (BODY_ERROR there), as for any body whose graphs are cached.
 */
static void check_key(struct reg_check *rc)
{
	const char *parts[] = {"torchloopd.check", rc->def.graph ? "graph" : "source",
	                       rc->def.source,     rc->job.body_file,
	                       rc->def.entry,      rc->d->worker_sha,
	                       rc->wi.torch,       rc->wi.torch_git,
	                       TORCHLOOP_VERSION};

	cache_key(parts, sizeof parts / sizeof parts[0], rc->key);
}

static void find_work(uv_work_t *w)
{
	struct reg_check *rc = w->data;

	check_key(rc);
	rc->remembered = cache_checked_find(&rc->d->cache, rc->key);
}

static void add_work(uv_work_t *w)
{
	struct reg_check *rc = w->data;

	cache_checked_add(&rc->d->cache, rc->key);
}

static void added(uv_work_t *w, int status)
{
	(void)status;
	free(w->data);
}

static void checked(struct compile_job *job, const struct compile_result *res,
                    const struct proto_err *err)
{
	struct reg_check *rc = job->data;

	(void)res;
	if (err != NULL) {
		free(rc->def.source);
		request_fail(rc->req, err);
		free(rc);
		return;
	}
	finish_register(rc->req, &rc->def);
	/* no key when the lookup could not be queued (op_register): nothing to record */
	if (rc->key[0] == '\0' || uv_queue_work(rc->d->loop, &rc->work, add_work, added) != 0)
		free(rc);
}

/* Remembered: registered at once; else the worker checks it. */
static void found(uv_work_t *w, int status)
{
	struct reg_check *rc = w->data;

	if (status == 0 && rc->remembered) {
		log_line(LOG_INFO, rc->req->id, rc->def.name,
		         "checked before (the cache remembers it): no check job");
		finish_register(rc->req, &rc->def);
		free(rc);
		return;
	}
	compiler_submit(rc->d->compiler, &rc->job);
}

static void op_register(struct request *req)
{
	struct reg_check *rc = calloc(1, sizeof *rc);
	struct proto_err err;
	struct adapter *old;

	if (rc == NULL) {
		request_fail_code(req, PROTO_E_INTERNAL, NULL, "out of memory");
		return;
	}
	if (parse_def(req, &rc->def, &err) != 0) {
		free(rc->def.source);
		free(rc);
		request_fail(req, &err);
		return;
	}
	old = adapter_find(&req->d->graphs.reg, rc->def.name, strlen(rc->def.name));
	if (old && adapter_same_def(old, &rc->def)) {
		finish_register(req, &rc->def); /* nothing new to import */
		free(rc);
		return;
	}
	rc->req = req;
	rc->job.check_only = true;
	rc->job.tenant = compiler_tenant(req->conn->uid); /* the text is the requester's */
	rc->job.graph = rc->def.graph;
	rc->job.body_source = rc->def.source;
	rc->job.body_file = rc->def.body_file[0] ? rc->def.body_file : rc->def.name;
	rc->job.entry = rc->def.entry;
	rc->job.done = checked;
	rc->job.data = rc;
	rc->d = req->d;
	rc->wi = *compiler_info(req->d->compiler);
	rc->work.data = rc;
	if (uv_queue_work(req->d->loop, &rc->work, find_work, found) != 0)
		compiler_submit(req->d->compiler, &rc->job);
}

const struct op_desc op_register_desc = {"register", op_register, 0};

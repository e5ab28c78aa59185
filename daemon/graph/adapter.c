/*
 * adapter.c - named adapters (the graph layer's registry).  Loop thread only.
 *
 * Registering a name that exists with the same definition (every field of
 * graphs.h's ADAPTER_FIELDS, the table a captured graph's name hashes too)
 * keeps the adapter (and its graphs); anything different replaces it: the
 * old adapter is unlisted, its specializations dropped (runs in flight
 * finish on their own references) and the budget starts again.  The
 * validation messages are the reference adapter's.
 */
#include "graphs.h"

#include "sha256.h"
#include "utf8.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the graph layer never sees a request or a connection (docs/architecture.md) */
#pragma GCC poison request conn outmsg daemon

static bool name_ok(const char *s)
{
	size_t n = strlen(s);

	if (n == 0 || n > ADAPTER_NAME_MAX)
		return false;
	for (size_t i = 0; i < n; i++) {
		char ch = s[i];
		if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
		      (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-'))
			return false;
	}
	return true;
}

static bool ident_ok(const char *s)
{
	if (!*s || (*s >= '0' && *s <= '9'))
		return false;
	for (; *s; s++)
		if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') ||
		      (*s >= '0' && *s <= '9') || *s == '_'))
			return false;
	return true;
}

int adapter_def_validate(struct adapter_def *def, struct proto_err *err)
{
	if (def->name[0] == '\0')
		return proto_fail(err, PROTO_E_INVALID_NAME, "name",
		                  "Loop adapter namespace must not be empty");
	if (!name_ok(def->name))
		return proto_fail(err, PROTO_E_INVALID_NAME, "name",
		                  "adapter name must match [A-Za-z0-9._-]{1,64}");
	if (def->max_steps < 1 || def->max_steps > PROTO_MAX_STEPS)
		return proto_fail(err, PROTO_E_INVALID_BOUNDS, "max_steps",
		                  PROTO_BOUND_MESSAGE("max_steps", PROTO_MAX_STEPS));
	if (def->max_elements < 1 || def->max_elements > PROTO_MAX_ELEMENTS)
		return proto_fail(err, PROTO_E_INVALID_BOUNDS, "max_elements",
		                  PROTO_BOUND_MESSAGE("max_elements", PROTO_MAX_ELEMENTS));
	if (def->budget < 1 || def->budget > PROTO_MAX_BUDGET)
		return proto_fail(err, PROTO_E_INVALID_BOUNDS, "recompile_budget",
		                  PROTO_BOUND_MESSAGE("recompile_budget", PROTO_MAX_BUDGET));
	if (strcmp(def->strategy, "unroll") != 0 && strcmp(def->strategy, "scan") != 0 &&
	    strcmp(def->strategy, "chunk") != 0)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "strategy",
		                  "strategy must be \"unroll\", \"scan\" or \"chunk\"");
	if (strcmp(def->dynamic, "none") != 0 && strcmp(def->dynamic, "batch") != 0)
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "dynamic",
		                  "dynamic must be \"none\" or \"batch\"");
	if (!ident_ok(def->entry))
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "entry",
		                  "entry must name a Python function");
	if (def->source == NULL || def->source[0] == '\0')
		return proto_fail(err, PROTO_E_INVALID_ARGUMENT, "body",
		                  "the adapter has no body source");
	/* an adapter file's body: a request's was checked with the frame (msg.c) */
	if (utf8_check(def->source, strlen(def->source)) != strlen(def->source))
		return proto_fail(err, PROTO_E_BAD_REQUEST, "body",
		                  "the body is not well-formed UTF-8 (byte %zu)",
		                  utf8_check(def->source, strlen(def->source)));
	if (utf8_check(def->body_file, strlen(def->body_file)) != strlen(def->body_file))
		return proto_fail(err, PROTO_E_BAD_REQUEST, "body_file",
		                  "body_file is not well-formed UTF-8");
	return 0;
}

void adapter_def_defaults(struct adapter_def *def)
{
	memset(def, 0, sizeof *def);
	def->max_steps = PROTO_DEFAULT_STEPS;
	def->max_elements = PROTO_DEFAULT_ELEMENTS;
	def->budget = PROTO_DEFAULT_BUDGET;
	snprintf(def->strategy, sizeof def->strategy, "unroll");
	snprintf(def->dynamic, sizeof def->dynamic, "none");
	snprintf(def->entry, sizeof def->entry, "body");
}

static void body_hash(struct adapter *a)
{
	struct sha256 s;
	uint8_t md[32];

	sha256_init(&s);
	sha256_update(&s, a->def.source, strlen(a->def.source) + 1);
	sha256_update(&s, a->def.entry, strlen(a->def.entry) + 1);
	if (a->def.graph) /* the same text as Python source is another body */
		sha256_update(&s, "graph", 6);
	sha256_final(&s, md);
	sha256_hex(md, a->body_sha);
}

/* ADAPTER_FIELDS' kinds as text */
static const char *field_STR(const char *v, char num[24])
{
	(void)num;
	return v ? v : "";
}

static const char *field_I64(int64_t v, char num[24])
{
	snprintf(num, 24, "%lld", (long long)v);
	return num;
}

static const char *field_BOOL(bool v, char num[24])
{
	(void)num;
	return v ? "1" : "0";
}

const char *adapter_def_field(const struct adapter_def *def, int i, char num[24])
{
	int k = 0;

#define FIELD_TEXT(member, key, kind)                                                              \
	if (k++ == i)                                                                              \
		return field_##kind(def->member, num);
	ADAPTER_FIELDS(FIELD_TEXT)
#undef FIELD_TEXT
	return NULL;
}

/* The two read the same table, so a field compared is a field hashed. */
bool adapter_same_def(const struct adapter *a, const struct adapter_def *def)
{
	char x[24], y[24];
	const char *s;

	for (int i = 0; (s = adapter_def_field(&a->def, i, x)) != NULL; i++)
		if (strcmp(s, adapter_def_field(def, i, y)) != 0)
			return false;
	return true;
}

void adapter_graph_name(const struct adapter_def *def, char out[ADAPTER_GRAPH_NAME_LEN + 1])
{
	struct sha256 s;
	uint8_t md[32];
	char hex[65], num[24];
	const char *f;

	sha256_init(&s);
	for (int i = 0; (f = adapter_def_field(def, i, num)) != NULL; i++) {
		if (i > 0)
			sha256_update(&s, "\n", 1);
		sha256_update(&s, f, strlen(f));
	}
	sha256_final(&s, md);
	sha256_hex(md, hex);
	snprintf(out, ADAPTER_GRAPH_NAME_LEN + 1, "g.%.40s", hex);
}

unsigned adapter_count_graphs(struct registry *r, uid_t owner, struct adapter **lru)
{
	unsigned n = 0;

	*lru = NULL;
	for (struct adapter *a = r->head; a; a = a->next) {
		if (!a->def.graph || a->def.owner != owner)
			continue;
		n++;
		if (*lru == NULL || a->last_found < (*lru)->last_found)
			*lru = a;
	}
	return n;
}

static void unlist(struct registry *r, struct adapter *a)
{
	struct adapter **pp = &r->head;

	while (*pp && *pp != a)
		pp = &(*pp)->next;
	if (*pp)
		*pp = a->next;
	r->count--;
	a->live = false;
	graphs_drop_all(a);
	adapter_unref(a);
}

/* Takes ownership of def->source. */
struct adapter *adapter_register(struct registry *r, struct adapter_def *def, bool *replaced,
                                 bool *unchanged)
{
	struct adapter *old = adapter_find(r, def->name, strlen(def->name));
	struct adapter *a;

	*replaced = *unchanged = false;
	if (old && adapter_same_def(old, def)) {
		free(def->source);
		def->source = NULL;
		old->def.origin = def->origin;
		*unchanged = true;
		return old;
	}
	a = calloc(1, sizeof *a);
	if (a == NULL)
		return NULL;
	a->def = *def;
	def->source = NULL;
	a->refs = 1;
	a->live = true;
	a->generation = ++r->generation;
	body_hash(a);
	if (old) {
		unlist(r, old);
		*replaced = true;
	}
	a->next = r->head;
	r->head = a;
	r->count++;
	return a;
}

int adapter_unregister(struct registry *r, const char *name, size_t len)
{
	struct adapter *a = adapter_find(r, name, len);

	if (a == NULL)
		return -1;
	unlist(r, a);
	return 0;
}

void adapter_clear(struct registry *r)
{
	while (r->head)
		unlist(r, r->head);
}

unsigned adapter_budget_used(const struct adapter *a, uid_t uid)
{
	for (unsigned i = 0; i < a->n_shares; i++)
		if (a->shares[i].uid == uid)
			return a->shares[i].used;
	return 0;
}

void adapter_record_latency(struct adapter *a, double us)
{
	a->stats.latency_us[a->stats.latency_n++ % LATENCY_RING] = us;
}

static int cmp_double(const void *x, const void *y)
{
	double a = *(const double *)x, b = *(const double *)y;

	return a < b ? -1 : a > b;
}

double adapter_latency_percentile(const struct adapter *a, double p)
{
	double tmp[LATENCY_RING];
	size_t n = a->stats.latency_n < LATENCY_RING ? a->stats.latency_n : LATENCY_RING;
	size_t idx;

	if (n == 0)
		return 0;
	memcpy(tmp, a->stats.latency_us, n * sizeof *tmp);
	qsort(tmp, n, sizeof *tmp, cmp_double);
	idx = (size_t)(p * (double)(n - 1) + 0.5);
	return tmp[idx < n ? idx : n - 1];
}

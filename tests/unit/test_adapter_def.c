/*
 * test_adapter_def.c - an adapter's definition and a captured graph's name
 * (daemon/graph/adapter.c), with no loop and no worker: every member of
 * struct adapter_def changed in turn; whatever adapter_same_def tells apart
 * gets another name (so nobody can replace another's graph under its name),
 * and the name is the one the Python package computes (a vector from
 * torchloop._graph.identity, also checked in tests/python/test_limits.py).
 */
#include "graphs.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

TestSuite(adapter_def);

/* torchloop._graph.identity('{"format":"torchloop.graph"}', 8, 4096, 8,
 * "unroll", "none"): tests/python/test_limits.py holds the same vector */
#define GRAPH_TEXT "{\"format\":\"torchloop.graph\"}"
#define GRAPH_NAME "g.10c4494dda1b98148c596518a20a986642b62c18"

static char source[] = GRAPH_TEXT, other_source[] = GRAPH_TEXT " ";

static void graph_def(struct adapter_def *def)
{
	adapter_def_defaults(def);
	snprintf(def->name, sizeof def->name, "g.any");
	def->source = source;
	def->graph = true;
	def->max_steps = 8;
	def->max_elements = 4096;
	def->budget = 8;
}

/* Changes member i of struct adapter_def (false past the last member). */
static bool change(struct adapter_def *def, int i)
{
	switch (i) {
	case 0:
		snprintf(def->name, sizeof def->name, "g.other");
		return true;
	case 1:
		def->source = other_source;
		return true;
	case 2:
		snprintf(def->body_file, sizeof def->body_file, "other.py");
		return true;
	case 3:
		snprintf(def->entry, sizeof def->entry, "other");
		return true;
	case 4:
		snprintf(def->strategy, sizeof def->strategy, "scan");
		return true;
	case 5:
		snprintf(def->dynamic, sizeof def->dynamic, "batch");
		return true;
	case 6:
		def->max_steps = 7;
		return true;
	case 7:
		def->max_elements = 4095;
		return true;
	case 8:
		def->budget = 2;
		return true;
	case 9:
		def->origin = ADAPTER_FILE;
		return true;
	case 10:
		def->graph = false;
		return true;
	case 11:
		def->owner = 65534;
		return true;
	default:
		return false;
	}
}

Test(adapter_def, every_field_the_definition_compares_changes_the_graph_name)
{
	struct adapter a;
	struct adapter_def def;
	char name[ADAPTER_GRAPH_NAME_LEN + 1], changed[ADAPTER_GRAPH_NAME_LEN + 1];
	int compared = 0, fields = 0;

#define COUNT_FIELD(member, key, kind) fields++;
	ADAPTER_FIELDS(COUNT_FIELD)
#undef COUNT_FIELD
	memset(&a, 0, sizeof a);
	graph_def(&a.def);
	adapter_graph_name(&a.def, name);
	for (int i = 0;; i++) {
		graph_def(&def);
		cr_assert(adapter_same_def(&a, &def));
		if (!change(&def, i))
			break;
		adapter_graph_name(&def, changed);
		if (adapter_same_def(&a, &def)) {
			cr_assert_str_eq(changed, name, "member %d is not compared but is hashed",
			                 i);
			continue;
		}
		compared++;
		cr_assert_str_neq(changed, name, "member %d is compared but not hashed", i);
	}
	/* what is compared is exactly the table: name, body_file, origin and
	 * owner are not part of a definition */
	cr_assert_eq(compared, fields, "%d members compared, %d in ADAPTER_FIELDS", compared,
	             fields);
	cr_assert_eq(fields, 8);
}

Test(adapter_def, the_graph_name_is_the_python_packages)
{
	struct adapter_def def;
	char name[ADAPTER_GRAPH_NAME_LEN + 1], num[24];

	graph_def(&def);
	adapter_graph_name(&def, name);
	cr_assert_str_eq(name, GRAPH_NAME);
	/* the fields' texts, in the table's order, past the last one NULL */
	cr_assert_str_eq(adapter_def_field(&def, 0, num), GRAPH_TEXT);
	cr_assert_str_eq(adapter_def_field(&def, 1, num), "1");
	cr_assert_str_eq(adapter_def_field(&def, 2, num), "body");
	cr_assert_str_eq(adapter_def_field(&def, 3, num), "8");
	cr_assert_str_eq(adapter_def_field(&def, 7, num), "none");
	cr_assert_null(adapter_def_field(&def, 8, num));
}

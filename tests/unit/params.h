/*
 * params.h - parameterized Criterion tests over a static table.  Criterion
 * re-executes the test binary for each test (ASLR moves everything), so a
 * parameter cannot carry pointers into the table; it carries the row's index.
 */
#ifndef TORCHLOOP_TEST_PARAMS_H
#define TORCHLOOP_TEST_PARAMS_H

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stddef.h>

/* Declares the parameters of test (suite, name): the indices 0 .. count-1. */
#define INDEX_PARAMS(suite, name, count)                                                           \
	ParameterizedTestParameters(suite, name)                                                   \
	{                                                                                          \
		static int idx[count];                                                             \
		for (size_t i_ = 0; i_ < (size_t)(count); i_++)                                    \
			idx[i_] = (int)i_;                                                         \
		return cr_make_param_array(int, idx, count);                                       \
	}

/* A test run once per row of the static array `table`; its body reads
 * table[*i]. */
#define TABLE_TEST(suite, name, table)                                                             \
	INDEX_PARAMS(suite, name, sizeof(table) / sizeof(table)[0])                                \
	ParameterizedTest(int *i, suite, name)

#endif

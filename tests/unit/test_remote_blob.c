/*
 * test_remote_blob.c - the remote tier's sealed blobs (daemon/base/remote_blob.c):
 * a blob opens under its key and secret with its metadata and artifact
 * intact; every change of a byte, every cut, another key, another secret
 * and a size over the cap are refused, each with its own reason, and
 * nothing refused is ever BLOB_OK.
 */
#include "remote.h"

#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

static const uint8_t SECRET[] = "the shared secret";
static const char KEY[] = "7f3c0a9e5b1d2c4f7f3c0a9e5b1d2c4f7f3c0a9e5b1d2c4f7f3c0a9e5b1d2c4f";
static const uint8_t Y[] = {0x81, 0xa1, 'k', 0xa1, 'T'}; /* {"k": "T"} */

static uint8_t *seal(const char *key, const uint8_t *so, size_t so_len, size_t *len)
{
	struct remote_meta m = {3, 5, 17, 12.5, "unroll", "scan", "a note", Y, sizeof Y};
	uint8_t *blob = remote_blob_seal(SECRET, sizeof SECRET - 1, key, &m, so, so_len, len);

	cr_assert_not_null(blob);
	return blob;
}

static enum remote_refusal open_as(const char *key, const uint8_t *blob, size_t len, uint64_t max,
                                   struct remote_meta *m, const uint8_t **so, size_t *so_len)
{
	struct proto_err err;

	return remote_blob_open(SECRET, sizeof SECRET - 1, key, blob, len, max, m, so, so_len,
	                        &err);
}

Test(remote_blob, opens_under_its_key_with_everything_it_was_sealed_with)
{
	uint8_t so[300];
	struct remote_meta m;
	const uint8_t *got;
	size_t len, got_len;
	uint8_t *blob;

	for (size_t i = 0; i < sizeof so; i++)
		so[i] = (uint8_t)(i * 7 + 1);
	blob = seal(KEY, so, sizeof so, &len);
	cr_assert_eq(open_as(KEY, blob, len, 1 << 20, &m, &got, &got_len), BLOB_OK);
	cr_assert_eq(got_len, sizeof so);
	cr_assert_arr_eq(got, so, sizeof so);
	cr_assert_eq(m.n_inputs, 3);
	cr_assert_eq(m.n_outputs, 5);
	cr_assert_eq(m.step_ops, 17);
	cr_assert_float_eq(m.compile_seconds, 12.5, 1e-12);
	cr_assert_str_eq(m.strategy, "unroll");
	cr_assert_str_eq(m.lowered, "scan");
	cr_assert_str_eq(m.note, "a note");
	cr_assert_eq(m.y_spec_len, sizeof Y);
	cr_assert_arr_eq(m.y_spec, Y, sizeof Y);
	free(blob);
}

Test(remote_blob, every_changed_byte_and_every_cut_is_refused)
{
	uint8_t so[64] = {1, 2, 3};
	struct remote_meta m;
	const uint8_t *got;
	size_t len, got_len;
	uint8_t *blob = seal(KEY, so, sizeof so, &len);

	for (size_t i = 0; i < len; i++) {
		blob[i] ^= 0x01;
		cr_assert_neq(open_as(KEY, blob, len, 1 << 20, &m, &got, &got_len), BLOB_OK,
		              "byte %zu changed", i);
		blob[i] ^= 0x01;
	}
	for (size_t n = 0; n < len; n++)
		cr_assert_eq(open_as(KEY, blob, n, 1 << 20, &m, &got, &got_len), BLOB_TRUNCATED,
		             "cut at %zu of %zu", n, len);
	blob[len - 1] ^= 0x80; /* the artifact's last byte: only the HMAC can tell */
	cr_assert_eq(open_as(KEY, blob, len, 1 << 20, &m, &got, &got_len), BLOB_BAD_MAC);
	free(blob);
}

Test(remote_blob, another_key_another_secret_and_an_oversized_blob_are_refused_by_name)
{
	uint8_t so[32] = {9};
	struct remote_meta m;
	const uint8_t *got;
	size_t len, got_len;
	uint8_t *blob = seal("another key", so, sizeof so, &len);
	struct proto_err err;

	cr_assert_eq(open_as(KEY, blob, len, 1 << 20, &m, &got, &got_len), BLOB_WRONG_KEY);
	cr_assert_eq(open_as("another key", blob, len, len - 1, &m, &got, &got_len),
	             BLOB_TOO_LARGE);
	cr_assert_eq(remote_blob_open((const uint8_t *)"not it", 6, "another key", blob, len,
	                              1 << 20, &m, &got, &got_len, &err),
	             BLOB_BAD_MAC);
	cr_assert_eq(open_as("another key", blob, len, len, &m, &got, &got_len), BLOB_OK);
	free(blob);
}

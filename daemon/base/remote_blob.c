/*
 * remote_blob.c - what the remote tier stores for a cache key:
 *
 *   "TLB1" | mac (32) | meta length (u32, big-endian) | meta | the .so's bytes
 *
 * meta is a msgpack map (key, n_in, n_out, ops, cs, strategy, lowered,
 * note, y, so_size); mac is HMAC-SHA256 under the shared secret over the
 * cache key, a 0 byte and everything after the mac.  So a blob is accepted
 * only whole, unchanged, sealed by a node that holds the secret, and under
 * the key it was sealed for.  What it carries is then committed to the local
 * cache like a compile's output (sha256 of the bytes, the .meta's key).
 *
 * Pure functions (the pool seals and opens blobs); HMAC and the
 * constant-time comparison are OpenSSL's libcrypto.  Also here: reading the
 * secret itself from its credentials file (at start).
 */
#include "remote.h"

#include "mpguard.h"

#include <errno.h>
#include <fcntl.h>
#include <msgpack.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAGIC     "TLB1"
#define MAGIC_LEN 4
#define HEAD      (MAGIC_LEN + REMOTE_MAC_LEN + 4)

/* HMAC-SHA256(secret, key || 0 || data) into mac; -1 on a libcrypto failure. */
static int seal_mac(const uint8_t *secret, size_t secret_len, const char *key, const uint8_t *data,
                    size_t len, uint8_t mac[REMOTE_MAC_LEN])
{
	EVP_MAC *hmac = EVP_MAC_fetch(NULL, "HMAC", NULL);
	EVP_MAC_CTX *ctx = hmac ? EVP_MAC_CTX_new(hmac) : NULL;
	char digest[] = "SHA256";
	OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0),
	                       OSSL_PARAM_construct_end()};
	size_t out = 0;
	int rc = -1;

	if (ctx && EVP_MAC_init(ctx, secret, secret_len, params) == 1 &&
	    EVP_MAC_update(ctx, (const unsigned char *)key, strlen(key) + 1) == 1 &&
	    EVP_MAC_update(ctx, data, len) == 1 &&
	    EVP_MAC_final(ctx, mac, &out, REMOTE_MAC_LEN) == 1 && out == REMOTE_MAC_LEN)
		rc = 0;
	EVP_MAC_CTX_free(ctx);
	EVP_MAC_free(hmac);
	return rc;
}

static void pack_str(msgpack_packer *pk, const char *k, const char *v)
{
	msgpack_pack_str_with_body(pk, k, strlen(k));
	msgpack_pack_str_with_body(pk, v, strlen(v));
}

static void pack_u64(msgpack_packer *pk, const char *k, uint64_t v)
{
	msgpack_pack_str_with_body(pk, k, strlen(k));
	msgpack_pack_uint64(pk, v);
}

uint8_t *remote_blob_seal(const uint8_t *secret, size_t secret_len, const char *key,
                          const struct remote_meta *m, const uint8_t *so, size_t so_len,
                          size_t *out_len)
{
	msgpack_sbuffer sb;
	msgpack_packer pk;
	uint8_t *blob = NULL;

	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	msgpack_pack_map(&pk, 10);
	pack_str(&pk, "key", key);
	pack_u64(&pk, "n_in", m->n_inputs);
	pack_u64(&pk, "n_out", m->n_outputs);
	pack_u64(&pk, "ops", m->step_ops);
	msgpack_pack_str_with_body(&pk, "cs", 2);
	msgpack_pack_double(&pk, m->compile_seconds);
	pack_str(&pk, "strategy", m->strategy);
	pack_str(&pk, "lowered", m->lowered);
	pack_str(&pk, "note", m->note);
	msgpack_pack_str_with_body(&pk, "y", 1);
	msgpack_pack_bin_with_body(&pk, m->y_spec, m->y_spec_len);
	pack_u64(&pk, "so_size", so_len);
	if (sb.data == NULL)
		goto out;
	*out_len = HEAD + sb.size + so_len;
	blob = malloc(*out_len);
	if (blob == NULL)
		goto out;
	memcpy(blob, MAGIC, MAGIC_LEN);
	blob[HEAD - 4] = (uint8_t)(sb.size >> 24);
	blob[HEAD - 3] = (uint8_t)(sb.size >> 16);
	blob[HEAD - 2] = (uint8_t)(sb.size >> 8);
	blob[HEAD - 1] = (uint8_t)sb.size;
	memcpy(blob + HEAD, sb.data, sb.size);
	memcpy(blob + HEAD + sb.size, so, so_len);
	if (seal_mac(secret, secret_len, key, blob + HEAD - 4, *out_len - (HEAD - 4),
	             blob + MAGIC_LEN) != 0) {
		free(blob);
		blob = NULL;
	}
out:
	msgpack_sbuffer_destroy(&sb);
	return blob;
}

static bool field_is(const msgpack_object_kv *kv, const char *name)
{
	return kv->key.type == MSGPACK_OBJECT_STR && kv->key.via.str.size == strlen(name) &&
	       memcmp(kv->key.via.str.ptr, name, kv->key.via.str.size) == 0;
}

static void copy_str(char *dst, size_t size, const msgpack_object *o)
{
	size_t n = o->type == MSGPACK_OBJECT_STR ? o->via.str.size : 0;

	if (n >= size)
		n = size - 1;
	memcpy(dst, n ? o->via.str.ptr : "", n);
	dst[n] = '\0';
}

/* One meta field into m (key into *key; so_size into *so_size). */
static void meta_field(const msgpack_object_kv *kv, struct remote_meta *m, char *key,
                       uint64_t *so_size)
{
	const msgpack_object *v = &kv->val;
	uint64_t u = v->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? v->via.u64 : 0;

	if (field_is(kv, "key"))
		copy_str(key, CACHE_KEY_HEX, v);
	else if (field_is(kv, "n_in"))
		m->n_inputs = (uint32_t)u;
	else if (field_is(kv, "n_out"))
		m->n_outputs = (uint32_t)u;
	else if (field_is(kv, "ops"))
		m->step_ops = (uint32_t)u;
	else if (field_is(kv, "cs") && v->type == MSGPACK_OBJECT_FLOAT64)
		m->compile_seconds = v->via.f64;
	else if (field_is(kv, "strategy"))
		copy_str(m->strategy, sizeof m->strategy, v);
	else if (field_is(kv, "lowered"))
		copy_str(m->lowered, sizeof m->lowered, v);
	else if (field_is(kv, "note"))
		copy_str(m->note, sizeof m->note, v);
	else if (field_is(kv, "y") && v->type == MSGPACK_OBJECT_BIN) {
		m->y_spec = (const uint8_t *)v->via.bin.ptr;
		m->y_spec_len = v->via.bin.size;
	} else if (field_is(kv, "so_size"))
		*so_size = u;
}

/* The meta of blob (its y spec points into blob); the blob's own key into key. */
static int read_meta(const uint8_t *blob, size_t len, struct remote_meta *m, char *key,
                     size_t *so_off, struct proto_err *err)
{
	size_t meta_len, off = 0;
	uint64_t so_size = UINT64_MAX;
	msgpack_unpacked up;
	int rc = -1;

	if (len < HEAD || memcmp(blob, MAGIC, MAGIC_LEN) != 0)
		return proto_fail(err, PROTO_E_ARTIFACT_CORRUPT, NULL, "not a torchloop blob");
	meta_len = (size_t)blob[HEAD - 4] << 24 | (size_t)blob[HEAD - 3] << 16 |
	           (size_t)blob[HEAD - 2] << 8 | blob[HEAD - 1];
	if (meta_len > len - HEAD || mpguard_check(blob + HEAD, meta_len, err) != 0)
		return proto_fail(err, PROTO_E_ARTIFACT_CORRUPT, NULL,
		                  "the blob's metadata is cut");
	memset(m, 0, sizeof *m);
	key[0] = '\0';
	msgpack_unpacked_init(&up);
	if (msgpack_unpack_next(&up, (const char *)blob + HEAD, meta_len, &off) ==
	        MSGPACK_UNPACK_SUCCESS &&
	    up.data.type == MSGPACK_OBJECT_MAP) {
		for (uint32_t i = 0; i < up.data.via.map.size; i++)
			meta_field(&up.data.via.map.ptr[i], m, key, &so_size);
		rc = 0;
	}
	msgpack_unpacked_destroy(&up);
	*so_off = HEAD + meta_len;
	if (rc != 0 || so_size != len - *so_off || m->y_spec == NULL)
		return proto_fail(err, PROTO_E_ARTIFACT_CORRUPT, NULL,
		                  "the blob holds %zu bytes of artifact, its metadata says %llu",
		                  len - *so_off, (unsigned long long)so_size);
	return 0;
}

enum remote_refusal remote_blob_open(const uint8_t *secret, size_t secret_len, const char *key,
                                     const uint8_t *blob, size_t len, uint64_t max_object,
                                     struct remote_meta *meta, const uint8_t **so, size_t *so_len,
                                     struct proto_err *err)
{
	uint8_t mac[REMOTE_MAC_LEN];
	char own[CACHE_KEY_HEX];
	size_t so_off = 0;

	if (len > max_object) {
		proto_fail(err, PROTO_E_ARTIFACT_CORRUPT, NULL,
		           "a blob of %zu bytes, over --remote-max-object=%llu", len,
		           (unsigned long long)max_object);
		return BLOB_TOO_LARGE;
	}
	if (read_meta(blob, len, meta, own, &so_off, err) != 0)
		return BLOB_TRUNCATED;
	if (strcmp(own, key) != 0) {
		proto_fail(err, PROTO_E_ARTIFACT_CORRUPT, NULL,
		           "the blob stored under %.16s... was sealed for %.16s...", key, own);
		return BLOB_WRONG_KEY;
	}
	if (seal_mac(secret, secret_len, key, blob + HEAD - 4, len - (HEAD - 4), mac) != 0 ||
	    CRYPTO_memcmp(mac, blob + MAGIC_LEN, REMOTE_MAC_LEN) != 0) {
		proto_fail(err, PROTO_E_ARTIFACT_CORRUPT, NULL,
		           "the blob's HMAC does not verify under this node's secret");
		return BLOB_BAD_MAC;
	}
	*so = blob + so_off;
	*so_len = len - so_off;
	return BLOB_OK;
}

/* The first line of a credentials file (a systemd LoadCredential= path). */
int remote_blob_read_secret(const char *path, char *out, size_t size, size_t *len, char *why,
                            size_t why_size)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	ssize_t n;

	if (fd < 0) {
		snprintf(why, why_size, "%s: %s", path, strerror(errno));
		return -1;
	}
	n = read(fd, out, size);
	close(fd);
	if (n < 0 || (size_t)n >= size) {
		snprintf(why, why_size, "%s: %s", path,
		         n < 0 ? strerror(errno) : "longer than 255 bytes");
		return -1;
	}
	while (n > 0 && (out[n - 1] == '\n' || out[n - 1] == '\r'))
		n--;
	out[n] = '\0';
	if (n == 0) {
		snprintf(why, why_size, "%s is empty", path);
		return -1;
	}
	*len = (size_t)n;
	return 0;
}

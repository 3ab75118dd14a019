/* A C99 program built against the INSTALLED kvcodec.h and libkvcodec.so
 * only (tests/capi/install_roundtrip.sh): for every method it makes a cache,
 * appends strided f32 keys and values in two chunks, fetches in f32, f16 and
 * bf16, saves through the size query, loads, and checks the loaded cache
 * gives the same bytes, stats and saved state; then trims. With a
 * calibration file as argv[1] and the model's keys and values of layer 1
 * as argv[2], argv[3] (S tokens from position 0, [S, H, D] f32, written by
 * install_roundtrip.sh from the KV dump: a calibration's basis and mean
 * fit the model's keys, not a synthetic signal), calibrated kvtc too.
 * Prints one line per method; exit status 1 after any failure. */
#include <kvcodec/kvcodec.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define H 2
#define S 300
#define D 64

static int failures = 0;

#define CHECK(cond, what)                                                          \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      fprintf(stderr, "FAIL %s: %s (last error: %s)\n", method, what, kvcodec_last_error()); \
      failures++;                                                                  \
      goto done;                                                                   \
    }                                                                              \
  } while (0)

/* Token-major [1, S, H, D] memory of a smooth low-rank signal. */
static void fill(float* x, unsigned seed) {
  int s, h, d;
  for (s = 0; s < S; ++s)
    for (h = 0; h < H; ++h)
      for (d = 0; d < D; ++d)
        x[(s * H + h) * D + d] = (float)(sin(0.05 * s * (h + 1) + 0.3 * d + seed) + 0.5 * cos(0.11 * d * (seed + 1)) +
                                         0.1 * sin(0.7 * s + d));
}

/* A [1, H, n, D] view of tokens [first, first + n) of token-major memory. */
static kvcodec_tensor view(const float* x, int first, int n) {
  kvcodec_tensor t;
  t.data = x + (size_t)first * H * D;
  t.dtype = KVCODEC_F32;
  t.shape[0] = 1, t.shape[1] = H, t.shape[2] = n, t.shape[3] = D;
  t.strides[0] = (int64_t)S * H * D, t.strides[1] = D, t.strides[2] = H * D, t.strides[3] = 1;
  return t;
}

/* Fetches both tensors in dtype into fresh buffers (caller frees). */
static int fetch(kvcodec_cache* c, int dtype, unsigned char** k, unsigned char** v, size_t* n) {
  if (kvcodec_cache_fetch_size(c, dtype, n) != KVCODEC_OK) return 0;
  *k = malloc(*n ? *n : 1);
  *v = malloc(*n ? *n : 1);
  return *k && *v && kvcodec_cache_fetch(c, dtype, *k, *v, *n) == KVCODEC_OK;
}

/* n floats from a raw little-endian f32 file. */
static int read_f32(const char* path, float* x, size_t n) {
  FILE* f = fopen(path, "rb");
  size_t got = 0;
  if (!f) return 0;
  got = fread(x, sizeof(float), n, f);
  fclose(f);
  return got == n;
}

static unsigned char* save(kvcodec_cache* c, size_t* n) {
  unsigned char* bytes;
  size_t written = 0;
  if (kvcodec_cache_save_size(c, n) != KVCODEC_OK) return NULL;
  bytes = malloc(*n);
  if (!bytes || kvcodec_cache_save(c, bytes, *n, &written) != KVCODEC_OK || written != *n) {
    free(bytes);
    return NULL;
  }
  return bytes;
}

/* max_rel_mse bounds the keys' reconstruction error against the input. */
static void round_trip(const char* method, const char* settings, const kvcodec_calibration* cal, const float* keys,
                       const float* values, double max_rel_mse) {
  kvcodec_cache_config cfg;
  kvcodec_cache *c = NULL, *loaded = NULL;
  kvcodec_tensor k1, v1, k2, v2;
  kvcodec_stats s1, s2;
  unsigned char *saved = NULL, *saved2 = NULL, *fk = NULL, *fv = NULL, *lk = NULL, *lv = NULL;
  size_t saved_n = 0, saved2_n = 0, n = 0, ln = 0;
  int64_t offset = 0, shape[4], dropped = 0;
  int dtype, trimmable = 0;
  double err = 0, ref = 0;
  size_t i;

  cfg.layer = 1, cfg.n_layers = 6, cfg.n_kv_heads = H, cfg.head_dim = D, cfg.rope_theta = 10000.0;
  CHECK(kvcodec_cache_create(method, settings, &cfg, cal, &c) == KVCODEC_OK, "create");
  k1 = view(keys, 0, 200), v1 = view(values, 0, 200), k2 = view(keys, 200, S - 200), v2 = view(values, 200, S - 200);
  CHECK(kvcodec_cache_append(c, &k1, &v1) == KVCODEC_OK, "append 1");
  CHECK(kvcodec_cache_append(c, &k2, &v2) == KVCODEC_OK, "append 2");
  CHECK(kvcodec_cache_offset(c, &offset) == KVCODEC_OK && offset == S, "offset");
  CHECK(kvcodec_cache_shape(c, shape) == KVCODEC_OK && shape[0] == 1 && shape[1] == H && shape[2] == S &&
            shape[3] == D, "shape");
  saved = save(c, &saved_n);
  CHECK(saved != NULL, "save");
  CHECK(kvcodec_cache_load(saved, saved_n, &loaded) == KVCODEC_OK, "load");
  CHECK(strcmp(kvcodec_cache_method(loaded), method) == 0, "loaded method");
  for (dtype = KVCODEC_F32; dtype <= KVCODEC_BF16; ++dtype) {
    CHECK(fetch(c, dtype, &fk, &fv, &n), "fetch");
    CHECK(fetch(loaded, dtype, &lk, &lv, &ln), "fetch loaded");
    CHECK(n == (size_t)H * S * D * kvcodec_dtype_size(dtype) && ln == n, "fetch size");
    CHECK(memcmp(fk, lk, n) == 0 && memcmp(fv, lv, n) == 0, "loaded cache reconstructs other bytes");
    if (dtype == KVCODEC_F32) { /* reconstruction error against the input, [1, H, S, D] vs [1, S, H, D] */
      for (i = 0; i < (size_t)H * S * D; ++i) {
        const size_t h = i / (S * D), s = i / D % S, d = i % D;
        const double x = keys[(s * H + h) * D + d], y = ((const float*)fk)[i];
        err += (x - y) * (x - y), ref += x * x;
      }
    }
    free(fk), free(fv), free(lk), free(lv);
    fk = fv = lk = lv = NULL;
  }
  CHECK(err / ref < max_rel_mse, "key reconstruction error above the bound");
  CHECK(kvcodec_cache_stats(c, &s1) == KVCODEC_OK && kvcodec_cache_stats(loaded, &s2) == KVCODEC_OK, "stats");
  /* The stored bytes and counters are restored exactly; memory held is not:
   * a loaded cache holds its vectors at their exact size, without the growth
   * slack of the appends, so it holds at least what it stores and at most
   * what the original holds. */
  CHECK(s1.tokens == s2.tokens && s1.compressed_key_bytes == s2.compressed_key_bytes &&
            s1.compressed_value_bytes == s2.compressed_value_bytes && s1.fp16_key_bytes == s2.fp16_key_bytes &&
            s1.fp16_value_bytes == s2.fp16_value_bytes && s1.shared_bytes == s2.shared_bytes &&
            s1.compression_ratio == s2.compression_ratio,
        "loaded stats differ");
  CHECK(s2.resident_bytes >= s2.compressed_key_bytes + s2.compressed_value_bytes &&
            s2.resident_bytes <= s1.resident_bytes,
        "loaded cache's resident bytes outside [stored, original's]");
  CHECK(s1.tokens == S && s1.fp16_key_bytes == (uint64_t)H * S * D * 2 && s1.compressed_key_bytes > 0, "stats values");
  saved2 = save(loaded, &saved2_n);
  CHECK(saved2 != NULL && saved2_n == saved_n && memcmp(saved, saved2, saved_n) == 0, "saved again differs");
  CHECK(kvcodec_cache_is_trimmable(loaded, &trimmable) == KVCODEC_OK, "is_trimmable");
  if (trimmable) {
    CHECK(kvcodec_cache_trim(loaded, 50, &dropped) == KVCODEC_OK && dropped == 50, "trim");
    CHECK(kvcodec_cache_offset(loaded, &offset) == KVCODEC_OK && offset == S - 50, "offset after trim");
    CHECK(kvcodec_cache_stats(loaded, &s2) == KVCODEC_OK && s2.fp16_key_bytes == (uint64_t)H * (S - 50) * D * 2,
          "stats after trim");
  }
  printf("%-6s %-28s ratio %6.2f  key rel. MSE %.2e  saved %zu bytes%s\n", method, settings, s1.compression_ratio,
         err / ref, saved_n, trimmable ? "  trimmed 50" : "");
done:
  free(saved), free(saved2), free(fk), free(fv), free(lk), free(lv);
  kvcodec_cache_free(c);
  kvcodec_cache_free(loaded);
}

int main(int argc, char** argv) {
  float* keys = malloc(sizeof(float) * S * H * D);
  float* values = malloc(sizeof(float) * S * H * D);
  kvcodec_calibration* cal = NULL;
  const char* method = "setup";
  if (!keys || !values) return 1;
  fill(keys, 1);
  fill(values, 2);
  printf("kvcodec %s\n", kvcodec_version());
  round_trip("fp16", "", NULL, keys, values, 0.05);
  round_trip("int8", "", NULL, keys, values, 0.05);
  round_trip("int4", "group_size=32", NULL, keys, values, 0.05);
  round_trip("kivi2", "residual=32", NULL, keys, values, 0.05);
  round_trip("palu", "", NULL, keys, values, 0.05);
  round_trip("kvtc", "mode=local;block=64", NULL, keys, values, 0.05);
  if (argc > 3) {
    method = "kvtc";
    CHECK(kvcodec_calibration_load(argv[1], &cal) == KVCODEC_OK, "calibration load");
    CHECK(read_f32(argv[2], keys, (size_t)S * H * D) && read_f32(argv[3], values, (size_t)S * H * D),
          "reading the model's keys and values");
    round_trip("kvtc", "window=16", cal, keys, values, 0.05);
  } else {
    printf("kvtc calibrated: SKIP (no calibration and model KV given)\n");
  }
done:
  kvcodec_calibration_free(cal);
  free(keys);
  free(values);
  if (failures) fprintf(stderr, "%d failure(s)\n", failures);
  return failures ? 1 : 0;
}

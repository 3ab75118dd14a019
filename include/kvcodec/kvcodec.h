/* kvcodec C API: compressed per-layer KV caches for engines in any language.
 *
 * C99, no C++ type crosses it; the model is zstd.h. Everything is reached
 * through opaque handles; every call that can fail returns a kvcodec_status
 * (0 = KVCODEC_OK) and, on failure, leaves a message naming what was wrong in
 * kvcodec_last_error() (thread-local). No C++ exception ever leaves the
 * library.
 *
 * One cache per transformer layer. Keys and values are [B, H_kv, S, D]
 * tensors (keys post-RoPE, as engines hold them) given as a pointer, a dtype
 * (f32, f16, bf16) and strides in ELEMENTS. The cache stores them compressed
 * and gives back the reconstructed history [B, H_kv, S_total, D].
 *
 * Settings strings: "field=value;field=value" with the method's fields (the
 * CLI's --set fields without the "<method>." prefix), e.g.
 * "mode=local;block=64" for kvtc or "group_size=64" for int4. "" or NULL
 * means the defaults. Values may contain ',' (kvtc bit_choices=1,2,4) but not
 * ';'. An unknown field or a value out of range fails with
 * KVCODEC_ERROR_CONFIG naming both.
 *
 * Thread safety: different handles may be used from different threads at the
 * same time. One cache handle must be used by one thread at a time (even
 * the read calls: fetch, visit and stats reuse scratch memory inside the
 * cache). A calibration handle is immutable and may be shared by any number
 * of caches and threads. kvcodec_last_error() is per thread.
 *
 * ABI: functions and enum values are only ever added; the structs below are
 * never changed (a new field means a new struct and new functions).
 */
#ifndef KVCODEC_H
#define KVCODEC_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define KVCODEC_API
#else
#define KVCODEC_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* --- version --------------------------------------------------------------- */

#define KVCODEC_VERSION_MAJOR 0
#define KVCODEC_VERSION_MINOR 1
#define KVCODEC_VERSION_PATCH 0
#define KVCODEC_VERSION_NUMBER (KVCODEC_VERSION_MAJOR * 10000 + KVCODEC_VERSION_MINOR * 100 + KVCODEC_VERSION_PATCH)

/* "0.1.0": the version of the library loaded at run time. */
KVCODEC_API const char* kvcodec_version(void);
/* KVCODEC_VERSION_NUMBER of the library loaded at run time. */
KVCODEC_API unsigned kvcodec_version_number(void);

/* --- errors ---------------------------------------------------------------- */

/* Stable numbers: never renumbered, only appended. 1-9 are the C++ library's
 * kvcodec::ErrorCode values; 100 and up belong to the C API. */
typedef enum kvcodec_status {
  KVCODEC_OK = 0,
  KVCODEC_ERROR_INVALID_ARGUMENT = 1, /* an argument out of range, a NULL pointer */
  KVCODEC_ERROR_CONFIG = 2,           /* a setting is unknown or out of range (names field, value, range) */
  KVCODEC_ERROR_FORMAT = 3,           /* malformed or damaged bytes (saved cache, calibration file) */
  KVCODEC_ERROR_CHECKSUM = 4,         /* a checksum did not match */
  KVCODEC_ERROR_IO = 5,               /* the operating system refused a read or write */
  KVCODEC_ERROR_UNSUPPORTED = 6,      /* a valid request the method cannot serve */
  KVCODEC_ERROR_SHAPE_MISMATCH = 7,   /* tensors of the wrong or of incompatible shapes */
  KVCODEC_ERROR_NOT_FOUND = 8,        /* a file or named item is missing */
  KVCODEC_ERROR_INTERNAL = 9,         /* a bug in kvcodec */
  KVCODEC_ERROR_BUFFER_TOO_SMALL = 100, /* the caller's buffer is smaller than the size query said */
  KVCODEC_ERROR_OUT_OF_MEMORY = 101
} kvcodec_status;

/* "ok", "invalid argument", "configuration error", ...; "unknown error" for
 * numbers not listed above. */
KVCODEC_API const char* kvcodec_status_name(int status);
/* The message of the last failing call on this thread ("" if none failed).
 * Kept until the next failing call on this thread (a success leaves it). */
KVCODEC_API const char* kvcodec_last_error(void);

/* --- tensors --------------------------------------------------------------- */

typedef enum kvcodec_dtype { KVCODEC_F32 = 0, KVCODEC_F16 = 1, KVCODEC_BF16 = 2 } kvcodec_dtype;

/* Bytes per element; 0 for an unknown dtype. */
KVCODEC_API size_t kvcodec_dtype_size(int dtype);

/* A [B, H, S, D] tensor the caller owns. strides are in elements; all four 0
 * means contiguous (strides {H*S*D, S*D, D, 1}). */
typedef struct kvcodec_tensor {
  const void* data;
  int32_t dtype; /* a kvcodec_dtype (an int, so any number a caller puts here is checked, never UB) */
  int64_t shape[4];
  int64_t strides[4];
} kvcodec_tensor;

/* --- calibrations ---------------------------------------------------------- */

/* A calibration file of `kvcodec calibrate` (kvtc mode=calibrated), loaded
 * once: every cache made with the handle shares the one parsed copy, and a
 * cache made with settings "calibration=<same path>" shares it too. */
typedef struct kvcodec_calibration kvcodec_calibration;

KVCODEC_API kvcodec_status kvcodec_calibration_load(const char* path, kvcodec_calibration** out);
/* NULL is a no-op. Caches made with the calibration keep it alive. */
KVCODEC_API void kvcodec_calibration_free(kvcodec_calibration* calibration);
/* The shape it was fitted for, and the bytes of its parameters. Any output
 * pointer may be NULL. */
KVCODEC_API kvcodec_status kvcodec_calibration_info(const kvcodec_calibration* calibration, int32_t* n_layers,
                                                    int32_t* n_kv_heads, int32_t* head_dim, double* rope_theta,
                                                    uint64_t* params_bytes);

/* --- caches ---------------------------------------------------------------- */

typedef struct kvcodec_cache kvcodec_cache;

/* What the model tells a cache about the layer it serves. */
typedef struct kvcodec_cache_config {
  int32_t layer;      /* index of the transformer layer, in [0, n_layers) */
  int32_t n_layers;   /* layers in the model (calibrated kvtc checks it) */
  int32_t n_kv_heads; /* H_kv */
  int32_t head_dim;   /* D */
  double rope_theta;  /* RoPE base (calibrated kvtc removes RoPE from keys) */
} kvcodec_cache_config;

/* Methods: "fp16", "int8", "int4", "kivi2", "palu", "kvtc". The i-th method's
 * name, NULL past the end. */
KVCODEC_API const char* kvcodec_method_name(size_t i);

/* Makes an empty cache. calibration may be NULL; when given, the cache is a
 * calibrated kvtc cache using it (method must be "kvtc" and settings may not
 * name another calibration file). */
KVCODEC_API kvcodec_status kvcodec_cache_create(const char* method, const char* settings,
                                                const kvcodec_cache_config* config,
                                                const kvcodec_calibration* calibration, kvcodec_cache** out);
/* Restores a cache from kvcodec_cache_save() bytes (validated whole first:
 * damaged bytes give KVCODEC_ERROR_FORMAT or _CHECKSUM). A calibrated kvtc
 * cache reads its calibration file again from the path it was made with. */
KVCODEC_API kvcodec_status kvcodec_cache_load(const void* data, size_t size, kvcodec_cache** out);
/* NULL is a no-op. */
KVCODEC_API void kvcodec_cache_free(kvcodec_cache* cache);

/* The method's name; valid while the cache lives. */
KVCODEC_API const char* kvcodec_cache_method(const kvcodec_cache* cache);
KVCODEC_API kvcodec_status kvcodec_cache_get_config(const kvcodec_cache* cache, kvcodec_cache_config* out);

/* Appends S tokens: keys and values [B, H_kv, S, D], same shape and dtype,
 * any strides. H_kv and D must be the config's, B the same at every append.
 * The cache keeps no pointer to them. */
KVCODEC_API kvcodec_status kvcodec_cache_append(kvcodec_cache* cache, const kvcodec_tensor* keys,
                                                const kvcodec_tensor* values);

/* Tokens stored (S_total). */
KVCODEC_API kvcodec_status kvcodec_cache_offset(const kvcodec_cache* cache, int64_t* out);
/* [B, H_kv, S_total, D] of what fetch gives (B = 0 before the first append). */
KVCODEC_API kvcodec_status kvcodec_cache_shape(const kvcodec_cache* cache, int64_t shape[4]);
/* Size query for fetch: bytes of ONE of the two tensors in dtype. */
KVCODEC_API kvcodec_status kvcodec_cache_fetch_size(const kvcodec_cache* cache, int dtype, size_t* bytes);
/* The reconstructed history [B, H_kv, S_total, D], contiguous, in dtype,
 * into keys and values (capacity bytes each, at least fetch_size). Bits
 * identical to the C++ KVCache::fetch(). */
KVCODEC_API kvcodec_status kvcodec_cache_fetch(kvcodec_cache* cache, int dtype, void* keys, void* values,
                                               size_t capacity);

/* Called with the history in order, as f32 blocks [B, H_kv, n, D] (any
 * strides) starting at token first_token; the tensors are valid during the
 * call only. Return 0 to go on, anything else to stop (the visit then
 * returns KVCODEC_OK). */
typedef int (*kvcodec_block_visitor)(void* user, int64_t first_token, const kvcodec_tensor* keys,
                                     const kvcodec_tensor* values);
KVCODEC_API kvcodec_status kvcodec_cache_visit(kvcodec_cache* cache, kvcodec_block_visitor visit, void* user);

/* Whether trim works for this cache (*out = 1 or 0). */
KVCODEC_API kvcodec_status kvcodec_cache_is_trimmable(const kvcodec_cache* cache, int* out);
/* Drops the n newest tokens (n >= 0), rolls every byte counter back;
 * *dropped (may be NULL) = how many were dropped (at most offset). */
KVCODEC_API kvcodec_status kvcodec_cache_trim(kvcodec_cache* cache, int64_t n, int64_t* dropped);

/* Size query for save. The serialised state is kept in the handle until the
 * next save, append, trim or free, so query + save serialise once. */
KVCODEC_API kvcodec_status kvcodec_cache_save_size(kvcodec_cache* cache, size_t* bytes);
/* The full compressed state (a checksummed container) into dst; *written
 * (may be NULL) = its size. Fails with KVCODEC_ERROR_BUFFER_TOO_SMALL (and
 * *written = the size needed) when capacity is too small. */
KVCODEC_API kvcodec_status kvcodec_cache_save(kvcodec_cache* cache, void* dst, size_t capacity, size_t* written);

/* Byte telemetry, K and V apart: everything stored is counted as serialised
 * (payload, tables, basis, scales, raw tail). */
typedef struct kvcodec_stats {
  int64_t tokens;
  uint64_t compressed_key_bytes;
  uint64_t compressed_value_bytes;
  uint64_t fp16_key_bytes; /* what f16 would cost for the tokens held */
  uint64_t fp16_value_bytes;
  /* What the process holds for this cache, and apart from it the bytes it
   * shares with other caches (a calibration), each shared object counted
   * once (docs/caches.md, "Memory as held"). */
  uint64_t resident_bytes;
  uint64_t shared_bytes;
  double compression_ratio; /* (fp16 K+V) / (compressed K+V); 0 when empty */
} kvcodec_stats;

KVCODEC_API kvcodec_status kvcodec_cache_stats(kvcodec_cache* cache, kvcodec_stats* out);

/* Method extras ("key.n_survived.0", "calibration_bytes", ...), each passed
 * to visit in name order; name is valid during the call only. Return 0 to go
 * on, anything else to stop. */
typedef int (*kvcodec_extra_visitor)(void* user, const char* name, double value);
KVCODEC_API kvcodec_status kvcodec_cache_extras(kvcodec_cache* cache, kvcodec_extra_visitor visit, void* user);


/* --- whole-prefix codec, on the CPU or a CUDA GPU ----------------------------
 *
 * One layer's KV of a whole sequence coded at once (a prefix leaving GPU
 * memory for host memory, disk or another machine, and coming back) in the
 * calibrated "kvtc-gpu/4" format of docs/gpu.md: the layer's calibrated
 * basis over its concatenated heads, RoPE removed from keys before the
 * projection and re-applied on decode, the first `sinks` and last `window`
 * tokens raw, the rest in independent rANS streams of 64 tokens.
 *
 * KV layout: ONE bf16 buffer [2, B, S, H_kv * D], keys then values, token
 * major within a row (a [B, H_kv, S, D] tensor transposed to [B, S, H_kv,
 * D]), contiguous, 16-byte aligned. H_kv * D must be 64 or 128 (the GPU
 * kernels' width) and D a multiple of 32.
 *
 * Where: KVCODEC_PREFIX_CPU codes on the host (every build; the reference the
 * GPU is tested against, bit for bit: same payload bytes, same decoded bf16).
 * KVCODEC_PREFIX_CUDA codes on the calling thread's current CUDA device:
 * the KV buffer is device memory, the payload and offsets device or pinned
 * host memory, and cuda_stream a cudaStream_t (NULL: the default stream). A
 * library built without CUDA refuses it with KVCODEC_ERROR_UNSUPPORTED; see
 * kvcodec_cuda_device_count(). cuda_stream must be NULL on the CPU. */

/* CUDA devices this library can use: 0 when it was built without CUDA
 * (then *compiled = 0; compiled may be NULL) or when none is usable. */
KVCODEC_API int kvcodec_cuda_device_count(int* compiled);

typedef enum kvcodec_prefix_device { KVCODEC_PREFIX_CPU = 0, KVCODEC_PREFIX_CUDA = 1 } kvcodec_prefix_device;

typedef struct kvcodec_prefix_codec kvcodec_prefix_codec;

/* A codec for `layer` of the calibration, batch rows B, sequences of 1 to
 * max_tokens tokens, sinks and window raw tokens (>= 0). The calibration is
 * kept alive by the codec. */
KVCODEC_API kvcodec_status kvcodec_prefix_codec_create(const kvcodec_calibration* calibration, int32_t layer,
                                                       int32_t batch, int64_t max_tokens, int32_t sinks,
                                                       int32_t window, int32_t device, kvcodec_prefix_codec** out);
/* NULL is a no-op. */
KVCODEC_API void kvcodec_prefix_codec_free(kvcodec_prefix_codec* codec);
/* How decode turns codes back into bf16. KVCODEC_RECON_EXACT (the default):
 * the format's fp32 arithmetic, bit-identical on CPU and GPU.
 * KVCODEC_RECON_TF32 (GPU only; the CPU refuses it with
 * KVCODEC_ERROR_UNSUPPORTED): the same product on tensor cores with TF32
 * operands, each output within 2^-9 * sum_k |v_k * basis[k][d]| of the exact
 * value before the bf16 rounding (docs/gpu.md); payloads are unchanged.
 * KVCODEC_RECON_INTEGER (CPU and GPU): the CPU KVTC codec's integer
 * reconstruction (int16 weights, exact int32 sums; on the GPU on integer
 * tensor cores), bit-identical on CPU and GPU; within the weights' 15-bit
 * rounding of the exact value. */
typedef enum kvcodec_reconstruction {
  KVCODEC_RECON_EXACT = 0,
  KVCODEC_RECON_TF32 = 1,
  KVCODEC_RECON_INTEGER = 2
} kvcodec_reconstruction;
KVCODEC_API kvcodec_status kvcodec_prefix_codec_set_reconstruction(kvcodec_prefix_codec* codec, int32_t mode);
/* For a sequence of `tokens` tokens: the largest payload encode can write
 * (the capacity to give it) and the entries of its offsets array (streams +
 * 1). Either output may be NULL. */
KVCODEC_API kvcodec_status kvcodec_prefix_codec_bounds(const kvcodec_prefix_codec* codec, int64_t tokens,
                                                       uint64_t* max_payload_bytes, int64_t* n_offsets);
/* kv [2, B, tokens, H_kv * D] bf16 -> payload (capacity bytes) and offsets
 * ([n_offsets] u64, stream i = payload[offsets[i], offsets[i + 1]), the raw
 * tokens after the last stream, 16-byte aligned); *written = the payload's
 * size. On the GPU it waits for the stream once (to learn the size).
 * first_position: the position of kv's first token (0 for a whole prefix;
 * a later block of a sequence coded on its own starts at its first token's
 * position: keys carry RoPE at their positions); first_position + tokens
 * <= max_tokens. The first `sinks` and last `window` tokens of the call
 * stay raw (0 and 0 for blocks that are all coded). */
KVCODEC_API kvcodec_status kvcodec_prefix_encode(kvcodec_prefix_codec* codec, const void* kv, int64_t tokens,
                                                 int64_t first_position, void* payload, uint64_t capacity,
                                                 uint64_t* offsets, void* cuda_stream, uint64_t* written);
/* The inverse into kv [2, B, tokens, H_kv * D] bf16 (the first_position the
 * payload was coded at). On the GPU it is queued
 * on the stream and returns at once; damaged streams are reported by
 * kvcodec_prefix_check (KVCODEC_ERROR_FORMAT naming the first bad stream).
 * On the CPU damaged bytes fail here, with the same status. */
KVCODEC_API kvcodec_status kvcodec_prefix_decode(kvcodec_prefix_codec* codec, const void* payload,
                                                 uint64_t payload_size, const uint64_t* offsets, int64_t tokens,
                                                 int64_t first_position, void* kv, void* cuda_stream);
/* Waits for the stream (GPU) and reports what the decodes since the last
 * check found; KVCODEC_OK at once on the CPU. */
KVCODEC_API kvcodec_status kvcodec_prefix_check(kvcodec_prefix_codec* codec, void* cuda_stream);

/* --- PALU latent codec, on the CPU or a CUDA GPU -----------------------------
 *
 * One head group of a PALU cache's keys or values coded outside the cache
 * with the projection that cache fitted: every token group of group_size
 * tokens becomes exactly the bytes the cache itself stores for it
 * (palu::encode_latent_group: latents z = U^T x rounded to f16, per (row,
 * latent channel) an f16 min and scale over the group's tokens, then every
 * code bit-packed at its channel's width), and decodes back to bf16
 * x_hat = U z, as the cache reconstructs it. Made from a cache of method
 * "palu" once it has fitted its projections (when its appends have brought
 * min_fit_tokens tokens; a calibrated cache at its first append); the codec
 * copies the projection, so the cache may change or be freed after.
 *
 * Layout: x [rows, tokens, dim] bf16, contiguous, tokens a multiple of
 * group_size. Shared mode (group_mode=shared): rows = B * n_heads, dim = D,
 * row b * n_heads + h = head first_head + h of batch row b, i.e. heads
 * [first_head, first_head + n_heads) of a [B, H_kv, S, D] tensor. Joint
 * mode: rows = B, dim = n_heads * D, each token's heads concatenated (the
 * group's heads transposed to [B, S, n_heads, D]). Packed: [tokens /
 * group_size, group_bytes] bytes, token group after token group.
 *
 * Which bytes: the cache's token group i holds its latent tokens [i *
 * group_size, (i + 1) * group_size), latent 0 being cache token first_token
 * (0; a calibrated cache's sinks stay raw before it). A calibrated cache
 * projects keys with RoPE removed (keys_without_rope = 1): the codec does
 * not, so such keys must come without RoPE to give the cache's bytes.
 *
 * Where: KVCODEC_DEVICE_CPU codes on the host in every build (the CPU
 * reference of src/gpu/palu_reference.cpp); KVCODEC_DEVICE_CUDA on the
 * calling thread's current CUDA device, x and the packed bytes in device
 * memory (4-byte aligned), queued on cuda_stream (a cudaStream_t, NULL: the
 * default stream) and returning at once. Both write the same bytes and
 * decode to the same bf16, bit for bit. A library built without CUDA
 * refuses KVCODEC_DEVICE_CUDA with KVCODEC_ERROR_UNSUPPORTED; cuda_stream
 * must be NULL on the CPU. Both devices take the same groups: group_size a
 * multiple of 32 up to 1024 and rank <= 256 (the GPU kernels' limits). */

/* The same numbers as kvcodec_prefix_device. */
typedef enum kvcodec_device { KVCODEC_DEVICE_CPU = 0, KVCODEC_DEVICE_CUDA = 1 } kvcodec_device;
typedef enum kvcodec_kv_part { KVCODEC_KEYS = 0, KVCODEC_VALUES = 1 } kvcodec_kv_part;

typedef struct kvcodec_palu_codec kvcodec_palu_codec;

typedef struct kvcodec_palu_layout {
  int32_t first_head;        /* the group's kv heads: [first_head, first_head + n_heads) */
  int32_t n_heads;
  int32_t joint;             /* 1: joint mode, 0: shared mode (the layout above) */
  int32_t rows;              /* B * n_heads (shared) or B (joint) */
  int32_t dim;               /* D (shared) or n_heads * D (joint) */
  int32_t rank;              /* latent channels r */
  int32_t group_size;        /* tokens per token group */
  int32_t keys_without_rope; /* 1: the cache projects these keys with RoPE removed */
  int64_t first_token;       /* the cache token of latent token 0 */
  int64_t max_tokens;        /* the most tokens one call takes */
  uint64_t group_bytes;      /* bytes of one packed token group */
} kvcodec_palu_layout;

/* Head groups of a fitted palu cache's keys and values (the same count). */
KVCODEC_API kvcodec_status kvcodec_palu_head_groups(const kvcodec_cache* cache, int32_t* n_groups);
/* A codec for head group `head_group` of the cache's keys or values
 * (part: a kvcodec_kv_part), calls of up to max_tokens tokens, on `device`
 * (a kvcodec_device). KVCODEC_ERROR_INVALID_ARGUMENT for a cache of another
 * method, one not fitted yet, a bad part, group or max_tokens;
 * KVCODEC_ERROR_UNSUPPORTED for value latents kept f16 (quantize_values=
 * false: no token groups) and groups past the kernels' limits. */
KVCODEC_API kvcodec_status kvcodec_palu_codec_create(const kvcodec_cache* cache, int32_t part, int32_t head_group,
                                                     int64_t max_tokens, int32_t device, kvcodec_palu_codec** out);
/* NULL is a no-op. */
KVCODEC_API void kvcodec_palu_codec_free(kvcodec_palu_codec* codec);
KVCODEC_API kvcodec_status kvcodec_palu_codec_layout(const kvcodec_palu_codec* codec, kvcodec_palu_layout* out);
/* x [rows, tokens, dim] bf16 -> packed (capacity bytes, at least tokens /
 * group_size * group_bytes; all of them are written). */
KVCODEC_API kvcodec_status kvcodec_palu_encode(kvcodec_palu_codec* codec, const void* x, int64_t tokens,
                                               void* packed, uint64_t capacity, void* cuda_stream);
/* packed (size bytes: exactly tokens / group_size * group_bytes, else
 * KVCODEC_ERROR_FORMAT) -> x [rows, tokens, dim] bf16. */
KVCODEC_API kvcodec_status kvcodec_palu_decode(kvcodec_palu_codec* codec, const void* packed, uint64_t size,
                                               int64_t tokens, void* x, void* cuda_stream);

#ifdef __cplusplus
}
#endif

#endif /* KVCODEC_H */

#include "cache/kvtc_base.hpp"

#include <cstring>

#include "cache/saved_meta.hpp"
#include "cache/settings.hpp"
#include "kvcodec/error.hpp"
#include "kvtc/raw_convert.hpp"

namespace kvcodec::cache_impl {

void KvtcCacheBase::head_rows_to_raw(const TensorView& src, int64_t b, int64_t h, int64_t first, int64_t n,
                                     uint16_t* dst, size_t dst_stride) const {
  const int64_t D = src.shape[3];
  const size_t esize = dtype_size(src.dtype);
  const uint8_t* row0 = static_cast<const uint8_t*>(src.data) +
                        (b * src.strides[0] + h * src.strides[1] + first * src.strides[2]) * int64_t(esize);
  const bool rows_contiguous = src.strides[3] == 1 || D == 1;
  if (rows_contiguous && (src.dtype == DType::kF32 || src.dtype == raw_dtype_)) {
    for (int64_t t = 0; t < n; ++t) {
      const uint8_t* row = row0 + t * src.strides[2] * int64_t(esize);
      uint16_t* out = dst + size_t(t) * dst_stride;
      if (src.dtype == DType::kF32)
        kvtc::f32_to_raw(reinterpret_cast<const float*>(row), out, raw_dtype_, size_t(D));
      else
        std::memcpy(out, row, size_t(D) * sizeof(uint16_t));
    }
    return;
  }
  TensorView head = src;
  head.data = row0;
  head.shape = {1, 1, n, D};
  if (dst_stride == size_t(D)) {
    copy_to_contiguous(head, dst, raw_dtype_);
    return;
  }
  std::vector<uint16_t> rows(size_t(n * D));
  copy_to_contiguous(head, rows.data(), raw_dtype_);
  for (int64_t t = 0; t < n; ++t) std::memcpy(dst + size_t(t) * dst_stride, rows.data() + t * D, size_t(D) * 2);
}

int64_t KvtcCacheBase::trim(int64_t n) {
  if (n < 0) throw Error(ErrorCode::kInvalidArgument, who_ + ": trim(" + std::to_string(n) + ")");
  const int64_t dropped = std::min(n, offset_);
  for (int64_t left = dropped; left > 0;) {
    const int64_t tail = raw_tokens() - sink_tokens();
    const bool blocks = encoded_tokens() > 0;
    if (tail > 0 || !blocks) {
      const int64_t cut = std::min(left, blocks ? tail : raw_tokens());
      cut_raw(cut);
      left -= cut;
    } else {
      uncode_newest_block();
    }
  }
  if (offset_ == 0) reset();
  return dropped;
}

std::vector<uint8_t> KvtcCacheBase::save() const {
  ContainerWriter w(ContainerKind::kCache);
  w.set_meta("method", "kvtc");
  w.set_meta("settings", encode_settings(settings_));
  w.set_meta("config.layer", std::to_string(config_.layer));
  w.set_meta("config.n_layers", std::to_string(config_.n_layers));
  w.set_meta("config.n_kv_heads", std::to_string(config_.n_kv_heads));
  w.set_meta("config.head_dim", std::to_string(config_.head_dim));
  w.set_meta("config.rope_theta", double_text(config_.rope_theta));
  write_layout_version(w, layout_version_);
  write_sections(w);
  return w.finish();
}

CacheStats KvtcCacheBase::stats() const {
  CacheStats st;
  st.method = "kvtc";
  st.tokens = offset_;
  const uint64_t fp16 =
      uint64_t(offset_) * uint64_t(batch_) * uint64_t(config_.n_kv_heads) * uint64_t(config_.head_dim) * 2;
  st.fp16_key_bytes = fp16;
  st.fp16_value_bytes = fp16;
  for (const bool is_key : {true, false}) {
    const TensorBytes b = tensor_bytes(is_key);
    const std::string prefix = is_key ? "key." : "value.";
    (is_key ? st.compressed_key_bytes : st.compressed_value_bytes) = b.side + b.payload + b.refine + b.raw;
    st.extras[prefix + "kvtc_bytes"] = double(b.side + b.payload);
    st.extras[prefix + "side_bytes"] = double(b.side);
    st.extras[prefix + "payload_bytes"] = double(b.payload);
    st.extras[prefix + "pre_entropy_bytes"] = double(b.pre_entropy);
    st.extras[prefix + "raw_bytes"] = double(b.raw);
    st.extras[prefix + "entropy_coding_gain"] = b.payload ? double(b.pre_entropy) / double(b.payload) : 0.0;
  }
  st.coded_symbols = coded_symbols_;
  add_mode_stats(st);
  return st;
}

}  // namespace kvcodec::cache_impl

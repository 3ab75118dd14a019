#include "cache/kvtc_base.hpp"

#include "cache/saved_meta.hpp"
#include "cache/settings.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec::cache_impl {

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

void KvtcCacheBase::write_saved_meta(ContainerWriter& w) const {
  w.set_meta("method", "kvtc");
  w.set_meta("settings", encode_settings(settings_));
  w.set_meta("config.layer", std::to_string(config_.layer));
  w.set_meta("config.n_layers", std::to_string(config_.n_layers));
  w.set_meta("config.n_kv_heads", std::to_string(config_.n_kv_heads));
  w.set_meta("config.head_dim", std::to_string(config_.head_dim));
  w.set_meta("config.rope_theta", double_text(config_.rope_theta));
}

}  // namespace kvcodec::cache_impl

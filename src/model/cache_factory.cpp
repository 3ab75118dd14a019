// Kept apart from llama.cpp so code that brings its own caches (tests) links
// without the factory.
#include "model/llama.hpp"

namespace kvcodec::model {

CacheFactory method_cache_factory(const std::string& method, const Settings& settings) {
  return [method, settings](const CacheConfig& config) { return make_cache(method, config, settings); };
}

}  // namespace kvcodec::model

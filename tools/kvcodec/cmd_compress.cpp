// kvcodec compress / decompress / inspect: a whole KV dump through a cache
// method into one container file, back to safetensors, and a look inside any
// kvcodec container (DESIGN 7, 9). The work is in src/cache/dump_codec.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fmt/format.h>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cache/dump_codec.hpp"
#include "commands.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec::cli {

namespace {

struct CompressArgs {
  std::string kv, out, method = "kvtc";
  std::vector<std::string> sets;
  double rope_theta = 10000.0;
  int threads = 1;
  bool json = false;
};

struct DecompressArgs {
  std::string in, out, dtype;
};

struct InspectArgs {
  std::string in;
  bool json = false;
  bool no_verify = false;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

nlohmann::json stats_json(const CacheStats& s) {
  nlohmann::json j;
  j["tokens"] = s.tokens;
  j["compressed_key_bytes"] = s.compressed_key_bytes;
  j["compressed_value_bytes"] = s.compressed_value_bytes;
  j["fp16_key_bytes"] = s.fp16_key_bytes;
  j["fp16_value_bytes"] = s.fp16_value_bytes;
  j["compression_ratio"] = s.compression_ratio();
  j["resident_bytes"] = s.resident_bytes;
  j["shared_bytes"] = s.shared_bytes();
  j["resident_ratio"] = s.resident_ratio();
  return j;
}

void run_compress(const CompressArgs& a) {
  const auto t0 = std::chrono::steady_clock::now();
  const dump::KvDump kv = dump::read_kv_dump(a.kv);
  dump::CompressOptions o;
  o.method = a.method;
  check_set_methods(a.sets, {a.method});
  o.settings = settings_for_method(a.sets, a.method);
  o.rope_theta = a.rope_theta;
  o.threads = a.threads;
  const bool tty = isatty(fileno(stderr)) != 0;
  o.progress = [&](int done, int total) {
    if (tty) std::fprintf(stderr, "\rcompress: layer %d/%d", done, total);
    if (tty && done == total) std::fputc('\n', stderr);
  };
  const std::vector<uint8_t> bytes = dump::compress_dump(kv, o);
  // Written only after everything succeeded, atomically (temp file + rename).
  const ContainerReader check = ContainerReader::parse(bytes.data(), bytes.size(), {}, a.out);
  const dump::CompressedDump opened = dump::open_compressed_dump(check);  // what decompress will see
  const CacheStats stats = opened.stats();
  const std::string tmp = a.out + ".tmp";
  if (FILE* f = std::fopen(tmp.c_str(), "wb")) {
    const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
    if (std::fclose(f) != 0 || !ok) {
      std::remove(tmp.c_str());
      throw Error(ErrorCode::kIo, "cannot write " + tmp);
    }
    if (std::rename(tmp.c_str(), a.out.c_str()) != 0) {
      std::remove(tmp.c_str());
      throw Error(ErrorCode::kIo, "cannot rename " + tmp + " to " + a.out);
    }
  } else {
    throw Error(ErrorCode::kIo, "cannot open " + tmp + " for writing");
  }
  const double ratio = double(kv.f16_bytes()) / double(bytes.size());
  if (a.json) {
    nlohmann::json j;
    j["input"] = a.kv;
    j["output"] = a.out;
    j["method"] = a.method;
    j["n_layers"] = kv.n_layers();
    j["shape"] = shape_string(kv.shape);
    j["dtype"] = dtype_name(kv.dtype);
    j["f16_bytes"] = kv.f16_bytes();
    j["file_bytes"] = bytes.size();
    j["file_ratio"] = ratio;
    j["caches"] = stats_json(stats);
    j["seconds"] = seconds_since(t0);
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("%s: %d layers of %s %s -> %s with %s: %s bytes (f16 %s), %.3fx; caches' K+V %s bytes (%.3fx); "
                "held in memory %s bytes (%.3fx) + %s shared\n",
                a.kv.c_str(), kv.n_layers(), shape_string(kv.shape).c_str(), dtype_name(kv.dtype), a.out.c_str(),
                a.method.c_str(), fmt::format("{}", bytes.size()).c_str(), fmt::format("{}", kv.f16_bytes()).c_str(),
                ratio, fmt::format("{}", stats.compressed_bytes()).c_str(), stats.compression_ratio(),
                fmt::format("{}", stats.resident_bytes).c_str(), stats.resident_ratio(),
                fmt::format("{}", stats.shared_bytes()).c_str());
  }
}

void run_decompress(const DecompressArgs& a) {
  const ContainerReader c = ContainerReader::read_file(a.in);
  const dump::CompressedDump d = dump::open_compressed_dump(c);
  const DType dtype = a.dtype.empty() ? d.dtype : parse_dtype(a.dtype);
  dump::decompress_dump(d, dtype).write(a.out);
  std::printf("%s: %zu layers of %s (%s cache) -> %s as %s\n", a.in.c_str(), d.layers.size(),
              shape_string(d.shape).c_str(), d.method.c_str(), a.out.c_str(), dtype_name(dtype));
}

void run_inspect(const InspectArgs& a) {
  ContainerLimits limits;
  limits.verify_checksums = !a.no_verify;
  const ContainerReader c = ContainerReader::read_file(a.in, limits);
  nlohmann::json j;
  j["file"] = a.in;
  j["kind"] = container_kind_name(c.kind());
  j["version"] = c.version();
  j["total_bytes"] = c.total_bytes();
  j["overhead_bytes"] = c.overhead();
  j["checksums_verified"] = !a.no_verify;
  j["meta"] = c.meta();
  nlohmann::json sections = nlohmann::json::array();
  for (const std::string& name : c.section_names()) sections.push_back({{"name", name}, {"bytes", c.section(name).size()}});
  j["sections"] = sections;
  // Kinds whose payload we can open: show what the caches hold.
  if (!a.no_verify && c.kind() == ContainerKind::kDump) {
    const dump::CompressedDump d = dump::open_compressed_dump(c);
    nlohmann::json layers = nlohmann::json::array();
    for (const auto& layer : d.layers) layers.push_back(stats_json(layer->stats()));
    j["layers"] = layers;
    j["caches"] = stats_json(d.stats());
    j["file_ratio"] = double(d.stats().fp16_bytes()) / double(c.total_bytes());
  } else if (!a.no_verify && c.kind() == ContainerKind::kCache) {
    std::vector<uint8_t> bytes;  // load_cache takes the whole saved container
    {
      std::FILE* f = std::fopen(a.in.c_str(), "rb");
      if (!f) throw Error(ErrorCode::kIo, "cannot open " + a.in);
      bytes.resize(c.total_bytes());
      const size_t got = std::fread(bytes.data(), 1, bytes.size(), f);
      std::fclose(f);
      if (got != bytes.size()) throw Error(ErrorCode::kIo, "short read of " + a.in);
    }
    const std::unique_ptr<KVCache> cache = load_cache(bytes.data(), bytes.size());
    j["caches"] = stats_json(cache->stats());
  }
  if (a.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("%s: kvcodec container, kind %s, version %u, %zu bytes (%zu of framing)%s\n", a.in.c_str(),
              container_kind_name(c.kind()), unsigned(c.version()), c.total_bytes(), c.overhead(),
              a.no_verify ? ", checksums NOT verified" : ", checksums verified");
  for (const auto& [k, v] : c.meta()) std::printf("  meta %-24s %s\n", k.c_str(), v.size() > 120 ? (v.substr(0, 117) + "...").c_str() : v.c_str());
  for (const std::string& name : c.section_names())
    std::printf("  section %-21s %zu bytes\n", name.c_str(), c.section(name).size());
  if (j.contains("layers")) {
    int i = 0;
    for (const auto& l : j["layers"])
      std::printf("  layer %-3d %lld tokens, K %llu + V %llu bytes, %.3fx\n", i++, (long long)l["tokens"].get<int64_t>(),
                  (unsigned long long)l["compressed_key_bytes"].get<uint64_t>(),
                  (unsigned long long)l["compressed_value_bytes"].get<uint64_t>(), l["compression_ratio"].get<double>());
  }
  if (j.contains("caches"))
    std::printf("  stored K+V %llu bytes vs f16 %llu, %.3fx\n",
                (unsigned long long)(j["caches"]["compressed_key_bytes"].get<uint64_t>() +
                                     j["caches"]["compressed_value_bytes"].get<uint64_t>()),
                (unsigned long long)(j["caches"]["fp16_key_bytes"].get<uint64_t>() +
                                     j["caches"]["fp16_value_bytes"].get<uint64_t>()),
                j["caches"]["compression_ratio"].get<double>());
  if (j.contains("caches"))
    std::printf("  held in memory once loaded %llu bytes (%.3fx), %llu shared with other caches\n",
                (unsigned long long)j["caches"]["resident_bytes"].get<uint64_t>(),
                j["caches"]["resident_ratio"].get<double>(),
                (unsigned long long)j["caches"]["shared_bytes"].get<uint64_t>());
}

}  // namespace

void register_compress(CLI::App& app) {
  auto ca = std::make_shared<CompressArgs>();
  CLI::App* c = app.add_subcommand("compress", "Compress every layer of a KV dump with a cache method into one .kvc file");
  c->add_option("--kv", ca->kv, "KV dump (safetensors with layers.{i}.key / layers.{i}.value [B, H, T, D])")->required();
  c->add_option("-o,--output", ca->out, "output container (.kvc)")->required();
  c->add_option("--method", ca->method, "cache method (kvtc, palu, fp16, int8, int4, kivi2)")->capture_default_str();
  c->add_option("--set", ca->sets, "method setting, <method>.<field>=<value> (repeatable)");
  c->add_option("--rope-theta", ca->rope_theta, "RoPE base of the model the keys come from (calibrated kvtc)")
      ->capture_default_str();
  c->add_option("--threads", ca->threads, "layers compressed in parallel")->check(CLI::Range(1, 256))->capture_default_str();
  c->add_flag("--json", ca->json, "print one JSON object on stdout");
  c->callback([ca] { run_compress(*ca); });

  auto da = std::make_shared<DecompressArgs>();
  CLI::App* d = app.add_subcommand("decompress", "Reconstruct a compressed KV dump (.kvc) as safetensors");
  d->add_option("input", da->in, "compressed dump (.kvc from kvcodec compress)")->required();
  d->add_option("-o,--output", da->out, "output safetensors file")->required();
  d->add_option("--dtype", da->dtype, "f32, f16 or bf16 (default: the original dump's dtype)");
  d->callback([da] { run_decompress(*da); });

  auto ia = std::make_shared<InspectArgs>();
  CLI::App* i = app.add_subcommand("inspect", "Show what a kvcodec container (.kvc, .kvcal, prefix entry) holds");
  i->add_option("input", ia->in, "container file")->required();
  i->add_flag("--json", ia->json, "print one JSON object on stdout");
  i->add_flag("--no-verify", ia->no_verify, "skip checksums (look inside a damaged file; caches are not opened)");
  i->callback([ia] { run_inspect(*ia); });
}

}  // namespace kvcodec::cli

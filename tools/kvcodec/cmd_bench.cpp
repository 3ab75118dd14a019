#include "commands.hpp"

namespace kvcodec::cli {

void register_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Compress a KV dump with each method; report ratio, error, speed");
  cmd->callback([] {});
}

}  // namespace kvcodec::cli

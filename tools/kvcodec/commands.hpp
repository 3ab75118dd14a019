// Subcommands of the kvcodec CLI. Each lives in its own cmd_<name>.cpp and
// registers itself on the app; main.cpp lists them.
#pragma once

#include <CLI/CLI.hpp>

namespace kvcodec::cli {

void register_bench(CLI::App& app);
void register_run(CLI::App& app);
void register_eval(CLI::App& app);
void register_serve(CLI::App& app);
void register_calibrate(CLI::App& app);
void register_compress(CLI::App& app);  // also decompress and inspect

}  // namespace kvcodec::cli

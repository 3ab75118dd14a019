// kvcodec: command-line entry point (DESIGN 9).
#include <cstdio>
#include <exception>

#include "commands.hpp"
#include "kvcodec/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"kvcodec: KV cache compression (KVTC, PALU) for LLM inference"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kvcodec 0.1.0");
  kvcodec::cli::register_bench(app);
  kvcodec::cli::register_compress(app);
  kvcodec::cli::register_run(app);
  kvcodec::cli::register_eval(app);
  kvcodec::cli::register_serve(app);
  kvcodec::cli::register_calibrate(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const kvcodec::Error& e) {
    std::fprintf(stderr, "kvcodec: error: %s (%s)\n", e.what(), kvcodec::error_code_name(e.code()));
    // A bad setting is a usage error, as CLI11's own parse errors are.
    return e.code() == kvcodec::ErrorCode::kConfig ? 2 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvcodec: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

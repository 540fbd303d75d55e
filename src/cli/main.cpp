// fitmoe: the command-line front end. One file per subcommand; this file only wires them up and
// turns every error into one line on stderr and exit code 1 (usage errors: 2).
#include <cstdio>

#include "cli/common.h"
#include "runtime/error.h"

int main(int argc, char** argv) {
  CLI::App app{"fitmoe: run Mixture-of-Experts LLMs from GGUF files on the hardware you have"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "fitmoe 0.1.0");
  fitmoe::cli::register_run(app);
  fitmoe::cli::register_generate(app);
  fitmoe::cli::register_logits(app);
  fitmoe::cli::register_bench(app);
  fitmoe::cli::register_info(app);
  fitmoe::cli::register_gen_model(app);
  fitmoe::cli::register_plan(app);
  fitmoe::cli::register_tokenize(app);
  fitmoe::cli::register_detokenize(app);
  fitmoe::cli::register_chat(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}

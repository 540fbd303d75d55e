// fitmoe: the command-line front end. One file per subcommand; this file only wires them up and
// turns every error into one line on stderr and exit code 1 (usage errors: 2).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli/common.h"
#include "runtime/error.h"

int main(int argc, char** argv) {
  CLI::App app{"fitmoe: run Mixture-of-Experts LLMs from GGUF files on the hardware you have"};
  app.require_subcommand(1);
  app.option_defaults()->always_capture_default();  // --help shows each option's default
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
  fitmoe::cli::register_perplexity(app);
  fitmoe::cli::register_serve(app);
  // The first word names a command; an unknown one gets the list and the nearest name (CLI11 alone says
  // only that a subcommand is required). `fitmoe help [COMMAND]` is --help.
  if (argc > 1 && argv[1][0] != '-') {
    const std::string word = argv[1];
    if (word == "help") {
      CLI::App* target = &app;
      if (argc > 2) {
        try {
          target = app.get_subcommand(argv[2]);
        } catch (const CLI::OptionNotFound&) {
          std::fprintf(stderr, "%s\n", fitmoe::cli::unknown_command_message(app, argv[2]).c_str());
          return 2;
        }
      }
      std::printf("%s", target->help().c_str());
      return 0;
    }
    bool known = false;
    for (const auto* sub : app.get_subcommands([](const CLI::App*) { return true; })) known |= sub->get_name() == word;
    if (!known) {
      std::fprintf(stderr, "%s\n", fitmoe::cli::unknown_command_message(app, word).c_str());
      return 2;
    }
  }
  // llama.cpp's multi-letter single-dash flags, which CLI11 would read as -n gl / -f a / -u b.
  std::vector<std::string> args(argv, argv + argc);
  for (auto& a : args) {
    if (a == "-ngl") a = "--n-gpu-layers";
    else if (a == "-fa") a = "--flash-attn";
    else if (a == "-ub") a = "--ubatch-size";
    else if (a == "-ctk") a = "--cache-type-k";
    else if (a == "-np") a = "--parallel";
    else if (a == "-ctv") a = "--cache-type-v";
  }
  std::vector<char*> argp;
  for (auto& a : args) argp.push_back(a.data());
  try {
    app.parse(static_cast<int>(argp.size()), argp.data());
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  } catch (const fitmoe::cli::Interrupted& e) {
    std::fflush(stdout);
    return 130;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}

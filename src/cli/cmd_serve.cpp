// fitmoe serve: the OpenAI-compatible HTTP server (src/server/server.h) over one loaded model. Prints
// the plan and the address, serves until SIGINT or SIGTERM, then finishes the answer that is running
// (its stream ends) and exits 0.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <thread>

#include "cli/common.h"
#include "runtime/error.h"
#ifdef FITMOE_HAVE_SERVER
#include "server/server.h"
#endif

namespace fitmoe::cli {

#ifndef FITMOE_HAVE_SERVER
void register_serve(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (not in this build)");
  cmd->allow_extras();
  cmd->callback([] { throw Error("this build has no HTTP server (configured with -DFITMOE_SERVER=OFF, as static builds are)"); });
}
#else

void register_serve(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (chat completions, completions, models)");
  auto o = std::make_shared<ModelOptions>();
  auto so = std::make_shared<server::ServerOptions>();
  add_model_options(*cmd, *o);
  add_sampler_options(*cmd, so->sampler);
  cmd->add_option("--host", so->host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", so->port, "port (0: any free one)")->check(CLI::Range(0, 65535))->capture_default_str();
  cmd->add_option("--api-key", so->api_key, "require 'Authorization: Bearer KEY' on every endpoint but /health");
  cmd->add_option("--alias", so->alias, "the model's name in /v1/models (default: the model's own name)");
  cmd->add_option("--parallel", so->parallel, "sequences served at once (1 so far)")->check(CLI::Range(1, 256))->capture_default_str();
  cmd->add_option("-n,--n-predict", so->default_max_tokens, "most tokens per answer when a request gives no max_tokens")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->callback([o, so] {
    // SIGINT / SIGTERM go to one waiting thread (blocked everywhere else, before any thread starts).
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
    auto model = load_model(*o);
    std::fprintf(stderr, "%s", model->plan().report().c_str());
    server::Server srv(*model, session_options(*o), *so);
    const int port = srv.bind();
    std::thread waiter([&] {
      int sig = 0;
      sigwait(&stop_signals, &sig);
      std::fprintf(stderr, "\n%s: stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
      srv.stop();
    });
    std::fprintf(stderr, "serving %s on http://%s:%d (OpenAI API under /v1; /health)\n", o->model_path.c_str(),
                 so->host.c_str(), port);
    std::printf("listening on http://%s:%d\n", so->host.c_str(), port);
    std::fflush(stdout);
    srv.run();
    pthread_kill(waiter.native_handle(), SIGTERM);  // (when run() ended on its own)
    waiter.join();
  });
}
#endif

}  // namespace fitmoe::cli

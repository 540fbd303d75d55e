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
#include "api/internal.h"
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
  auto sampler = std::make_shared<SamplerParams>();
  add_model_options(*cmd, *o);
  add_sampler_options(*cmd, *sampler);
  cmd->add_option("--host", so->host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", so->port, "port (0: any free one)")->check(CLI::Range(0, 65535))->capture_default_str();
  cmd->add_option("--api-key", so->api_key, "require 'Authorization: Bearer KEY' on every endpoint but /health");
  cmd->add_option("--alias", so->alias, "the model's name in /v1/models (default: the model's own name)");
  cmd->add_option("--parallel", so->parallel, "requests decoded together, each on its own sequence (continuous batching)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--cache", so->cached, "further sequences that keep finished conversations for prompt reuse")
      ->check(CLI::Range(0, 256))
      ->capture_default_str();
  cmd->add_option("--prefill-chunk", so->prefill_chunk, "prompt tokens per step while other requests decode")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("-n,--n-predict", so->default_max_tokens, "most tokens per answer when a request gives no max_tokens")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->callback([o, so, sampler] {
    // SIGINT / SIGTERM go to one waiting thread (blocked everywhere else, before any thread starts).
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
    o->n_seq = so->parallel + so->cached;  // (the plan reserves a KV cache for each)
    auto model = load_model(*o);
    std::fprintf(stderr, "%s", model->plan().report().c_str());
    if (so->alias.empty()) so->alias = model->config().name.empty() ? "fitmoe" : model->config().name;
    GenerateOptions& d = so->defaults;
    d.temperature = sampler->temperature;
    d.top_k = sampler->top_k;
    d.top_p = sampler->top_p;
    d.min_p = sampler->min_p;
    d.seed = sampler->seed;
    d.repeat_penalty = sampler->repeat_penalty;
    const SessionOptions session = session_options(*o);
    auto engine = EngineAccess::adopt(std::move(model), session, session.n_threads);
    server::Server srv(*engine, *so);
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

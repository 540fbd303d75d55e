// fitmoe's HTTP server (issue 22, first part): OpenAI-compatible endpoints over one loaded model.
//
//   GET  /health                 {"status": "ok"} (no key needed)
//   GET  /v1/models              the one model, named by --alias (default: the file's name)
//   POST /v1/chat/completions    messages rendered with the GGUF's chat template; streaming (SSE) or not;
//                                tools -> tool_calls (tool_calls.h), <think> -> reasoning_content (reasoning.h)
//   POST /v1/completions         a raw prompt; streaming or not
//   POST /v1/messages            Anthropic's Messages API (text blocks, system, stop_sequences; its
//                                streaming events and error body)
//   GET  /metrics                Prometheus text: requests, refusals, queue, tokens, prompt reuse,
//                                the last request's prefill and decode speed, context and KV bytes
//   POST /tokenize, /detokenize  {"content": text} <-> {"tokens": [ids]}
//
// Built only on the public API (include/fitmoe/fitmoe.h): requests go to a fitmoe::Scheduler, which
// decodes up to `--parallel` of them together (continuous batching) and keeps finished conversations on
// their sequences (plus `--cache` more), so a request whose prompt starts with what a sequence holds
// evaluates only the rest (KV cache, and recurrent state through checkpoints). Beyond `max_queue`
// waiting requests the server answers 503 with Retry-After. Every bad request gets a 4xx with an
// OpenAI-style JSON error body naming the problem; a client that disconnects stops its generation at the
// next step.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "fitmoe/fitmoe.h"

namespace fitmoe::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;            // 0: any free port (bind() says which)
  std::string api_key;        // non-empty: /v1/* and the token endpoints need "Authorization: Bearer KEY"
  std::string alias;          // the model's name in /v1/models and in answers
  int parallel = 1;           // requests decoded together (--parallel)
  int cached = 0;             // further sequences that keep finished conversations for reuse (--cache)
  int prefill_chunk = 256;    // prompt tokens per step beside decoding requests
  size_t max_body = 8u << 20;  // bytes of a request body
  int max_queue = 64;         // requests waiting beyond the running ones
  int default_max_tokens = 2048;
  GenerateOptions defaults;   // sampling for fields a request leaves out
};

class Server {
 public:
  // The engine must have been loaded for parallel + cached sequences (LoadConfig::n_seq).
  Server(Engine& engine, const ServerOptions& options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the listening socket; returns the port (the one asked for, or the one chosen for port 0).
  // Throws fitmoe::Error when the address cannot be bound.
  int bind();
  // Serves until stop() (from any thread); bind() first.
  void run();
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fitmoe::server

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
// Requests run one at a time on one sequence (`--parallel 1`; several sequences per engine are the rest
// of issue 22); a request waits for the one before it, and beyond `max_queue` waiting ones the server
// answers 503 with Retry-After. A request whose prompt starts with what the sequence holds evaluates only
// the rest (prompt reuse for the KV cache and, through checkpoints, recurrent state). Every bad request
// gets a 4xx with an OpenAI-style JSON error body naming the problem; a client that disconnects stops its
// generation at the next token.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "model/model.h"
#include "runtime/session.h"
#include "text/sampling.h"

namespace fitmoe::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;            // 0: any free port (bind() says which)
  std::string api_key;        // non-empty: /v1/* and the token endpoints need "Authorization: Bearer KEY"
  std::string alias;          // the model's name in /v1/models and in answers
  int parallel = 1;           // sequences (only 1 so far)
  size_t max_body = 8u << 20;  // bytes of a request body
  int max_queue = 64;         // requests waiting beyond the running one
  int default_max_tokens = 2048;
  SamplerParams sampler;      // defaults for fields a request leaves out
};

class Server {
 public:
  Server(const Model& model, const SessionOptions& session, const ServerOptions& options);
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

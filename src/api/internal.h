// What the public API's pieces share behind include/fitmoe/fitmoe.h: the engine's insides, the text side
// of a generation (TextStream: detokenizing, stop strings, held-back text, end of turn, log-probabilities)
// used by Sequence::generate and by the Scheduler alike, and the bridge through which the CLI hands a
// model it loaded with all its flags to the API (fitmoe serve).
#pragma once
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fitmoe/fitmoe.h"
#include "model/model.h"
#include "runtime/session.h"
#include "runtime/thread_pool.h"
#include "text/sampling.h"
#include "text/tokenizer.h"

namespace fitmoe {

struct Engine::Impl {
  LoadConfig config;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tok;
  SessionOptions session;              // what every sequence gets (context, cache type, batch)
  std::unique_ptr<ThreadPool> pool;    // the engine's one pool
  std::mutex forward_mu;               // one forward pass at a time (the pool and the GPU workspace)
};

// The CLI's bridge: an engine over a model loaded with every CLI flag.
struct EngineAccess {
  static std::unique_ptr<Engine> adopt(std::unique_ptr<Model> model, const SessionOptions& session, int n_threads);
  static Engine::Impl& impl(Engine& e) { return *e.impl_; }
};

SamplerParams sampler_params(const GenerateOptions& o);
// Prompt reuse: cuts the session back to the longest prefix its history shares with the prompt (at
// most all but the prompt's last token, which is evaluated for its logits; recurrent state comes back
// from a checkpoint and is re-evaluated up to there) and returns that prefix's length.
size_t reuse_prefix(Session& s, std::span<const int32_t> prompt);
// Throws ApiError when options or the prompt cannot be generated from on a context of n_ctx.
void check_generation(const GenerateOptions& o, std::span<const int32_t> prompt, int n_ctx, int n_vocab);

// The text of one generation, token by token: push() each sampled token; false means the generation
// is over (end of turn, a stop string, the callback said stop). Text that could still become a stop
// string is held back until it cannot.
class TextStream {
 public:
  TextStream(const Tokenizer& tok, const GenerateOptions& o, std::function<bool(const std::string&)> on_text);
  bool push(int32_t token, const float* logits, int n_vocab);
  void finish();  // flushes what was held back (unless a stop string ended it)
  GenerateResult& result() { return r_; }

 private:
  bool flush(size_t end);
  const Tokenizer& tok_;
  const GenerateOptions& o_;
  std::function<bool(const std::string&)> on_text_;
  StreamDecoder dec_;
  GenerateResult r_;
  size_t sent_ = 0;
  bool ended_ = false;
};

}  // namespace fitmoe

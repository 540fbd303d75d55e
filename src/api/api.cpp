// The public API (include/fitmoe/fitmoe.h) over the engine's own types: Model, Session, Tokenizer.
#include "fitmoe/fitmoe.h"

#include <algorithm>

#include "model/model.h"
#include "runtime/error.h"
#include "runtime/session.h"
#include "text/chat.h"
#include "text/held_prefix.h"
#include "text/sampling.h"
#include "text/tokenizer.h"

namespace fitmoe {

namespace {
// Internal errors become ApiError at the boundary.
template <typename F>
auto guard(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const ApiError&) {
    throw;
  } catch (const std::exception& e) {
    throw ApiError(e.what());
  }
}

size_t common_prefix(std::span<const int32_t> a, const std::vector<int32_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}
}  // namespace

struct Engine::Impl {
  LoadConfig config;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tok;
  KvCacheType kv;
};

struct Sequence::Impl {
  const Engine::Impl& engine;
  Session session;
  Impl(const Engine::Impl& e, const SessionOptions& so) : engine(e), session(*e.model, so) {}
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

std::unique_ptr<Engine> Engine::load(const LoadConfig& c) {
  return guard([&] {
    if (c.n_ctx <= 0) throw ApiError("n_ctx must be positive (got " + std::to_string(c.n_ctx) + ")");
    auto impl = std::make_unique<Impl>();
    impl->config = c;
    KvCacheType kv;
    kv.automatic = c.cache_type_k == "auto" && c.cache_type_v == "auto";
    if (c.cache_type_k != "auto" && !kv_type_from_name(c.cache_type_k, &kv.k))
      throw ApiError("cache_type_k '" + c.cache_type_k + "' is not a KV cache type (auto, " + kv_type_names() + ")");
    if (c.cache_type_v != "auto" && !kv_type_from_name(c.cache_type_v, &kv.v))
      throw ApiError("cache_type_v '" + c.cache_type_v + "' is not a KV cache type (auto, " + kv_type_names() + ")");
    LoadOptions lo;
    lo.plan.use_gpu = c.use_gpu;
    lo.plan.vram_budget = c.vram_budget;
    lo.plan.n_ctx = c.n_ctx;
    lo.plan.kv = kv;
    impl->model = Model::load(c.model_path, lo);
    impl->tok = Tokenizer::from_gguf(impl->model->file());
    impl->kv = impl->model->plan().options.kv;  // (auto resolved by the plan)
    return std::unique_ptr<Engine>(new Engine(std::move(impl)));
  });
}

std::string Engine::plan_report() const { return impl_->model->plan().report(); }
std::string Engine::architecture() const { return impl_->model->config().arch; }
int Engine::n_vocab() const { return impl_->model->config().n_vocab; }
bool Engine::on_gpu() const { return impl_->model->on_gpu(); }

std::vector<int32_t> Engine::tokenize(std::string_view text, bool add_special) const {
  return guard([&] { return impl_->tok->encode(text, add_special); });
}

std::string Engine::detokenize(std::span<const int32_t> tokens) const {
  return guard([&] {
    for (int32_t t : tokens)
      if (t < 0 || t >= n_vocab()) throw ApiError("token id " + std::to_string(t) + " is outside the vocabulary");
    return impl_->tok->decode(tokens, false);
  });
}

std::string Engine::apply_chat_template(const std::vector<Message>& messages, bool add_generation_prompt) const {
  return guard([&] {
    std::vector<ChatMessage> m;
    for (const Message& x : messages) m.push_back({x.role, x.content, nullptr});
    return fitmoe::apply_chat_template(*impl_->tok, m, add_generation_prompt);
  });
}

std::unique_ptr<Sequence> Engine::new_sequence(int n_ctx) const {
  return guard([&] {
    SessionOptions so;
    so.n_threads = impl_->config.n_threads;
    so.n_ctx = n_ctx > 0 ? n_ctx : impl_->config.n_ctx;
    so.kv = impl_->kv;
    return std::unique_ptr<Sequence>(new Sequence(std::make_unique<Sequence::Impl>(*impl_, so)));
  });
}

Sequence::Sequence(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Sequence::~Sequence() = default;
int Sequence::n_past() const { return impl_->session.n_past(); }
int Sequence::n_ctx() const { return impl_->session.n_ctx(); }

std::vector<float> Sequence::eval(std::span<const int32_t> tokens, int n_logits) {
  return guard([&] {
    const int n_vocab = impl_->engine.model->config().n_vocab;
    for (int32_t t : tokens)
      if (t < 0 || t >= n_vocab) throw ApiError("token id " + std::to_string(t) + " is outside the vocabulary");
    if (n_past() + static_cast<int>(tokens.size()) > n_ctx())
      throw ApiError(std::to_string(tokens.size()) + " tokens do not fit: the sequence holds " + std::to_string(n_past()) +
                     " of " + std::to_string(n_ctx()));
    return impl_->session.eval(tokens, n_logits);
  });
}

void Sequence::truncate(int n) {
  guard([&] {
    impl_->session.truncate(std::clamp(n, 0, n_past()));
    return 0;
  });
}

GenerateResult Sequence::generate(std::span<const int32_t> prompt, const GenerateOptions& o,
                                  const std::function<bool(const std::string&)>& on_text) {
  return guard([&] {
    if (prompt.empty()) throw ApiError("the prompt is empty");
    if (o.max_tokens < 1) throw ApiError("max_tokens must be at least 1");
    Session& s = impl_->session;
    const Tokenizer& tok = *impl_->engine.tok;
    if (static_cast<int>(prompt.size()) >= s.n_ctx())
      throw ApiError("the prompt is " + std::to_string(prompt.size()) + " tokens; the sequence holds " + std::to_string(s.n_ctx()));
    GenerateResult r;
    r.n_prompt = static_cast<int>(prompt.size());
    size_t keep = common_prefix(prompt, s.history());
    if (keep == prompt.size()) --keep;
    s.truncate(static_cast<int>(keep));
    r.n_reused = static_cast<int>(keep);
    SamplerParams sp;
    sp.temperature = o.temperature;
    sp.top_k = o.top_k;
    sp.top_p = o.top_p;
    sp.min_p = o.min_p;
    sp.seed = o.seed;
    Sampler sampler(sp);
    StreamDecoder dec(tok);
    size_t sent = 0;
    bool stop = false;
    auto flush = [&](size_t end) {
      if (end > sent && on_text && !on_text(r.text.substr(sent, end - sent))) stop = true;
      sent = std::max(sent, end);
      return !stop;
    };
    GenerationStats st;
    const std::vector<int32_t> fresh(prompt.begin() + static_cast<long>(keep), prompt.end());
    s.generate(fresh, std::min(o.max_tokens, s.n_ctx() - r.n_prompt), sampler, [&](int32_t t) {
      if (tok.is_eog(t)) {
        r.stopped_at_end = true;
        return false;
      }
      r.text += dec.push(t);
      for (const std::string& x : o.stop) {
        const size_t at = x.empty() ? std::string::npos : r.text.find(x, sent > x.size() ? sent - x.size() : 0);
        if (at != std::string::npos) {
          r.text.resize(at);
          r.stopped_at_end = true;
          flush(at);
          return false;
        }
      }
      return flush(r.text.size() - held_prefix(r.text, o.stop));  // (what may still become a stop string)
    }, tok.eog_tokens(), &st);
    if (!r.stopped_at_end || r.text.size() > sent) {
      r.text += dec.flush();
      flush(r.text.size());
    }
    s.checkpoint();
    r.n_generated = st.n_generated;
    r.prompt_tokens_per_second = st.prompt_tps();
    r.decode_tokens_per_second = st.generate_tps();
    return r;
  });
}

}  // namespace fitmoe

// The public API (include/fitmoe/fitmoe.h) over the engine's own types: Model, Session, Tokenizer.
#include "fitmoe/fitmoe.h"

#include "api/internal.h"

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

}  // namespace

struct Sequence::Impl {
  Engine::Impl& engine;
  Session session;
  Impl(Engine::Impl& e, const SessionOptions& so) : engine(e), session(*e.model, so, e.pool.get()) {}
};

SamplerParams sampler_params(const GenerateOptions& o) {
  SamplerParams sp;
  sp.temperature = o.temperature;
  sp.top_k = o.top_k;
  sp.top_p = o.top_p;
  sp.min_p = o.min_p;
  sp.seed = o.seed;
  sp.repeat_penalty = o.repeat_penalty;
  sp.presence_penalty = o.presence_penalty;
  sp.frequency_penalty = o.frequency_penalty;
  return sp;
}

size_t reuse_prefix(Session& s, std::span<const int32_t> prompt) {
  const std::vector<int32_t>& h = s.history();
  size_t keep = 0;
  while (keep < prompt.size() && keep < h.size() && prompt[keep] == h[keep]) ++keep;
  if (keep == prompt.size() && keep > 0) --keep;
  s.truncate(static_cast<int>(keep));
  return keep;
}

void check_generation(const GenerateOptions& o, std::span<const int32_t> prompt, int n_ctx, int n_vocab) {
  if (prompt.empty()) throw ApiError("the prompt is empty");
  if (o.max_tokens < 1) throw ApiError("max_tokens must be at least 1");
  if (o.top_logprobs > 20) throw ApiError("top_logprobs must be at most 20");
  if (static_cast<int>(prompt.size()) >= n_ctx)
    throw ApiError("the prompt is " + std::to_string(prompt.size()) + " tokens; the sequence holds " + std::to_string(n_ctx));
  for (int32_t t : prompt)
    if (t < 0 || t >= n_vocab) throw ApiError("token id " + std::to_string(t) + " is outside the vocabulary");
}

TextStream::TextStream(const Tokenizer& tok, const GenerateOptions& o, std::function<bool(const std::string&)> on_text)
    : tok_(tok), o_(o), on_text_(std::move(on_text)), dec_(tok) {}

bool TextStream::flush(size_t end) {
  if (end > sent_ && on_text_ && !on_text_(r_.text.substr(sent_, end - sent_))) r_.cancelled = true;
  sent_ = std::max(sent_, end);
  return !r_.cancelled;
}

bool TextStream::push(int32_t t, const float* logits, int n_vocab) {
  ++r_.n_generated;
  if (o_.top_logprobs >= 0 && logits) {
    // log softmax of the model's logits (in double), the chosen token and the best alternatives.
    double mx = logits[0];
    for (int i = 1; i < n_vocab; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
    double sum = 0;
    for (int i = 0; i < n_vocab; ++i) sum += std::exp(logits[i] - mx);
    const double lse = mx + std::log(sum);
    TokenLogprob lp;
    lp.id = t;
    lp.text = tok_.token_piece(t, false);
    lp.logprob = static_cast<float>(logits[t] - lse);
    std::vector<int32_t> ids(static_cast<size_t>(n_vocab));
    for (int i = 0; i < n_vocab; ++i) ids[i] = i;
    const int k = std::min(o_.top_logprobs, n_vocab);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                      [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
    for (int i = 0; i < k; ++i) lp.top.emplace_back(ids[i], static_cast<float>(logits[ids[i]] - lse));
    r_.logprobs.push_back(std::move(lp));
  }
  if (tok_.is_eog(t)) {
    r_.stopped_at_end = true;
    return false;
  }
  r_.text += dec_.push(t);
  for (const std::string& x : o_.stop) {
    const size_t at = x.empty() ? std::string::npos : r_.text.find(x, sent_ > x.size() ? sent_ - x.size() : 0);
    if (at != std::string::npos) {
      r_.text.resize(at);
      r_.stopped_at_end = true;
      r_.stop_string = x;
      ended_ = true;
      flush(at);
      return false;
    }
  }
  return flush(r_.text.size() - held_prefix(r_.text, o_.stop));  // (what may still become a stop string)
}

void TextStream::finish() {
  if (ended_ || r_.cancelled) return;
  r_.text += dec_.flush();
  flush(r_.text.size());
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

std::unique_ptr<Engine> EngineAccess::adopt(std::unique_ptr<Model> model, const SessionOptions& session, int n_threads) {
  auto impl = std::make_unique<Engine::Impl>();
  impl->session = session;
  if (impl->session.kv.automatic) impl->session.kv = model->plan().options.kv;  // (auto resolved by the plan)
  impl->config.n_ctx = session.n_ctx;
  impl->config.n_threads = n_threads;
  impl->tok = Tokenizer::from_gguf(model->file());
  impl->pool = std::make_unique<ThreadPool>(default_threads(*model, n_threads));
  impl->model = std::move(model);
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

std::unique_ptr<Engine> Engine::load(const LoadConfig& c) {
  return guard([&] {
    if (c.n_ctx <= 0) throw ApiError("n_ctx must be positive (got " + std::to_string(c.n_ctx) + ")");
    if (c.n_seq < 1 || c.n_seq > 4096) throw ApiError("n_seq must be from 1 to 4096 (got " + std::to_string(c.n_seq) + ")");
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
    lo.plan.n_seq = c.n_seq;
    lo.plan.kv = kv;
    SessionOptions so;
    so.n_ctx = c.n_ctx;
    so.kv = kv;
    so.n_threads = c.n_threads;
    auto e = EngineAccess::adopt(Model::load(c.model_path, lo), so, c.n_threads);
    e->impl_->config = c;
    return e;
  });
}

std::string Engine::plan_report() const { return impl_->model->plan().report(); }
std::string Engine::architecture() const { return impl_->model->config().arch; }
int Engine::n_vocab() const { return impl_->model->config().n_vocab; }
int Engine::n_ctx() const { return impl_->session.n_ctx; }
bool Engine::on_gpu() const { return impl_->model->on_gpu(); }
uint64_t Engine::gpu_bytes_used() const { return impl_->model->gpu_bytes_used(); }
std::string Engine::chat_template() const { return impl_->tok->chat_template(); }

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

std::string Engine::apply_chat_template_json(std::string_view messages_json, std::string_view context_json,
                                             bool add_generation_prompt) const {
  return guard([&] {
    using json = nlohmann::ordered_json;
    json msgs, ctx;
    try {
      msgs = json::parse(messages_json);
      ctx = context_json.empty() ? json::object() : json::parse(context_json);
    } catch (const json::exception& e) {
      throw ApiError(std::string("chat template input is not valid JSON: ") + e.what());
    }
    if (!msgs.is_array()) throw ApiError("the messages must be a JSON list");
    if (!ctx.is_object()) throw ApiError("the template context must be a JSON object");
    std::vector<ChatMessage> m;
    for (const json& x : msgs) {
      if (!x.is_object() || !x.contains("role") || !x["role"].is_string()) throw ApiError("each message needs a string 'role'");
      ChatMessage cm{x["role"].get<std::string>(), "", nullptr};
      json extra = json::object();
      for (const auto& [k, v] : x.items()) {
        if (k == "role") continue;
        if (k == "content" && v.is_string()) cm.content = v.get<std::string>();
        else if (!(k == "content" && v.is_null())) extra[k] = v;
      }
      if (!extra.empty()) cm.extra = extra;
      m.push_back(std::move(cm));
    }
    return fitmoe::apply_chat_template(*impl_->tok, m, add_generation_prompt, ctx);
  });
}

std::unique_ptr<Sequence> Engine::new_sequence(int n_ctx) const {
  return guard([&] {
    SessionOptions so = impl_->session;
    if (n_ctx > 0) so.n_ctx = n_ctx;
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
    std::lock_guard<std::mutex> lock(impl_->engine.forward_mu);
    return impl_->session.eval(tokens, n_logits);
  });
}

void Sequence::truncate(int n) {
  guard([&] {
    std::lock_guard<std::mutex> lock(impl_->engine.forward_mu);
    impl_->session.truncate(std::clamp(n, 0, n_past()));
    return 0;
  });
}

GenerateResult Sequence::generate(std::span<const int32_t> prompt, const GenerateOptions& o,
                                  const std::function<bool(const std::string&)>& on_text) {
  return guard([&] {
    Session& s = impl_->session;
    const Model& m = *impl_->engine.model;
    check_generation(o, prompt, s.n_ctx(), m.config().n_vocab);
    std::lock_guard<std::mutex> lock(impl_->engine.forward_mu);
    TextStream text(*impl_->engine.tok, o, on_text);
    GenerateResult& r = text.result();
    r.n_prompt = static_cast<int>(prompt.size());
    const size_t keep = reuse_prefix(s, prompt);
    r.n_reused = static_cast<int>(keep);
    Sampler sampler(sampler_params(o));
    GenerationStats st;
    const std::vector<int32_t> fresh(prompt.begin() + static_cast<long>(keep), prompt.end());
    const int n_vocab = m.config().n_vocab;
    s.generate(fresh, std::min(o.max_tokens, s.n_ctx() - r.n_prompt), sampler, [&](int32_t t) {
      return text.push(t, o.top_logprobs >= 0 ? s.last_logits() : nullptr, n_vocab);
    }, {}, &st);
    text.finish();
    s.checkpoint();
    r.n_generated = st.n_generated;
    r.prompt_tokens_per_second = st.prompt_tps();
    r.decode_tokens_per_second = st.generate_tps();
    r.seconds_to_first_token = st.prompt_seconds;
    return r;
  });
}

}  // namespace fitmoe

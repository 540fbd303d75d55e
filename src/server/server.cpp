// The HTTP server: server.h says what it serves. cpp-httplib does the HTTP (a thread per connection
// from its pool); nlohmann::json the bodies; fitmoe::Scheduler the generations (a connection's thread
// waits for its request's text and writes it out, so a slow client never holds up the batch).
#include "server/server.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/reasoning.h"
#include "server/tool_calls.h"

namespace fitmoe::server {

namespace {

using json = nlohmann::ordered_json;

// A request the server refuses: HTTP status, OpenAI's error type, the field it is about.
struct HttpError {
  int status;
  std::string message, type, param, code;
};

[[noreturn]] void refuse(const std::string& message, const std::string& param = "", int status = 400,
                         const std::string& code = "") {
  throw HttpError{status, message, status == 401 ? "authentication_error" : status >= 500 ? "server_error"
                                                   : status == 404                       ? "not_found_error"
                                                   : status == 503                       ? "overloaded_error"
                                                                                         : "invalid_request_error",
                  param, code};
}

// (Text from a request can hold invalid UTF-8, e.g. in a parser's message: replaced, never thrown.)
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// OpenAI's error body, or Anthropic's ({"type": "error", "error": {"type", "message"}}) on /v1/messages.
void send_error(httplib::Response& res, const HttpError& e, bool anthropic = false) {
  if (e.status == 503) res.set_header("Retry-After", "1");
  if (anthropic) {
    const std::string type = e.status == 413 ? "request_too_large" : e.status == 503 ? "overloaded_error"
                             : e.status >= 500 ? "api_error" : e.type;
    res.status = e.status;
    res.set_content(dump(json{{"type", "error"}, {"error", {{"type", type}, {"message", e.message}}}}), "application/json");
    return;
  }
  json err = {{"message", e.message}, {"type", e.type}};
  err["param"] = e.param.empty() ? json(nullptr) : json(e.param);
  err["code"] = e.code.empty() ? json(nullptr) : json(e.code);
  res.status = e.status;
  res.set_content(dump(json{{"error", err}}), "application/json");
}

json parse_body(const httplib::Request& req) {
  try {
    json j = json::parse(req.body);
    if (!j.is_object()) refuse("the request body must be a JSON object");
    return j;
  } catch (const json::exception& e) {
    refuse(std::string("the request body is not valid JSON: ") + e.what());
  }
}

// Typed optional fields, range-checked; absent or null gives the default.
double number_field(const json& b, const char* k, double def, double lo, double hi) {
  if (!b.contains(k) || b[k].is_null()) return def;
  if (!b[k].is_number()) refuse(std::string("'") + k + "' must be a number", k);
  const double v = b[k].get<double>();
  if (!(v >= lo && v <= hi))
    refuse(std::string("'") + k + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi), k);
  return v;
}
int64_t int_field(const json& b, const char* k, int64_t def, int64_t lo, int64_t hi) {
  if (!b.contains(k) || b[k].is_null()) return def;
  if (!b[k].is_number_integer() && !b[k].is_number_unsigned())
    refuse(std::string("'") + k + "' must be an integer", k);
  if (b[k].is_number_unsigned() && b[k].get<uint64_t>() > static_cast<uint64_t>(hi))
    refuse(std::string("'") + k + "' must be at most " + std::to_string(hi), k);
  const int64_t v = b[k].get<int64_t>();
  if (v < lo || v > hi)
    refuse(std::string("'") + k + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi), k);
  return v;
}
bool bool_field(const json& b, const char* k, bool def) {
  if (!b.contains(k) || b[k].is_null()) return def;
  if (!b[k].is_boolean()) refuse(std::string("'") + k + "' must be true or false", k);
  return b[k].get<bool>();
}

// What one generation needs, checked before any work.
struct GenRequest {
  std::vector<int32_t> prompt;
  GenerateOptions gen;  // max_tokens, sampling, stop strings, logprobs
  bool stream = false, include_usage = false;
  // Thinking models (a template with <think>): the answer's reasoning goes to reasoning_content;
  // in_thinking: the generation prompt itself opened <think>.
  bool split_thinking = false, in_thinking = false;
  bool parse_tools = false;  // the request offered tools: tool calls in the answer become tool_calls
};

struct GenResult {
  std::string text;
  std::string finish = "length";  // "stop" (end of turn or a stop string) or "length"
  std::string stop_hit;           // the stop string that ended it, if one did
  int n_prompt = 0, n_completion = 0, n_reused = 0;
  double prompt_tps = 0, decode_tps = 0;
  bool cancelled = false;
  std::vector<TokenLogprob> logprobs;
};

// A request in the scheduler and the pieces of text it produced that its connection has not written
// yet (the scheduler's thread pushes, the connection's thread pops).
struct Pending {
  std::shared_ptr<Job> job;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::string> pieces;
  std::atomic<bool> gone{false};  // the client is gone: stop at the next step
};

int64_t now_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

struct Server::Impl {
  Engine& engine;
  ServerOptions opt;
  Scheduler scheduler;
  std::atomic<uint64_t> next_id{1};
  httplib::Server http;
  int port = -1;
  bool thinking_template = false;             // the chat template knows <think> (Qwen3, Qwen3.5/3.6)
  ToolSyntax tool_syntax = ToolSyntax::Qwen;  // Gemma 4's <|tool_call> where its template has it
  // /metrics beyond the scheduler's own figures (figures for a dashboard, not a ledger)
  struct Metrics {
    std::atomic<uint64_t> refused{0};
    std::atomic<double> last_prompt_tps{0}, last_decode_tps{0}, last_ttft{0};
  } metrics;

  static SchedulerConfig scheduler_config(const ServerOptions& o) {
    SchedulerConfig c;
    c.n_parallel = o.parallel;
    c.n_cached = o.cached;
    c.max_queue = o.max_queue;
    c.prefill_chunk = o.prefill_chunk;
    return c;
  }

  Impl(Engine& e, const ServerOptions& o) : engine(e), opt(o), scheduler(e, scheduler_config(o)) {
    if (opt.alias.empty()) opt.alias = "fitmoe";
    thinking_template = engine.chat_template().find("<think>") != std::string::npos;
    if (engine.chat_template().find("<|tool_call>") != std::string::npos) tool_syntax = ToolSyntax::Gemma4;
    routes();
  }

  void check_model(const json& b) {
    if (!b.contains("model") || b["model"].is_null()) return;
    if (!b["model"].is_string()) refuse("'model' must be a string", "model");
    const std::string name = b["model"].get<std::string>();
    if (name != opt.alias) refuse("the model '" + name + "' does not exist (this server has '" + opt.alias + "')", "model", 404,
                                  "model_not_found");
  }

  // The fields chat and completions share.
  void common_fields(const json& b, GenRequest& g) {
    check_model(b);
    if (int_field(b, "n", 1, 1, 1 << 20) != 1) refuse("'n' must be 1 (one choice per request)", "n");
    GenerateOptions& o = g.gen;
    o = opt.defaults;
    int64_t max_tokens = int_field(b, "max_completion_tokens", -1, 1, 1 << 30);
    if (max_tokens < 0) max_tokens = int_field(b, "max_tokens", opt.default_max_tokens, 1, 1 << 30);
    o.max_tokens = static_cast<int>(max_tokens);
    o.temperature = static_cast<float>(number_field(b, "temperature", o.temperature, 0, 2));
    o.top_p = static_cast<float>(number_field(b, "top_p", o.top_p, 0, 1));
    o.top_k = static_cast<int>(int_field(b, "top_k", o.top_k, 0, 1 << 30));
    o.min_p = static_cast<float>(number_field(b, "min_p", o.min_p, 0, 1));
    o.presence_penalty = static_cast<float>(number_field(b, "presence_penalty", 0, -2, 2));
    o.frequency_penalty = static_cast<float>(number_field(b, "frequency_penalty", 0, -2, 2));
    o.repeat_penalty = static_cast<float>(number_field(b, "repeat_penalty", o.repeat_penalty, 0.01, 10));
    o.seed = static_cast<uint64_t>(int_field(b, "seed", static_cast<int64_t>(o.seed & 0x7fffffffffffffffULL), INT64_MIN, INT64_MAX));
    // logprobs: chat takes a boolean and top_logprobs (0..20); completions an integer (0..5).
    if (b.contains("logprobs") && !b["logprobs"].is_null()) {
      if (b["logprobs"].is_boolean()) {
        if (b["logprobs"].get<bool>()) o.top_logprobs = static_cast<int>(int_field(b, "top_logprobs", 0, 0, 20));
      } else {
        o.top_logprobs = static_cast<int>(int_field(b, "logprobs", 0, 0, 5));
      }
    } else if (int_field(b, "top_logprobs", 0, 0, 20) > 0) {
      refuse("'top_logprobs' needs 'logprobs': true", "top_logprobs");
    }
    if (b.contains("stop") && !b["stop"].is_null()) {
      const json& s = b["stop"];
      if (s.is_string()) {
        o.stop.push_back(s.get<std::string>());
      } else if (s.is_array() && s.size() <= 16) {
        for (const auto& x : s) {
          if (!x.is_string()) refuse("'stop' must be a string or a list of strings", "stop");
          o.stop.push_back(x.get<std::string>());
        }
      } else {
        refuse("'stop' must be a string or a list of at most 16 strings", "stop");
      }
      o.stop.erase(std::remove(o.stop.begin(), o.stop.end(), std::string()), o.stop.end());
    }
    g.stream = bool_field(b, "stream", false);
    if (g.stream && o.top_logprobs >= 0) refuse("'logprobs' are not implemented for streamed answers yet", "logprobs");
    if (b.contains("stream_options") && !b["stream_options"].is_null()) {
      if (!b["stream_options"].is_object()) refuse("'stream_options' must be an object", "stream_options");
      g.include_usage = bool_field(b["stream_options"], "include_usage", false);
    }
    check_length(g);
  }

  void check_length(const GenRequest& g) {
    const int n_ctx = engine.n_ctx();
    if (static_cast<int>(g.prompt.size()) >= n_ctx)
      refuse("the prompt is " + std::to_string(g.prompt.size()) + " tokens; the context holds " + std::to_string(n_ctx) +
                 " and the answer needs at least one more",
             "messages", 400, "context_length_exceeded");
  }

  std::vector<int32_t> render(const json& msgs, const json& ctx, GenRequest* g = nullptr) {
    std::string text;
    try {
      text = engine.apply_chat_template_json(dump(msgs), dump(ctx), true);
    } catch (const ApiError& e) {
      refuse(std::string("the chat template cannot render these messages: ") + e.what(), "messages");
    }
    if (g && thinking_template) {
      g->split_thinking = true;
      const size_t open = text.rfind("<think>"), close = text.rfind("</think>");
      const size_t turn = text.rfind("assistant");
      g->in_thinking = open != std::string::npos && turn != std::string::npos && open > turn &&
                       (close == std::string::npos || close < open);
    }
    return engine.tokenize(text, /*add_special=*/true);
  }

  // Anthropic's Messages API: system apart, content as text blocks, max_tokens required.
  GenRequest messages_request(const json& b) {
    check_model(b);
    auto text_of = [](const json& c, const char* what) {
      if (c.is_string()) return c.get<std::string>();
      if (!c.is_array()) refuse(std::string(what) + " must be a string or a list of text blocks", what);
      std::string t;
      for (const auto& blk : c) {
        if (!blk.is_object() || blk.value("type", "") != "text" || !blk.contains("text") || !blk["text"].is_string())
          refuse(std::string("only text blocks are supported in ") + what + " ({\"type\": \"text\", \"text\": ...})", what);
        t += blk["text"].get<std::string>();
      }
      return t;
    };
    json msgs = json::array();
    if (b.contains("system") && !b["system"].is_null()) msgs.push_back({{"role", "system"}, {"content", text_of(b["system"], "system")}});
    if (!b.contains("messages") || !b["messages"].is_array() || b["messages"].empty())
      refuse("'messages' must be a non-empty list", "messages");
    for (const auto& m : b["messages"]) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content"))
        refuse("each message must be an object with 'role' and 'content'", "messages");
      const std::string role = m["role"].get<std::string>();
      if (role != "user" && role != "assistant") refuse("unknown message role '" + role + "' (user, assistant)", "messages");
      msgs.push_back({{"role", role}, {"content", text_of(m["content"], "messages")}});
    }
    if (!b.contains("max_tokens")) refuse("'max_tokens' is required", "max_tokens");
    GenRequest g;
    g.prompt = render(msgs, json::object());
    GenerateOptions& o = g.gen;
    o = opt.defaults;
    o.max_tokens = static_cast<int>(int_field(b, "max_tokens", 1, 1, 1 << 30));
    o.temperature = static_cast<float>(number_field(b, "temperature", o.temperature, 0, 1));
    o.top_p = static_cast<float>(number_field(b, "top_p", o.top_p, 0, 1));
    o.top_k = static_cast<int>(int_field(b, "top_k", o.top_k, 0, 1 << 30));
    if (b.contains("stop_sequences") && !b["stop_sequences"].is_null()) {
      if (!b["stop_sequences"].is_array()) refuse("'stop_sequences' must be a list of strings", "stop_sequences");
      for (const auto& x : b["stop_sequences"]) {
        if (!x.is_string()) refuse("'stop_sequences' must be a list of strings", "stop_sequences");
        if (!x.get<std::string>().empty()) o.stop.push_back(x.get<std::string>());
      }
    }
    g.stream = bool_field(b, "stream", false);
    check_length(g);
    return g;
  }

  GenRequest chat_request(const json& b) {
    if (!b.contains("messages") || !b["messages"].is_array() || b["messages"].empty())
      refuse("'messages' must be a non-empty list", "messages");
    json msgs = json::array();
    for (const auto& m : b["messages"]) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
        refuse("each message must be an object with a 'role'", "messages");
      std::string role = m["role"].get<std::string>();
      if (role == "developer") role = "system";
      if (role != "system" && role != "user" && role != "assistant" && role != "tool")
        refuse("unknown message role '" + role + "' (system, developer, user, assistant, tool)", "messages");
      json cm = {{"role", role}, {"content", ""}};
      const json c = m.contains("content") ? m["content"] : json(nullptr);
      if (c.is_string()) {
        cm["content"] = c;
      } else if (c.is_array()) {
        std::string text;
        for (const auto& part : c) {
          if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
            refuse("only text content parts are supported ({\"type\": \"text\", \"text\": ...})", "messages");
          text += part["text"].get<std::string>();
        }
        cm["content"] = text;
      } else if (!c.is_null()) {
        refuse("a message's 'content' must be a string, a list of text parts or null", "messages");
      }
      for (const char* k : {"tool_calls", "name", "tool_call_id", "reasoning_content"})
        if (m.contains(k)) cm[k] = m[k];
      msgs.push_back(std::move(cm));
    }
    json ctx = json::object();
    bool tools_on = false;
    if (b.contains("tools") && !b["tools"].is_null()) {
      if (!b["tools"].is_array()) refuse("'tools' must be a list", "tools");
      for (const auto& t : b["tools"])
        if (!t.is_object() || t.value("type", "") != "function" || !t.contains("function") || !t["function"].is_object() ||
            !t["function"].contains("name") || !t["function"]["name"].is_string())
          refuse("each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": ...}}", "tools");
      tools_on = !b["tools"].empty();
    }
    if (b.contains("tool_choice") && !b["tool_choice"].is_null()) {
      const json& tc = b["tool_choice"];
      if (!(tc.is_string() && (tc == "none" || tc == "auto" || tc == "required")) && !tc.is_object())
        refuse("'tool_choice' must be none, auto, required or an object naming a function", "tool_choice");
      if (tc.is_string() && tc == "none") tools_on = false;
    }
    if (tools_on) ctx["tools"] = b["tools"];
    if (b.contains("chat_template_kwargs") && !b["chat_template_kwargs"].is_null()) {
      if (!b["chat_template_kwargs"].is_object()) refuse("'chat_template_kwargs' must be an object", "chat_template_kwargs");
      for (const auto& [k, v] : b["chat_template_kwargs"].items()) ctx[k] = v;
    }
    if (b.contains("enable_thinking") && !b["enable_thinking"].is_null())
      ctx["enable_thinking"] = bool_field(b, "enable_thinking", true);
    GenRequest g;
    g.parse_tools = tools_on;
    g.prompt = render(msgs, ctx, &g);
    common_fields(b, g);
    return g;
  }

  GenRequest completion_request(const json& b) {
    if (!b.contains("prompt")) refuse("'prompt' is required", "prompt");
    GenRequest g;
    const json& p = b["prompt"];
    if (p.is_string()) {
      g.prompt = engine.tokenize(p.get<std::string>(), /*add_special=*/true);
    } else if (p.is_array() && !p.empty() && std::all_of(p.begin(), p.end(), [](const json& x) { return x.is_number_integer(); })) {
      const int n_vocab = engine.n_vocab();
      for (const auto& x : p) {
        const int64_t id = x.get<int64_t>();
        if (id < 0 || id >= n_vocab) refuse("token id " + std::to_string(id) + " is outside the vocabulary", "prompt");
        g.prompt.push_back(static_cast<int32_t>(id));
      }
    } else {
      refuse("'prompt' must be a string or a list of token ids", "prompt");
    }
    if (g.prompt.empty()) refuse("the prompt is empty", "prompt");
    common_fields(b, g);
    return g;
  }

  // Queues one generation (a full queue answers 503 here, before any byte of a stream is sent).
  std::shared_ptr<Pending> start(const GenRequest& g) {
    auto p = std::make_shared<Pending>();
    std::weak_ptr<Pending> w = p;
    try {
      p->job = scheduler.submit(g.prompt, g.gen, [w](const std::string& piece) {
        auto q = w.lock();
        if (!q) return false;
        {
          std::lock_guard<std::mutex> lock(q->mu);
          q->pieces.push_back(piece);
        }
        q->cv.notify_one();
        return !q->gone.load();
      });
    } catch (const QueueFull& e) {
      refuse(e.what(), "", 503);
    } catch (const ApiError& e) {
      refuse(e.what(), "messages");
    }
    return p;
  }

  // Waits for the generation on the connection's thread: emit(text) gets each piece of the answer as
  // it becomes final (text that could still turn into a stop string is held back); false from it (the
  // client is gone) cancels the generation at its next step.
  GenResult finish(Pending& p, const std::function<bool(const std::string&)>& emit) {
    bool writing = true;
    for (;;) {
      std::deque<std::string> got;
      bool done;
      {
        std::unique_lock<std::mutex> lock(p.mu);
        p.cv.wait_for(lock, std::chrono::milliseconds(20), [&] { return !p.pieces.empty(); });
        got.swap(p.pieces);
        done = p.job->done();  // (its last piece was pushed before it was done)
        if (done) {
          for (auto& x : p.pieces) got.push_back(std::move(x));
          p.pieces.clear();
        }
      }
      for (const std::string& piece : got)
        if (writing && !emit(piece)) {
          writing = false;
          p.gone = true;
          p.job->cancel();
        }
      if (done) break;
    }
    GenerateResult x;
    try {
      x = p.job->wait();
    } catch (const ApiError& e) {
      refuse(e.what(), "", 500);
    }
    GenResult r;
    r.text = x.text;
    r.finish = x.stopped_at_end ? "stop" : "length";
    r.stop_hit = x.stop_string;
    r.n_prompt = x.n_prompt;
    r.n_completion = x.n_generated;
    r.n_reused = x.n_reused;
    r.prompt_tps = x.prompt_tokens_per_second;
    r.decode_tps = x.decode_tokens_per_second;
    r.cancelled = x.cancelled || !writing;
    r.logprobs = std::move(x.logprobs);
    metrics.last_prompt_tps = r.prompt_tps;
    metrics.last_decode_tps = r.decode_tps;
    metrics.last_ttft = x.seconds_to_first_token;
    return r;
  }

  GenResult generate(const GenRequest& g) {
    auto p = start(g);
    return finish(*p, [](const std::string&) { return true; });
  }

  // OpenAI's logprobs: chat {"content": [{token, logprob, bytes, top_logprobs}]}, completions
  // {tokens, token_logprobs, top_logprobs, text_offset}.
  json logprobs_json(const GenResult& r, bool chat) {
    auto bytes = [](const std::string& t) {
      json b = json::array();
      for (unsigned char c : t) b.push_back(static_cast<int>(c));
      return b;
    };
    auto piece = [&](int32_t id) { return engine.detokenize(std::span<const int32_t>(&id, 1)); };
    if (chat) {
      json content = json::array();
      for (const TokenLogprob& t : r.logprobs) {
        json top = json::array();
        for (const auto& [id, lp] : t.top) {
          const std::string s = piece(id);
          top.push_back({{"token", s}, {"logprob", lp}, {"bytes", bytes(s)}});
        }
        content.push_back({{"token", t.text}, {"logprob", t.logprob}, {"bytes", bytes(t.text)}, {"top_logprobs", top}});
      }
      return {{"content", content}};
    }
    json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
    size_t off = 0;
    for (const TokenLogprob& t : r.logprobs) {
      tokens.push_back(t.text);
      lps.push_back(t.logprob);
      json top = json::object();
      for (const auto& [id, lp] : t.top) top[piece(id)] = lp;
      tops.push_back(top);
      offsets.push_back(off);
      off += t.text.size();
    }
    return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
  }

  // One tool call in OpenAI's shape (with its index in a streamed delta).
  json tool_call_json(const ToolCall& c, size_t index, bool with_index) {
    json j = {{"id", "call_" + std::to_string(next_id.fetch_add(1))}, {"type", "function"},
              {"function", {{"name", c.name}, {"arguments", c.arguments}}}};
    if (with_index) j["index"] = index;
    return j;
  }

  json usage(const GenResult& r) const {
    return {{"prompt_tokens", r.n_prompt}, {"completion_tokens", r.n_completion}, {"total_tokens", r.n_prompt + r.n_completion},
            {"prompt_tokens_details", {{"cached_tokens", r.n_reused}}}};
  }

  // Chat and completions: the same flow, different shapes of the answer.
  void serve_generation(const httplib::Request& req, httplib::Response& res, bool chat) {
    const json body = parse_body(req);
    GenRequest g = chat ? chat_request(body) : completion_request(body);
    const std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id.fetch_add(1));
    const int64_t created = now_seconds();
    const char* object = chat ? "chat.completion" : "text_completion";
    if (!g.stream) {
      GenResult r = generate(g);
      json choice = {{"index", 0}};
      if (chat) {
        std::string reasoning, content;
        json calls = json::array();
        ToolCallParser tools([&](const std::string& t) { content += t; return true; }, [&](const ToolCall& c) {
          calls.push_back(tool_call_json(c, calls.size(), false));
          return true;
        }, tool_syntax);
        auto to_content = [&](const std::string& t) { return g.parse_tools ? tools.feed(t) : (content += t, true); };
        if (g.split_thinking) {
          ThinkSplitter split([&](const std::string& t) { reasoning += t; return true; }, to_content, g.in_thinking);
          split.feed(r.text);
          split.finish();
        } else {
          to_content(r.text);
        }
        tools.finish();
        choice["message"] = {{"role", "assistant"}, {"content", calls.empty() || !content.empty() ? json(content) : json(nullptr)}};
        if (!reasoning.empty()) choice["message"]["reasoning_content"] = reasoning;
        if (!calls.empty()) choice["message"]["tool_calls"] = calls;
        if (!calls.empty()) r.finish = "tool_calls";
      } else {
        choice["text"] = r.text, choice["logprobs"] = nullptr;
      }
      if (g.gen.top_logprobs >= 0) choice["logprobs"] = logprobs_json(r, chat);
      choice["finish_reason"] = r.finish;
      json out = {{"id", id}, {"object", object}, {"created", created}, {"model", opt.alias}, {"choices", json::array({choice})},
                  {"usage", usage(r)}};
      res.set_content(dump(out), "application/json");
      return;
    }
    // Streaming: server-sent events, one chunk per piece of text, then the finish, the usage if asked,
    // and [DONE]. The request is queued now (503 before any event when the queue is full); the
    // provider, on the connection's thread, writes its text as it comes.
    std::shared_ptr<Pending> pending = start(g);
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider("text/event-stream", [this, g, id, created, chat, pending](size_t, httplib::DataSink& sink) {
      const char* chunk_object = chat ? "chat.completion.chunk" : "text_completion";
      auto event = [&](const json& j) {
        const std::string s = "data: " + dump(j) + "\n\n";
        return sink.write(s.data(), s.size());
      };
      auto chunk = [&](const json& delta_or_text, const json& finish) {
        json choice = {{"index", 0}};
        if (chat) choice["delta"] = delta_or_text;
        else choice["text"] = delta_or_text, choice["logprobs"] = nullptr;
        choice["finish_reason"] = finish;
        return event({{"id", id}, {"object", chunk_object}, {"created", created}, {"model", opt.alias},
                      {"choices", json::array({choice})}});
      };
      bool ok = !chat || chunk(json{{"role", "assistant"}, {"content", ""}}, nullptr);
      GenResult r;
      if (ok) {
        auto content = [&](const std::string& piece) { return chunk(chat ? json{{"content", piece}} : json(piece), nullptr); };
        size_t n_calls = 0;
        ToolCallParser tools(content, [&](const ToolCall& c) {
          return chunk(json{{"tool_calls", json::array({tool_call_json(c, n_calls++, true)})}}, nullptr);
        }, tool_syntax);
        auto to_content = [&](const std::string& t) { return chat && g.parse_tools ? tools.feed(t) : content(t); };
        if (chat && g.split_thinking) {
          ThinkSplitter split([&](const std::string& t) { return chunk(json{{"reasoning_content", t}}, nullptr); }, to_content,
                              g.in_thinking);
          r = finish(*pending, [&](const std::string& piece) { return split.feed(piece); });
          ok = !r.cancelled && split.finish();
        } else {
          r = finish(*pending, to_content);
          ok = !r.cancelled;
        }
        ok = ok && tools.finish();
        if (n_calls) r.finish = "tool_calls";
      } else {
        pending->job->cancel();
        r = finish(*pending, [](const std::string&) { return false; });
      }
      if (ok) ok = chunk(chat ? json::object() : json(""), r.finish);
      if (ok && g.include_usage)
        ok = event({{"id", id}, {"object", chunk_object}, {"created", created}, {"model", opt.alias},
                    {"choices", json::array()}, {"usage", usage(r)}});
      if (ok) {
        const std::string done = "data: [DONE]\n\n";
        sink.write(done.data(), done.size());
      }
      sink.done();
      return true;
    });
  }

  // POST /v1/messages: Anthropic's answer shape and, streaming, its event sequence.
  void serve_messages(const httplib::Request& req, httplib::Response& res) {
    const json body = parse_body(req);
    GenRequest g = messages_request(body);
    const std::string id = "msg_" + std::to_string(next_id.fetch_add(1));
    auto stop_reason = [](const GenResult& r) {
      return r.finish == "length" ? "max_tokens" : r.stop_hit.empty() ? "end_turn" : "stop_sequence";
    };
    auto stop_sequence = [](const GenResult& r) { return r.stop_hit.empty() ? json(nullptr) : json(r.stop_hit); };
    if (!g.stream) {
      const GenResult r = generate(g);
      json out = {{"id", id}, {"type", "message"}, {"role", "assistant"}, {"model", opt.alias},
                  {"content", json::array({{{"type", "text"}, {"text", r.text}}})}, {"stop_reason", stop_reason(r)},
                  {"stop_sequence", stop_sequence(r)},
                  {"usage", {{"input_tokens", r.n_prompt}, {"output_tokens", r.n_completion},
                             {"cache_read_input_tokens", r.n_reused}}}};
      res.set_content(dump(out), "application/json");
      return;
    }
    std::shared_ptr<Pending> pending = start(g);
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider("text/event-stream", [this, g, id, pending, stop_reason, stop_sequence](size_t, httplib::DataSink& sink) {
      auto event = [&](const char* name, const json& j) {
        const std::string s = std::string("event: ") + name + "\ndata: " + dump(j) + "\n\n";
        return sink.write(s.data(), s.size());
      };
      bool ok = event("message_start", {{"type", "message_start"},
                                        {"message", {{"id", id}, {"type", "message"}, {"role", "assistant"}, {"model", opt.alias},
                                                     {"content", json::array()}, {"stop_reason", nullptr},
                                                     {"stop_sequence", nullptr},
                                                     {"usage", {{"input_tokens", g.prompt.size()}, {"output_tokens", 0}}}}}});
      ok = ok && event("content_block_start",
                       {{"type", "content_block_start"}, {"index", 0}, {"content_block", {{"type", "text"}, {"text", ""}}}});
      GenResult r;
      if (ok) {
        r = finish(*pending, [&](const std::string& piece) {
          return event("content_block_delta",
                       {{"type", "content_block_delta"}, {"index", 0}, {"delta", {{"type", "text_delta"}, {"text", piece}}}});
        });
        ok = !r.cancelled;
      } else {
        pending->job->cancel();
        r = finish(*pending, [](const std::string&) { return false; });
      }
      ok = ok && event("content_block_stop", {{"type", "content_block_stop"}, {"index", 0}});
      ok = ok && event("message_delta", {{"type", "message_delta"},
                                         {"delta", {{"stop_reason", stop_reason(r)}, {"stop_sequence", stop_sequence(r)}}},
                                         {"usage", {{"output_tokens", r.n_completion}}}});
      if (ok) event("message_stop", {{"type", "message_stop"}});
      sink.done();
      return true;
    });
  }

  std::string metrics_text() {
    std::string out;
    auto metric = [&](const char* name, const char* type, const char* help, double v) {
      out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + " ";
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.17g\n", v);
      out += buf;
    };
    const Scheduler::Stats st = scheduler.stats();
    metric("fitmoe_requests_total", "counter", "generation requests answered", static_cast<double>(st.requests));
    metric("fitmoe_requests_refused_total", "counter", "requests answered with a 4xx or 5xx", static_cast<double>(metrics.refused.load()));
    metric("fitmoe_requests_running", "gauge", "requests being decoded", st.running);
    metric("fitmoe_requests_waiting", "gauge", "requests queued behind the running ones", st.waiting);
    metric("fitmoe_prompt_tokens_total", "counter", "prompt tokens of all requests", static_cast<double>(st.prompt_tokens));
    metric("fitmoe_prompt_tokens_reused_total", "counter", "prompt tokens found in the cache (not evaluated again)",
           static_cast<double>(st.reused_tokens));
    metric("fitmoe_completion_tokens_total", "counter", "generated tokens", static_cast<double>(st.generated_tokens));
    metric("fitmoe_steps_total", "counter", "batched forward steps", static_cast<double>(st.steps));
    metric("fitmoe_prompt_tokens_per_second", "gauge", "prompt tokens evaluated per second, all requests (last second)",
           st.prompt_tokens_per_second);
    metric("fitmoe_decode_tokens_per_second", "gauge", "tokens generated per second, all requests (last second)",
           st.decode_tokens_per_second);
    metric("fitmoe_last_request_decode_tokens_per_second", "gauge", "decode speed of the last finished request",
           metrics.last_decode_tps.load());
    metric("fitmoe_last_request_seconds_to_first_token", "gauge", "time to first token of the last finished request",
           metrics.last_ttft.load());
    metric("fitmoe_sequences", "gauge", "sequences holding a conversation", st.sequences);
    metric("fitmoe_context_size_tokens", "gauge", "the context of each sequence", engine.n_ctx());
    metric("fitmoe_kv_cache_bytes", "gauge", "bytes of the sequences' KV caches and state", static_cast<double>(st.state_bytes));
    metric("fitmoe_gpu_bytes", "gauge", "GPU memory the engine holds", static_cast<double>(engine.gpu_bytes_used()));
    return out;
  }

  void routes() {
    auto guarded = [this](auto fn, bool anthropic = false) {
      return [this, fn, anthropic](const httplib::Request& req, httplib::Response& res) {
        try {
          fn(req, res);
          return;
        } catch (const HttpError& e) {
          send_error(res, e, anthropic);
        } catch (const json::exception& e) {
          send_error(res, HttpError{400, std::string("the request does not have the expected shape: ") + e.what(),
                                    "invalid_request_error", "", ""}, anthropic);
        } catch (const std::exception& e) {
          send_error(res, HttpError{500, e.what(), "server_error", "", ""}, anthropic);
        }
        metrics.refused++;
      };
    };
    http.set_payload_max_length(opt.max_body);
    // A connection thread for every request the scheduler may hold (running and waiting) and a few
    // more: a request keeps its thread while it waits, so with httplib's default pool (8 threads) a
    // ninth client would not even be read until one of them finished.
    const size_t threads = static_cast<size_t>(opt.parallel + opt.max_queue + 8);
    http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (opt.api_key.empty() || req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
      const std::string auth = req.get_header_value("Authorization");
      const std::string want = "Bearer " + opt.api_key;
      const std::string xkey = req.get_header_value("x-api-key");  // (Anthropic's header)
      if (auth == want || xkey == opt.api_key) return httplib::Server::HandlerResponse::Unhandled;
      send_error(res, HttpError{401, auth.empty() && xkey.empty() ? "an API key is required (Authorization: Bearer KEY or x-api-key)"
                                                                  : "the API key is not valid",
                                "authentication_error", "", "invalid_api_key"},
                 req.path == "/v1/messages");
      return httplib::Server::HandlerResponse::Handled;
    });
    // Bodies for httplib's own refusals (404 no such path, 413 body too large, 400 bad HTTP), as JSON.
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      std::string msg = res.status == 404   ? "no such endpoint: " + req.method + " " + req.path
                        : res.status == 413 ? "the request body is too large"
                        : res.status == 405 ? "method not allowed"
                                            : "bad request";
      send_error(res, HttpError{res.status, msg, res.status == 404 ? "not_found_error" : "invalid_request_error", "", ""});
    });
    http.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(dump(json{{"status", "ok"}}), "application/json");
    });
    http.Get("/v1/models", guarded([this](const httplib::Request&, httplib::Response& res) {
      json m = {{"id", opt.alias}, {"object", "model"}, {"created", now_seconds()}, {"owned_by", "fitmoe"}};
      res.set_content(dump(json{{"object", "list"}, {"data", json::array({m})}}), "application/json");
    }));
    http.Post("/v1/chat/completions", guarded([this](const httplib::Request& req, httplib::Response& res) {
      serve_generation(req, res, true);
    }));
    http.Post("/v1/completions", guarded([this](const httplib::Request& req, httplib::Response& res) {
      serve_generation(req, res, false);
    }));
    http.Post("/v1/messages", guarded([this](const httplib::Request& req, httplib::Response& res) { serve_messages(req, res); },
                                      true));
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics_text(), "text/plain; version=0.0.4");
    });
    http.Post("/tokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
      const json b = parse_body(req);
      if (!b.contains("content") || !b["content"].is_string()) refuse("'content' must be a string", "content");
      const bool special = bool_field(b, "add_special", false);
      res.set_content(dump(json{{"tokens", engine.tokenize(b["content"].get<std::string>(), special)}}), "application/json");
    }));
    http.Post("/detokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
      const json b = parse_body(req);
      if (!b.contains("tokens") || !b["tokens"].is_array()) refuse("'tokens' must be a list of token ids", "tokens");
      std::vector<int32_t> ids;
      const int n_vocab = engine.n_vocab();
      for (const auto& x : b["tokens"]) {
        if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= n_vocab)
          refuse("'tokens' must hold ids from 0 to " + std::to_string(n_vocab - 1), "tokens");
        ids.push_back(static_cast<int32_t>(x.get<int64_t>()));
      }
      // (JSON needs valid UTF-8: dump() puts U+FFFD where ids split a character)
      res.set_content(dump(json{{"content", engine.detokenize(ids)}}), "application/json");
    }));
  }
};

Server::Server(Engine& engine, const ServerOptions& options) : impl_(std::make_unique<Impl>(engine, options)) {}
Server::~Server() { stop(); }

int Server::bind() {
  Impl& i = *impl_;
  if (i.opt.port < 0 || i.opt.port > 65535) throw ApiError("--port " + std::to_string(i.opt.port) + ": a port from 0 to 65535");
  if (i.opt.port == 0) {
    i.port = i.http.bind_to_any_port(i.opt.host);
  } else {
    i.port = i.http.bind_to_port(i.opt.host, i.opt.port) ? i.opt.port : -1;
  }
  if (i.port <= 0)
    throw ApiError("cannot listen on " + i.opt.host + ":" + std::to_string(i.opt.port) + " (in use, or not an address of this machine)");
  return i.port;
}

void Server::run() { impl_->http.listen_after_bind(); }

void Server::stop() {
  if (impl_ && impl_->http.is_running()) impl_->http.stop();
}

}  // namespace fitmoe::server

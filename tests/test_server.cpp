// The HTTP server against the engine, over real sockets on 127.0.0.1: greedy answers equal the
// session's own generation (alone, streamed, and on later turns that reuse the cached prompt), the
// OpenAI shapes, and the 4xx answers for bad requests; then the `fitmoe serve` binary started and
// stopped with SIGTERM.
#ifdef FITMOE_HAVE_SERVER
#include <gtest/gtest.h>
#include <httplib.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <atomic>
#include <chrono>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "api/internal.h"
#include "cli_util.h"
#include "model/model.h"
#include "runtime/session.h"
#include "server/reasoning.h"
#include "server/tool_calls.h"
#include "server/server.h"
#include "testdata.h"
#include "text/chat.h"
#include "text/tokenizer.h"

using namespace fitmoe;
using json = nlohmann::ordered_json;

namespace {

std::string tiny() { return test::testdata("qwen3moe-tiny/qwen3moe-tiny-f32.gguf"); }

std::unique_ptr<Model> cpu_model() {
  LoadOptions lo;
  lo.plan.use_gpu = false;
  return Model::load(tiny(), lo);
}

SessionOptions session_opts() {
  SessionOptions so;
  so.n_threads = 2;
  so.n_ctx = 512;
  return so;
}

// An engine over the same file as m (the server takes an engine of its own), with room for the
// server's sequences.
std::unique_ptr<Engine> engine_for(const Model& m, const server::ServerOptions& o) {
  LoadOptions lo;
  lo.plan.use_gpu = false;
  lo.plan.n_seq = o.parallel + o.cached;
  return EngineAccess::adopt(Model::load(m.file().path(), lo), session_opts(), 2);
}

// A server on a free port for one test, its loop on a thread.
struct Running {
  std::unique_ptr<Engine> engine;
  server::Server srv;
  int port;
  std::thread loop;
  Running(const Model& m, server::ServerOptions o = {})
      : engine(engine_for(m, o)), srv(*engine, with_port0(o)), port(srv.bind()) {
    loop = std::thread([this] { srv.run(); });
  }
  ~Running() {
    srv.stop();
    loop.join();
  }
  static server::ServerOptions with_port0(server::ServerOptions o) {
    o.port = 0;
    o.alias = "tiny";
    return o;
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(60, 0);
    return c;
  }
};

// The greedy answer the session itself gives for a chat (the reference for the server's).
std::string greedy_answer(const Model& m, const std::vector<ChatMessage>& msgs, int n) {
  auto tok = Tokenizer::from_gguf(m.file());
  Session s(m, session_opts());
  const auto ids = tok->encode(apply_chat_template(*tok, msgs, true), true);
  SamplerParams sp;
  sp.temperature = 0;
  Sampler sampler(sp);
  StreamDecoder dec(*tok);
  std::string out;
  s.generate(ids, n, sampler, [&](int32_t t) {
    if (tok->is_eog(t)) return false;
    out += dec.push(t);
    return true;
  }, tok->eog_tokens());
  return out + dec.flush();
}

json chat_body(const std::string& user, int max_tokens, bool stream = false) {
  return {{"model", "tiny"},
          {"messages", json::array({{{"role", "system"}, {"content", "You are terse."}}, {{"role", "user"}, {"content", user}}})},
          {"max_tokens", max_tokens},
          {"temperature", 0},
          {"stream", stream}};
}

// The content deltas of an SSE answer, concatenated; *done: whether [DONE] closed it.
std::string sse_content(const std::string& body, bool* done, json* usage) {
  std::string out;
  *done = false;
  size_t at = 0;
  while ((at = body.find("data: ", at)) != std::string::npos) {
    const size_t end = body.find("\n\n", at);
    const std::string payload = body.substr(at + 6, end - at - 6);
    at = end;
    if (payload == "[DONE]") {
      *done = true;
      continue;
    }
    const json j = json::parse(payload);
    if (j.contains("usage")) *usage = j["usage"];
    for (const auto& c : j["choices"])
      if (c.contains("delta") && c["delta"].contains("content")) out += c["delta"]["content"].get<std::string>();
  }
  return out;
}

void expect_error(const httplib::Result& r, int status, const std::string& words) {
  ASSERT_TRUE(r) << "no answer";
  EXPECT_EQ(r->status, status) << r->body;
  const json j = json::parse(r->body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j.contains("error")) << r->body;
  EXPECT_NE(j["error"]["message"].get<std::string>().find(words), std::string::npos) << r->body;
}

}  // namespace

TEST(Server, ChatAnswersAreTheSessionsGreedyAnswersAloneStreamedAndOnLaterTurns) {
  auto m = cpu_model();
  Running run(*m);
  auto c = run.client();
  const std::vector<ChatMessage> msgs = {{"system", "You are terse.", nullptr}, {"user", "Say something.", nullptr}};
  const std::string want = greedy_answer(*m, msgs, 12);

  auto r = c.Post("/v1/chat/completions", chat_body("Say something.", 12).dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["model"], "tiny");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"].get<std::string>(), want);
  EXPECT_TRUE(j["choices"][0]["finish_reason"] == "length" || j["choices"][0]["finish_reason"] == "stop");
  EXPECT_GT(j["usage"]["prompt_tokens"].get<int>(), 5);
  EXPECT_EQ(j["usage"]["total_tokens"].get<int>(), j["usage"]["prompt_tokens"].get<int>() + j["usage"]["completion_tokens"].get<int>());

  // Streamed: the same text in pieces, the usage chunk, then [DONE].
  json sb = chat_body("Say something.", 12, true);
  sb["stream_options"] = {{"include_usage", true}};
  auto s = c.Post("/v1/chat/completions", sb.dump(), "application/json");
  ASSERT_TRUE(s);
  ASSERT_EQ(s->status, 200) << s->body;
  EXPECT_NE(s->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
  bool done = false;
  json usage;
  EXPECT_EQ(sse_content(s->body, &done, &usage), want);
  EXPECT_TRUE(done);
  EXPECT_EQ(usage["prompt_tokens"], j["usage"]["prompt_tokens"]);

  // Another conversation, then the first again: the sequence's cache is reused or cut back, the answers
  // stay the session's.
  const std::vector<ChatMessage> other = {{"system", "You are terse.", nullptr}, {"user", "Count to three.", nullptr}};
  auto o = c.Post("/v1/chat/completions", chat_body("Count to three.", 10).dump(), "application/json");
  ASSERT_TRUE(o);
  EXPECT_EQ(json::parse(o->body)["choices"][0]["message"]["content"].get<std::string>(), greedy_answer(*m, other, 10));
  auto again = c.Post("/v1/chat/completions", chat_body("Say something.", 12).dump(), "application/json");
  ASSERT_TRUE(again);
  EXPECT_EQ(json::parse(again->body)["choices"][0]["message"]["content"].get<std::string>(), want);
}

TEST(Server, CompletionsModelsHealthAndTokens) {
  auto m = cpu_model();
  Running run(*m);
  auto c = run.client();
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(json::parse(models->body)["data"][0]["id"], "tiny");

  auto t = c.Post("/tokenize", json{{"content", "hello world"}}.dump(), "application/json");
  ASSERT_TRUE(t);
  ASSERT_EQ(t->status, 200) << t->body;
  const json ids = json::parse(t->body)["tokens"];
  EXPECT_FALSE(ids.empty());
  auto d = c.Post("/detokenize", json{{"tokens", ids}}.dump(), "application/json");
  ASSERT_TRUE(d);
  EXPECT_EQ(json::parse(d->body)["content"], "hello world");

  // Tools reach the template (Qwen3's describes them in the system turn: a longer prompt).
  json plain = chat_body("What is the weather in Paris?", 2);
  json with_tools = plain;
  with_tools["tools"] = json::array({{{"type", "function"},
                                      {"function", {{"name", "get_weather"}, {"description", "the weather in a city"},
                                                    {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}});
  auto p0 = c.Post("/v1/chat/completions", plain.dump(), "application/json");
  auto p1 = c.Post("/v1/chat/completions", with_tools.dump(), "application/json");
  ASSERT_TRUE(p0 && p1);
  ASSERT_EQ(p1->status, 200) << p1->body;
  EXPECT_GT(json::parse(p1->body)["usage"]["prompt_tokens"].get<int>(), json::parse(p0->body)["usage"]["prompt_tokens"].get<int>() + 20);

  json body = {{"prompt", "Once upon a time"}, {"max_tokens", 6}, {"temperature", 0}};
  auto r = c.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["usage"]["completion_tokens"].get<int>(), 6);
  // A stop string cuts the answer before it, and the finish reason says so.
  const std::string text = j["choices"][0]["text"].get<std::string>();
  if (text.size() >= 2) {
    body["stop"] = text.substr(1, 1);
    auto st = c.Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(st);
    const json js = json::parse(st->body);
    EXPECT_EQ(js["choices"][0]["text"].get<std::string>(), text.substr(0, text.find(text.substr(1, 1))));
    EXPECT_EQ(js["choices"][0]["finish_reason"], "stop");
  }
}

TEST(Server, BadRequestsGetA4xxThatNamesTheProblem) {
  auto m = cpu_model();
  server::ServerOptions o;
  o.max_body = 4096;
  Running run(*m, o);
  auto c = run.client();
  const char* path = "/v1/chat/completions";
  expect_error(c.Post(path, "{not json", "application/json"), 400, "not valid JSON");
  expect_error(c.Post(path, "[1, 2]", "application/json"), 400, "JSON object");
  expect_error(c.Post(path, json{{"messages", json::array()}}.dump(), "application/json"), 400, "messages");
  json b = chat_body("hi", 4);
  b["max_tokens"] = -5;
  expect_error(c.Post(path, b.dump(), "application/json"), 400, "max_tokens");
  b = chat_body("hi", 4);
  b["max_tokens"] = "lots";
  expect_error(c.Post(path, b.dump(), "application/json"), 400, "integer");
  b = chat_body("hi", 4);
  b["temperature"] = 7;
  expect_error(c.Post(path, b.dump(), "application/json"), 400, "temperature");
  b = chat_body("hi", 4);
  b["model"] = "gpt-9";
  expect_error(c.Post(path, b.dump(), "application/json"), 404, "gpt-9");
  b = chat_body("hi", 4);
  b["messages"][1]["role"] = "wizard";
  expect_error(c.Post(path, b.dump(), "application/json"), 400, "wizard");
  b = chat_body("hi", 4);
  b["tools"] = json::array({{{"type", "function"}}});
  expect_error(c.Post(path, b.dump(), "application/json"), 400, "tool");
  b = chat_body("hi", 4, true);
  b["logprobs"] = true;
  expect_error(c.Post(path, b.dump(), "application/json"), 400, "not implemented for streamed");
  b = chat_body("hi", 4);
  b["top_logprobs"] = 3;
  expect_error(c.Post(path, b.dump(), "application/json"), 400, "logprobs");
  b = chat_body("hi", 4);
  b["logprobs"] = true;
  b["top_logprobs"] = 21;
  expect_error(c.Post(path, b.dump(), "application/json"), 400, "top_logprobs");
  b = chat_body("hi", 4);
  b["frequency_penalty"] = 2.5;
  expect_error(c.Post(path, b.dump(), "application/json"), 400, "frequency_penalty");
  b = chat_body("hi", 4);
  b["n"] = 3;
  expect_error(c.Post(path, b.dump(), "application/json"), 400, "'n'");
  // Invalid UTF-8 in a string, a prompt longer than the context, a body over the limit, no such path.
  expect_error(c.Post(path, std::string("{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}"), "application/json"),
               400, "JSON");
  json lp = {{"prompt", json::array()}, {"max_tokens", 4}};
  for (int i = 0; i < 600; ++i) lp["prompt"].push_back(1);
  auto big = c.Post("/v1/completions", lp.dump(), "application/json");
  expect_error(big, 400, "context");
  EXPECT_EQ(json::parse(big->body)["error"]["code"], "context_length_exceeded");
  expect_error(c.Post(path, std::string(8000, ' '), "application/json"), 413, "too large");
  expect_error(c.Get("/v1/nothing"), 404, "no such endpoint");
  // And it still answers afterwards.
  auto ok = c.Post(path, chat_body("hi", 2).dump(), "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

// Hostile and malformed requests in bulk (bounded, loopback only): truncated and mutated bodies, random
// bytes, wrong types in every field. Each gets an answer below 500; the server answers correctly after.
TEST(Server, ThousandsOfMalformedRequestsNeverBreakIt) {
  auto m = cpu_model();
  Running run(*m);
  auto c = run.client();
  const std::string valid = chat_body("Say something.", 1).dump();
  std::mt19937 rng(7);
  const std::vector<json> odd_values = {nullptr, -1, 1e308, "x", json::array(), json::object(), true, -0.5, 1 << 30};
  const char* fields[] = {"messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
                          "stream_options", "model", "n", "tools", "max_completion_tokens", "chat_template_kwargs",
                          "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "tool_choice"};
  constexpr int kRequests = 10000;
  int answered = 0;
  for (int i = 0; i < kRequests; ++i) {
    std::string body;
    switch (i % 4) {
      case 0: body = valid.substr(0, rng() % valid.size()); break;  // truncated
      case 1: {                                                     // a byte changed
        body = valid;
        body[rng() % body.size()] = static_cast<char>(rng());
        break;
      }
      case 2: {                                                     // random bytes
        body.resize(rng() % 200);
        for (char& ch : body) ch = static_cast<char>(rng());
        break;
      }
      default: {                                                    // a field of the wrong type or range
        json b = json::parse(valid);
        b[fields[rng() % std::size(fields)]] = odd_values[rng() % odd_values.size()];
        b["max_tokens"] = 1;
        body = b.dump();
      }
    }
    const char* path = i % 8 == 7 ? "/v1/completions" : i % 8 == 5 ? "/v1/messages" : "/v1/chat/completions";
    auto r = c.Post(path, body, "application/json");
    ASSERT_TRUE(r) << "no answer to request " << i << ": " << body;
    ASSERT_LT(r->status, 500) << body << " -> " << r->body;
    ++answered;
  }
  EXPECT_EQ(answered, kRequests);
  auto ok = c.Post("/v1/chat/completions", chat_body("Say something.", 4).dump(), "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

// Anthropic's Messages API: the same greedy answer in its shape, its streaming events in order, its
// error body; and /metrics counting what was served (the repeated prompt found in the cache).
TEST(Server, AnthropicMessagesAndMetrics) {
  auto m = cpu_model();
  Running run(*m);
  auto c = run.client();
  const std::vector<ChatMessage> msgs = {{"system", "You are terse.", nullptr}, {"user", "Say something.", nullptr}};
  const std::string want = greedy_answer(*m, msgs, 12);
  json b = {{"model", "tiny"}, {"max_tokens", 12}, {"temperature", 0}, {"system", "You are terse."},
            {"messages", json::array({{{"role", "user"}, {"content", json::array({{{"type", "text"}, {"text", "Say something."}}})}}})}};
  auto r = c.Post("/v1/messages", b.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["type"], "message");
  EXPECT_EQ(j["role"], "assistant");
  EXPECT_EQ(j["content"][0]["type"], "text");
  EXPECT_EQ(j["content"][0]["text"].get<std::string>(), want);
  EXPECT_TRUE(j["stop_reason"] == "end_turn" || j["stop_reason"] == "max_tokens") << j["stop_reason"];
  EXPECT_GT(j["usage"]["input_tokens"].get<int>(), 5);

  b["stream"] = true;
  auto s = c.Post("/v1/messages", b.dump(), "application/json");
  ASSERT_TRUE(s);
  ASSERT_EQ(s->status, 200) << s->body;
  std::vector<std::string> names;
  std::string text;
  size_t at = 0;
  while ((at = s->body.find("event: ", at)) != std::string::npos) {
    const size_t nl = s->body.find('\n', at);
    names.push_back(s->body.substr(at + 7, nl - at - 7));
    const size_t data = s->body.find("data: ", nl);
    const size_t end = s->body.find("\n\n", data);
    const json e = json::parse(s->body.substr(data + 6, end - data - 6));
    EXPECT_EQ(e["type"], names.back());
    if (names.back() == "content_block_delta") text += e["delta"]["text"].get<std::string>();
    at = end;
  }
  ASSERT_GE(names.size(), 5u);
  EXPECT_EQ(names.front(), "message_start");
  EXPECT_EQ(names[1], "content_block_start");
  EXPECT_EQ(names[names.size() - 3], "content_block_stop");
  EXPECT_EQ(names[names.size() - 2], "message_delta");
  EXPECT_EQ(names.back(), "message_stop");
  EXPECT_EQ(text, want);

  json nomax = b;
  nomax.erase("max_tokens");
  auto e = c.Post("/v1/messages", nomax.dump(), "application/json");
  ASSERT_TRUE(e);
  EXPECT_EQ(e->status, 400);
  const json ej = json::parse(e->body);
  EXPECT_EQ(ej["type"], "error");
  EXPECT_EQ(ej["error"]["type"], "invalid_request_error");
  EXPECT_NE(ej["error"]["message"].get<std::string>().find("max_tokens"), std::string::npos);

  auto mt = c.Get("/metrics");
  ASSERT_TRUE(mt);
  EXPECT_EQ(mt->status, 200);
  EXPECT_NE(mt->body.find("fitmoe_requests_total 2"), std::string::npos) << mt->body;
  EXPECT_NE(mt->body.find("fitmoe_requests_refused_total 1"), std::string::npos) << mt->body;
  EXPECT_EQ(mt->body.find("fitmoe_prompt_tokens_reused_total 0\n"), std::string::npos) << mt->body;  // the second found the first's
}

// The reasoning split of thinking models, fed in every way a stream can cut the text.
TEST(ThinkSplitter, SeparatesReasoningFromTheAnswerAtEveryCut) {
  const std::string text = "<think>\nfirst I think</think>\n\nthe answer";
  for (size_t a = 0; a <= text.size(); ++a)
    for (size_t b = a; b <= text.size(); b += 3) {
      std::string r, c;
      server::ThinkSplitter s([&](const std::string& t) { r += t; return true; }, [&](const std::string& t) { c += t; return true; });
      s.feed(text.substr(0, a));
      s.feed(text.substr(a, b - a));
      s.feed(text.substr(b));
      s.finish();
      ASSERT_EQ(r, "first I think") << a << " " << b;
      ASSERT_EQ(c, "the answer") << a << " " << b;
    }
  std::string r, c;
  server::ThinkSplitter plain([&](const std::string& t) { r += t; return true; }, [&](const std::string& t) { c += t; return true; });
  plain.feed("<thin");
  plain.feed("king is fine");  // not the tag: all content
  plain.finish();
  EXPECT_EQ(r, "");
  EXPECT_EQ(c, "<thinking is fine");
  std::string r2, c2;  // the prompt opened <think> already
  server::ThinkSplitter opened([&](const std::string& t) { r2 += t; return true; }, [&](const std::string& t) { c2 += t; return true; },
                               true);
  opened.feed("\nhmm</thi");
  opened.feed("nk>\n\nyes");
  opened.finish();
  EXPECT_EQ(r2, "hmm");
  EXPECT_EQ(c2, "yes");
}

// Tool calls in both formats, fed at every cut: content around them, each call whole, bad ones kept as text.
TEST(ToolCallParser, QwenJsonAndXmlCallsAtEveryCut) {
  const std::string text =
      "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
      "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=note>\nhello world\n</parameter>\n"
      "</function>\n</tool_call> done";
  for (size_t a = 0; a <= text.size(); a += 2)
    for (size_t b = a; b <= text.size(); b += 7) {
      std::string content;
      std::vector<server::ToolCall> calls;
      server::ToolCallParser p([&](const std::string& t) { content += t; return true; },
                               [&](const server::ToolCall& c) { calls.push_back(c); return true; });
      p.feed(text.substr(0, a));
      p.feed(text.substr(a, b - a));
      p.feed(text.substr(b));
      p.finish();
      ASSERT_EQ(content, "Let me check. done") << a << " " << b;
      ASSERT_EQ(calls.size(), 2u);
      EXPECT_EQ(calls[0].name, "get_weather");
      EXPECT_EQ(json::parse(calls[0].arguments), json::parse("{\"city\": \"Paris\"}"));
      EXPECT_EQ(calls[1].name, "add");
      EXPECT_EQ(json::parse(calls[1].arguments), json::parse("{\"a\": 2, \"note\": \"hello world\"}"));
    }
  std::string content;
  int n = 0;
  server::ToolCallParser bad([&](const std::string& t) { content += t; return true; }, [&](const server::ToolCall&) { return ++n, true; });
  bad.feed("x<tool_call>{not json}</tool_call>y<tool_call>{\"name\": \"cut");
  bad.finish();
  EXPECT_EQ(n, 0);
  EXPECT_EQ(content, "x<tool_call>{not json}</tool_call>y<tool_call>{\"name\": \"cut");
}

// Gemma 4's notation: bare keys, <|"|>-quoted strings (holding braces, commas and colons), numbers,
// booleans, nested objects and lists; at every cut of the stream; a call that does not parse stays text.
TEST(ToolCallParser, Gemma4CallsAtEveryCut) {
  const std::string text =
      "Sure.<|tool_call>call:get_weather{city:<|\"|>Paris, {FR}: now<|\"|>,days:3,metric:true}<tool_call|>"
      "<|tool_call>call:plan{steps:[1,2.5,<|\"|>x<|\"|>],opts:{deep:{on:false,tag:null}},<|\"|>quoted key<|\"|>:1}<tool_call|> ok";
  for (size_t a = 0; a <= text.size(); a += 3)
    for (size_t b = a; b <= text.size(); b += 11) {
      std::string content;
      std::vector<server::ToolCall> calls;
      server::ToolCallParser p([&](const std::string& t) { content += t; return true; },
                               [&](const server::ToolCall& c) { calls.push_back(c); return true; }, server::ToolSyntax::Gemma4);
      p.feed(text.substr(0, a));
      p.feed(text.substr(a, b - a));
      p.feed(text.substr(b));
      p.finish();
      ASSERT_EQ(content, "Sure. ok") << a << " " << b;
      ASSERT_EQ(calls.size(), 2u);
      EXPECT_EQ(calls[0].name, "get_weather");
      EXPECT_EQ(json::parse(calls[0].arguments), json::parse(R"({"city": "Paris, {FR}: now", "days": 3, "metric": true})"));
      EXPECT_EQ(calls[1].name, "plan");
      EXPECT_EQ(json::parse(calls[1].arguments),
                json::parse(R"({"steps": [1, 2.5, "x"], "opts": {"deep": {"on": false, "tag": null}}, "quoted key": 1})"));
    }
  std::string content;
  int n = 0;
  server::ToolCallParser bad([&](const std::string& t) { content += t; return true; }, [&](const server::ToolCall&) { return ++n, true; },
                             server::ToolSyntax::Gemma4);
  bad.feed("x<|tool_call>call:f{a:<|\"|>unclosed}<tool_call|>y<|tool_call>notacall{}<tool_call|>");
  bad.finish();
  EXPECT_EQ(n, 0);
  EXPECT_EQ(content, "x<|tool_call>call:f{a:<|\"|>unclosed}<tool_call|>y<|tool_call>notacall{}<tool_call|>");
}

// Sixteen clients streaming at once (bounded: three requests each): every stream complete, ending in
// [DONE], and each the answer its own prompt gets alone (nothing mixed between them).
TEST(Server, ConcurrentStreamsAreCompleteAndNotMixedUp) {
  auto m = cpu_model();
  Running run(*m);
  constexpr int kClients = 16;
  std::vector<std::string> want(kClients);
  for (int i = 0; i < kClients; ++i)
    want[i] = greedy_answer(*m, {{"system", "You are terse.", nullptr}, {"user", "Count to " + std::to_string(i) + ".", nullptr}}, 8);
  std::vector<std::string> bad(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i)
    clients.emplace_back([&, i] {
      for (int k = 0; k < 3; ++k) {
        auto c = run.client();  // (a connection per request, as the server closes each after its answer)
        auto r = c.Post("/v1/chat/completions", chat_body("Count to " + std::to_string(i) + ".", 8, true).dump(), "application/json");
        if (!r || r->status != 200) {
          bad[i] = "no answer or status " + (r ? std::to_string(r->status) + " " + r->body : std::string("- ") + httplib::to_string(r.error()));
          return;
        }
        bool done = false;
        json usage;
        const std::string got = sse_content(r->body, &done, &usage);
        if (!done || got != want[i]) {
          bad[i] = "request " + std::to_string(k) + ": got '" + got + "' want '" + want[i] + "'" + (done ? "" : " (no [DONE])");
          return;
        }
      }
    });
  for (auto& t : clients) t.join();
  for (int i = 0; i < kClients; ++i) EXPECT_EQ(bad[i], "") << "client " << i;
}

// The process's resident memory in KiB (VmRSS).
long rss_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

// A soak: sixteen streaming clients for a bounded time against four sequences (continuous batching
// and a queue), each request a short conversation of its own: every stream complete with [DONE] and
// the answer its prompt gets alone (none mixed up), and the server's memory flat between the first
// and the last part of the run.
TEST(Server, SoakSixteenStreamingClientsMemoryFlat) {
  auto m = cpu_model();
  server::ServerOptions o;
  o.parallel = 4;
  o.cached = 2;
  Running run(*m, o);
  constexpr int kClients = 16, kPrompts = 4;
  std::vector<std::string> want(kPrompts);
  for (int i = 0; i < kPrompts; ++i)
    want[i] = greedy_answer(*m, {{"system", "You are terse.", nullptr}, {"user", "Topic " + std::to_string(i) + ".", nullptr}}, 6);
  std::atomic<bool> stop{false};
  std::atomic<int> done_requests{0};
  std::vector<std::string> bad(kClients);
  auto client = [&](int i) {
    for (int k = 0; !stop; ++k) {
      auto c = run.client();  // (a connection per request, as the server closes each after its answer)
      const int p = (i + k) % kPrompts;
      auto r = c.Post("/v1/chat/completions", chat_body("Topic " + std::to_string(p) + ".", 6, true).dump(), "application/json");
      if (!r || r->status != 200) {
        bad[i] = "no answer or status " + (r ? std::to_string(r->status) + " " + r->body : std::string("- ") + httplib::to_string(r.error()));
        return;
      }
      bool done = false;
      json usage;
      const std::string got = sse_content(r->body, &done, &usage);
      if (!done || got != want[p]) {
        bad[i] = "got '" + got + "' want '" + want[p] + "'" + (done ? "" : " (no [DONE])");
        return;
      }
      ++done_requests;
    }
  };
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) clients.emplace_back(client, i);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const long early = rss_kib();
  const int early_done = done_requests;
  std::this_thread::sleep_for(std::chrono::seconds(6));
  const long late = rss_kib();
  stop = true;
  for (auto& t : clients) t.join();
  for (int i = 0; i < kClients; ++i) EXPECT_EQ(bad[i], "") << "client " << i;
  EXPECT_GT(done_requests - early_done, kClients) << "the soak's second part served too few requests to say anything";
  EXPECT_LT(late - early, 16 * 1024) << "resident memory grew from " << early << " to " << late << " KiB while serving "
                                     << done_requests - early_done << " requests";
}

// A client that goes away mid-stream: its generation stops at the next token (far before max_tokens),
// and the server serves the next request.
TEST(Server, ClientThatDisconnectsCancelsItsGeneration) {
  auto m = cpu_model();
  Running run(*m);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(run.port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  json body = chat_body("Tell a long story.", 450, true);
  body["temperature"] = 0.8;  // (sampling: no early end-of-turn to hide the cancellation)
  body["seed"] = 3;
  const std::string b = body.dump();
  const std::string req = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          "Content-Length: " + std::to_string(b.size()) + "\r\n\r\n" + b;
  ASSERT_EQ(write(fd, req.data(), req.size()), static_cast<ssize_t>(req.size()));
  std::string got;
  char buf[512];
  while (got.find("data: ") == std::string::npos) {  // the headers and the first event, then away
    const ssize_t n = read(fd, buf, sizeof buf);
    ASSERT_GT(n, 0);
    got.append(buf, static_cast<size_t>(n));
  }
  linger lg{1, 0};  // (a reset, as a client that dies)
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
  close(fd);
  auto c = run.client();
  auto next = c.Post("/v1/chat/completions", chat_body("hi", 2).dump(), "application/json");  // (waits for the first)
  ASSERT_TRUE(next);
  EXPECT_EQ(next->status, 200);
  auto mt = c.Get("/metrics");
  ASSERT_TRUE(mt);
  const std::string key = "\nfitmoe_completion_tokens_total ";  // (the value line, not its # HELP)
  const size_t at = mt->body.find(key);
  ASSERT_NE(at, std::string::npos);
  const double total = std::stod(mt->body.substr(at + key.size()));
  // (uninterrupted, this request generates 314 tokens before its end-of-turn)
  std::printf("  tokens generated by the abandoned stream and the next request: %.0f\n", total);
  EXPECT_LT(total, 150) << "the abandoned stream ran on: " << mt->body;
}

// Several conversations at once on the hybrid (DeltaNet) and the sliding-window architecture, each over
// three turns: every answer is the greedy answer its conversation gets alone on a fresh sequence (so
// neither the batch it ran in nor the prompt reuse changed it), and from the second turn on the
// prompt's earlier part comes from the cache (usage.prompt_tokens_details.cached_tokens).
class ServerTurns : public ::testing::TestWithParam<const char*> {};

TEST_P(ServerTurns, AnswersAloneOrAmongOthersAndWithReuseAreTheSame) {
  LoadOptions lo;
  lo.plan.use_gpu = false;
  auto m = Model::load(test::testdata(GetParam()), lo);
  server::ServerOptions o;
  o.parallel = 3;
  o.cached = 2;
  o.prefill_chunk = 7;  // (prompts are evaluated in several chunks beside the others' decoding)
  Running run(*m, o);
  constexpr int kClients = 3, kTurns = 3, kTokens = 6;
  std::vector<std::string> bad(kClients);
  std::vector<std::vector<std::vector<ChatMessage>>> convs(kClients);
  std::vector<std::vector<std::string>> answers(kClients);
  std::vector<std::vector<int>> cached(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i)
    clients.emplace_back([&, i] {
      std::vector<ChatMessage> msgs = {{"system", "You are terse.", nullptr}};
      json body_msgs = json::array({{{"role", "system"}, {"content", "You are terse."}}});
      for (int k = 0; k < kTurns; ++k) {
        const std::string user = "Client " + std::to_string(i) + " asks question " + std::to_string(k) + ".";
        msgs.push_back({"user", user, nullptr});
        body_msgs.push_back({{"role", "user"}, {"content", user}});
        json b = {{"messages", body_msgs}, {"max_tokens", kTokens}, {"temperature", 0}, {"stream", k == 1}};
        auto c = run.client();
        auto r = c.Post("/v1/chat/completions", b.dump(), "application/json");
        if (!r || r->status != 200) {
          bad[i] = "turn " + std::to_string(k) + ": no answer or status " + (r ? std::to_string(r->status) + " " + r->body : "-");
          return;
        }
        std::string text;
        int reused = -1;
        if (k == 1) {
          bool done = false;
          json usage;
          text = sse_content(r->body, &done, &usage);
        } else {
          const json j = json::parse(r->body);
          text = j["choices"][0]["message"]["content"].get<std::string>();
          reused = j["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
        }
        convs[i].push_back(msgs);
        answers[i].push_back(text);
        cached[i].push_back(reused);
        msgs.push_back({"assistant", text, nullptr});
        body_msgs.push_back({{"role", "assistant"}, {"content", text}});
      }
    });
  for (auto& t : clients) t.join();
  for (int i = 0; i < kClients; ++i) {
    ASSERT_EQ(bad[i], "") << "client " << i;
    for (int k = 0; k < kTurns; ++k)
      EXPECT_EQ(answers[i][k], greedy_answer(*m, convs[i][k], kTokens)) << "client " << i << " turn " << k;
    EXPECT_GT(cached[i][2], 0) << "client " << i << ": the third turn evaluated its whole prompt again";
  }
}

INSTANTIATE_TEST_SUITE_P(HybridAndSliding, ServerTurns,
                         ::testing::Values("qwen35moe-tiny/qwen35moe-tiny-q4_k_m.gguf", "gemma4moe-tiny/gemma4moe-tiny-q4_k_m.gguf"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           return std::string(i.param).find("gemma") != std::string::npos ? "gemma4moe" : "qwen35moe";
                         });

// logprobs: per generated token its log-probability and the top alternatives, most likely first; a
// greedy answer's token is the first alternative.
TEST(Server, LogprobsAndPenalties) {
  auto m = cpu_model();
  Running run(*m);
  auto c = run.client();
  json b = chat_body("Say something.", 5);
  b["logprobs"] = true;
  b["top_logprobs"] = 3;
  auto r = c.Post("/v1/chat/completions", b.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  const json& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), j["usage"]["completion_tokens"].get<size_t>());
  for (const json& t : content) {
    ASSERT_EQ(t["top_logprobs"].size(), 3u);
    EXPECT_LE(t["logprob"].get<double>(), 0.0);
    EXPECT_EQ(t["logprob"].get<double>(), t["top_logprobs"][0]["logprob"].get<double>());
    EXPECT_GE(t["top_logprobs"][0]["logprob"].get<double>(), t["top_logprobs"][1]["logprob"].get<double>());
  }
  // Completions' shape.
  json cb = {{"prompt", "Once upon a time"}, {"max_tokens", 4}, {"temperature", 0}, {"logprobs", 2}};
  auto cr = c.Post("/v1/completions", cb.dump(), "application/json");
  ASSERT_TRUE(cr);
  ASSERT_EQ(cr->status, 200) << cr->body;
  const json cj = json::parse(cr->body)["choices"][0]["logprobs"];
  EXPECT_EQ(cj["tokens"].size(), cj["token_logprobs"].size());
  EXPECT_EQ(cj["top_logprobs"][0].size(), 2u);
  // A strong frequency penalty changes a greedy answer that repeats itself.
  json pb = chat_body("Repeat the word yes ten times.", 24);
  auto plain = c.Post("/v1/chat/completions", pb.dump(), "application/json");
  pb["frequency_penalty"] = 2.0;
  pb["presence_penalty"] = 2.0;
  auto pen = c.Post("/v1/chat/completions", pb.dump(), "application/json");
  ASSERT_TRUE(plain && pen);
  EXPECT_NE(json::parse(plain->body)["choices"][0]["message"]["content"], json::parse(pen->body)["choices"][0]["message"]["content"]);
}

TEST(Server, ApiKeyIsRequiredWhereSet) {
  auto m = cpu_model();
  server::ServerOptions o;
  o.api_key = "sekret";
  Running run(*m, o);
  auto c = run.client();
  expect_error(c.Get("/v1/models"), 401, "API key");
  httplib::Headers wrong = {{"Authorization", "Bearer nope"}};
  expect_error(c.Get("/v1/models", wrong), 401, "not valid");
  httplib::Headers right = {{"Authorization", "Bearer sekret"}};
  auto r = c.Get("/v1/models", right);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
}

TEST(ServerCli, ServesUntilSigtermAndRefusesWhatItCannotRun) {
  auto bad = test::run_fitmoe("serve -m " + tiny() + " --gpu none --parallel 0 --port 0");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("--parallel"), std::string::npos) << bad.err;

  int out[2];
  ASSERT_EQ(pipe(out), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    dup2(out[1], 1);
    close(out[0]);
    close(out[1]);
    execl(FITMOE_BINARY, FITMOE_BINARY, "serve", "-m", tiny().c_str(), "--gpu", "none", "--port", "0", "-c", "256",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  std::string line;
  char ch;
  while (read(out[0], &ch, 1) == 1 && ch != '\n') line += ch;
  close(out[0]);
  const size_t colon = line.rfind(':');
  ASSERT_NE(colon, std::string::npos) << line;
  const int port = std::stoi(line.substr(colon + 1));
  httplib::Client c("127.0.0.1", port);
  auto h = c.Get("/health");
  ASSERT_TRUE(h) << line;
  EXPECT_EQ(h->status, 200);
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

#endif  // FITMOE_HAVE_SERVER

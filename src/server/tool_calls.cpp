#include "server/tool_calls.h"

#include <nlohmann/json.hpp>

#include "text/held_prefix.h"

namespace fitmoe::server {

namespace {
const std::string kQuote = "<|\"|>";  // Gemma 4's string delimiter

// Gemma 4's argument notation into JSON: objects with bare (or <|"|>-quoted) keys, strings between
// <|"|> marks, and JSON's numbers, true, false, null and lists. A small recursive descent over the
// text; false on anything else.
class Gemma4Args {
 public:
  explicit Gemma4Args(const std::string& s) : s_(s) {}
  bool value(nlohmann::ordered_json* out, int depth = 0) {
    if (depth > 64) return false;
    ws();
    if (at_ >= s_.size()) return false;
    if (s_.compare(at_, kQuote.size(), kQuote) == 0) {
      const size_t end = s_.find(kQuote, at_ + kQuote.size());
      if (end == std::string::npos) return false;
      *out = s_.substr(at_ + kQuote.size(), end - at_ - kQuote.size());
      at_ = end + kQuote.size();
      return true;
    }
    const char c = s_[at_];
    if (c == '{') return object(out, depth);
    if (c == '[') {
      ++at_;
      *out = nlohmann::ordered_json::array();
      ws();
      if (at_ < s_.size() && s_[at_] == ']') return ++at_, true;
      for (;;) {
        nlohmann::ordered_json v;
        if (!value(&v, depth + 1)) return false;
        out->push_back(std::move(v));
        ws();
        if (at_ >= s_.size()) return false;
        if (s_[at_] == ',') { ++at_; continue; }
        if (s_[at_] == ']') return ++at_, true;
        return false;
      }
    }
    // A bare word: a number, true, false or null (JSON's spelling), else the word as a string.
    const size_t start = at_;
    while (at_ < s_.size() && s_[at_] != ',' && s_[at_] != '}' && s_[at_] != ']') ++at_;
    std::string word = trim(s_.substr(start, at_ - start));
    if (word.empty()) return false;
    const nlohmann::ordered_json j = nlohmann::ordered_json::parse(word, nullptr, false);
    *out = !j.is_discarded() && !j.is_object() && !j.is_array() ? j : nlohmann::ordered_json(word);
    return true;
  }
  bool object(nlohmann::ordered_json* out, int depth) {
    if (at_ >= s_.size() || s_[at_] != '{') return false;
    ++at_;
    *out = nlohmann::ordered_json::object();
    ws();
    if (at_ < s_.size() && s_[at_] == '}') return ++at_, true;
    for (;;) {
      ws();
      std::string key;
      if (s_.compare(at_, kQuote.size(), kQuote) == 0) {
        const size_t end = s_.find(kQuote, at_ + kQuote.size());
        if (end == std::string::npos) return false;
        key = s_.substr(at_ + kQuote.size(), end - at_ - kQuote.size());
        at_ = end + kQuote.size();
        ws();
        if (at_ >= s_.size() || s_[at_] != ':') return false;
      } else {
        const size_t colon = s_.find(':', at_);
        if (colon == std::string::npos) return false;
        key = trim(s_.substr(at_, colon - at_));
        at_ = colon;
      }
      if (key.empty()) return false;
      ++at_;  // ':'
      nlohmann::ordered_json v;
      if (!value(&v, depth + 1)) return false;
      (*out)[key] = std::move(v);
      ws();
      if (at_ >= s_.size()) return false;
      if (s_[at_] == ',') { ++at_; continue; }
      if (s_[at_] == '}') return ++at_, true;
      return false;
    }
  }
  bool done() {
    ws();
    return at_ == s_.size();
  }

 private:
  void ws() {
    while (at_ < s_.size() && (s_[at_] == ' ' || s_[at_] == '\n' || s_[at_] == '\t' || s_[at_] == '\r')) ++at_;
  }
  static std::string trim(const std::string& s) {
    const size_t a = s.find_first_not_of(" \t\r\n");
    if (a == std::string::npos) return "";
    return s.substr(a, s.find_last_not_of(" \t\r\n") - a + 1);
  }
  const std::string& s_;
  size_t at_ = 0;
};

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return "";
  const size_t b = s.find_last_not_of(" \t\r\n");
  return s.substr(a, b - a + 1);
}

// <parameter=name>\nvalue\n</parameter>: the value as JSON where it is JSON (numbers, booleans,
// objects, lists), else as a string.
nlohmann::ordered_json xml_value(const std::string& raw) {
  std::string v = raw;
  if (!v.empty() && v.front() == '\n') v.erase(0, 1);
  if (!v.empty() && v.back() == '\n') v.pop_back();
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(v, nullptr, false);
  if (!j.is_discarded() && !j.is_string()) return j;
  return v;
}
}  // namespace

bool parse_tool_call(const std::string& body, ToolCall* out) {
  const std::string b = trim(body);
  using json = nlohmann::ordered_json;
  if (!b.empty() && b.front() == '{') {
    const json j = json::parse(b, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
    out->name = j["name"].get<std::string>();
    json args = j.contains("arguments") ? j["arguments"] : json::object();
    if (args.is_string()) {  // (some models put the arguments as a JSON string)
      const json parsed = json::parse(args.get<std::string>(), nullptr, false);
      if (parsed.is_discarded()) return false;
      args = parsed;
    }
    if (!args.is_object()) return false;
    out->arguments = args.dump();
    return true;
  }
  const std::string fopen = "<function=";
  if (b.compare(0, fopen.size(), fopen) != 0) return false;
  const size_t name_end = b.find('>', fopen.size());
  const size_t fclose = b.rfind("</function>");
  if (name_end == std::string::npos || fclose == std::string::npos || fclose < name_end) return false;
  out->name = trim(b.substr(fopen.size(), name_end - fopen.size()));
  if (out->name.empty()) return false;
  json args = json::object();
  size_t at = name_end + 1;
  const std::string popen = "<parameter=", pclose = "</parameter>";
  while ((at = b.find(popen, at)) != std::string::npos && at < fclose) {
    const size_t pname_end = b.find('>', at + popen.size());
    const size_t vend = b.find(pclose, pname_end == std::string::npos ? at : pname_end);
    if (pname_end == std::string::npos || vend == std::string::npos) return false;
    args[trim(b.substr(at + popen.size(), pname_end - at - popen.size()))] = xml_value(b.substr(pname_end + 1, vend - pname_end - 1));
    at = vend + pclose.size();
  }
  out->arguments = args.dump();
  return true;
}

bool parse_gemma4_tool_call(const std::string& body, ToolCall* out) {
  const std::string b = trim(body);
  const std::string head = "call:";
  if (b.compare(0, head.size(), head) != 0) return false;
  const size_t brace = b.find('{');
  if (brace == std::string::npos) return false;
  out->name = trim(b.substr(head.size(), brace - head.size()));
  if (out->name.empty()) return false;
  const std::string args_text = b.substr(brace);
  Gemma4Args p(args_text);
  nlohmann::ordered_json args;
  if (!p.object(&args, 0) || !p.done()) return false;
  out->arguments = args.dump();
  return true;
}

ToolCallParser::ToolCallParser(Text content, Call call, ToolSyntax syntax)
    : content_(std::move(content)),
      call_(std::move(call)),
      syntax_(syntax),
      open_(syntax == ToolSyntax::Gemma4 ? "<|tool_call>" : "<tool_call>"),
      close_(syntax == ToolSyntax::Gemma4 ? "<tool_call|>" : "</tool_call>") {}

bool ToolCallParser::close_call() {
  const size_t at = buf_.find(close_);
  const std::string body = buf_.substr(0, at);
  buf_.erase(0, at + close_.size());
  inside_ = false;
  ToolCall c;
  if (syntax_ == ToolSyntax::Gemma4 ? parse_gemma4_tool_call(body, &c) : parse_tool_call(body, &c)) {
    ++n_calls_;
    return call_(c);
  }
  return content_(open_ + body + close_);  // not a call after all: the text stays
}

bool ToolCallParser::feed(const std::string& piece) {
  buf_ += piece;
  for (;;) {
    if (inside_) {
      if (buf_.find(close_) == std::string::npos) return true;
      if (!close_call()) return false;
      continue;
    }
    const size_t at = buf_.find(open_);
    if (at == std::string::npos) {
      const size_t keep = held_prefix(buf_, open_);
      const std::string out = buf_.substr(0, buf_.size() - keep);
      buf_.erase(0, buf_.size() - keep);
      return out.empty() || content_(out);
    }
    const std::string before = buf_.substr(0, at);
    buf_.erase(0, at + open_.size());
    inside_ = true;
    if (!before.empty() && !content_(before)) return false;
  }
}

bool ToolCallParser::finish() {
  if (buf_.empty()) return true;
  // An unclosed call (the answer was cut off): its text, as content.
  const std::string rest = inside_ ? open_ + buf_ : buf_;
  buf_.clear();
  inside_ = false;
  return content_(rest);
}

}  // namespace fitmoe::server

#include "server/tool_calls.h"

#include <nlohmann/json.hpp>

#include "text/held_prefix.h"

namespace fitmoe::server {

namespace {
const std::string kOpen = "<tool_call>", kClose = "</tool_call>";

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

bool ToolCallParser::close_call() {
  const size_t at = buf_.find(kClose);
  const std::string body = buf_.substr(0, at);
  buf_.erase(0, at + kClose.size());
  inside_ = false;
  ToolCall c;
  if (parse_tool_call(body, &c)) {
    ++n_calls_;
    return call_(c);
  }
  return content_(kOpen + body + kClose);  // not a call after all: the text stays
}

bool ToolCallParser::feed(const std::string& piece) {
  buf_ += piece;
  for (;;) {
    if (inside_) {
      if (buf_.find(kClose) == std::string::npos) return true;
      if (!close_call()) return false;
      continue;
    }
    const size_t at = buf_.find(kOpen);
    if (at == std::string::npos) {
      const size_t keep = held_prefix(buf_, kOpen);
      const std::string out = buf_.substr(0, buf_.size() - keep);
      buf_.erase(0, buf_.size() - keep);
      return out.empty() || content_(out);
    }
    const std::string before = buf_.substr(0, at);
    buf_.erase(0, at + kOpen.size());
    inside_ = true;
    if (!before.empty() && !content_(before)) return false;
  }
}

bool ToolCallParser::finish() {
  if (buf_.empty()) return true;
  // An unclosed call (the answer was cut off): its text, as content.
  const std::string rest = inside_ ? kOpen + buf_ : buf_;
  buf_.clear();
  inside_ = false;
  return content_(rest);
}

}  // namespace fitmoe::server

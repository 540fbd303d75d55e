// Jinja2 subset interpreter: lexer (with trim_blocks / lstrip_blocks and -/+ whitespace control),
// recursive-descent parser to an AST, and a tree-walking evaluator over Python-like values.
#include "text/jinja.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <ctime>
#include <functional>
#include <unordered_map>
#include <vector>

#include "runtime/error.h"
#include "text/unicode.h"

namespace fitmoe::jinja {

namespace {

[[noreturn]] void fail(int line, const std::string& msg) {
  throw Error("chat template, line " + std::to_string(line) + ": " + msg);
}

// ===================================== limits =====================================================
// The budget of the render in progress (see Limits in jinja.h). It is thread-local because values are
// made and copied in many small helpers (Value::str, Value's copy constructor, to_str) that have no
// interpreter at hand; outside a render (parsing) nothing is charged.

struct Value;
struct Dict;
struct Func;
struct Interp;
using List = std::vector<Value>;

struct Budget {
  Limits lim;
  uint64_t steps = 0, bytes = 0;
  int value_depth = 0;
  // Containers the template changed in place: only those can close a reference cycle, which shared
  // ownership never frees; the render empties them when it ends.
  std::vector<std::weak_ptr<List>> changed_lists;
  std::vector<std::weak_ptr<Dict>> changed_dicts;
};
thread_local Budget* t_budget = nullptr;

[[noreturn]] void fail_limit(const std::string& msg) { throw Error("chat template: " + msg); }

void charge_steps(uint64_t n) {
  if (t_budget && (t_budget->steps += n) > t_budget->lim.max_steps)
    fail_limit("rendering takes more than " + std::to_string(t_budget->lim.max_steps) + " steps");
}
void charge_bytes(uint64_t n) {
  if (t_budget && (t_budget->bytes += n) > t_budget->lim.max_bytes)
    fail_limit("rendering makes more than " + std::to_string(t_budget->lim.max_bytes) + " bytes of values");
}
// Called before a string of n bytes is made (or while one grows), so that it is never allocated.
void check_string(uint64_t n) {
  if (t_budget && n > t_budget->lim.max_string)
    fail_limit("a string value exceeds " + std::to_string(t_budget->lim.max_string) + " bytes");
}
void check_items(uint64_t n) {
  if (t_budget && n > t_budget->lim.max_items)
    fail_limit("a list exceeds " + std::to_string(t_budget->lim.max_items) + " items");
}

// Printing and comparing values recurse into them; values nest without a parse-time bound (a list
// appended into a list in a loop), so the recursion is bounded here rather than by the stack.
struct ValueNest {
  ValueNest() {
    if (t_budget && ++t_budget->value_depth > t_budget->lim.max_value_depth) {
      --t_budget->value_depth;
      fail_limit("values nest deeper than " + std::to_string(t_budget->lim.max_value_depth) + " levels");
    }
  }
  ~ValueNest() {
    if (t_budget) --t_budget->value_depth;
  }
  ValueNest(const ValueNest&) = delete;
  ValueNest& operator=(const ValueNest&) = delete;
};

void delete_list(List* l);
void delete_dict(Dict* d);

struct Value {
  enum T : uint8_t { Undef, None, Bool, Int, Float, Str, Lst, Dct, Fn };
  T t = Undef;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // string value; for Undef, the name that was undefined (for messages)
  std::shared_ptr<List> l;
  std::shared_ptr<Dict> d;
  std::shared_ptr<Func> fn;

  Value() = default;
  // Every copy of a string is charged: evaluation copies values freely, which is where the work is.
  Value(const Value& o) : t(o.t), b(o.b), i(o.i), f(o.f), s((charge_bytes(o.s.size()), o.s)), l(o.l), d(o.d), fn(o.fn) {}
  Value(Value&&) noexcept = default;
  Value& operator=(const Value& o) {
    if (this != &o) {
      charge_bytes(o.s.size());
      t = o.t, b = o.b, i = o.i, f = o.f, s = o.s, l = o.l, d = o.d, fn = o.fn;
    }
    return *this;
  }
  Value& operator=(Value&&) noexcept = default;

  static Value undef(std::string name = {}) {
    Value v;
    v.s = std::move(name);
    return v;
  }
  static Value none() {
    Value v;
    v.t = None;
    return v;
  }
  static Value boolean(bool x) {
    Value v;
    v.t = Bool;
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v;
    v.t = Int;
    v.i = x;
    return v;
  }
  static Value real(double x) {
    Value v;
    v.t = Float;
    v.f = x;
    return v;
  }
  static Value str(std::string x) {
    check_string(x.size());
    charge_bytes(x.size());
    Value v;
    v.t = Str;
    v.s = std::move(x);
    return v;
  }
  static Value list(List x = {}) {
    check_items(x.size());
    charge_steps(x.size());
    charge_bytes(x.size() * sizeof(Value));
    Value v;
    v.t = Lst;
    v.l = std::shared_ptr<List>(new List(std::move(x)), delete_list);
    return v;
  }
  static Value dict();
  bool is_num() const { return t == Int || t == Float || t == Bool; }
  double num() const { return t == Float ? f : t == Int ? static_cast<double>(i) : (b ? 1.0 : 0.0); }
};

// Freeing a deeply nested value recursively would overflow the stack (a chain of a million one-element
// lists is a few template lines), so containers are freed through a work list: the outermost deleter
// drains it, an inner one only moves its elements onto it.
thread_local List* t_graveyard = nullptr;
template <class C, class F>
void free_iteratively(C* c, F&& move_elements_out) {
  if (t_graveyard) {
    move_elements_out(*c, *t_graveyard);
    delete c;
    return;
  }
  List grave;
  t_graveyard = &grave;
  move_elements_out(*c, grave);
  delete c;
  while (!grave.empty()) {
    List v;  // (a Value is destroyed at the end of each turn; its containers land in `grave`)
    v.swap(grave);
    while (!v.empty()) v.pop_back();
  }
  t_graveyard = nullptr;
}
void delete_list(List* l) {
  free_iteratively(l, [](List& c, List& grave) {
    for (auto& x : c) grave.push_back(std::move(x));
  });
}

struct Dict {
  enum Kind { Plain, Namespace, Loop } kind = Plain;
  std::vector<std::pair<std::string, Value>> items;
  Value* find(std::string_view k) {
    for (auto& kv : items)
      if (kv.first == k) return &kv.second;
    return nullptr;
  }
  void set(const std::string& k, Value v) {
    if (Value* p = find(k)) *p = std::move(v);
    else items.emplace_back(k, std::move(v));
  }
};

void delete_dict(Dict* d) {
  free_iteratively(d, [](Dict& c, List& grave) {
    for (auto& kv : c.items) grave.push_back(std::move(kv.second));
  });
}

Value Value::dict() {
  Value v;
  v.t = Dct;
  v.d = std::shared_ptr<Dict>(new Dict(), delete_dict);
  return v;
}

// A list about to grow by n items in place (append, extend, insert): bounded, charged, and remembered
// as changed (see Budget).
void grow_list(const std::shared_ptr<List>& l, size_t n) {
  check_items(l->size() + n);
  charge_bytes(n * sizeof(Value));
  if (t_budget && (t_budget->changed_lists.empty() || t_budget->changed_lists.back().lock() != l)) {
    charge_bytes(sizeof(std::weak_ptr<List>));
    t_budget->changed_lists.push_back(l);
  }
}
void changed_dict(const std::shared_ptr<Dict>& d) {
  if (t_budget && (t_budget->changed_dicts.empty() || t_budget->changed_dicts.back().lock() != d)) {
    charge_bytes(sizeof(std::weak_ptr<Dict>));
    t_budget->changed_dicts.push_back(d);
  }
}

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* get(size_t idx, std::string_view name) const {
    for (const auto& [k, v] : kw)
      if (k == name) return &v;
    return idx < pos.size() ? &pos[idx] : nullptr;
  }
};

struct Func {
  std::string name;
  std::function<Value(Interp&, Args&, int)> call;
};

Value make_fn(std::string name, std::function<Value(Interp&, Args&, int)> f) {
  Value v;
  v.t = Value::Fn;
  v.fn = std::make_shared<Func>(Func{std::move(name), std::move(f)});
  return v;
}

const char* type_name(const Value& v) {
  switch (v.t) {
    case Value::Undef: return "undefined";
    case Value::None: return "NoneType";
    case Value::Bool: return "bool";
    case Value::Int: return "int";
    case Value::Float: return "float";
    case Value::Str: return "str";
    case Value::Lst: return "list";
    case Value::Dct: return v.d->kind == Dict::Namespace ? "Namespace" : v.d->kind == Dict::Loop ? "LoopContext" : "dict";
    case Value::Fn: return "function";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.t) {
    case Value::Undef: case Value::None: return false;
    case Value::Bool: return v.b;
    case Value::Int: return v.i != 0;
    case Value::Float: return v.f != 0.0;
    case Value::Str: return !v.s.empty();
    case Value::Lst: return !v.l->empty();
    case Value::Dct: return v.d->kind != Dict::Plain || !v.d->items.empty();
    case Value::Fn: return true;
  }
  return false;
}

// Python's repr(float).
std::string py_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
  if (x == 0) return std::signbit(x) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), x, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  // sci: [-]d[.ddd]e[+-]XX
  bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  size_t e = sci.find('e');
  int exp = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (size_t k = 0; k < e; ++k)
    if (sci[k] != '.') digits.push_back(sci[k]);
  std::string out;
  if (exp >= -5 + 1 && exp < 16) {  // -4 <= exp < 16: positional
    if (exp >= 0) {
      if (digits.size() <= static_cast<size_t>(exp) + 1) {
        out = digits + std::string(static_cast<size_t>(exp) + 1 - digits.size(), '0') + ".0";
      } else {
        out = digits.substr(0, static_cast<size_t>(exp) + 1) + "." + digits.substr(static_cast<size_t>(exp) + 1);
      }
    } else {
      out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return neg ? "-" + out : out;
}

std::string py_repr_str(const std::string& s) {
  bool has_sq = s.find('\'') != std::string::npos, has_dq = s.find('"') != std::string::npos;
  char q = (has_sq && !has_dq) ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == static_cast<unsigned char>(q)) { out += '\\'; out += static_cast<char>(c); }
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7F) {
      char b[8];
      std::snprintf(b, sizeof(b), "\\x%02x", c);
      out += b;
    } else out += static_cast<char>(c);
  }
  out += q;
  return out;
}

std::string to_str(const Value& v);

std::string repr(const Value& v) {
  if (v.t == Value::Str) return py_repr_str(v.s);
  return to_str(v);
}

// Python's str() of a value, as {{ }} prints it.
std::string to_str(const Value& v) {
  switch (v.t) {
    case Value::Undef: return "";
    case Value::None: return "None";
    case Value::Bool: return v.b ? "True" : "False";
    case Value::Int: return std::to_string(v.i);
    case Value::Float: return py_float(v.f);
    case Value::Str: return v.s;
    case Value::Lst: {
      ValueNest nest;
      std::string o = "[";
      for (size_t k = 0; k < v.l->size(); ++k) {
        o += (k ? ", " : "") + repr((*v.l)[k]);
        check_string(o.size());  // (a list holding the same list twice, 64 levels deep, prints 2^64 items)
      }
      return o + "]";
    }
    case Value::Dct: {
      if (v.d->kind == Dict::Namespace) return "<Namespace>";
      if (v.d->kind == Dict::Loop) return "<LoopContext>";
      ValueNest nest;
      std::string o = "{";
      bool first = true;
      for (const auto& [k, x] : v.d->items) {
        o += (first ? "" : ", ") + py_repr_str(k) + ": " + repr(x);
        check_string(o.size());
        first = false;
      }
      return o + "}";
    }
    case Value::Fn: return "<function " + v.fn->name + ">";
  }
  return "";
}

void json_escape(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof(b), "\\u%04x", c);
          out += b;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

// json.dumps(v, ensure_ascii=False, indent=indent): separators ", " / ": " without indent, "," / ": " with.
void to_json(std::string& out, const Value& v, int indent, int level) {
  auto nl = [&](int lvl) {
    if (indent < 0) return;
    const uint64_t pad = static_cast<uint64_t>(indent) * static_cast<uint64_t>(lvl);
    check_string(out.size() + 1 + pad);
    out += '\n';
    out.append(static_cast<size_t>(pad), ' ');
  };
  switch (v.t) {
    case Value::Undef: case Value::None: out += "null"; return;
    case Value::Bool: out += v.b ? "true" : "false"; return;
    case Value::Int: out += std::to_string(v.i); return;
    case Value::Float:
      if (std::isnan(v.f)) out += "NaN";
      else if (std::isinf(v.f)) out += v.f < 0 ? "-Infinity" : "Infinity";
      else out += py_float(v.f);
      return;
    case Value::Str:
      check_string(out.size() + v.s.size());
      json_escape(out, v.s);
      return;
    case Value::Lst: {
      if (v.l->empty()) { out += "[]"; return; }
      ValueNest nest;
      out += '[';
      for (size_t k = 0; k < v.l->size(); ++k) {
        if (k) out += indent < 0 ? ", " : ",";
        nl(level + 1);
        to_json(out, (*v.l)[k], indent, level + 1);
        check_string(out.size());
      }
      nl(level);
      out += ']';
      return;
    }
    case Value::Dct: {
      if (v.d->items.empty()) { out += "{}"; return; }
      ValueNest nest;
      out += '{';
      bool first = true;
      for (const auto& [k, x] : v.d->items) {
        if (!first) out += indent < 0 ? ", " : ",";
        first = false;
        nl(level + 1);
        json_escape(out, k);
        out += ": ";
        to_json(out, x, indent, level + 1);
        check_string(out.size());
      }
      nl(level);
      out += '}';
      return;
    }
    case Value::Fn: out += "null"; return;
  }
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: return Value::integer(static_cast<int64_t>(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: return Value::real(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::str(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      l.reserve(j.size());
      for (const auto& x : j) l.push_back(from_json(x));
      return Value::list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = Value::dict();
      for (const auto& [k, x] : j.items()) d.d->items.emplace_back(k, from_json(x));
      return d;
    }
    default: return Value::none();
  }
}

// Python equality. Each call is a step and compared bytes are charged: unique and `in` compare many pairs.
bool equal(const Value& a, const Value& b) {
  charge_steps(1);
  if (a.is_num() && b.is_num()) {
    if (a.t == Value::Float || b.t == Value::Float) return a.num() == b.num();
    int64_t x = a.t == Value::Int ? a.i : a.b, y = b.t == Value::Int ? b.i : b.b;
    return x == y;
  }
  if (a.t != b.t) return false;
  switch (a.t) {
    case Value::Undef: case Value::None: return true;
    case Value::Str:
      if (a.s.size() != b.s.size()) return false;
      charge_bytes(a.s.size());
      return a.s == b.s;
    case Value::Lst: {
      if (a.l->size() != b.l->size()) return false;
      ValueNest nest;
      for (size_t k = 0; k < a.l->size(); ++k)
        if (!equal((*a.l)[k], (*b.l)[k])) return false;
      return true;
    }
    case Value::Dct: {
      if (a.d == b.d) return true;
      if (a.d->items.size() != b.d->items.size()) return false;
      ValueNest nest;
      for (const auto& [k, x] : a.d->items) {
        Value* y = b.d->find(k);
        if (!y || !equal(x, *y)) return false;
      }
      return true;
    }
    case Value::Fn: return a.fn == b.fn;
    default: return false;
  }
}

// Python ordering; throws for unorderable types.
int compare(const Value& a, const Value& b, int line) {
  charge_steps(1);
  if (a.is_num() && b.is_num()) {
    if (a.t == Value::Float || b.t == Value::Float) return a.num() < b.num() ? -1 : a.num() > b.num() ? 1 : 0;
    int64_t x = a.t == Value::Int ? a.i : a.b, y = b.t == Value::Int ? b.i : b.b;
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.t == Value::Str && b.t == Value::Str) {
    charge_bytes(std::min(a.s.size(), b.s.size()));
    return a.s.compare(b.s) < 0 ? -1 : a.s.compare(b.s) > 0 ? 1 : 0;
  }
  if (a.t == Value::Lst && b.t == Value::Lst) {
    ValueNest nest;
    for (size_t k = 0; k < a.l->size() && k < b.l->size(); ++k) {
      if (equal((*a.l)[k], (*b.l)[k])) continue;
      return compare((*a.l)[k], (*b.l)[k], line);
    }
    return a.l->size() < b.l->size() ? -1 : a.l->size() > b.l->size() ? 1 : 0;
  }
  fail(line, std::string("cannot compare ") + type_name(a) + " with " + type_name(b));
}

// Code points of a string (4 bytes each, charged before they are made).
std::vector<uint32_t> cps_of(const std::string& s) {
  charge_bytes(static_cast<uint64_t>(s.size()) * 4);
  return text::utf8_to_cps(s);
}

// Code-point view of a string for indexing and slicing.
std::vector<std::string> chars_of(const std::string& s) {
  charge_bytes(static_cast<uint64_t>(s.size()) * sizeof(std::string));  // (before it is made)
  std::vector<std::string> out;
  size_t i = 0;
  while (i < s.size()) {
    size_t at = i;
    uint32_t cp;
    text::decode_lenient(s, i, cp);
    out.emplace_back(s.substr(at, i - at));
  }
  return out;
}

// Python slice indices.
std::vector<int64_t> slice_indices(int64_t n, const Value* a, const Value* b, const Value* c, int line) {
  int64_t step = 1;
  if (c && c->t != Value::None && c->t != Value::Undef) {
    if (c->t != Value::Int) fail(line, "slice step must be an integer");
    step = c->i;
    if (step == 0) fail(line, "slice step cannot be zero");
    if (step == INT64_MIN) step = INT64_MIN + 1;  // (the same slice of any list there can be; -step fits)
  }
  auto norm = [&](const Value* v, int64_t dflt, bool is_start) -> int64_t {
    if (!v || v->t == Value::None || v->t == Value::Undef) return dflt;
    if (v->t != Value::Int) fail(line, "slice indices must be integers");
    int64_t x = v->i;
    if (x < 0) x += n;
    if (step > 0) return std::clamp<int64_t>(x, 0, n);
    (void)is_start;
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  int64_t start = norm(a, step > 0 ? 0 : n - 1, true), stop = norm(b, step > 0 ? n : -1, false);
  std::vector<int64_t> idx;
  // k stays within [-1, n] and |step| may be near 2^63: stop before k + step could overflow.
  if (step > 0)
    for (int64_t k = start; k < stop; k = stop - k > step ? k + step : stop) idx.push_back(k);
  else
    for (int64_t k = start; k > stop; k = k - stop > -step ? k + step : stop) idx.push_back(k);
  return idx;
}

// ===================================== lexer ======================================================

enum class Tk { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, End };

struct Token {
  Tk k;
  std::string v;
  int line;
  int64_t i = 0;
  double f = 0;
};

class Lexer {
 public:
  explicit Lexer(std::string_view src) : s_(src) {}

  std::vector<Token> run() {
    bool strip_next = false;  // "-%}" / "-}}" / "-#}": strip leading whitespace of the next text
    bool trim_nl = false;     // trim_blocks: drop one newline right after a block or comment tag
    while (pos_ < s_.size()) {
      size_t p = find_tag(pos_);
      const std::string orig(s_.substr(pos_, p - pos_));
      std::string text = orig;
      const int text_line = line_;
      const bool seg_at_start = pos_ == 0;
      count_lines(pos_, p);
      if (trim_nl) {
        if (text.rfind("\r\n", 0) == 0) text.erase(0, 2);
        else if (!text.empty() && text[0] == '\n') text.erase(0, 1);
      }
      if (strip_next) {
        size_t k = 0;
        while (k < text.size() && std::isspace(static_cast<unsigned char>(text[k]))) ++k;
        text.erase(0, k);
      }
      strip_next = trim_nl = false;
      if (p >= s_.size()) {
        emit_text(std::move(text), text_line);
        break;
      }
      const char kind = s_[p + 1];  // '{', '%' or '#'
      const char mod = p + 2 < s_.size() ? s_[p + 2] : 0;
      if (mod == '-') {
        size_t k = text.size();
        while (k > 0 && std::isspace(static_cast<unsigned char>(text[k - 1]))) --k;
        text.resize(k);
      } else if ((kind == '%' || kind == '#') && mod != '+') {
        // lstrip_blocks: spaces/tabs between the start of the line (in the source) and the tag go.
        size_t nl = orig.rfind('\n');
        size_t from = nl == std::string::npos ? 0 : nl + 1;
        bool line_start = nl != std::string::npos || seg_at_start;
        if (line_start && orig.find_first_not_of(" \t", from) == std::string::npos) {
          size_t cut = orig.size() - from;
          text.resize(text.size() >= cut ? text.size() - cut : 0);
        }
      }
      emit_text(std::move(text), text_line);
      pos_ = p + 2 + ((mod == '-' || mod == '+') ? 1 : 0);
      if (kind == '#') {
        size_t e = s_.find("#}", pos_);
        if (e == std::string_view::npos) fail(line_, "unterminated comment");
        bool dash = e > pos_ && s_[e - 1] == '-';
        count_lines(pos_, e + 2);
        pos_ = e + 2;
        if (dash) strip_next = true;
        else trim_nl = true;
        continue;
      }
      if (kind == '%' && try_raw(strip_next, trim_nl)) continue;
      toks_.push_back({kind == '{' ? Tk::VarBegin : Tk::BlockBegin, "", line_});
      int end_mod = lex_tag(kind == '{' ? '}' : '%');
      if (end_mod == '-') strip_next = true;
      else if (kind == '%' && end_mod != '+') trim_nl = true;
    }
    toks_.push_back({Tk::End, "", line_});
    return std::move(toks_);
  }

 private:
  std::string_view s_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> toks_;

  void count_lines(size_t a, size_t b) {
    for (size_t k = a; k < b && k < s_.size(); ++k)
      if (s_[k] == '\n') ++line_;
  }
  size_t find_tag(size_t from) const {
    for (size_t k = from; k + 1 < s_.size(); ++k)
      if (s_[k] == '{' && (s_[k + 1] == '{' || s_[k + 1] == '%' || s_[k + 1] == '#')) return k;
    return s_.size();
  }
  void emit_text(std::string text, int line) {
    if (!text.empty()) toks_.push_back({Tk::Text, std::move(text), line});
  }

  // {% raw %} ... {% endraw %}: the content is text.
  bool try_raw(bool& strip_next, bool& trim_nl) {
    size_t k = pos_;
    while (k < s_.size() && std::isspace(static_cast<unsigned char>(s_[k]))) ++k;
    if (s_.compare(k, 3, "raw") != 0) return false;
    k += 3;
    while (k < s_.size() && std::isspace(static_cast<unsigned char>(s_[k]))) ++k;
    bool dash = k < s_.size() && s_[k] == '-';
    if (dash) ++k;
    if (s_.compare(k, 2, "%}") != 0) return false;
    k += 2;
    // Find {% endraw %} (any whitespace control).
    size_t e = k;
    for (;;) {
      e = s_.find("{%", e);
      if (e == std::string_view::npos) fail(line_, "unterminated raw block");
      size_t q = e + 2;
      bool ldash = q < s_.size() && s_[q] == '-';
      if (ldash || (q < s_.size() && s_[q] == '+')) ++q;
      while (q < s_.size() && std::isspace(static_cast<unsigned char>(s_[q]))) ++q;
      if (s_.compare(q, 6, "endraw") == 0) {
        q += 6;
        while (q < s_.size() && std::isspace(static_cast<unsigned char>(s_[q]))) ++q;
        bool rdash = q < s_.size() && s_[q] == '-';
        if (rdash) ++q;
        if (s_.compare(q, 2, "%}") == 0) {
          std::string body(s_.substr(k, e - k));
          if (dash) {
            size_t a = 0;
            while (a < body.size() && std::isspace(static_cast<unsigned char>(body[a]))) ++a;
            body.erase(0, a);
          }
          if (ldash) {
            size_t b = body.size();
            while (b > 0 && std::isspace(static_cast<unsigned char>(body[b - 1]))) --b;
            body.resize(b);
          }
          emit_text(std::move(body), line_);
          count_lines(pos_, q + 2);
          pos_ = q + 2;
          if (rdash) strip_next = true;
          else trim_nl = true;
          return true;
        }
      }
      e += 2;
    }
  }

  // Lexes the inside of a tag up to its end; returns the end modifier ('-', '+' or 0).
  int lex_tag(char close) {
    int depth = 0;
    for (;;) {
      while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) {
        if (s_[pos_] == '\n') ++line_;
        ++pos_;
      }
      if (pos_ >= s_.size()) fail(line_, "unterminated tag");
      char c = s_[pos_];
      // End of tag?
      if (depth == 0) {
        if ((c == '-' || c == '+') && s_.compare(pos_ + 1, 2, std::string{close, '}'}) == 0) {
          pos_ += 3;
          toks_.push_back({close == '}' ? Tk::VarEnd : Tk::BlockEnd, "", line_});
          return c;
        }
        if (c == close && pos_ + 1 < s_.size() && s_[pos_ + 1] == '}') {
          pos_ += 2;
          toks_.push_back({close == '}' ? Tk::VarEnd : Tk::BlockEnd, "", line_});
          return 0;
        }
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t b = pos_;
        while (pos_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == '_')) ++pos_;
        toks_.push_back({Tk::Name, std::string(s_.substr(b, pos_ - b)), line_});
        continue;
      }
      if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t b = pos_;
        while (pos_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == '_')) ++pos_;
        bool is_float = false;
        if (pos_ + 1 < s_.size() && s_[pos_] == '.' && std::isdigit(static_cast<unsigned char>(s_[pos_ + 1]))) {
          is_float = true;
          ++pos_;
          while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
        }
        if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
          size_t q = pos_ + 1;
          if (q < s_.size() && (s_[q] == '+' || s_[q] == '-')) ++q;
          if (q < s_.size() && std::isdigit(static_cast<unsigned char>(s_[q]))) {
            is_float = true;
            pos_ = q;
            while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
          }
        }
        std::string num;
        for (char ch : s_.substr(b, pos_ - b))
          if (ch != '_') num.push_back(ch);
        Token t{is_float ? Tk::Float : Tk::Int, num, line_};
        if (is_float) t.f = std::strtod(num.c_str(), nullptr);
        else {
          auto r = std::from_chars(num.data(), num.data() + num.size(), t.i);
          if (r.ec != std::errc()) fail(line_, "integer literal out of range: " + num);
        }
        toks_.push_back(std::move(t));
        continue;
      }
      if (c == '\'' || c == '"') {
        toks_.push_back({Tk::String, lex_string(c), line_});
        continue;
      }
      static const char* ops[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">",
                                  "=", "(", ")", "[", "]", "{", "}", ",", ".", ":", "|"};
      bool matched = false;
      for (const char* op : ops) {
        size_t n = std::strlen(op);
        if (s_.compare(pos_, n, op) == 0) {
          if (op[0] == '(' || op[0] == '[' || op[0] == '{') ++depth;
          if ((op[0] == ')' || op[0] == ']' || op[0] == '}') && depth > 0) --depth;
          toks_.push_back({Tk::Op, op, line_});
          pos_ += n;
          matched = true;
          break;
        }
      }
      if (!matched) fail(line_, std::string("unexpected character '") + c + "' in tag");
    }
  }

  std::string lex_string(char q) {
    std::string out;
    ++pos_;
    while (pos_ < s_.size() && s_[pos_] != q) {
      char c = s_[pos_];
      if (c == '\n') ++line_;
      if (c != '\\') {
        out.push_back(c);
        ++pos_;
        continue;
      }
      if (pos_ + 1 >= s_.size()) break;
      char e = s_[pos_ + 1];
      pos_ += 2;
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'v': out += '\v'; break;
        case 'a': out += '\a'; break;
        case '0': out += '\0'; break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case '\n': ++line_; break;
        case 'x': case 'u': case 'U': {
          size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          uint32_t cp = 0;
          for (size_t k = 0; k < n; ++k) {
            if (pos_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[pos_])))
              fail(line_, "bad escape in string literal");
            char h = s_[pos_++];
            cp = cp * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
          }
          text::append_utf8(out, cp > 0x10FFFF ? text::kReplacementChar : cp);
          break;
        }
        default: out += '\\'; out += e; break;
      }
    }
    if (pos_ >= s_.size()) fail(line_, "unterminated string literal");
    ++pos_;
    return out;
  }
};

// ===================================== AST ========================================================

struct Expr;
using ExprP = std::unique_ptr<Expr>;

struct Expr {
  enum K {
    Lit, Name, Attr, Item, Slice, Call, Filter, Test, Neg, Pos, Not, And, Or, Bin, Cmp, Cond, ListLit, TupleLit, DictLit
  } k;
  int line = 0;
  Value lit;                  // Lit
  std::string name;           // Name, Attr, Filter, Test, Bin (operator)
  ExprP a, b, c;              // operands; Slice: a = object, b/c/d = start/stop/step
  ExprP d;
  std::vector<ExprP> args;    // Call/Filter/Test positional, ListLit/TupleLit items, DictLit keys+values, Cmp operands
  std::vector<std::pair<std::string, ExprP>> kwargs;
  std::vector<std::string> ops;  // Cmp operators
  bool negated = false;       // Test
};

struct Stmt;
using StmtP = std::unique_ptr<Stmt>;
using Body = std::vector<StmtP>;

struct Stmt {
  enum K { Text, Output, If, For, Set, SetBlock, Macro, FilterBlock, Do, Break, Continue, Scope } k;
  int line = 0;
  std::string text;                          // Text
  ExprP expr;                                // Output, Set value, For iterable, Do
  std::vector<std::pair<ExprP, Body>> branches;  // If (cond, body); else as a branch with null cond
  std::vector<std::string> targets;          // For / Set names; Set "ns.attr" -> targets = {ns}, attr
  std::string attr;                          // Set on namespace attribute
  ExprP cond;                                // For filter
  Body body, else_body;
  // Macro
  std::string name;
  std::vector<std::pair<std::string, ExprP>> params;
  // FilterBlock: filters applied in order (Filter expressions whose `a` is null)
  std::vector<ExprP> filters;
};

// ===================================== parser =====================================================

const char* const kFilters[] = {"abs", "attr", "capitalize", "count", "default", "d", "dictsort", "escape", "e",
                                "first", "float", "indent", "int", "items", "join", "last", "length", "list",
                                "lower", "map", "max", "min", "reject", "rejectattr", "replace", "reverse", "round",
                                "safe", "select", "selectattr", "sort", "string", "sum", "title", "tojson", "trim",
                                "unique", "upper", "wordcount"};
const char* const kTests[] = {"boolean", "callable", "defined", "divisibleby", "eq", "equalto", "==", "even",
                              "false", "float", "ge", ">=", "gt", ">", "greaterthan", "in", "integer", "iterable",
                              "le", "<=", "lt", "<", "lessthan", "mapping", "ne", "!=", "none", "number", "odd",
                              "sameas", "sequence", "string", "true", "undefined", "upper", "lower"};

template <size_t N>
bool known(const char* const (&list)[N], const std::string& s) {
  for (const char* x : list)
    if (s == x) return true;
  return false;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  // Nesting limit for statements and expressions (templates come from files: no stack overflow).
  struct Depth {
    Parser& p;
    explicit Depth(Parser& pp) : p(pp) {
      if (++p.depth_ > 200) fail(p.cur().line, "template nests deeper than 200 levels");
    }
    ~Depth() { --p.depth_; }
  };
  int depth_ = 0;

  Body parse_template() {
    std::string stop;
    Body b = parse_body({}, stop);
    if (!stop.empty()) fail(cur().line, "unexpected '" + stop + "'");
    return b;
  }

 private:
  std::vector<Token> t_;
  size_t p_ = 0;

  const Token& cur() const { return t_[p_]; }
  const Token& peek(size_t k = 1) const { return t_[std::min(p_ + k, t_.size() - 1)]; }
  bool is_op(const char* op) const { return cur().k == Tk::Op && cur().v == op; }
  bool is_name(const char* n) const { return cur().k == Tk::Name && cur().v == n; }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(cur().line, std::string("expected '") + op + "', found " + describe(cur()));
    ++p_;
  }
  std::string expect_name() {
    if (cur().k != Tk::Name) fail(cur().line, "expected a name, found " + describe(cur()));
    return t_[p_++].v;
  }
  void expect_block_end() {
    if (cur().k != Tk::BlockEnd) fail(cur().line, "expected end of tag, found " + describe(cur()));
    ++p_;
  }
  static std::string describe(const Token& t) {
    switch (t.k) {
      case Tk::Name: return "'" + t.v + "'";
      case Tk::Op: return "'" + t.v + "'";
      case Tk::String: return "a string";
      case Tk::Int: case Tk::Float: return "a number";
      case Tk::BlockEnd: case Tk::VarEnd: return "end of tag";
      case Tk::End: return "end of template";
      default: return "text";
    }
  }

  // Parses statements until a block tag whose name is in `stops`; that name is returned in `stop` (the
  // tag's name token is consumed, the rest of the tag is not).
  Body parse_body(std::initializer_list<const char*> stops, std::string& stop) {
    Body body;
    stop.clear();
    while (cur().k != Tk::End) {
      const Token& tk = cur();
      if (tk.k == Tk::Text) {
        auto s = std::make_unique<Stmt>();
        s->k = Stmt::Text;
        s->line = tk.line;
        s->text = tk.v;
        body.push_back(std::move(s));
        ++p_;
        continue;
      }
      if (tk.k == Tk::VarBegin) {
        ++p_;
        auto s = std::make_unique<Stmt>();
        s->k = Stmt::Output;
        s->line = tk.line;
        s->expr = parse_tuple(true);
        if (cur().k != Tk::VarEnd) fail(cur().line, "expected '}}', found " + describe(cur()));
        ++p_;
        body.push_back(std::move(s));
        continue;
      }
      if (tk.k != Tk::BlockBegin) fail(tk.line, "unexpected " + describe(tk));
      ++p_;
      if (cur().k != Tk::Name) fail(cur().line, "expected a tag name, found " + describe(cur()));
      std::string name = cur().v;
      for (const char* st : stops)
        if (name == st) {
          ++p_;
          stop = name;
          return body;
        }
      body.push_back(parse_statement());
    }
    if (stops.size()) fail(cur().line, std::string("missing '{% ") + *(stops.end() - 1) + " %}'");
    return body;
  }

  StmtP parse_statement() {
    Depth guard(*this);
    const int line = cur().line;
    std::string name = t_[p_++].v;
    auto s = std::make_unique<Stmt>();
    s->line = line;
    std::string stop;
    if (name == "if") {
      s->k = Stmt::If;
      ExprP cond = parse_tuple(true);
      expect_block_end();
      for (;;) {
        Body b = parse_body({"elif", "else", "endif"}, stop);
        s->branches.emplace_back(std::move(cond), std::move(b));
        if (stop == "elif") {
          cond = parse_tuple(true);
          expect_block_end();
          continue;
        }
        if (stop == "else") {
          expect_block_end();
          Body eb = parse_body({"endif"}, stop);
          s->branches.emplace_back(nullptr, std::move(eb));
        }
        expect_block_end();
        break;
      }
      return s;
    }
    if (name == "for") {
      s->k = Stmt::For;
      s->targets.push_back(expect_name());
      while (is_op(",")) {
        ++p_;
        s->targets.push_back(expect_name());
      }
      if (!is_name("in")) fail(cur().line, "expected 'in' in for loop");
      ++p_;
      s->expr = parse_tuple(false);
      if (is_name("if")) {
        ++p_;
        s->cond = parse_expression(false);
      }
      if (is_name("recursive")) fail(cur().line, "recursive for loops are not supported");
      expect_block_end();
      s->body = parse_body({"else", "endfor"}, stop);
      if (stop == "else") {
        expect_block_end();
        s->else_body = parse_body({"endfor"}, stop);
      }
      expect_block_end();
      return s;
    }
    if (name == "set") {
      std::string first = expect_name();
      if (is_op(".")) {
        ++p_;
        s->attr = expect_name();
      }
      s->targets.push_back(first);
      while (is_op(",")) {
        ++p_;
        s->targets.push_back(expect_name());
      }
      if (is_op("=")) {
        ++p_;
        s->k = Stmt::Set;
        s->expr = parse_tuple(true);
        expect_block_end();
        return s;
      }
      if (s->targets.size() != 1 || !s->attr.empty()) fail(line, "block set needs a single name");
      s->k = Stmt::SetBlock;
      expect_block_end();
      s->body = parse_body({"endset"}, stop);
      expect_block_end();
      return s;
    }
    if (name == "macro") {
      s->k = Stmt::Macro;
      s->name = expect_name();
      expect_op("(");
      while (!is_op(")")) {
        std::string pn = expect_name();
        ExprP dflt;
        if (is_op("=")) {
          ++p_;
          dflt = parse_expression(true);
        }
        s->params.emplace_back(pn, std::move(dflt));
        if (!is_op(",")) break;
        ++p_;
      }
      expect_op(")");
      expect_block_end();
      s->body = parse_body({"endmacro"}, stop);
      if (cur().k == Tk::Name) ++p_;  // {% endmacro name %}
      expect_block_end();
      return s;
    }
    if (name == "filter") {
      s->k = Stmt::FilterBlock;
      for (;;) {
        s->filters.push_back(parse_filter_call(nullptr));
        if (!is_op("|")) break;
        ++p_;
      }
      expect_block_end();
      s->body = parse_body({"endfilter"}, stop);
      expect_block_end();
      return s;
    }
    if (name == "do") {
      s->k = Stmt::Do;
      s->expr = parse_tuple(true);
      expect_block_end();
      return s;
    }
    if (name == "break" || name == "continue") {
      s->k = name == "break" ? Stmt::Break : Stmt::Continue;
      expect_block_end();
      return s;
    }
    if (name == "generation") {  // transformers' assistant-mask marker: render the body as is
      s->k = Stmt::Scope;
      expect_block_end();
      s->body = parse_body({"endgeneration"}, stop);
      expect_block_end();
      return s;
    }
    fail(line, "unsupported tag '" + name + "'");
  }

  // ---- expressions ----
  ExprP node(Expr::K k, int line) {
    auto e = std::make_unique<Expr>();
    e->k = k;
    e->line = line;
    return e;
  }

  // A tuple without parentheses ("a, b") or a single expression.
  ExprP parse_tuple(bool with_cond) {
    const int line = cur().line;
    ExprP first = parse_expression(with_cond);
    if (!is_op(",")) return first;
    auto t = node(Expr::TupleLit, line);
    t->args.push_back(std::move(first));
    while (is_op(",")) {
      ++p_;
      if (cur().k == Tk::BlockEnd || cur().k == Tk::VarEnd) break;
      t->args.push_back(parse_expression(with_cond));
    }
    return t;
  }

  ExprP parse_expression(bool with_cond) {
    Depth guard(*this);
    return with_cond ? parse_cond() : parse_or();
  }

  ExprP parse_cond() {
    Depth guard(*this);
    ExprP e = parse_or();
    while (is_name("if")) {
      const int line = cur().line;
      ++p_;
      auto c = node(Expr::Cond, line);
      c->b = parse_or();  // condition
      c->a = std::move(e);  // value if true
      if (is_name("else")) {
        ++p_;
        c->c = parse_cond();
      }
      e = std::move(c);
    }
    return e;
  }

  ExprP parse_or() {
    ExprP e = parse_and();
    while (is_name("or")) {
      auto o = node(Expr::Or, cur().line);
      ++p_;
      o->a = std::move(e);
      o->b = parse_and();
      e = std::move(o);
    }
    return e;
  }

  ExprP parse_and() {
    ExprP e = parse_not();
    while (is_name("and")) {
      auto o = node(Expr::And, cur().line);
      ++p_;
      o->a = std::move(e);
      o->b = parse_not();
      e = std::move(o);
    }
    return e;
  }

  ExprP parse_not() {
    Depth guard(*this);
    if (is_name("not")) {
      auto n = node(Expr::Not, cur().line);
      ++p_;
      n->a = parse_not();
      return n;
    }
    return parse_compare();
  }

  ExprP parse_compare() {
    const int line = cur().line;
    ExprP e = parse_math1();
    std::vector<std::string> ops;
    std::vector<ExprP> operands;
    for (;;) {
      std::string op;
      if (cur().k == Tk::Op && (cur().v == "==" || cur().v == "!=" || cur().v == "<" || cur().v == "<=" ||
                                cur().v == ">" || cur().v == ">=")) {
        op = cur().v;
        ++p_;
      } else if (is_name("in")) {
        op = "in";
        ++p_;
      } else if (is_name("not") && peek().k == Tk::Name && peek().v == "in") {
        op = "not in";
        p_ += 2;
      } else {
        break;
      }
      ops.push_back(op);
      operands.push_back(parse_math1());
    }
    if (ops.empty()) return e;
    auto c = node(Expr::Cmp, line);
    c->args.push_back(std::move(e));
    for (auto& o : operands) c->args.push_back(std::move(o));
    c->ops = std::move(ops);
    return c;
  }

  ExprP bin(const std::string& op, ExprP l, ExprP r, int line) {
    auto b = node(Expr::Bin, line);
    b->name = op;
    b->a = std::move(l);
    b->b = std::move(r);
    return b;
  }

  ExprP parse_math1() {
    ExprP e = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = cur().v;
      int line = cur().line;
      ++p_;
      e = bin(op, std::move(e), parse_concat(), line);
    }
    return e;
  }

  ExprP parse_concat() {
    ExprP e = parse_math2();
    while (is_op("~")) {
      int line = cur().line;
      ++p_;
      e = bin("~", std::move(e), parse_math2(), line);
    }
    return e;
  }

  ExprP parse_math2() {
    ExprP e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = cur().v;
      int line = cur().line;
      ++p_;
      e = bin(op, std::move(e), parse_pow(), line);
    }
    return e;
  }

  ExprP parse_pow() {
    ExprP e = parse_unary(true);
    while (is_op("**")) {
      int line = cur().line;
      ++p_;
      e = bin("**", std::move(e), parse_unary(true), line);
    }
    return e;
  }

  ExprP parse_unary(bool with_filter) {
    Depth guard(*this);
    ExprP e;
    if (is_op("-") || is_op("+")) {
      auto u = node(is_op("-") ? Expr::Neg : Expr::Pos, cur().line);
      ++p_;
      u->a = parse_unary(false);
      e = std::move(u);
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprP parse_primary() {
    const Token& tk = cur();
    const int line = tk.line;
    if (tk.k == Tk::Name) {
      ++p_;
      auto lit = [&](Value v) {
        auto e = node(Expr::Lit, line);
        e->lit = std::move(v);
        return e;
      };
      if (tk.v == "true" || tk.v == "True") return lit(Value::boolean(true));
      if (tk.v == "false" || tk.v == "False") return lit(Value::boolean(false));
      if (tk.v == "none" || tk.v == "None") return lit(Value::none());
      auto e = node(Expr::Name, line);
      e->name = tk.v;
      return e;
    }
    if (tk.k == Tk::String) {
      std::string s;
      while (cur().k == Tk::String) s += t_[p_++].v;  // adjacent literals concatenate
      auto e = node(Expr::Lit, line);
      e->lit = Value::str(std::move(s));
      return e;
    }
    if (tk.k == Tk::Int || tk.k == Tk::Float) {
      ++p_;
      auto e = node(Expr::Lit, line);
      e->lit = tk.k == Tk::Int ? Value::integer(tk.i) : Value::real(tk.f);
      return e;
    }
    if (is_op("(")) {
      ++p_;
      if (is_op(")")) {
        ++p_;
        return node(Expr::TupleLit, line);
      }
      ExprP first = parse_expression(true);
      if (is_op(")")) {
        ++p_;
        return first;
      }
      auto t = node(Expr::TupleLit, line);
      t->args.push_back(std::move(first));
      while (is_op(",")) {
        ++p_;
        if (is_op(")")) break;
        t->args.push_back(parse_expression(true));
      }
      expect_op(")");
      return t;
    }
    if (is_op("[")) {
      ++p_;
      auto l = node(Expr::ListLit, line);
      while (!is_op("]")) {
        l->args.push_back(parse_expression(true));
        if (!is_op(",")) break;
        ++p_;
      }
      expect_op("]");
      return l;
    }
    if (is_op("{")) {
      ++p_;
      auto d = node(Expr::DictLit, line);
      while (!is_op("}")) {
        d->args.push_back(parse_expression(true));
        expect_op(":");
        d->args.push_back(parse_expression(true));
        if (!is_op(",")) break;
        ++p_;
      }
      expect_op("}");
      return d;
    }
    fail(line, "unexpected " + describe(tk) + " in expression");
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (is_op("*") || is_op("**")) fail(cur().line, "*args / **kwargs in calls are not supported");
      if (cur().k == Tk::Name && peek().k == Tk::Op && peek().v == "=") {
        std::string k = t_[p_].v;
        p_ += 2;
        e.kwargs.emplace_back(k, parse_expression(true));
      } else {
        e.args.push_back(parse_expression(true));
      }
      if (!is_op(",")) break;
      ++p_;
    }
    expect_op(")");
  }

  ExprP parse_postfix(ExprP e) {
    for (;;) {
      const int line = cur().line;
      if (is_op(".")) {
        ++p_;
        auto a = node(Expr::Attr, line);
        if (cur().k == Tk::Int) {  // foo.0 means foo[0]
          a->k = Expr::Item;
          auto idx = node(Expr::Lit, line);
          idx->lit = Value::integer(cur().i);
          ++p_;
          a->a = std::move(e);
          a->b = std::move(idx);
        } else {
          a->name = expect_name();
          a->a = std::move(e);
        }
        e = std::move(a);
      } else if (is_op("[")) {
        ++p_;
        ExprP start, stop, step;
        bool slice = false;
        if (!is_op(":")) start = parse_expression(true);
        if (is_op(":")) {
          slice = true;
          ++p_;
          if (!is_op("]") && !is_op(":")) stop = parse_expression(true);
          if (is_op(":")) {
            ++p_;
            if (!is_op("]")) step = parse_expression(true);
          }
        }
        expect_op("]");
        if (slice) {
          auto s = node(Expr::Slice, line);
          s->a = std::move(e);
          s->b = std::move(start);
          s->c = std::move(stop);
          s->d = std::move(step);
          e = std::move(s);
        } else {
          auto it = node(Expr::Item, line);
          it->a = std::move(e);
          it->b = std::move(start);
          e = std::move(it);
        }
      } else if (is_op("(")) {
        auto c = node(Expr::Call, line);
        c->a = std::move(e);
        parse_call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  // "name(args)" after '|' (or in a filter block); `obj` may be null there.
  ExprP parse_filter_call(ExprP obj) {
    const int line = cur().line;
    std::string name = expect_name();
    while (is_op(".")) {  // dotted filter names are not used by chat templates; keep the message clear
      ++p_;
      name += "." + expect_name();
    }
    if (!known(kFilters, name)) fail(line, "unsupported filter '" + name + "'");
    auto f = node(Expr::Filter, line);
    f->name = name;
    f->a = std::move(obj);
    if (is_op("(")) parse_call_args(*f);
    return f;
  }

  ExprP parse_filter_expr(ExprP e) {
    for (;;) {
      if (is_op("|")) {
        ++p_;
        e = parse_filter_call(std::move(e));
      } else if (is_name("is")) {
        const int line = cur().line;
        ++p_;
        auto t = node(Expr::Test, line);
        if (is_name("not")) {
          t->negated = true;
          ++p_;
        }
        std::string name;
        if (cur().k == Tk::Name) name = t_[p_++].v;
        else if (cur().k == Tk::Op && (cur().v == "==" || cur().v == "!=" || cur().v == "<" || cur().v == "<=" ||
                                       cur().v == ">" || cur().v == ">="))
          name = t_[p_++].v;
        else fail(line, "expected a test name after 'is'");
        if (!known(kTests, name)) fail(line, "unsupported test '" + name + "'");
        t->name = name;
        t->a = std::move(e);
        if (is_op("(")) {
          parse_call_args(*t);
        } else if ((cur().k == Tk::Name && cur().v != "else" && cur().v != "or" && cur().v != "and" &&
                    cur().v != "if" && cur().v != "in" && cur().v != "not" && cur().v != "is") ||
                   cur().k == Tk::String || cur().k == Tk::Int || cur().k == Tk::Float || is_op("[") || is_op("{")) {
          t->args.push_back(parse_postfix(parse_primary()));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        auto c = node(Expr::Call, cur().line);
        c->a = std::move(e);
        parse_call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
};

// ===================================== interpreter ================================================

struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;
  Value* find(const std::string& n) {
    for (Scope* s = this; s; s = s->parent.get()) {
      auto it = s->vars.find(n);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};

enum class Flow { Normal, Break, Continue };

struct Interp {
  int depth = 0;  // macro calls within macro calls
  int nest = 0;   // eval / exec frames within each other (the stack)
  std::shared_ptr<Scope> root;

  void tick(int line) {
    if (t_budget && ++t_budget->steps > t_budget->lim.max_steps)
      fail(line, "rendering takes more than " + std::to_string(t_budget->lim.max_steps) + " steps");
  }
  // Bounds the recursion of evaluation (macros calling macros, each nesting expressions) below what
  // the stack holds, also in sanitizer builds whose frames are large.
  struct Nest {
    Interp& in;
    Nest(Interp& i, int line) : in(i) {
      if (t_budget && ++in.nest > t_budget->lim.max_nesting) {
        --in.nest;
        fail(line, "rendering nests deeper than " + std::to_string(t_budget->lim.max_nesting) + " levels");
      }
    }
    ~Nest() {
      if (t_budget) --in.nest;
    }
  };
  static size_t max_output() { return t_budget ? t_budget->lim.max_output : SIZE_MAX; }

  // ---- statements ----
  Flow exec(const Body& body, const std::shared_ptr<Scope>& sc, std::string& out) {
    for (const auto& s : body) {
      Flow f = exec(*s, sc, out);
      if (f != Flow::Normal) return f;
      if (out.size() > max_output()) fail(s->line, "output exceeds " + std::to_string(max_output()) + " bytes");
    }
    return Flow::Normal;
  }

  Flow exec(const Stmt& s, const std::shared_ptr<Scope>& sc, std::string& out) {
    tick(s.line);
    Nest nest_guard(*this, s.line);
    switch (s.k) {
      case Stmt::Text: out += s.text; return Flow::Normal;
      case Stmt::Output: out += to_str(eval(*s.expr, sc)); return Flow::Normal;
      case Stmt::If:
        for (const auto& [cond, body] : s.branches)
          if (!cond || truthy(eval(*cond, sc))) return exec(body, sc, out);
        return Flow::Normal;
      case Stmt::For: return exec_for(s, sc, out);
      case Stmt::Set: {
        Value v = eval(*s.expr, sc);
        if (!s.attr.empty()) {
          Value* ns = sc->find(s.targets[0]);
          if (!ns || ns->t != Value::Dct || ns->d->kind != Dict::Namespace)
            fail(s.line, "cannot set attribute '" + s.attr + "' of '" + s.targets[0] + "': not a namespace()");
          changed_dict(ns->d);
          ns->d->set(s.attr, std::move(v));
        } else {
          assign(s.targets, std::move(v), *sc, s.line);
        }
        return Flow::Normal;
      }
      case Stmt::SetBlock: {
        std::string buf;
        exec(s.body, sc, buf);
        sc->vars[s.targets[0]] = Value::str(std::move(buf));
        return Flow::Normal;
      }
      case Stmt::Macro: {
        sc->vars[s.name] = make_macro(s, sc);
        return Flow::Normal;
      }
      case Stmt::FilterBlock: {
        std::string buf;
        exec(s.body, sc, buf);
        Value v = Value::str(std::move(buf));
        for (const auto& f : s.filters) v = apply_filter(*f, std::move(v), sc);
        out += to_str(v);
        return Flow::Normal;
      }
      case Stmt::Do: eval(*s.expr, sc); return Flow::Normal;
      case Stmt::Break: return Flow::Break;
      case Stmt::Continue: return Flow::Continue;
      case Stmt::Scope: return exec(s.body, sc, out);
    }
    return Flow::Normal;
  }

  void assign(const std::vector<std::string>& targets, Value v, Scope& sc, int line) {
    if (targets.size() == 1) {
      sc.vars[targets[0]] = std::move(v);
      return;
    }
    List items = iterate(v, line);
    if (items.size() != targets.size())
      fail(line, "cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(targets.size()));
    for (size_t k = 0; k < targets.size(); ++k) sc.vars[targets[k]] = std::move(items[k]);
  }

  List iterate(const Value& v, int line) {
    switch (v.t) {
      case Value::Undef: return {};
      case Value::Lst:
        charge_steps(v.l->size());
        return *v.l;
      case Value::Dct: {
        List keys;
        for (const auto& kv : v.d->items) keys.push_back(Value::str(kv.first));
        return keys;
      }
      case Value::Str: {
        List chars;
        for (auto& c : chars_of(v.s)) chars.push_back(Value::str(std::move(c)));
        return chars;
      }
      default: fail(line, std::string("'") + type_name(v) + "' object is not iterable");
    }
  }

  Flow exec_for(const Stmt& s, const std::shared_ptr<Scope>& sc, std::string& out) {
    List items = iterate(eval(*s.expr, sc), s.line);
    auto ls = std::make_shared<Scope>();
    ls->parent = sc;
    if (s.cond) {
      List kept;
      for (auto& it : items) {
        assign(s.targets, it, *ls, s.line);
        if (truthy(eval(*s.cond, ls))) kept.push_back(std::move(it));
      }
      items.swap(kept);
    }
    if (items.empty()) return exec(s.else_body, sc, out);
    const int64_t n = static_cast<int64_t>(items.size());
    // One loop object whose fields advance, as Jinja2's LoopContext.
    Value loop = Value::dict();
    loop.d->kind = Dict::Loop;
    auto& li = loop.d->items;
    for (const char* f : {"index", "index0", "revindex", "revindex0", "first", "last", "length", "depth", "depth0",
                          "previtem", "nextitem"})
      li.emplace_back(f, Value());
    std::weak_ptr<Dict> wd = loop.d;
    li.emplace_back("cycle", make_fn("loop.cycle", [wd](Interp&, Args& a, int line) {
                      auto d = wd.lock();
                      if (!d || a.pos.empty()) fail(line, "loop.cycle() needs at least one argument");
                      return a.pos[static_cast<size_t>(d->items[1].second.i) % a.pos.size()];
                    }));
    ls->vars["loop"] = loop;
    for (int64_t k = 0; k < n; ++k) {
      tick(s.line);
      assign(s.targets, items[static_cast<size_t>(k)], *ls, s.line);
      li[0].second = Value::integer(k + 1);
      li[1].second = Value::integer(k);
      li[2].second = Value::integer(n - k);
      li[3].second = Value::integer(n - k - 1);
      li[4].second = Value::boolean(k == 0);
      li[5].second = Value::boolean(k == n - 1);
      li[6].second = Value::integer(n);
      li[7].second = Value::integer(1);
      li[8].second = Value::integer(0);
      li[9].second = k > 0 ? items[static_cast<size_t>(k - 1)] : Value::undef("loop.previtem");
      li[10].second = k + 1 < n ? items[static_cast<size_t>(k + 1)] : Value::undef("loop.nextitem");
      Flow f = exec(s.body, ls, out);
      if (f == Flow::Break) break;
    }
    return Flow::Normal;
  }

  Value make_macro(const Stmt& m, const std::shared_ptr<Scope>& def_scope) {
    const Stmt* mp = &m;
    std::weak_ptr<Scope> ws = def_scope;
    return make_fn(m.name, [mp, ws](Interp& in, Args& a, int line) {
      auto parent = ws.lock();
      if (!parent) fail(line, "macro '" + mp->name + "' called after its scope ended");
      const int max_depth = t_budget ? t_budget->lim.max_macro_depth : 64;
      if (++in.depth > max_depth) {
        --in.depth;
        fail(line, "macro recursion deeper than " + std::to_string(max_depth));
      }
      auto sc = std::make_shared<Scope>();
      sc->parent = parent;
      if (a.pos.size() > mp->params.size())
        fail(line, "macro '" + mp->name + "' takes " + std::to_string(mp->params.size()) + " arguments, " +
                       std::to_string(a.pos.size()) + " given");
      for (const auto& [k, v] : a.kw) {
        bool ok = false;
        for (const auto& pr : mp->params) ok |= pr.first == k;
        if (!ok) fail(line, "macro '" + mp->name + "' has no parameter '" + k + "'");
      }
      for (size_t k = 0; k < mp->params.size(); ++k) {
        const auto& [pn, dflt] = mp->params[k];
        const Value* given = a.get(k, pn);
        if (given) sc->vars[pn] = *given;
        else if (dflt) sc->vars[pn] = in.eval(*dflt, sc);
        else sc->vars[pn] = Value::undef(pn);
      }
      std::string buf;
      in.exec(mp->body, sc, buf);
      --in.depth;
      return Value::str(std::move(buf));
    });
  }

  // ---- expressions ----
  Value eval(const Expr& e, const std::shared_ptr<Scope>& sc) {
    tick(e.line);
    Nest nest_guard(*this, e.line);
    switch (e.k) {
      case Expr::Lit: return e.lit;
      case Expr::Name: {
        Value* v = sc->find(e.name);
        return v ? *v : Value::undef(e.name);
      }
      case Expr::Attr: return get_attr(eval(*e.a, sc), e.name, e.line);
      case Expr::Item: return get_item(eval(*e.a, sc), eval(*e.b, sc), e.line);
      case Expr::Slice: {
        Value obj = eval(*e.a, sc);
        Value a = e.b ? eval(*e.b, sc) : Value::none(), b = e.c ? eval(*e.c, sc) : Value::none(),
              c = e.d ? eval(*e.d, sc) : Value::none();
        if (obj.t == Value::Lst) {
          List out;
          for (int64_t k : slice_indices(static_cast<int64_t>(obj.l->size()), &a, &b, &c, e.line))
            out.push_back((*obj.l)[static_cast<size_t>(k)]);
          return Value::list(std::move(out));
        }
        if (obj.t == Value::Str) {
          auto ch = chars_of(obj.s);
          std::string out;
          for (int64_t k : slice_indices(static_cast<int64_t>(ch.size()), &a, &b, &c, e.line))
            out += ch[static_cast<size_t>(k)];
          return Value::str(std::move(out));
        }
        if (obj.t == Value::Undef) return obj;
        fail(e.line, std::string("cannot slice a ") + type_name(obj));
      }
      case Expr::Call: {
        Value callee = eval(*e.a, sc);
        if (callee.t != Value::Fn) {
          if (callee.t == Value::Undef)
            fail(e.line, "'" + (callee.s.empty() ? std::string("value") : callee.s) + "' is undefined (not a function)");
          fail(e.line, std::string("a ") + type_name(callee) + " is not callable");
        }
        Args args = eval_args(e, sc);
        return callee.fn->call(*this, args, e.line);
      }
      case Expr::Filter: return apply_filter(e, eval(*e.a, sc), sc);
      case Expr::Test: {
        bool r = apply_test(e, eval(*e.a, sc), sc);
        return Value::boolean(e.negated ? !r : r);
      }
      case Expr::Neg: case Expr::Pos: {
        Value v = eval(*e.a, sc);
        if (v.t == Value::Int || v.t == Value::Bool) {
          const int64_t x = v.t == Value::Int ? v.i : v.b;
          if (e.k == Expr::Neg && x == INT64_MIN) fail(e.line, "integer overflow in unary minus");
          return Value::integer(e.k == Expr::Neg ? -x : x);
        }
        if (v.t == Value::Float) return Value::real(e.k == Expr::Neg ? -v.f : v.f);
        fail(e.line, std::string("bad operand type for unary minus: ") + type_name(v));
      }
      case Expr::Not: return Value::boolean(!truthy(eval(*e.a, sc)));
      case Expr::And: {
        Value a = eval(*e.a, sc);
        return truthy(a) ? eval(*e.b, sc) : a;
      }
      case Expr::Or: {
        Value a = eval(*e.a, sc);
        return truthy(a) ? a : eval(*e.b, sc);
      }
      case Expr::Bin: return binary(e.name, eval(*e.a, sc), eval(*e.b, sc), e.line);
      case Expr::Cmp: {
        Value left = eval(*e.args[0], sc);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.args[k + 1], sc);
          if (!cmp_op(e.ops[k], left, right, e.line)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case Expr::Cond:
        if (truthy(eval(*e.b, sc))) return eval(*e.a, sc);
        return e.c ? eval(*e.c, sc) : Value::undef();
      case Expr::ListLit: case Expr::TupleLit: {
        List l;
        for (const auto& x : e.args) l.push_back(eval(*x, sc));
        return Value::list(std::move(l));
      }
      case Expr::DictLit: {
        Value d = Value::dict();
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          Value key = eval(*e.args[k], sc);
          if (key.t != Value::Str)
            fail(e.line, std::string("dict keys must be strings (a ") + type_name(key) + " key is not supported)");
          d.d->set(key.s, eval(*e.args[k + 1], sc));
        }
        return d;
      }
    }
    return Value::undef();
  }

  Args eval_args(const Expr& e, const std::shared_ptr<Scope>& sc) {
    Args a;
    for (const auto& x : e.args) a.pos.push_back(eval(*x, sc));
    for (const auto& [k, x] : e.kwargs) a.kw.emplace_back(k, eval(*x, sc));
    return a;
  }

  bool contains(const Value& hay, const Value& needle, int line) {
    switch (hay.t) {
      case Value::Str:
        if (needle.t != Value::Str) fail(line, "'in <string>' requires a string as left operand");
        charge_bytes(hay.s.size());
        return hay.s.find(needle.s) != std::string::npos;
      case Value::Lst:
        for (const auto& x : *hay.l)
          if (equal(x, needle)) return true;
        return false;
      case Value::Dct:
        return needle.t == Value::Str && hay.d->find(needle.s) != nullptr;
      case Value::Undef: return false;
      default: fail(line, std::string("argument of type '") + type_name(hay) + "' is not iterable");
    }
  }

  bool cmp_op(const std::string& op, const Value& a, const Value& b, int line) {
    if (op == "==") return equal(a, b);
    if (op == "!=") return !equal(a, b);
    if (op == "in") return contains(b, a, line);
    if (op == "not in") return !contains(b, a, line);
    int c = compare(a, b, line);
    if (op == "<") return c < 0;
    if (op == "<=") return c <= 0;
    if (op == ">") return c > 0;
    return c >= 0;
  }

  Value binary(const std::string& op, const Value& a, const Value& b, int line) {
    if (op == "~") {
      std::string x = to_str(a), y = to_str(b);
      check_string(x.size() + y.size());
      return Value::str(x + y);
    }
    if (op == "+") {
      if (a.t == Value::Str && b.t == Value::Str) {
        check_string(a.s.size() + b.s.size());
        return Value::str(a.s + b.s);
      }
      if (a.t == Value::Lst && b.t == Value::Lst) {
        check_items(a.l->size() + b.l->size());
        List l = *a.l;
        l.insert(l.end(), b.l->begin(), b.l->end());
        return Value::list(std::move(l));
      }
    }
    if (op == "*") {
      const Value* s = a.t == Value::Str || a.t == Value::Lst ? &a : b.t == Value::Str || b.t == Value::Lst ? &b : nullptr;
      const Value* n = s == &a ? &b : &a;
      if (s && (n->t == Value::Int || n->t == Value::Bool)) {
        const uint64_t times = static_cast<uint64_t>(std::max<int64_t>(0, n->t == Value::Int ? n->i : n->b));
        const uint64_t unit = s->t == Value::Str ? s->s.size() : s->l->size();
        // (checked before the product is formed: 'x' * 10**18 must not wrap around)
        const uint64_t bound = s->t == Value::Str ? (t_budget ? t_budget->lim.max_string : 256u << 20)
                                                  : (t_budget ? t_budget->lim.max_items : 1u << 20);
        if (unit && times > bound / unit) {
          if (s->t == Value::Str) check_string(bound + 1);
          check_items(bound + 1);
        }
        const uint64_t reps = unit ? times : 0;  // ('' * 10**18 is '' at once)
        if (s->t == Value::Str) {
          std::string r;
          r.reserve(static_cast<size_t>(reps * unit));
          for (uint64_t k = 0; k < reps; ++k) r += s->s;
          return Value::str(std::move(r));
        }
        List r;
        for (uint64_t k = 0; k < reps; ++k) r.insert(r.end(), s->l->begin(), s->l->end());
        return Value::list(std::move(r));
      }
    }
    if (!a.is_num() || !b.is_num())
      fail(line, std::string("unsupported operand types for ") + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
    const bool ints = a.t != Value::Float && b.t != Value::Float;
    const int64_t x = a.t == Value::Int ? a.i : a.b, y = b.t == Value::Int ? b.i : b.b;
    // Python's integers do not overflow; 64-bit ones here do, which is an error rather than a wrong
    // number (or undefined behaviour).
    auto checked = [&](bool (*f)(int64_t, int64_t, int64_t*)) {
      int64_t r = 0;
      if (f(x, y, &r)) fail(line, "integer overflow in " + op);
      return Value::integer(r);
    };
    auto add = [](int64_t p, int64_t q, int64_t* r) { return __builtin_add_overflow(p, q, r); };
    auto sub = [](int64_t p, int64_t q, int64_t* r) { return __builtin_sub_overflow(p, q, r); };
    auto mul = [](int64_t p, int64_t q, int64_t* r) { return __builtin_mul_overflow(p, q, r); };
    if (op == "+") return ints ? checked(add) : Value::real(a.num() + b.num());
    if (op == "-") return ints ? checked(sub) : Value::real(a.num() - b.num());
    if (op == "*") return ints ? checked(mul) : Value::real(a.num() * b.num());
    if (op == "/") {
      if (b.num() == 0) fail(line, "division by zero");
      return Value::real(a.num() / b.num());
    }
    if (op == "//" || op == "%") {
      if (b.num() == 0) fail(line, op == "%" ? "modulo by zero" : "division by zero");
      if (ints) {
        if (x == INT64_MIN && y == -1) fail(line, "integer overflow in " + op);
        int64_t q = x / y, r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) {
          --q;
          r += y;
        }
        return Value::integer(op == "//" ? q : r);
      }
      double q = std::floor(a.num() / b.num());
      return op == "//" ? Value::real(q) : Value::real(a.num() - q * b.num());
    }
    if (op == "**") {
      if (ints && y >= 0) {
        // 0, 1 and -1 stay small for any exponent; any other base overflows within 63 factors.
        if (x == 0 || x == 1) return Value::integer(y == 0 ? 1 : x);
        if (x == -1) return Value::integer(y % 2 ? -1 : 1);
        int64_t p = 1;
        for (int64_t k = 0; k < y; ++k)
          if (__builtin_mul_overflow(p, x, &p)) fail(line, "integer overflow in **");
        return Value::integer(p);
      }
      return Value::real(std::pow(a.num(), b.num()));
    }
    fail(line, "unknown operator " + op);
  }

  // ---- attribute and item access ----
  Value get_attr(const Value& obj, const std::string& name, int line) {
    if (obj.t == Value::Dct) {
      if (obj.d->kind == Dict::Plain) {
        Value m = dict_method(obj, name);
        if (m.t == Value::Fn) return m;
      }
      Value* v = obj.d->find(name);
      return v ? *v : Value::undef(name);
    }
    if (obj.t == Value::Str) return str_method(obj, name, line);
    if (obj.t == Value::Lst) return list_method(obj, name);
    return Value::undef(name);
  }

  Value get_item(const Value& obj, const Value& key, int line) {
    if (obj.t == Value::Dct) {
      if (key.t == Value::Str) {
        Value* v = obj.d->find(key.s);
        if (v) return *v;
        return obj.d->kind == Dict::Plain ? Value::undef(key.s) : get_attr(obj, key.s, line);
      }
      Value* v = obj.d->find(to_str(key));
      return v ? *v : Value::undef();
    }
    if (obj.t == Value::Lst || obj.t == Value::Str) {
      if (key.t != Value::Int && key.t != Value::Bool) {
        if (key.t == Value::Str) return get_attr(obj, key.s, line);
        fail(line, "indices must be integers");
      }
      int64_t idx = key.t == Value::Int ? key.i : key.b;
      if (obj.t == Value::Lst) {
        int64_t n = static_cast<int64_t>(obj.l->size());
        if (idx < 0) idx += n;
        if (idx < 0 || idx >= n) return Value::undef();
        return (*obj.l)[static_cast<size_t>(idx)];
      }
      auto ch = chars_of(obj.s);
      int64_t n = static_cast<int64_t>(ch.size());
      if (idx < 0) idx += n;
      if (idx < 0 || idx >= n) return Value::undef();
      return Value::str(ch[static_cast<size_t>(idx)]);
    }
    return Value::undef();
  }

  static std::string arg_str(const Args& a, size_t i, std::string_view name, const std::string& dflt, int line) {
    const Value* v = a.get(i, name);
    if (!v || v->t == Value::None || v->t == Value::Undef) return dflt;
    if (v->t != Value::Str) fail(line, "expected a string argument '" + std::string(name) + "'");
    return v->s;
  }

  static bool in_set(uint32_t cp, const std::vector<uint32_t>* set) {
    if (!set) return text::py_isspace(cp);
    return std::find(set->begin(), set->end(), cp) != set->end();
  }

  static std::string strip(const std::string& s, const Value* chars, bool left, bool right) {
    std::vector<uint32_t> set;
    const std::vector<uint32_t>* sp = nullptr;
    if (chars && chars->t == Value::Str) {
      set = cps_of(chars->s);
      sp = &set;
    }
    auto cps = cps_of(s);
    size_t b = 0, e = cps.size();
    if (left)
      while (b < e && in_set(cps[b], sp)) ++b;
    if (right)
      while (e > b && in_set(cps[e - 1], sp)) --e;
    if (b == 0 && e == cps.size()) return s;
    return text::cps_to_utf8(cps.data() + b, e - b);
  }

  static List split(const std::string& s, const Value* sep, int64_t maxsplit, bool from_right, int line) {
    List out;
    if (!sep || sep->t == Value::None || sep->t == Value::Undef) {
      // Runs of whitespace; leading/trailing whitespace ignored.
      auto cps = cps_of(s);
      std::vector<std::pair<size_t, size_t>> words;
      size_t k = 0;
      while (k < cps.size()) {
        while (k < cps.size() && text::py_isspace(cps[k])) ++k;
        if (k >= cps.size()) break;
        size_t b = k;
        while (k < cps.size() && !text::py_isspace(cps[k])) ++k;
        charge_bytes(sizeof(Value) + 16);
        check_items(words.size() + 1);
        words.emplace_back(b, k);
      }
      if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit + 1) {
        // Keep the remainder (with its inner whitespace) as the last (or first) item.
        if (!from_right) {
          for (int64_t w = 0; w < maxsplit; ++w)
            out.push_back(Value::str(text::cps_to_utf8(cps.data() + words[w].first, words[w].second - words[w].first)));
          size_t rb = words[static_cast<size_t>(maxsplit)].first, re = words.back().second;
          out.push_back(Value::str(text::cps_to_utf8(cps.data() + rb, re - rb)));
        } else {
          size_t first_kept = words.size() - static_cast<size_t>(maxsplit);
          size_t rb = words.front().first, re = words[first_kept - 1].second;
          out.push_back(Value::str(text::cps_to_utf8(cps.data() + rb, re - rb)));
          for (size_t w = first_kept; w < words.size(); ++w)
            out.push_back(Value::str(text::cps_to_utf8(cps.data() + words[w].first, words[w].second - words[w].first)));
        }
        return out;
      }
      for (auto [b, e] : words) out.push_back(Value::str(text::cps_to_utf8(cps.data() + b, e - b)));
      return out;
    }
    if (sep->t != Value::Str) fail(line, "split() separator must be a string");
    if (sep->s.empty()) fail(line, "empty separator");
    std::vector<std::string> parts;
    if (!from_right) {
      size_t pos = 0;
      int64_t n = 0;
      for (;;) {
        size_t f = (maxsplit >= 0 && n >= maxsplit) ? std::string::npos : s.find(sep->s, pos);
        charge_bytes(sizeof(Value) + sizeof(std::string));
        check_items(parts.size() + 1);
        if (f == std::string::npos) {
          parts.push_back(s.substr(pos));
          break;
        }
        parts.push_back(s.substr(pos, f - pos));
        pos = f + sep->s.size();
        ++n;
      }
    } else {
      size_t end = s.size();
      int64_t n = 0;
      for (;;) {
        size_t f = (maxsplit >= 0 && n >= maxsplit) || end < sep->s.size() ? std::string::npos
                                                                            : s.rfind(sep->s, end - sep->s.size());
        charge_bytes(sizeof(Value) + sizeof(std::string));
        check_items(parts.size() + 1);
        if (f == std::string::npos) {
          parts.push_back(s.substr(0, end));
          break;
        }
        parts.push_back(s.substr(f + sep->s.size(), end - f - sep->s.size()));
        end = f;
        ++n;
      }
      std::reverse(parts.begin(), parts.end());
    }
    for (auto& p : parts) out.push_back(Value::str(std::move(p)));
    return out;
  }

  static std::string title_case(const std::string& s) {
    std::string out;
    bool prev_cased = false;
    size_t i = 0;
    while (i < s.size()) {
      size_t at = i;
      uint32_t cp;
      text::decode_lenient(s, i, cp);
      std::string ch = s.substr(at, i - at);
      std::string up = text::utf8_upper(ch), lo = text::utf8_lower(ch);
      bool cased = up != lo;
      out += cased ? (prev_cased ? lo : up) : ch;
      prev_cased = cased;
    }
    return out;
  }

  static std::string capitalize(const std::string& s) {
    if (s.empty()) return s;
    size_t i = 0;
    uint32_t cp;
    text::decode_lenient(s, i, cp);
    return text::utf8_upper(s.substr(0, i)) + text::utf8_lower(s.substr(i));
  }

  static std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
    if (from.empty()) {
      // Python inserts `to` between every character (and at both ends).
      auto ch = chars_of(s);
      std::string out;
      int64_t n = 0;
      for (const auto& c : ch) {
        if (count < 0 || n < count) {
          out += to;
          ++n;
        }
        out += c;
        check_string(out.size());
      }
      if (count < 0 || n < count) out += to;
      return out;
    }
    std::string out;
    size_t pos = 0;
    int64_t n = 0;
    for (;;) {
      size_t f = (count >= 0 && n >= count) ? std::string::npos : s.find(from, pos);
      if (f == std::string::npos) break;
      out.append(s, pos, f - pos);
      out += to;
      check_string(out.size());
      pos = f + from.size();
      ++n;
    }
    out.append(s, pos);
    return out;
  }

  Value str_method(const Value& obj, const std::string& name, int line) {
    charge_bytes(2 * obj.s.size());  // (s below, and the method's copy of it)
    const std::string s = obj.s;
    auto fn = [&](std::function<Value(Args&, int)> f) {
      return make_fn("str." + name, [f](Interp&, Args& a, int l) { return f(a, l); });
    };
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      bool l = name != "rstrip", r = name != "lstrip";
      return fn([s, l, r](Args& a, int) { return Value::str(strip(s, a.get(0, "chars"), l, r)); });
    }
    if (name == "split" || name == "rsplit") {
      bool right = name == "rsplit";
      return fn([s, right](Args& a, int l) {
        const Value* ms = a.get(1, "maxsplit");
        int64_t m = ms && ms->t == Value::Int ? ms->i : -1;
        return Value::list(split(s, a.get(0, "sep"), m, right, l));
      });
    }
    if (name == "startswith" || name == "endswith") {
      bool start = name == "startswith";
      return fn([s, start](Args& a, int l) {
        const Value* p = a.get(0, "prefix");
        if (!p) fail(l, "startswith/endswith need an argument");
        auto test = [&](const std::string& x) {
          if (x.size() > s.size()) return false;
          return start ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0;
        };
        if (p->t == Value::Str) return Value::boolean(test(p->s));
        if (p->t == Value::Lst) {
          for (const auto& x : *p->l)
            if (x.t == Value::Str && test(x.s)) return Value::boolean(true);
          return Value::boolean(false);
        }
        fail(l, "startswith/endswith need a string or a tuple of strings");
      });
    }
    if (name == "upper") return fn([s](Args&, int) { return Value::str(text::utf8_upper(s)); });
    if (name == "lower") return fn([s](Args&, int) { return Value::str(text::utf8_lower(s)); });
    if (name == "title") return fn([s](Args&, int) { return Value::str(title_case(s)); });
    if (name == "capitalize") return fn([s](Args&, int) { return Value::str(capitalize(s)); });
    if (name == "replace")
      return fn([s](Args& a, int l) {
        const Value* cnt = a.get(2, "count");
        return Value::str(replace_all(s, arg_str(a, 0, "old", "", l), arg_str(a, 1, "new", "", l),
                                      cnt && cnt->t == Value::Int ? cnt->i : -1));
      });
    if (name == "find" || name == "count" || name == "rfind" || name == "index") {
      std::string nm = name;
      return fn([s, nm](Args& a, int l) {
        std::string sub = arg_str(a, 0, "sub", "", l);
        if (nm == "count") {
          if (sub.empty()) return Value::integer(static_cast<int64_t>(text::utf8_length(s)) + 1);
          int64_t c = 0;
          for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++c;
          return Value::integer(c);
        }
        size_t p = nm == "rfind" ? s.rfind(sub) : s.find(sub);
        if (p == std::string::npos) {
          if (nm == "index") fail(l, "substring not found");
          return Value::integer(-1);
        }
        return Value::integer(static_cast<int64_t>(text::utf8_length(s.substr(0, p))));
      });
    }
    if (name == "join")
      return fn([s](Args& a, int l) {
        const Value* it = a.get(0, "iterable");
        if (!it) fail(l, "join() needs an argument");
        std::string out;
        bool first = true;
        for (const auto& x : Interp::static_iterate(*it, l)) {
          if (!first) out += s;
          first = false;
          if (x.t != Value::Str) fail(l, "join() items must be strings");
          out += x.s;
          check_string(out.size());
        }
        return Value::str(std::move(out));
      });
    if (name == "format")
      return fn([s](Args& a, int l) {
        std::string out;
        size_t auto_idx = 0;
        for (size_t k = 0; k < s.size(); ++k) {
          char c = s[k];
          if (c == '{' && k + 1 < s.size() && s[k + 1] == '{') {
            out += '{';
            ++k;
          } else if (c == '}' && k + 1 < s.size() && s[k + 1] == '}') {
            out += '}';
            ++k;
          } else if (c == '{') {
            size_t e = s.find('}', k);
            if (e == std::string::npos) fail(l, "format(): unmatched '{'");
            std::string field = s.substr(k + 1, e - k - 1);
            if (field.find_first_of(":!.[") != std::string::npos)
              fail(l, "format(): format specs and conversions are not supported ('{" + field + "}')");
            const Value* v = nullptr;
            if (field.empty()) {
              if (auto_idx >= a.pos.size()) fail(l, "format(): not enough arguments");
              v = &a.pos[auto_idx++];
            } else if (std::all_of(field.begin(), field.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); })) {
              size_t idx = SIZE_MAX;
              std::from_chars(field.data(), field.data() + field.size(), idx);  // (idx stays SIZE_MAX on overflow)
              if (idx >= a.pos.size()) fail(l, "format(): argument index out of range");
              v = &a.pos[idx];
            } else {
              for (const auto& [kk, vv] : a.kw)
                if (kk == field) v = &vv;
              if (!v) fail(l, "format(): missing argument '" + field + "'");
            }
            out += to_str(*v);
            check_string(out.size());
            k = e;
          } else {
            out += c;
          }
        }
        return Value::str(std::move(out));
      });
    if (name == "isspace" || name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isupper" ||
        name == "islower") {
      std::string nm = name;
      return fn([s, nm](Args&, int) {
        if (s.empty()) return Value::boolean(false);
        if (nm == "isupper") return Value::boolean(text::utf8_upper(s) == s && text::utf8_lower(s) != s);
        if (nm == "islower") return Value::boolean(text::utf8_lower(s) == s && text::utf8_upper(s) != s);
        for (uint32_t c : cps_of(s)) {
          bool ok = nm == "isspace" ? text::py_isspace(c)
                    : nm == "isdigit" ? (c >= '0' && c <= '9')
                    : nm == "isalpha" ? ((c | 32) >= 'a' && (c | 32) <= 'z') || c >= 0x80
                                      : ((c | 32) >= 'a' && (c | 32) <= 'z') || (c >= '0' && c <= '9') || c >= 0x80;
          if (!ok) return Value::boolean(false);
        }
        return Value::boolean(true);
      });
    }
    (void)line;
    return Value::undef(name);
  }

  static List static_iterate(const Value& v, int line) {
    Interp tmp;
    return tmp.iterate(v, line);
  }

  Value dict_method(const Value& obj, const std::string& name) {
    auto d = obj.d;
    if (name == "items")
      return make_fn("dict.items", [d](Interp&, Args&, int) {
        List l;
        for (const auto& [k, v] : d->items) l.push_back(Value::list({Value::str(k), v}));
        return Value::list(std::move(l));
      });
    if (name == "keys")
      return make_fn("dict.keys", [d](Interp&, Args&, int) {
        List l;
        for (const auto& kv : d->items) l.push_back(Value::str(kv.first));
        return Value::list(std::move(l));
      });
    if (name == "values")
      return make_fn("dict.values", [d](Interp&, Args&, int) {
        List l;
        for (const auto& kv : d->items) l.push_back(kv.second);
        return Value::list(std::move(l));
      });
    if (name == "get")
      return make_fn("dict.get", [d](Interp&, Args& a, int l) {
        if (a.pos.empty()) fail(l, "get() needs a key");
        const Value& k = a.pos[0];
        Value* v = d->find(k.t == Value::Str ? k.s : to_str(k));
        if (v) return *v;
        return a.pos.size() > 1 ? a.pos[1] : Value::none();
      });
    return Value::undef(name);
  }

  Value list_method(const Value& obj, const std::string& name) {
    auto l = obj.l;
    if (name == "append")
      return make_fn("list.append", [l](Interp&, Args& a, int line) {
        if (a.pos.size() != 1) fail(line, "append() takes one argument");
        grow_list(l, 1);
        l->push_back(a.pos[0]);
        return Value::none();
      });
    if (name == "extend")
      return make_fn("list.extend", [l](Interp& in, Args& a, int line) {
        if (a.pos.size() != 1) fail(line, "extend() takes one argument");
        List items = in.iterate(a.pos[0], line);
        grow_list(l, items.size());
        for (auto& x : items) l->push_back(std::move(x));
        return Value::none();
      });
    if (name == "pop")
      return make_fn("list.pop", [l](Interp&, Args& a, int line) {
        if (l->empty()) fail(line, "pop from empty list");
        int64_t n = static_cast<int64_t>(l->size()), idx = n - 1;
        if (!a.pos.empty() && a.pos[0].t == Value::Int) idx = a.pos[0].i < 0 ? a.pos[0].i + n : a.pos[0].i;
        if (idx < 0 || idx >= n) fail(line, "pop index out of range");
        Value v = (*l)[static_cast<size_t>(idx)];
        l->erase(l->begin() + idx);
        return v;
      });
    if (name == "insert")
      return make_fn("list.insert", [l](Interp&, Args& a, int line) {
        if (a.pos.size() != 2 || a.pos[0].t != Value::Int) fail(line, "insert() takes an index and a value");
        int64_t n = static_cast<int64_t>(l->size()), idx = a.pos[0].i < 0 ? a.pos[0].i + n : a.pos[0].i;
        idx = std::clamp<int64_t>(idx, 0, n);
        grow_list(l, 1);
        l->insert(l->begin() + idx, a.pos[1]);
        return Value::none();
      });
    if (name == "index" || name == "count")
      return make_fn("list." + name, [l, name](Interp&, Args& a, int line) {
        if (a.pos.empty()) fail(line, name + "() needs an argument");
        int64_t c = 0;
        for (size_t k = 0; k < l->size(); ++k)
          if (equal((*l)[k], a.pos[0])) {
            if (name == "index") return Value::integer(static_cast<int64_t>(k));
            ++c;
          }
        if (name == "index") fail(line, "value is not in list");
        return Value::integer(c);
      });
    return Value::undef(name);
  }

  // ---- filters ----
  Value attr_path(const Value& v, const std::string& path, int line) {
    Value cur = v;
    size_t pos = 0;
    while (pos <= path.size()) {
      size_t dot = path.find('.', pos);
      std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
      bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
      int64_t idx = INT64_MAX;  // (an index too long for 64 bits is out of range, as INT64_MAX is)
      if (digits) std::from_chars(part.data(), part.data() + part.size(), idx);
      cur = digits ? get_item(cur, Value::integer(idx), line) : get_item(cur, Value::str(part), line);
      if (dot == std::string::npos) break;
      pos = dot + 1;
    }
    return cur;
  }

  // int(x) of a float: NaN, infinities and values beyond 64 bits are errors (a cast would be undefined).
  static Value float_to_int(double x, int line) {
    if (!(x > -9223372036854775808.0 && x < 9223372036854775808.0))
      fail(line, "cannot convert float " + py_float(x) + " to integer");
    return Value::integer(static_cast<int64_t>(x));
  }

  static int64_t length_of(const Value& v, int line) {
    switch (v.t) {
      case Value::Undef: return 0;
      case Value::Str: return static_cast<int64_t>(text::utf8_length(v.s));
      case Value::Lst: return static_cast<int64_t>(v.l->size());
      case Value::Dct: return static_cast<int64_t>(v.d->items.size());
      default: fail(line, std::string("object of type '") + type_name(v) + "' has no len()");
    }
  }

  Value apply_filter(const Expr& f, Value v, const std::shared_ptr<Scope>& sc) {
    Args a = eval_args(f, sc);
    const std::string& n = f.name;
    const int line = f.line;
    if (n == "default" || n == "d") {
      const Value* dflt = a.get(0, "default_value");
      const Value* boolean = a.get(1, "boolean");
      bool use = v.t == Value::Undef || (boolean && truthy(*boolean) && !truthy(v));
      return use ? (dflt ? *dflt : Value::str("")) : v;
    }
    if (n == "length" || n == "count") return Value::integer(length_of(v, line));
    if (n == "string") return Value::str(to_str(v));
    if (n == "safe") return v;
    if (n == "trim") return Value::str(strip(to_str(v), a.get(0, "chars"), true, true));
    if (n == "upper") return Value::str(text::utf8_upper(to_str(v)));
    if (n == "lower") return Value::str(text::utf8_lower(to_str(v)));
    if (n == "capitalize") return Value::str(capitalize(to_str(v)));
    if (n == "title") return Value::str(title_case(to_str(v)));
    if (n == "tojson") {
      const Value* ind = a.get(0, "indent");
      std::string out;
      to_json(out, v, ind && ind->t == Value::Int ? static_cast<int>(ind->i) : -1, 0);
      return Value::str(std::move(out));
    }
    if (n == "replace") {
      const Value* cnt = a.get(2, "count");
      return Value::str(replace_all(to_str(v), arg_str(a, 0, "old", "", line), arg_str(a, 1, "new", "", line),
                                    cnt && cnt->t == Value::Int ? cnt->i : -1));
    }
    if (n == "escape" || n == "e") {
      std::string out;
      for (char c : to_str(v)) {
        switch (c) {
          case '&': out += "&amp;"; break;
          case '<': out += "&lt;"; break;
          case '>': out += "&gt;"; break;
          case '"': out += "&#34;"; break;
          case '\'': out += "&#39;"; break;
          default: out += c;
        }
        check_string(out.size());
      }
      return Value::str(std::move(out));
    }
    if (n == "wordcount") return Value::integer(static_cast<int64_t>(split(to_str(v), nullptr, -1, false, line).size()));
    if (n == "indent") {
      const Value* w = a.get(0, "width");
      const Value* first = a.get(1, "first");
      const Value* blank = a.get(2, "blank");
      const int64_t width = w && w->t == Value::Int ? std::max<int64_t>(0, w->i) : 4;
      if (!(w && w->t == Value::Str)) check_string(static_cast<uint64_t>(width));
      std::string pad = w && w->t == Value::Str ? w->s : std::string(static_cast<size_t>(width), ' ');
      std::string s = to_str(v), out;
      size_t pos = 0;
      bool first_line = true;
      for (;;) {
        size_t nl = s.find('\n', pos);
        std::string ln = s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
        bool do_pad = first_line ? (first && truthy(*first)) : (!ln.empty() || (blank && truthy(*blank)));
        out += (do_pad ? pad : "") + ln;
        check_string(out.size());
        if (nl == std::string::npos) break;
        out += '\n';
        pos = nl + 1;
        first_line = false;
      }
      return Value::str(std::move(out));
    }
    if (n == "first" || n == "last") {
      if (v.t == Value::Str) {
        auto ch = chars_of(v.s);
        if (ch.empty()) return Value::undef();
        return Value::str(n == "first" ? ch.front() : ch.back());
      }
      List l = iterate(v, line);
      if (l.empty()) return Value::undef();
      return n == "first" ? l.front() : l.back();
    }
    if (n == "list") return Value::list(iterate(v, line));
    if (n == "items") {
      if (v.t == Value::Undef) return Value::list();
      if (v.t != Value::Dct) fail(line, std::string("items filter needs a mapping, got ") + type_name(v));
      List l;
      for (const auto& [k, x] : v.d->items) l.push_back(Value::list({Value::str(k), x}));
      return Value::list(std::move(l));
    }
    if (n == "dictsort") {
      if (v.t != Value::Dct) fail(line, std::string("dictsort needs a mapping, got ") + type_name(v));
      const Value* cs = a.get(0, "case_sensitive");
      const Value* by = a.get(1, "by");
      const Value* rev = a.get(2, "reverse");
      bool case_sens = cs && truthy(*cs), by_value = by && by->t == Value::Str && by->s == "value";
      List l;
      for (const auto& [k, x] : v.d->items) l.push_back(Value::list({Value::str(k), x}));
      auto key = [&](const Value& p) {
        Value k = (*p.l)[by_value ? 1 : 0];
        if (!case_sens && k.t == Value::Str) k.s = text::utf8_lower(k.s);
        return k;
      };
      std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) { return compare(key(x), key(y), line) < 0; });
      if (rev && truthy(*rev)) std::reverse(l.begin(), l.end());
      return Value::list(std::move(l));
    }
    if (n == "join") {
      std::string sep = arg_str(a, 0, "d", "", line);
      const Value* attr = a.get(1, "attribute");
      std::string out;
      bool first = true;
      for (const auto& x : iterate(v, line)) {
        if (!first) out += sep;
        first = false;
        out += to_str(attr && attr->t == Value::Str ? attr_path(x, attr->s, line) : x);
        check_string(out.size());
      }
      return Value::str(std::move(out));
    }
    if (n == "reverse") {
      if (v.t == Value::Str) {
        auto ch = chars_of(v.s);
        std::string out;
        for (auto it = ch.rbegin(); it != ch.rend(); ++it) out += *it;
        return Value::str(std::move(out));
      }
      List l = iterate(v, line);
      std::reverse(l.begin(), l.end());
      return Value::list(std::move(l));
    }
    if ((n == "map" || n == "select" || n == "reject" || n == "selectattr" || n == "rejectattr") && !truthy(v))
      return Value::list();  // Jinja2 yields nothing for a falsy input (e.g. none)
    if (n == "map") {
      List l = iterate(v, line), out;
      if (const Value* attr = a.get(99, "attribute")) {
        const Value* dflt = a.get(99, "default");
        for (const auto& x : l) {
          Value r = attr_path(x, to_str(*attr), line);
          out.push_back(r.t == Value::Undef && dflt ? *dflt : r);
        }
        return Value::list(std::move(out));
      }
      if (a.pos.empty() || a.pos[0].t != Value::Str) fail(line, "map needs a filter name or attribute=");
      Expr sub;
      sub.k = Expr::Filter;
      sub.line = line;
      sub.name = a.pos[0].s;
      if (!known(kFilters, sub.name)) fail(line, "unsupported filter '" + sub.name + "'");
      std::vector<Value> extra(a.pos.begin() + 1, a.pos.end());
      for (const auto& x : l) out.push_back(apply_filter_values(sub.name, x, extra, line, sc));
      return Value::list(std::move(out));
    }
    if (n == "select" || n == "reject" || n == "selectattr" || n == "rejectattr") {
      bool attr_mode = n == "selectattr" || n == "rejectattr", keep_if = n == "select" || n == "selectattr";
      size_t ti = 0;
      std::string attr;
      if (attr_mode) {
        if (a.pos.empty() || a.pos[0].t != Value::Str) fail(line, n + " needs an attribute name");
        attr = a.pos[0].s;
        ti = 1;
      }
      std::string test = a.pos.size() > ti && a.pos[ti].t == Value::Str ? a.pos[ti].s : "";
      if (!test.empty() && !known(kTests, test)) fail(line, "unsupported test '" + test + "'");
      std::vector<Value> targs(a.pos.begin() + static_cast<ptrdiff_t>(std::min(a.pos.size(), ti + 1)), a.pos.end());
      List out;
      for (const auto& x : iterate(v, line)) {
        Value subject = attr_mode ? attr_path(x, attr, line) : x;
        bool r = test.empty() ? truthy(subject) : test_values(test, subject, targs, line);
        if (r == keep_if) out.push_back(x);
      }
      return Value::list(std::move(out));
    }
    if (n == "unique") {
      const Value* attr = a.get(1, "attribute");
      const Value* cs = a.get(0, "case_sensitive");
      List out, keys;
      for (const auto& x : iterate(v, line)) {
        Value k = attr && attr->t == Value::Str ? attr_path(x, attr->s, line) : x;
        if (!(cs && truthy(*cs)) && k.t == Value::Str) k.s = text::utf8_lower(k.s);
        bool seen = false;
        for (const auto& y : keys) seen |= equal(y, k);
        if (!seen) {
          keys.push_back(k);
          out.push_back(x);
        }
      }
      return Value::list(std::move(out));
    }
    if (n == "sort") {
      const Value* rev = a.get(0, "reverse");
      const Value* cs = a.get(1, "case_sensitive");
      const Value* attr = a.get(2, "attribute");
      List l = iterate(v, line);
      auto key = [&](const Value& x) {
        Value k = attr && attr->t == Value::Str ? attr_path(x, attr->s, line) : x;
        if (!(cs && truthy(*cs)) && k.t == Value::Str) k.s = text::utf8_lower(k.s);
        return k;
      };
      std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) { return compare(key(x), key(y), line) < 0; });
      if (rev && truthy(*rev)) std::reverse(l.begin(), l.end());
      return Value::list(std::move(l));
    }
    if (n == "sum") {
      const Value* attr = a.get(0, "attribute");
      const Value* start = a.get(1, "start");
      Value acc = start ? *start : Value::integer(0);
      for (const auto& x : iterate(v, line)) acc = binary("+", acc, attr && attr->t == Value::Str ? attr_path(x, attr->s, line) : x, line);
      return acc;
    }
    if (n == "max" || n == "min") {
      const Value* cs = a.get(0, "case_sensitive");
      const Value* attr = a.get(1, "attribute");
      List l = iterate(v, line);
      if (l.empty()) return Value::undef();
      auto key = [&](const Value& x) {
        Value k = attr && attr->t == Value::Str ? attr_path(x, attr->s, line) : x;
        if (!(cs && truthy(*cs)) && k.t == Value::Str) k.s = text::utf8_lower(k.s);
        return k;
      };
      size_t best = 0;
      for (size_t k = 1; k < l.size(); ++k) {
        int c = compare(key(l[k]), key(l[best]), line);
        if (n == "max" ? c > 0 : c < 0) best = k;
      }
      return l[best];
    }
    if (n == "abs") {
      if (v.t == Value::Int) return Value::integer(v.i < 0 ? -v.i : v.i);
      if (v.t == Value::Float) return Value::real(std::fabs(v.f));
      fail(line, std::string("bad operand type for abs(): ") + type_name(v));
    }
    if (n == "int") {
      const Value* dflt = a.get(0, "default");
      Value d = dflt ? *dflt : Value::integer(0);
      if (v.t == Value::Int) return v;
      if (v.t == Value::Bool) return Value::integer(v.b);
      if (v.t == Value::Float) return float_to_int(v.f, line);
      if (v.t == Value::Str) {
        std::string s = strip(v.s, nullptr, true, true);
        int64_t x = 0;
        auto r = std::from_chars(s.data(), s.data() + s.size(), x);
        if (r.ec == std::errc() && r.ptr == s.data() + s.size()) return Value::integer(x);
        char* end = nullptr;
        double f2 = std::strtod(s.c_str(), &end);
        if (!s.empty() && end && *end == '\0') return float_to_int(f2, line);
      }
      return d;
    }
    if (n == "float") {
      const Value* dflt = a.get(0, "default");
      if (v.is_num()) return Value::real(v.num());
      if (v.t == Value::Str) {
        std::string s = strip(v.s, nullptr, true, true);
        char* end = nullptr;
        double x = std::strtod(s.c_str(), &end);
        if (!s.empty() && end && *end == '\0') return Value::real(x);
      }
      return dflt ? *dflt : Value::real(0.0);
    }
    if (n == "round") {
      const Value* prec = a.get(0, "precision");
      const Value* method = a.get(1, "method");
      int p = prec && prec->t == Value::Int ? static_cast<int>(prec->i) : 0;
      std::string m = method && method->t == Value::Str ? method->s : "common";
      double scale = std::pow(10.0, p), x = v.num() * scale;
      double r = m == "ceil" ? std::ceil(x) : m == "floor" ? std::floor(x) : std::nearbyint(x);  // half to even, as Python
      return Value::real(r / scale);
    }
    if (n == "attr") {
      std::string name = arg_str(a, 0, "name", "", line);
      return get_attr(v, name, line);
    }
    fail(line, "unsupported filter '" + n + "'");
  }

  Value apply_filter_values(const std::string& name, const Value& v, const std::vector<Value>& args, int line,
                            const std::shared_ptr<Scope>& sc) {
    Expr f;
    f.k = Expr::Filter;
    f.line = line;
    f.name = name;
    for (const auto& x : args) {
      auto lit = std::make_unique<Expr>();
      lit->k = Expr::Lit;
      lit->line = line;
      lit->lit = x;
      f.args.push_back(std::move(lit));
    }
    return apply_filter(f, v, sc);
  }

  // ---- tests ----
  bool apply_test(const Expr& t, const Value& v, const std::shared_ptr<Scope>& sc) {
    Args a = eval_args(t, sc);
    return test_values(t.name, v, a.pos, t.line);
  }

  bool test_values(const std::string& n, const Value& v, const std::vector<Value>& args, int line) {
    auto arg = [&]() -> const Value& {
      if (args.empty()) fail(line, "test '" + n + "' needs an argument");
      return args[0];
    };
    if (n == "defined") return v.t != Value::Undef;
    if (n == "undefined") return v.t == Value::Undef;
    if (n == "none") return v.t == Value::None;
    if (n == "string") return v.t == Value::Str;
    if (n == "number") return v.t == Value::Int || v.t == Value::Float || v.t == Value::Bool;
    if (n == "integer") return v.t == Value::Int;
    if (n == "float") return v.t == Value::Float;
    if (n == "boolean") return v.t == Value::Bool;
    if (n == "true") return v.t == Value::Bool && v.b;
    if (n == "false") return v.t == Value::Bool && !v.b;
    if (n == "mapping") return v.t == Value::Dct && v.d->kind == Dict::Plain;
    if (n == "iterable") return v.t == Value::Lst || v.t == Value::Str || v.t == Value::Dct || v.t == Value::Undef;
    if (n == "sequence") return v.t == Value::Lst || v.t == Value::Str || (v.t == Value::Dct && v.d->kind == Dict::Plain);
    if (n == "callable") return v.t == Value::Fn;
    if (n == "lower") return v.t == Value::Str && text::utf8_lower(v.s) == v.s;
    if (n == "upper") return v.t == Value::Str && text::utf8_upper(v.s) == v.s;
    if (n == "even" || n == "odd") {
      if (v.t != Value::Int) fail(line, "test '" + n + "' needs an integer");
      return (v.i % 2 == 0) == (n == "even");
    }
    if (n == "divisibleby") {
      const Value& d = arg();
      if (v.t != Value::Int || d.t != Value::Int || d.i == 0) fail(line, "divisibleby needs non-zero integers");
      return v.i % d.i == 0;
    }
    if (n == "eq" || n == "equalto" || n == "==") return equal(v, arg());
    if (n == "ne" || n == "!=") return !equal(v, arg());
    if (n == "lt" || n == "<" || n == "lessthan") return compare(v, arg(), line) < 0;
    if (n == "le" || n == "<=") return compare(v, arg(), line) <= 0;
    if (n == "gt" || n == ">" || n == "greaterthan") return compare(v, arg(), line) > 0;
    if (n == "ge" || n == ">=") return compare(v, arg(), line) >= 0;
    if (n == "in") return contains(arg(), v, line);
    if (n == "sameas") {
      const Value& o = arg();
      if (v.t != o.t) return false;
      switch (v.t) {
        case Value::None: case Value::Undef: return true;
        case Value::Bool: return v.b == o.b;
        case Value::Lst: return v.l == o.l;
        case Value::Dct: return v.d == o.d;
        default: return equal(v, o);
      }
    }
    fail(line, "unsupported test '" + n + "'");
  }
};

// Globals every render sees.
void add_globals(Scope& g) {
  g.vars["raise_exception"] = make_fn("raise_exception", [](Interp&, Args& a, int line) -> Value {
    std::string msg = a.pos.empty() ? std::string("(no message)") : to_str(a.pos[0]);
    throw Error("chat template raised an exception (line " + std::to_string(line) + "): " + msg);
  });
  g.vars["range"] = make_fn("range", [](Interp&, Args& a, int line) {
    int64_t start = 0, stop = 0, step = 1;
    for (const auto& x : a.pos)
      if (x.t != Value::Int && x.t != Value::Bool) fail(line, "range() arguments must be integers");
    auto iv = [](const Value& x) { return x.t == Value::Int ? x.i : static_cast<int64_t>(x.b); };
    if (a.pos.size() == 1) stop = iv(a.pos[0]);
    else if (a.pos.size() >= 2) {
      start = iv(a.pos[0]);
      stop = iv(a.pos[1]);
      if (a.pos.size() >= 3) step = iv(a.pos[2]);
    } else fail(line, "range() needs arguments");
    if (step == 0) fail(line, "range() step cannot be zero");
    List l;
    const size_t max_items = t_budget ? t_budget->lim.max_items : 10'000'000;
    for (int64_t k = start; step > 0 ? k < stop : k > stop;) {
      if (l.size() >= max_items) fail(line, "range() has more than " + std::to_string(max_items) + " items");
      l.push_back(Value::integer(k));
      if (__builtin_add_overflow(k, step, &k)) break;  // (past the end of either direction)
    }
    return Value::list(std::move(l));
  });
  g.vars["namespace"] = make_fn("namespace", [](Interp&, Args& a, int line) {
    Value ns = Value::dict();
    ns.d->kind = Dict::Namespace;
    for (const auto& x : a.pos) {
      if (x.t != Value::Dct) fail(line, "namespace() positional arguments must be mappings");
      for (const auto& [k, v] : x.d->items) ns.d->set(k, v);
    }
    for (const auto& [k, v] : a.kw) ns.d->set(k, v);
    return ns;
  });
  g.vars["dict"] = make_fn("dict", [](Interp&, Args& a, int line) {
    Value d = Value::dict();
    for (const auto& x : a.pos) {
      if (x.t != Value::Dct) fail(line, "dict() positional arguments must be mappings");
      for (const auto& [k, v] : x.d->items) d.d->set(k, v);
    }
    for (const auto& [k, v] : a.kw) d.d->set(k, v);
    return d;
  });
  g.vars["strftime_now"] = make_fn("strftime_now", [](Interp&, Args& a, int line) {
    if (a.pos.empty() || a.pos[0].t != Value::Str) fail(line, "strftime_now() needs a format string");
    std::time_t now = std::time(nullptr);
    std::tm tmv{};
    localtime_r(&now, &tmv);
    char buf[256];
    size_t n = std::strftime(buf, sizeof(buf), a.pos[0].s.c_str(), &tmv);
    return Value::str(std::string(buf, n));
  });
}

}  // namespace

struct Template::Program {
  Body body;
};

Template::Template(std::string_view source) : prog_(std::make_unique<Program>()) {
  Lexer lx(source);
  Parser ps(lx.run());
  prog_->body = ps.parse_template();
}

Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

namespace {
// Installs a render's budget for this thread and, when the render ends (also by an error), empties the
// containers the template changed, which frees any reference cycle among them.
struct BudgetScope {
  Budget b;
  Budget* prev;
  explicit BudgetScope(const Limits& lim) : prev(t_budget) {
    b.lim = lim;
    t_budget = &b;
  }
  ~BudgetScope() {
    t_budget = prev;  // (nothing below is charged)
    for (auto& w : b.changed_lists)
      if (auto l = w.lock()) List().swap(*l);
    for (auto& w : b.changed_dicts)
      if (auto d = w.lock()) decltype(d->items)().swap(d->items);
  }
  BudgetScope(const BudgetScope&) = delete;
  BudgetScope& operator=(const BudgetScope&) = delete;
};
}  // namespace

std::string Template::render(const nlohmann::ordered_json& context, const Limits& limits) const {
  BudgetScope budget(limits);  // (first, so that it ends after every value of the render)
  Interp in;
  auto globals = std::make_shared<Scope>();
  add_globals(*globals);
  auto root = std::make_shared<Scope>();
  root->parent = globals;
  if (context.is_object())
    for (const auto& [k, v] : context.items()) root->vars[k] = from_json(v);
  else if (!context.is_null())
    throw Error("chat template: the render context must be a JSON object");
  in.root = root;
  std::string out;
  in.exec(prog_->body, root, out);
  return out;
}

}  // namespace fitmoe::jinja

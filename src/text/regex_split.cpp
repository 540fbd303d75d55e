#include "text/regex_split.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstring>

#include "runtime/error.h"
#include "text/unicode.h"

namespace fitmoe::text {

struct RegexSplitter::Compiled {
  pcre2_code* code = nullptr;
  bool jit = false;
  std::string pattern;
  ~Compiled() {
    if (code) pcre2_code_free(code);
  }
};

namespace {

// Per-thread match state: match data big enough for any of our patterns, a JIT stack that can grow to
// 8 MiB, and a match context for the interpreter fallback with a generous heap limit.
struct MatchState {
  pcre2_match_data* md = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  pcre2_match_context* mctx = nullptr;
  MatchState() {
    md = pcre2_match_data_create(32, nullptr);
    jit_stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    mctx = pcre2_match_context_create(nullptr);
    if (!md || !mctx) throw Error("pcre2: out of memory");
    if (jit_stack) pcre2_jit_stack_assign(mctx, nullptr, jit_stack);
    pcre2_set_heap_limit(mctx, 1024 * 1024);  // KiB: 1 GiB for pathological backtracking
  }
  ~MatchState() {
    pcre2_match_data_free(md);
    pcre2_match_context_free(mctx);
    if (jit_stack) pcre2_jit_stack_free(jit_stack);
  }
};

MatchState& match_state() {
  thread_local MatchState s;
  return s;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  if (pcre2_get_error_message(code, buf, sizeof(buf)) < 0) return "error " + std::to_string(code);
  return reinterpret_cast<const char*>(buf);
}

}  // namespace

RegexSplitter::RegexSplitter(const std::vector<std::string>& patterns) {
  for (const auto& p : patterns) {
    auto c = std::make_unique<Compiled>();
    c->pattern = p;
    int err = 0;
    PCRE2_SIZE eoff = 0;
    c->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), PCRE2_UTF | PCRE2_UCP, &err, &eoff,
                            nullptr);
    if (!c->code)
      throw Error("pre-tokenizer regex does not compile at offset " + std::to_string(eoff) + ": " +
                  pcre2_message(err) + ": " + p);
    c->jit = pcre2_jit_compile(c->code, PCRE2_JIT_COMPLETE) == 0;
    res_.push_back(std::move(c));
  }
}

RegexSplitter::~RegexSplitter() = default;

void RegexSplitter::split(std::string_view subject, std::vector<Piece>& out) const {
  MatchState& ms = match_state();
  std::vector<Piece> cur{{0, static_cast<uint32_t>(subject.size())}}, next;
  if (subject.empty()) return;
  for (size_t r = 0; r < res_.size(); ++r) {
    const Compiled& c = *res_[r];
    std::vector<Piece>& dst = (r + 1 == res_.size()) ? out : next;
    if (&dst == &next) next.clear();
    for (const Piece& pc : cur) {
      const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data() + pc.off);
      const PCRE2_SIZE n = pc.len;
      PCRE2_SIZE pos = 0, prev = 0;
      while (pos < n) {
        int rc = c.jit ? pcre2_jit_match(c.code, s, n, pos, 0, ms.md, ms.mctx)
                       : pcre2_match(c.code, s, n, pos, PCRE2_NO_UTF_CHECK, ms.md, ms.mctx);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT)  // deep backtracking: the interpreter keeps its frames on the heap
          rc = pcre2_match(c.code, s, n, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, ms.md, ms.mctx);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) throw Error("pre-tokenizer regex failed: " + pcre2_message(rc));
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ms.md);
        PCRE2_SIZE b = ov[0], e = ov[1];
        if (b > prev) dst.push_back({pc.off + static_cast<uint32_t>(prev), static_cast<uint32_t>(b - prev)});
        if (e > b) {
          dst.push_back({pc.off + static_cast<uint32_t>(b), static_cast<uint32_t>(e - b)});
          prev = pos = e;
        } else {
          // Empty match: step over one character and go on (none of the built-in patterns does this).
          pos = b + static_cast<PCRE2_SIZE>(utf8_len_from_lead(s[b]));
          if (pos > n) pos = n;
        }
      }
      if (prev < n) dst.push_back({pc.off + static_cast<uint32_t>(prev), static_cast<uint32_t>(n - prev)});
    }
    if (&dst == &next) cur.swap(next);
  }
  if (res_.empty()) out.push_back({0, static_cast<uint32_t>(subject.size())});
}

std::string_view prepare_subject(std::string_view text, std::string& scratch) {
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  bool copied = false;
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    size_t at = i;
    uint32_t cp;
    decode_lenient(text, i, cp);
    uint32_t r = class_stand_in(cp);
    if (!r) continue;
    if (!copied) {
      scratch.assign(text.data(), n);
      copied = true;
    }
    std::string enc;
    append_utf8(enc, r);
    if (enc.size() == i - at) std::memcpy(scratch.data() + at, enc.data(), enc.size());
  }
  return copied ? std::string_view(scratch) : text;
}

}  // namespace fitmoe::text

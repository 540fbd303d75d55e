// Pre-tokenizer splitting with PCRE2 (JIT, UTF + Unicode properties).
//
// A pre-tokenizer is a list of regexes applied one after the other, like the reference does: the first
// splits the text into matches and the gaps between them; every later regex splits each piece again.
// Matching never looks outside the piece it splits.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace fitmoe::text {

struct Piece {
  uint32_t off, len;
};

class RegexSplitter {
 public:
  // Compiles every pattern (PCRE2_UTF | PCRE2_UCP, JIT when available); throws fitmoe::Error naming the
  // pattern and PCRE2's message when one does not compile.
  explicit RegexSplitter(const std::vector<std::string>& patterns);
  ~RegexSplitter();
  RegexSplitter(const RegexSplitter&) = delete;
  RegexSplitter& operator=(const RegexSplitter&) = delete;

  // subject must be valid UTF-8 (see prepare_subject). Appends pieces covering [0, subject.size()).
  void split(std::string_view subject, std::vector<Piece>& out) const;

 private:
  struct Compiled;
  std::vector<std::unique_ptr<Compiled>> res_;
};

// The text PCRE2 matches. `text` is what will be tokenized: valid UTF-8, except that it may hold
// UTF-16 surrogates that lenient decoding let through. When some code point needs a class stand-in (see
// unicode.h) a same-length copy with the stand-ins is written to `scratch` and returned; otherwise
// `text` itself is returned. Byte offsets are identical in both.
std::string_view prepare_subject(std::string_view text, std::string& scratch);

}  // namespace fitmoe::text

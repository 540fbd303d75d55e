// libFuzzer target for the tokenizers (text/tokenizer.cpp with the pre-tokenizer regexes, byte-level
// BPE, SentencePiece with byte fallback, NFC): arbitrary bytes are encoded and decoded with real
// vocabularies, and arbitrary ids are decoded, one piece at a time too.
//
// The vocabularies are the GGUFs named in FITMOE_FUZZ_VOCABS (':'-separated paths; scripts/test.sh
// passes ../shared/testdata/tokenizers/{qwen3,gemma3}-vocab.gguf, a byte-level BPE and a SentencePiece
// vocabulary), loaded once. The first input byte picks the vocabulary and the flags; the rest is text.
// encode must give ids inside the vocabulary; decode of any id list either works or throws
// fitmoe::Error (ids outside the vocabulary); nothing else may escape or crash.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "format/gguf.h"
#include "runtime/error.h"
#include "text/tokenizer.h"

namespace {

std::vector<std::unique_ptr<fitmoe::Tokenizer>> load() {
  std::vector<std::unique_ptr<fitmoe::Tokenizer>> out;
  const char* env = std::getenv("FITMOE_FUZZ_VOCABS");
  std::string paths = env ? env : "";
  size_t pos = 0;
  while (pos <= paths.size() && !paths.empty()) {
    size_t colon = paths.find(':', pos);
    std::string p = paths.substr(pos, colon == std::string::npos ? std::string::npos : colon - pos);
    if (!p.empty()) out.push_back(fitmoe::Tokenizer::from_gguf(*fitmoe::gguf::File::open(p)));
    if (colon == std::string::npos) break;
    pos = colon + 1;
  }
  if (out.empty()) {
    std::fprintf(stderr, "fuzz_tokenizer: set FITMOE_FUZZ_VOCABS to one or more vocabulary GGUFs\n");
    std::abort();
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto toks = load();
  if (size == 0) return 0;
  const fitmoe::Tokenizer& tok = *toks[data[0] % toks.size()];
  const bool add_special = data[0] & 0x10, parse_special = data[0] & 0x20, special = data[0] & 0x40;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);

  std::vector<int32_t> ids = tok.encode(text, add_special, parse_special);
  for (int32_t id : ids)
    if (id < 0 || id >= tok.n_vocab()) std::abort();  // encode made an id outside the vocabulary
  (void)tok.decode(ids, special);
  fitmoe::StreamDecoder sd(tok);
  for (int32_t id : ids) (void)sd.push(id);
  (void)sd.flush();

  // The same bytes read as token ids, mostly inside the vocabulary, some outside.
  std::vector<int32_t> raw;
  for (size_t k = 1; k + 4 <= size; k += 4) {
    uint32_t v = static_cast<uint32_t>(data[k]) | static_cast<uint32_t>(data[k + 1]) << 8 |
                 static_cast<uint32_t>(data[k + 2]) << 16 | static_cast<uint32_t>(data[k + 3]) << 24;
    raw.push_back(v & 0x80000000u ? static_cast<int32_t>(v) : static_cast<int32_t>(v % (tok.n_vocab() + 8)));
  }
  try {
    (void)tok.decode(raw, special);
  } catch (const fitmoe::Error&) {
  }
  fitmoe::StreamDecoder sd2(tok);
  for (int32_t id : raw) {
    try {
      (void)sd2.push(id);
    } catch (const fitmoe::Error&) {
    }
  }
  (void)sd2.flush();
  return 0;
}

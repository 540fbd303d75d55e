// Tokenizer implementation. The algorithms follow llama.cpp's llama-vocab.cpp behaviour (which the test
// vectors in ../shared/testdata/tokenizers pin down); the code is our own:
//  - special-token partition: special tokens are taken longest first (ties: the reference's sort
//    order), each splitting the remaining raw text at its left-most, non-overlapping occurrences;
//  - byte-level BPE: PCRE2 pre-tokenizer, then per word the lowest-rank merge of adjacent symbols
//    (ties: left-most) until none applies; symbols that end up outside the vocabulary fall back to
//    single-byte tokens;
//  - SentencePiece: repeatedly merge the adjacent pair whose concatenation is the highest-scoring token
//    (ties: left-most), unknown characters to <0xXX> byte tokens.
#include "text/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <queue>
#include <set>

#include "format/gguf.h"
#include "runtime/error.h"
#include "text/regex_split.h"
#include "text/unicode.h"

namespace fitmoe {

namespace {

// ---- hashing and flat hash maps ---------------------------------------------------------------------

inline uint64_t mix64(uint64_t a, uint64_t b) {
  __uint128_t r = static_cast<__uint128_t>(a) * b;
  return static_cast<uint64_t>(r) ^ static_cast<uint64_t>(r >> 64);
}

inline uint64_t load64(const char* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}
inline uint32_t load32(const char* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// Hash of a short byte string with fixed-size (overlapping) loads only.
inline uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xFF51AFD7ED558CCDull);
  if (n >= 8) {
    const char* end = p + n;
    while (n > 8) {
      h = mix64(h ^ load64(p), 0xBF58476D1CE4E5B9ull);
      p += 8;
      n -= 8;
    }
    return mix64(h ^ load64(end - 8), 0x94D049BB133111EBull);
  }
  uint64_t w;
  if (n >= 4) w = (static_cast<uint64_t>(load32(p)) << 32) | load32(p + n - 4);
  else if (n > 0) w = (static_cast<uint64_t>(static_cast<uint8_t>(p[0])) << 16) |
                      (static_cast<uint64_t>(static_cast<uint8_t>(p[n / 2])) << 8) | static_cast<uint8_t>(p[n - 1]);
  else w = 0;
  return mix64(h ^ w, 0x94D049BB133111EBull);
}

// Equality of two byte strings of the same length n, without a library call for short ones.
inline bool bytes_eq(const char* a, const char* b, size_t n) {
  if (n >= 8) {
    if (n > 16) return std::memcmp(a, b, n) == 0;
    return load64(a) == load64(b) && load64(a + n - 8) == load64(b + n - 8);
  }
  if (n >= 4) return load32(a) == load32(b) && load32(a + n - 4) == load32(b + n - 4);
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return false;
  return true;
}

inline size_t pow2_at_least(size_t n) {
  size_t c = 16;
  while (c < n) c <<= 1;
  return c;
}

// string -> int32 map with keys copied into an arena. Open addressing, linear probing.
class StrMap {
 public:
  void reserve(size_t n) {
    slots_.assign(pow2_at_least(n + n / 2 + 1), Slot{});
    mask_ = slots_.size() - 1;
  }
  size_t size() const { return count_; }
  // Inserts key -> val; if present, overwrites when `overwrite`. Returns the value now stored.
  int32_t insert(std::string_view key, int32_t val, bool overwrite) {
    if ((count_ + 1) * 3 > slots_.size() * 2) grow();
    uint64_t h = hash_bytes(key.data(), key.size());
    size_t i = h & mask_;
    uint32_t tag = static_cast<uint32_t>(h >> 32);
    for (;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.len == kEmpty) {
        s = Slot{tag, val, static_cast<uint32_t>(arena_.size()), static_cast<uint32_t>(key.size())};
        arena_.append(key);
        ++count_;
        return val;
      }
      if (s.tag == tag && s.len == key.size() && bytes_eq(arena_.data() + s.off, key.data(), key.size())) {
        if (overwrite) s.val = val;
        return s.val;
      }
    }
  }
  // A 16-bits-per-key filter (1 MiB for a 262k vocabulary, mostly cache-resident) that answers most
  // "not in the map" lookups without touching the table. Build it once all keys are in.
  void build_filter() {
    size_t bits = pow2_at_least(count_ * 16);
    filter_.assign(bits / 64, 0);
    filter_mask_ = bits - 1;
    for (const Slot& s : slots_) {
      if (s.len == kEmpty) continue;
      uint32_t t = s.tag;
      filter_[(t & filter_mask_) >> 6] |= 1ull << (t & 63);
    }
  }
  int32_t find(std::string_view key) const {
    if (slots_.empty()) return -1;
    uint64_t h = hash_bytes(key.data(), key.size());
    uint32_t tag = static_cast<uint32_t>(h >> 32);
    if (!filter_.empty() && !(filter_[(tag & filter_mask_) >> 6] >> (tag & 63) & 1)) return -1;
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.len == kEmpty) return -1;
      if (s.tag == tag && s.len == key.size() && bytes_eq(arena_.data() + s.off, key.data(), key.size()))
        return s.val;
    }
  }

 private:
  static constexpr uint32_t kEmpty = 0xFFFFFFFFu;
  struct Slot {
    uint32_t tag = 0;
    int32_t val = -1;
    uint32_t off = 0;
    uint32_t len = kEmpty;
  };
  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(old.empty() ? 16 : old.size() * 2, Slot{});
    mask_ = slots_.size() - 1;
    for (const Slot& s : old) {
      if (s.len == kEmpty) continue;
      uint64_t h = hash_bytes(arena_.data() + s.off, s.len);
      size_t i = h & mask_;
      while (slots_[i].len != kEmpty) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0, count_ = 0;
  std::string arena_;
  std::vector<uint64_t> filter_;
  size_t filter_mask_ = 0;
};

// (left symbol id, right symbol id) -> (merge rank, merged symbol id).
class PairMap {
 public:
  void reserve(size_t n) {
    slots_.assign(pow2_at_least(n * 2 + 1), Slot{});
    mask_ = slots_.size() - 1;
  }
  // Keeps the first value inserted for a key (the reference keeps the lowest rank of duplicate merges).
  void insert(uint64_t key, int32_t rank, int32_t res) {
    for (size_t i = mix64(key, 0x9E3779B97F4A7C15ull) & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.key == kEmpty) {
        s = Slot{key, rank, res};
        return;
      }
      if (s.key == key) return;
    }
  }
  const std::pair<int32_t, int32_t>* find(uint64_t key, std::pair<int32_t, int32_t>& tmp) const {
    for (size_t i = mix64(key, 0x9E3779B97F4A7C15ull) & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == kEmpty) return nullptr;
      if (s.key == key) {
        tmp = {s.rank, s.res};
        return &tmp;
      }
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  struct Slot {
    uint64_t key = kEmpty;
    int32_t rank = 0, res = 0;
  };
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

inline uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

// ---- pre-tokenizer table -----------------------------------------------------------------------------

// Regexes in PCRE2 syntax (UTF + UCP). The (?i:'s|...) contractions of the tokenizer.json patterns are
// written with explicit ASCII case pairs, and the GPT-4o letter-case classes as "letter but not [a-z]" /
// "letter but not [A-Z]", which is what the reference matches (it does not tell non-ASCII upper and lower
// case apart).
const char* const kContractions = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])";
const std::string kGpt2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";
const std::string kQwen2 = std::string(kContractions) +
                           "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const std::string kQwen35 =
    std::string(kContractions) +
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const std::string kLlama3 = std::string(kContractions) +
                            "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const std::string kGpt4o = "[^\\r\\n\\p{L}\\p{N}]?[^\\P{L}a-z]*[^\\P{L}A-Z]+" + std::string(kContractions) +
                           "?|[^\\r\\n\\p{L}\\p{N}]?[^\\P{L}a-z]+[^\\P{L}A-Z]*" + std::string(kContractions) +
                           "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

struct PreSpec {
  std::vector<std::string> names;
  std::vector<std::string> regexes;
  bool ignore_merges = false;
  bool add_bos = false;
  bool nfc = false;
  bool no_bos = false;  // the reference clears the BOS id (glm4)
};

const std::vector<PreSpec>& pre_specs() {
  static const std::vector<PreSpec> specs = {
      {{"default"},
       {"[\\p{P}\\$\\+<=>\\^~\\|]+", kGpt2, "\\p{N}+", "[0-9][0-9][0-9]"}},
      {{"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"},
       {kLlama3},
       true,
       true},
      {{"dbrx", "smaug-bpe"}, {kLlama3}},
      {{"glm4", "chatglm-bpe"}, {kLlama3}, false, false, false, true},
      // Qwen's Hugging Face tokenizers NFC-normalise; we follow them (see tokenizer.h).
      {{"qwen2"}, {kQwen2}, false, false, true},
      {{"qwen35"}, {kQwen35}, false, false, true},
      {{"deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"}, {kQwen2}},
      {{"gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"}, {kGpt4o}},
      {{"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
        "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling", "jina-v1-en", "jina-v2-code",
        "roberta-bpe"},
       {kGpt2}},
      {{"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"},
       {"\\p{N}", kGpt2}},
      {{"deepseek-v3", "hunyuan-dense", "joyai-llm"},
       {"\\p{N}{1,3}", "[\\x{4E00}-\\x{9FA5}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| "
        "?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
      {{"seed-coder"},
       {std::string(kContractions) +
        "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
  };
  return specs;
}

// Token texts the reference treats as end-of-generation (and forces to CONTROL).
const char* const kEogTexts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>", "[e~["};
const char* const kEotTexts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
    "[EOT]", "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>", "<end_of_utterance>"};
const char* const kFimPre[] = {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                               "<\xef\xbd\x9c" "fim\xe2\x96\x81" "begin\xef\xbd\x9c>", "<PRE>",
                               "\xe2\x96\x81<PRE>", "<|code_prefix|>", "<|prefix|>"};
const char* const kFimSuf[] = {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
                               "<\xef\xbd\x9c" "fim\xe2\x96\x81hole\xef\xbd\x9c>", "<SUF>", "\xe2\x96\x81<SUF>",
                               "<|code_suffix|>", "<|suffix|>"};
const char* const kFimMid[] = {"<|fim_middle|>", "<fim-middle>", "<fim_middle>",
                               "<\xef\xbd\x9c" "fim\xe2\x96\x81" "end\xef\xbd\x9c>", "<MID>", "\xe2\x96\x81<MID>",
                               "<|code_middle|>", "<|middle|>"};
const char* const kFimPad[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"};
const char* const kFimRep[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"};
const char* const kFimSep[] = {"<|file_sep|>"};

const std::string kSpaceMark = "\xe2\x96\x81";  // U+2581, SentencePiece's space

void escape_spaces(std::string_view in, std::string& out) {
  out.clear();
  out.reserve(in.size() + in.size() / 4);
  for (char c : in) {
    if (c == ' ') out += kSpaceMark;
    else out.push_back(c);
  }
}

std::string unescape_spaces(std::string_view in) {
  std::string out;
  out.reserve(in.size());
  size_t i = 0;
  while (i < in.size()) {
    if (in.compare(i, 3, kSpaceMark) == 0) {
      out.push_back(' ');
      i += 3;
    } else {
      out.push_back(in[i++]);
    }
  }
  return out;
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// "<0x41>" -> 0x41, parsed the lenient way the reference does (strtol of the two characters at 3..4).
uint8_t byte_token_value(const std::string& t) {
  int v = 0;
  for (size_t k = 3; k < 5 && k < t.size(); ++k) {
    int h = hex_value(t[k]);
    if (h < 0) break;
    v = v * 16 + h;
  }
  return static_cast<uint8_t>(v);
}

struct Trie {
  struct Node {
    int32_t value = -1;                         // special-token priority index ending here
    std::vector<std::pair<uint8_t, int32_t>> kids;  // sorted by byte
  };
  std::vector<Node> nodes{Node{}};
  void insert(std::string_view s, int32_t value) {
    int32_t n = 0;
    for (unsigned char c : s) {
      auto& kids = nodes[n].kids;
      auto it = std::lower_bound(kids.begin(), kids.end(), std::make_pair(c, INT32_MIN));
      if (it != kids.end() && it->first == c) {
        n = it->second;
      } else {
        int32_t nn = static_cast<int32_t>(nodes.size());
        nodes[n].kids.insert(it, {c, nn});
        nodes.emplace_back();
        n = nn;
      }
    }
    nodes[n].value = value;
  }
  int32_t child(int32_t n, unsigned char c) const {
    const auto& kids = nodes[n].kids;
    auto it = std::lower_bound(kids.begin(), kids.end(), std::make_pair(c, INT32_MIN));
    return (it != kids.end() && it->first == c) ? it->second : -1;
  }
};

}  // namespace

// ---- the implementation ------------------------------------------------------------------------------

struct Tokenizer::Impl {
  enum class Algo { BpeBytes, BpeUtf8, Spm } algo = Algo::BpeBytes;
  std::string model, pre;
  std::vector<std::string> text;
  std::vector<float> score;
  std::vector<uint32_t> attr;
  StrMap index;  // text -> id
  int32_t bos = -1, eos = -1, eot = -1, eom = -1, unk = -1, pad = -1;
  int32_t fim_pre = -1, fim_suf = -1, fim_mid = -1, fim_pad = -1, fim_rep = -1, fim_sep = -1;
  bool add_bos = false, add_eos = false, add_space_prefix = false, escape_ws = false;
  bool nfc = false, ignore_merges = false;
  std::vector<int32_t> eog;       // sorted
  std::vector<uint8_t> eog_flag;  // per id
  std::vector<std::string> piece;  // token_to_piece(special = true) per id
  std::string chat_template;

  // Special tokens in priority order, and a trie over their texts (values = priority index).
  std::vector<int32_t> specials;
  Trie trie;
  std::array<uint8_t, 256> special_first{};

  // BPE.
  std::unique_ptr<text::RegexSplitter> splitter;
  StrMap intern;       // symbol strings that are not tokens -> symbol id (n_vocab + k)
  size_t n_extra = 0;
  int32_t sym_tok(int32_t sid) const { return sid < static_cast<int32_t>(text.size()) ? sid : -1; }
  int32_t sym_find(std::string_view s) const {
    int32_t t = index.find(s);
    return t >= 0 ? t : intern.find(s);
  }
  PairMap merges;
  std::array<int32_t, 256> byte_sym{};                  // byte-level: byte -> symbol id of its alphabet char
  std::array<std::array<int32_t, 2>, 256> byte_fb{};    // byte-level fallback tokens per byte (-1 = none)
  std::array<int32_t, 256> hex_tok{};                   // <0xXX> tokens

  void load(const gguf::File& f);
  void finish_specials();

  struct Frag {
    bool is_token;
    int32_t id;
    size_t off, len;
  };
  void partition(std::string_view s, bool parse_special, std::vector<Frag>& out) const;

  struct Scratch {
    struct Sym {
      int32_t sid;
      uint32_t start, len;
      int32_t prev, next;
    };
    struct Cand {
      int32_t rank, left, right, res;
      uint32_t llen, rlen;
    };
    std::vector<Sym> syms;
    std::vector<Cand> heap;
    std::vector<text::Piece> pieces;
    std::string s1, s2, s3;
    // Per-call word cache (long inputs only): word -> ids, as Hugging Face's BPE cache does.
    bool use_cache = false;
    StrMap cache;
    std::vector<std::pair<uint32_t, uint32_t>> cache_ent;
    std::vector<int32_t> cache_ids;
  };
  void bpe_fragment(std::string_view frag, Scratch& sc, std::vector<int32_t>& out) const;
  void bpe_word(std::string_view word, Scratch& sc, std::vector<int32_t>& out) const;
  void spm_fragment(std::string_view frag, Scratch& sc, std::vector<int32_t>& out) const;
  void spm_word(std::string_view word, std::vector<int32_t>& out) const;
  // Runs `fn(word)` through the per-call word cache.
  template <class F>
  void cached(std::string_view word, Scratch& sc, std::vector<int32_t>& out, F&& fn) const;

  // Words for the U+2581 vocabularies: no token (SentencePiece) or merge result (gemma4) crosses the
  // point where a U+2581 follows another character, except the few listed here, so the text can be cut
  // there (where none of them occurs across the cut) and each word tokenized on its own with the same
  // result, which makes the word cache possible.
  bool space_split = false;
  std::vector<std::pair<std::string, std::vector<uint32_t>>> space_spanning;  // token, offsets of its inner U+2581
  void init_space_split(const std::vector<std::string_view>& strings);
  void space_words(std::string_view t, std::vector<text::Piece>& out) const;
  std::string make_piece(int32_t id) const;
};

namespace {

// Reads an optional token-id key the way the reference does: absent or out of range -> keep `id`.
void read_id(const gguf::File& f, std::string_view key, int32_t& id, size_t n_vocab) {
  const gguf::Value* v = f.find(key);
  if (!v) return;
  if (!v->is_integer()) throw Error(f.path() + ": metadata key " + std::string(key) + " is not an integer");
  if (v->i >= 0 && static_cast<uint64_t>(v->i) < n_vocab) id = static_cast<int32_t>(v->i);
}

}  // namespace

void Tokenizer::Impl::load(const gguf::File& f) {
  const std::string where = f.path() + ": ";
  model = std::string(f.get_string("tokenizer.ggml.model"));
  std::string pre_name(f.opt_string("tokenizer.ggml.pre").value_or(""));
  const auto& toks = f.get_string_array("tokenizer.ggml.tokens");
  const size_t n = toks.size();
  if (n == 0) throw Error(where + "tokenizer.ggml.tokens is empty");
  if (n > static_cast<size_t>(INT32_MAX)) throw Error(where + "vocabulary too large");

  std::vector<std::string_view> merge_strs;
  if (model == "gpt2") {
    algo = Algo::BpeBytes;
    if (!f.find("tokenizer.ggml.merges")) throw Error(where + "BPE tokenizer without tokenizer.ggml.merges");
    merge_strs = f.get_string_array("tokenizer.ggml.merges");
    bos = 11;
    eos = 11;
  } else if (model == "gemma4") {
    algo = Algo::BpeUtf8;
    if (!f.find("tokenizer.ggml.merges")) throw Error(where + "gemma4 tokenizer without tokenizer.ggml.merges");
    merge_strs = f.get_string_array("tokenizer.ggml.merges");
    pre_name = "gemma4";
    escape_ws = true;
  } else if (model == "llama") {
    algo = Algo::Spm;
    bos = 1;
    eos = 2;
    unk = 0;
    add_bos = true;
    add_space_prefix = true;
    pre_name.clear();
  } else {
    throw Error(where + "tokenizer model '" + model + "' is not supported (supported: gpt2, llama, gemma4)");
  }
  if (algo == Algo::BpeBytes) {
    if (pre_name.empty()) pre_name = "default";
    const PreSpec* spec = nullptr;
    for (const auto& s : pre_specs())
      for (const auto& nm : s.names)
        if (nm == pre_name) spec = &s;
    if (!spec) throw Error(where + "pre-tokenizer '" + pre_name + "' is not supported");
    splitter = std::make_unique<text::RegexSplitter>(spec->regexes);
    ignore_merges = spec->ignore_merges;
    add_bos = spec->add_bos;
    nfc = spec->nfc;
    if (spec->no_bos) bos = -1;
  }
  pre = pre_name;
  if (auto v = f.opt_bool("tokenizer.ggml.add_space_prefix")) add_space_prefix = *v;

  // Vocabulary.
  text.resize(n);
  attr.assign(n, TOKEN_ATTR_NORMAL);
  score.assign(n, 0.0f);
  index.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    text[i] = toks[i].empty() ? "[EMPTY_" + std::to_string(i) + "]" : std::string(toks[i]);
    index.insert(text[i], static_cast<int32_t>(i), true);
  }
  index.build_filter();
  if (f.find("tokenizer.ggml.scores")) {
    auto sc = f.get_float_array("tokenizer.ggml.scores");
    if (sc.size() < n) throw Error(where + "tokenizer.ggml.scores has fewer entries than tokens");
    std::copy(sc.begin(), sc.begin() + static_cast<ptrdiff_t>(n), score.begin());
  }
  if (f.find("tokenizer.ggml.token_type")) {
    auto tt = f.get_int_array("tokenizer.ggml.token_type");
    if (tt.size() < n) throw Error(where + "tokenizer.ggml.token_type has fewer entries than tokens");
    for (size_t i = 0; i < n; ++i) {
      switch (tt[i]) {
        case 1: attr[i] = TOKEN_ATTR_NORMAL; break;
        case 2: attr[i] = TOKEN_ATTR_UNKNOWN; break;
        case 3: attr[i] = TOKEN_ATTR_CONTROL; break;
        case 4: attr[i] = TOKEN_ATTR_USER_DEFINED; break;
        case 5: attr[i] = TOKEN_ATTR_UNUSED; break;
        case 6: attr[i] = TOKEN_ATTR_BYTE; break;
        default: attr[i] = TOKEN_ATTR_UNDEFINED; break;
      }
    }
  }

  // Special ids: defaults out of range are dropped, metadata overrides when in range.
  for (int32_t* id : {&bos, &eos, &unk})
    if (*id >= 0 && static_cast<size_t>(*id) >= n) *id = -1;
  read_id(f, "tokenizer.ggml.bos_token_id", bos, n);
  read_id(f, "tokenizer.ggml.eos_token_id", eos, n);
  read_id(f, "tokenizer.ggml.eot_token_id", eot, n);
  read_id(f, "tokenizer.ggml.eom_token_id", eom, n);
  read_id(f, "tokenizer.ggml.unknown_token_id", unk, n);
  read_id(f, "tokenizer.ggml.padding_token_id", pad, n);
  read_id(f, "tokenizer.ggml.fim_pre_token_id", fim_pre, n);
  read_id(f, "tokenizer.ggml.fim_suf_token_id", fim_suf, n);
  read_id(f, "tokenizer.ggml.fim_mid_token_id", fim_mid, n);
  read_id(f, "tokenizer.ggml.fim_pad_token_id", fim_pad, n);
  read_id(f, "tokenizer.ggml.fim_rep_token_id", fim_rep, n);
  read_id(f, "tokenizer.ggml.fim_sep_token_id", fim_sep, n);
  read_id(f, "tokenizer.ggml.prefix_token_id", fim_pre, n);
  read_id(f, "tokenizer.ggml.suffix_token_id", fim_suf, n);
  read_id(f, "tokenizer.ggml.middle_token_id", fim_mid, n);
  if (auto v = f.opt_bool("tokenizer.ggml.add_bos_token")) add_bos = *v;
  if (auto v = f.opt_bool("tokenizer.ggml.add_eos_token")) add_eos = *v;
  if (algo == Algo::BpeUtf8) add_bos = true;  // the reference always adds <bos> for gemma4

  finish_specials();

  // BPE merges: intern every string that can be a symbol, map symbol pairs to (rank, result).
  if (algo != Algo::Spm) {
    // Symbol ids: vocabulary ids for strings in the vocabulary, n_vocab + k for the others.
    intern.reserve(64);
    merges.reserve(merge_strs.size());
    auto sym = [&](std::string_view s) {
      int32_t t = index.find(s);
      if (t >= 0) return t;
      int32_t extra = static_cast<int32_t>(n + n_extra);
      int32_t id = intern.insert(s, extra, false);
      if (id == extra) ++n_extra;
      return id;
    };
    if (algo == Algo::BpeBytes) {
      for (int b = 0; b < 256; ++b) {
        std::string ch;
        text::append_utf8(ch, text::byte_to_unicode(static_cast<uint8_t>(b)));
        byte_sym[b] = sym(ch);
        // Fallback when a symbol is not a token: the reference looks up each byte of the symbol's
        // alphabet spelling as a one-byte string.
        for (size_t k = 0; k < 2; ++k) byte_fb[b][k] = k < ch.size() ? index.find(std::string_view(&ch[k], 1)) : -1;
      }
    }
    std::string joined;
    for (size_t r = 0; r < merge_strs.size(); ++r) {
      std::string_view m = merge_strs[r];
      size_t sp = m.size() > 1 ? m.find(' ', 1) : std::string_view::npos;
      if (sp == std::string_view::npos) continue;  // the reference files it under ("", ""), which never matches
      std::string_view a = m.substr(0, sp), b = m.substr(sp + 1);
      if (a.empty() || b.empty()) continue;
      joined.assign(a);
      joined.append(b);
      int32_t sa = sym(a), sb = sym(b), sr = sym(joined);
      merges.insert(pair_key(sa, sb), static_cast<int32_t>(r), sr);
    }
  }
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    hex_tok[b] = index.find(buf);
  }

  if (algo == Algo::Spm) {
    std::vector<std::string_view> all(text.begin(), text.end());
    init_space_split(all);
  } else if (algo == Algo::BpeUtf8) {
    std::vector<std::string_view> results;
    std::string joined;
    std::vector<std::string> keep;
    keep.reserve(merge_strs.size());
    for (std::string_view m : merge_strs) {
      size_t sp = m.size() > 1 ? m.find(' ', 1) : std::string_view::npos;
      if (sp == std::string_view::npos) continue;
      keep.push_back(std::string(m.substr(0, sp)) + std::string(m.substr(sp + 1)));
    }
    results.assign(keep.begin(), keep.end());
    init_space_split(results);
  }

  // Piece cache.
  piece.resize(n);
  for (size_t i = 0; i < n; ++i) piece[i] = make_piece(static_cast<int32_t>(i));

  if (auto t = f.opt_string("tokenizer.chat_template")) chat_template = std::string(*t);
}

void Tokenizer::Impl::finish_specials() {
  const size_t n = text.size();
  // The reference picks the first match in hash-map order; we take the lowest id (this only decides
  // which id eot()/fim_*() report when a vocabulary has several candidates).
  auto first_match = [&](const auto& names, int32_t& id) {
    if (id >= 0) return;
    for (const char* nm : names) {
      int32_t t = index.find(nm);
      if (t >= 0 && (id < 0 || t < id)) id = t;
    }
    if (id >= 0) attr[id] |= TOKEN_ATTR_CONTROL;
  };
  first_match(kEotTexts, eot);
  if (eom < 0) {
    int32_t id = index.find("<|eom_id|>");
    if (id >= 0) {
      eom = id;
      attr[id] |= TOKEN_ATTR_CONTROL;
    }
  }
  first_match(kFimPre, fim_pre);
  first_match(kFimSuf, fim_suf);
  first_match(kFimMid, fim_mid);
  first_match(kFimPad, fim_pad);
  first_match(kFimRep, fim_rep);
  first_match(kFimSep, fim_sep);
  for (size_t i = 0; i < n; ++i)
    if ((attr[i] & TOKEN_ATTR_CONTROL) && text[i].find("unused") != std::string::npos) attr[i] |= TOKEN_ATTR_UNUSED;

  std::set<int32_t> eg;
  for (int32_t id : {fim_pad, fim_rep, fim_sep})
    if (id >= 0) eg.insert(id);
  for (const char* nm : kEogTexts) {
    int32_t id = index.find(nm);
    if (id < 0) continue;
    eg.insert(id);
    attr[id] |= TOKEN_ATTR_CONTROL;
  }
  for (const char* nm : {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}) {
    int32_t id = index.find(nm);
    if (id >= 0) attr[id] = TOKEN_ATTR_USER_DEFINED;
  }
  for (int32_t id : {eos, eot, eom})
    if (id >= 0) eg.insert(id);
  // o200k_harmony / solar-open: <|end|> is not end-of-generation when <|return|>/<|call|> exist.
  auto has = [&](const char* nm) {
    int32_t id = index.find(nm);
    return id >= 0 && eg.count(id) ? id : -1;
  };
  int32_t end_id = has("<|end|>");
  if (end_id >= 0 && ((has("<|return|>") >= 0 && has("<|call|>") >= 0) ||
                      (has("<|calls|>") >= 0 && has("<|flush|>") >= 0))) {
    eg.erase(end_id);
    attr[end_id] = TOKEN_ATTR_USER_DEFINED;
  }
  // gemma4: </s> is not end-of-generation when <|tool_response> is.
  int32_t s_id = has("</s>");
  if (s_id >= 0 && has("<|tool_response>") >= 0) {
    eg.erase(s_id);
    attr[s_id] = TOKEN_ATTR_NORMAL;
  }
  eog.assign(eg.begin(), eg.end());
  eog_flag.assign(n, 0);
  for (int32_t id : eog) eog_flag[id] = 1;

  // Special tokens, longest first. std::sort (not stable) on ascending ids with this comparator, as the
  // reference does, so that equal-length tokens keep the reference's relative order.
  specials.clear();
  for (size_t i = 0; i < n; ++i)
    if (attr[i] & (TOKEN_ATTR_CONTROL | TOKEN_ATTR_USER_DEFINED | TOKEN_ATTR_UNKNOWN))
      specials.push_back(static_cast<int32_t>(i));
  std::sort(specials.begin(), specials.end(),
            [&](int32_t a, int32_t b) { return text[a].size() > text[b].size(); });
  for (size_t p = 0; p < specials.size(); ++p) {
    const std::string& t = text[specials[p]];
    trie.insert(t, static_cast<int32_t>(p));
    special_first[static_cast<unsigned char>(t[0])] = 1;
  }
}

std::string Tokenizer::Impl::make_piece(int32_t id) const {
  const uint32_t a = attr[id];
  const std::string& t = text[id];
  if (a & (TOKEN_ATTR_UNKNOWN | TOKEN_ATTR_CONTROL | TOKEN_ATTR_USER_DEFINED)) return t;
  if (a & TOKEN_ATTR_NORMAL) {
    if (algo == Algo::Spm || escape_ws) return unescape_spaces(t);
    // Byte-level: every character of the token stands for one byte.
    std::string out;
    size_t i = 0;
    while (i < t.size()) {
      size_t at = i;
      uint32_t cp;
      text::decode_lenient(t, i, cp);
      int b = text::unicode_to_byte(cp);
      if (b >= 0) {
        out.push_back(static_cast<char>(b));
      } else {
        out += "[UNK_BYTE_0x";
        std::string enc;
        text::append_utf8(enc, cp);
        char buf[4];
        for (unsigned char c : enc) {
          std::snprintf(buf, sizeof(buf), "%02x", c);
          out += buf;
        }
        (void)at;
        out += t + "]";
      }
    }
    return out;
  }
  if (a & TOKEN_ATTR_BYTE) return std::string(1, static_cast<char>(byte_token_value(t)));
  return std::string();
}

void Tokenizer::Impl::partition(std::string_view s, bool parse_special, std::vector<Frag>& out) const {
  out.clear();
  if (s.empty()) return;
  // Which special tokens occur at all (one pass with the trie).
  std::vector<int32_t> present;
  std::vector<uint8_t> seen;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size(); ++i) {
    if (!special_first[p[i]]) continue;
    int32_t node = 0;
    for (size_t j = i; j < s.size(); ++j) {
      node = trie.child(node, p[j]);
      if (node < 0) break;
      int32_t v = trie.nodes[node].value;
      if (v < 0) continue;
      if (!parse_special && (attr[specials[v]] & (TOKEN_ATTR_CONTROL | TOKEN_ATTR_UNKNOWN))) continue;
      if (seen.empty()) seen.assign(specials.size(), 0);
      if (!seen[v]) {
        seen[v] = 1;
        present.push_back(v);
      }
    }
  }
  out.push_back({false, -1, 0, s.size()});
  if (present.empty()) return;
  std::sort(present.begin(), present.end());
  std::vector<Frag> next;
  for (int32_t v : present) {
    const int32_t id = specials[v];
    const std::string& t = text[id];
    next.clear();
    for (const Frag& fr : out) {
      if (fr.is_token) {
        next.push_back(fr);
        continue;
      }
      size_t pos = fr.off, end = fr.off + fr.len;
      while (pos < end) {
        size_t m = s.substr(0, end).find(t, pos);
        if (m == std::string_view::npos) break;
        if (m > pos) next.push_back({false, -1, pos, m - pos});
        next.push_back({true, id, m, t.size()});
        pos = m + t.size();
      }
      if (pos < end) next.push_back({false, -1, pos, end - pos});
    }
    out.swap(next);
  }
}

void Tokenizer::Impl::bpe_word(std::string_view w, Scratch& sc, std::vector<int32_t>& out) const {
  using Sym = Scratch::Sym;
  using Cand = Scratch::Cand;
  auto& syms = sc.syms;
  auto& heap = sc.heap;
  syms.clear();
  heap.clear();
  const bool bytes = algo == Algo::BpeBytes;
  const auto* p = reinterpret_cast<const unsigned char*>(w.data());
  const uint32_t n = static_cast<uint32_t>(w.size());

  if (bytes && n == 1) {  // one byte: one alphabet character
    int32_t t = sym_tok(byte_sym[p[0]]);
    if (t >= 0) {
      out.push_back(t);
    } else {
      for (int32_t fb : byte_fb[p[0]])
        if (fb >= 0) out.push_back(fb);
    }
    return;
  }
  if (ignore_merges) {
    // The whole word as one token if the vocabulary has it (llama3 family).
    std::string enc;
    for (uint32_t i = 0; i < n; ++i) text::append_utf8(enc, text::byte_to_unicode(p[i]));
    int32_t t = index.find(enc);
    if (t >= 0) {
      out.push_back(t);
      return;
    }
  }
  if (!bytes && w.find_first_not_of('\n') == std::string_view::npos) {
    // gemma4: a run of newlines that is itself a token stays whole.
    int32_t t = index.find(w);
    if (t >= 0) {
      out.push_back(t);
      return;
    }
  }
  // Initial symbols: bytes (byte-level) or UTF-8 characters by lead byte.
  for (uint32_t i = 0; i < n;) {
    uint32_t len = bytes ? 1 : std::min<uint32_t>(static_cast<uint32_t>(text::utf8_len_from_lead(p[i])), n - i);
    int32_t sid = bytes ? byte_sym[p[i]] : sym_find(w.substr(i, len));
    int32_t idx = static_cast<int32_t>(syms.size());
    syms.push_back(Sym{sid, i, len, idx - 1, i + len < n ? idx + 1 : -1});
    i += len;
  }
  auto cmp = [](const Cand& a, const Cand& b) { return a.rank > b.rank || (a.rank == b.rank && a.left > b.left); };
  auto add = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const Sym& a = syms[l];
    const Sym& b = syms[r];
    if (a.sid < 0 || b.sid < 0) return;
    std::pair<int32_t, int32_t> tmp;
    auto* m = merges.find(pair_key(a.sid, b.sid), tmp);
    if (!m) return;
    heap.push_back(Cand{m->first, l, r, m->second, a.len, b.len});
    std::push_heap(heap.begin(), heap.end(), cmp);
  };
  for (int32_t i = 1; i < static_cast<int32_t>(syms.size()); ++i) add(i - 1, i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), cmp);
    Cand c = heap.back();
    heap.pop_back();
    Sym& l = syms[c.left];
    Sym& r = syms[c.right];
    if (l.len != c.llen || r.len != c.rlen || l.next != c.right) continue;  // outdated
    l.sid = c.res;
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) syms[r.next].prev = c.left;
    add(l.prev, c.left);
    add(c.left, l.next);
  }
  for (const Sym& s : syms) {
    if (s.len == 0) continue;
    int32_t t = s.sid >= 0 ? sym_tok(s.sid) : -1;
    if (t >= 0) {
      out.push_back(t);
      continue;
    }
    for (uint32_t k = s.start; k < s.start + s.len; ++k) {
      if (bytes) {
        for (int32_t fb : byte_fb[p[k]])
          if (fb >= 0) out.push_back(fb);
      } else if (hex_tok[p[k]] >= 0) {
        out.push_back(hex_tok[p[k]]);
      }
    }
  }
}

template <class F>
void Tokenizer::Impl::cached(std::string_view word, Scratch& sc, std::vector<int32_t>& out, F&& fn) const {
  if (!sc.use_cache || word.size() > 256) {
    fn(word);
    return;
  }
  int32_t e = sc.cache.find(word);
  if (e >= 0) {
    auto [o, l] = sc.cache_ent[static_cast<size_t>(e)];
    out.insert(out.end(), sc.cache_ids.begin() + o, sc.cache_ids.begin() + o + l);
    return;
  }
  size_t before = out.size();
  fn(word);
  if (sc.cache_ent.size() < (1u << 20)) {
    sc.cache.insert(word, static_cast<int32_t>(sc.cache_ent.size()), false);
    sc.cache_ent.emplace_back(static_cast<uint32_t>(sc.cache_ids.size()), static_cast<uint32_t>(out.size() - before));
    sc.cache_ids.insert(sc.cache_ids.end(), out.begin() + static_cast<ptrdiff_t>(before), out.end());
  }
}

void Tokenizer::Impl::init_space_split(const std::vector<std::string_view>& strings) {
  space_spanning.clear();
  for (std::string_view t : strings) {
    std::vector<uint32_t> offs;
    for (size_t k = 1; k + 3 <= t.size(); ++k) {
      if (t.compare(k, 3, kSpaceMark) != 0) continue;
      if (k >= 3 && t.compare(k - 3, 3, kSpaceMark) == 0) continue;  // inside a leading run of U+2581
      offs.push_back(static_cast<uint32_t>(k));
    }
    if (!offs.empty()) space_spanning.emplace_back(std::string(t), std::move(offs));
    if (space_spanning.size() > 64) break;
  }
  space_split = space_spanning.size() <= 64;
}

void Tokenizer::Impl::space_words(std::string_view t, std::vector<text::Piece>& out) const {
  out.clear();
  size_t start = 0;
  for (size_t b = 1; b + 3 <= t.size(); ++b) {
    if (static_cast<unsigned char>(t[b]) != 0xE2 || t.compare(b, 3, kSpaceMark) != 0) continue;
    if (b >= 3 && t.compare(b - 3, 3, kSpaceMark) == 0) continue;
    bool cut = true;
    for (const auto& [tok, offs] : space_spanning) {
      for (uint32_t k : offs)
        if (b >= k && b - k + tok.size() <= t.size() && t.compare(b - k, tok.size(), tok) == 0) cut = false;
    }
    if (!cut || b == start) continue;
    out.push_back({static_cast<uint32_t>(start), static_cast<uint32_t>(b - start)});
    start = b;
  }
  if (start < t.size()) out.push_back({static_cast<uint32_t>(start), static_cast<uint32_t>(t.size() - start)});
}

void Tokenizer::Impl::bpe_fragment(std::string_view frag, Scratch& sc, std::vector<int32_t>& out) const {
  std::string_view t = frag;
  if (algo == Algo::BpeUtf8) {
    escape_spaces(t, sc.s1);
    t = sc.s1;
  }
  if (!text::is_valid_utf8(t)) {
    sc.s2 = text::canonicalize_lenient(t);
    t = sc.s2;
  }
  auto word_fn = [&](std::string_view w) { bpe_word(w, sc, out); };
  if (algo == Algo::BpeUtf8) {
    // Runs of newlines and runs of everything else; merges then run over each whole run (cut at U+2581
    // where that cannot change the result, see space_words).
    size_t i = 0;
    while (i < t.size()) {
      bool nl = t[i] == '\n';
      size_t j = i;
      while (j < t.size() && (t[j] == '\n') == nl) ++j;
      std::string_view run = t.substr(i, j - i);
      if (nl || !space_split) {
        cached(run, sc, out, word_fn);
      } else {
        space_words(run, sc.pieces);
        for (const auto& pc : sc.pieces) cached(run.substr(pc.off, pc.len), sc, out, word_fn);
      }
      i = j;
    }
    return;
  }
  if (nfc && text::may_need_nfc(t)) {
    sc.s1 = text::nfc(t);
    t = sc.s1;
  }
  std::string_view subject = text::prepare_subject(t, sc.s3);
  sc.pieces.clear();
  splitter->split(subject, sc.pieces);
  for (const auto& pc : sc.pieces) cached(t.substr(pc.off, pc.len), sc, out, word_fn);
}

void Tokenizer::Impl::spm_fragment(std::string_view frag, Scratch& sc, std::vector<int32_t>& out) const {
  auto word_fn = [&](std::string_view w) { spm_word(w, out); };
  if (!space_split) {
    cached(frag, sc, out, word_fn);
    return;
  }
  space_words(frag, sc.pieces);
  for (const auto& pc : sc.pieces) cached(frag.substr(pc.off, pc.len), sc, out, word_fn);
}

void Tokenizer::Impl::spm_word(std::string_view frag, std::vector<int32_t>& out) const {
  struct Sym {
    uint32_t start, len;
    int32_t prev, next;
  };
  struct Big {
    float score;
    int32_t left, right;
    uint32_t size;
  };
  thread_local std::vector<Sym> syms;
  thread_local std::vector<Big> heap;
  syms.clear();
  heap.clear();
  const uint32_t n = static_cast<uint32_t>(frag.size());
  const auto* p = reinterpret_cast<const unsigned char*>(frag.data());
  for (uint32_t i = 0; i < n;) {
    uint32_t len = std::min<uint32_t>(static_cast<uint32_t>(text::utf8_len_from_lead(p[i])), n - i);
    int32_t idx = static_cast<int32_t>(syms.size());
    syms.push_back(Sym{i, len, idx - 1, i + len < n ? idx + 1 : -1});
    i += len;
  }
  auto cmp = [](const Big& a, const Big& b) { return a.score < b.score || (a.score == b.score && a.left > b.left); };
  auto add = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    uint32_t size = syms[l].len + syms[r].len;
    int32_t t = index.find(frag.substr(syms[l].start, size));
    if (t < 0) return;
    heap.push_back(Big{score[t], l, r, size});
    std::push_heap(heap.begin(), heap.end(), cmp);
  };
  for (int32_t i = 1; i < static_cast<int32_t>(syms.size()); ++i) add(i - 1, i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), cmp);
    Big b = heap.back();
    heap.pop_back();
    Sym& l = syms[b.left];
    Sym& r = syms[b.right];
    if (l.len == 0 || r.len == 0 || l.len + r.len != b.size) continue;
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) syms[r.next].prev = b.left;
    add(l.prev, b.left);
    add(b.left, l.next);
  }
  for (int32_t i = syms.empty() ? -1 : 0; i != -1; i = syms[i].next) {
    const Sym& s = syms[i];
    int32_t t = index.find(frag.substr(s.start, s.len));
    if (t >= 0) {
      out.push_back(t);
      continue;
    }
    for (uint32_t k = s.start; k < s.start + s.len; ++k) {
      int32_t b = hex_tok[p[k]];
      if (b < 0) b = index.find(std::string_view(frag.data() + k, 1));
      if (b < 0) {
        char buf[8];
        std::snprintf(buf, sizeof(buf), "%02X", p[k]);
        throw Error(std::string("tokenizer: byte 0x") + buf + " has no token (no <0x" + buf + "> in the vocabulary)");
      }
      out.push_back(b);
    }
  }
}

// ---- public API ------------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const gguf::File& f) {
  auto impl = std::make_unique<Impl>();
  impl->load(f);
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

std::vector<int32_t> Tokenizer::encode(std::string_view s, bool add_special, bool parse_special) const {
  const Impl& m = *impl_;
  if (s.size() >= (1ull << 31)) throw Error("tokenizer: input of " + std::to_string(s.size()) + " bytes is too large (limit 2 GiB)");
  std::vector<int32_t> out;
  out.reserve(s.size() / 3 + 4);
  std::vector<Impl::Frag> frags;
  m.partition(s, parse_special, frags);
  Impl::Scratch sc;
  sc.use_cache = s.size() >= 2048;
  if (add_special && m.add_bos) {
    if (m.bos < 0) throw Error("tokenizer: the model asks for a BOS token but has none");
    out.push_back(m.bos);
  }
  bool prev_special = true;  // SentencePiece: a space is prefixed to text that starts or follows a special token
  for (const auto& fr : frags) {
    if (fr.is_token) {
      out.push_back(fr.id);
      prev_special = true;
      continue;
    }
    std::string_view piece = s.substr(fr.off, fr.len);
    if (m.algo == Impl::Algo::Spm) {
      std::string t;
      if (m.add_space_prefix && prev_special) t = " ";
      t.append(piece);
      std::string esc;
      escape_spaces(t, esc);
      m.spm_fragment(esc, sc, out);
      prev_special = false;
    } else {
      m.bpe_fragment(piece, sc, out);
    }
  }
  if (add_special && m.add_eos) {
    if (m.eos < 0) throw Error("tokenizer: the model asks for an EOS token but has none");
    out.push_back(m.eos);
  }
  return out;
}

std::string Tokenizer::token_piece(int32_t id, bool special) const {
  if (id < 0 || id >= n_vocab()) throw Error("token id " + std::to_string(id) + " is out of range [0, " +
                                             std::to_string(n_vocab()) + ")");
  if (!special && (impl_->attr[id] & (TOKEN_ATTR_UNKNOWN | TOKEN_ATTR_CONTROL))) return std::string();
  return impl_->piece[id];
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool special) const {
  std::string out;
  bool strip = impl_->add_space_prefix;
  for (int32_t id : ids) {
    std::string p = token_piece(id, special);
    if (strip && !p.empty() && p[0] == ' ') p.erase(0, 1);
    strip = false;
    out += p;
  }
  return out;
}

const std::string& Tokenizer::token_text(int32_t id) const {
  if (id < 0 || id >= n_vocab()) throw Error("token id " + std::to_string(id) + " is out of range");
  return impl_->text[id];
}
uint32_t Tokenizer::token_attr(int32_t id) const {
  if (id < 0 || id >= n_vocab()) throw Error("token id " + std::to_string(id) + " is out of range");
  return impl_->attr[id];
}
int32_t Tokenizer::token_id(std::string_view t) const { return impl_->index.find(t); }
int32_t Tokenizer::bos() const { return impl_->bos; }
int32_t Tokenizer::eos() const { return impl_->eos; }
int32_t Tokenizer::eot() const { return impl_->eot; }
int32_t Tokenizer::pad() const { return impl_->pad; }
int32_t Tokenizer::unk() const { return impl_->unk; }
std::vector<int32_t> Tokenizer::eog_tokens() const { return impl_->eog; }
bool Tokenizer::is_eog(int32_t id) const { return id >= 0 && id < n_vocab() && impl_->eog_flag[id]; }
bool Tokenizer::is_control(int32_t id) const {
  return id >= 0 && id < n_vocab() && (impl_->attr[id] & TOKEN_ATTR_CONTROL);
}
bool Tokenizer::add_bos() const { return impl_->add_bos; }
bool Tokenizer::add_eos() const { return impl_->add_eos; }
int Tokenizer::n_vocab() const { return static_cast<int>(impl_->text.size()); }
std::string Tokenizer::chat_template() const { return impl_->chat_template; }
std::string Tokenizer::model() const { return impl_->model; }
std::string Tokenizer::pre() const { return impl_->pre; }

// ---- streaming ---------------------------------------------------------------------------------------

std::string StreamDecoder::push(int32_t id) {
  std::string p = tok_.token_piece(id, special_);
  if (first_ && tok_.impl_->add_space_prefix && !p.empty() && p[0] == ' ') p.erase(0, 1);
  first_ = false;
  pending_ += p;
  size_t k = text::utf8_complete_prefix(pending_);
  std::string out = text::sanitize_utf8(std::string_view(pending_).substr(0, k));
  pending_.erase(0, k);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = text::sanitize_utf8(pending_);
  reset();
  return out;
}

}  // namespace fitmoe

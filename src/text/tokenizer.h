// Tokenizers from GGUF metadata, reproducing llama.cpp's llama_tokenize / llama_token_to_piece.
//
// Supported `tokenizer.ggml.model` values:
//   gpt2    byte-level BPE (Qwen, Llama 3, GPT-4o style, ...). `tokenizer.ggml.pre` picks the
//           pre-tokenizer regexes: qwen2 (and its aliases), qwen35, llama-bpe/llama3 family, gpt-4o/llama4
//           family, gpt-2 family, starcoder family, deepseek-v3 family, glm4, default. Unknown names fail.
//   llama   SentencePiece (score-driven merges, byte fallback to <0xXX>), e.g. Gemma 3 GGUFs.
//   gemma4  Gemma 4's BPE over raw UTF-8 with spaces written as U+2581 and byte fallback to <0xXX>.
// Anything else throws fitmoe::Error.
//
// Special tokens: CONTROL (and UNKNOWN) token text in the input becomes that token when parse_special is
// on; USER_DEFINED token text always does. Longer special tokens win, then the left-most occurrence, as
// in llama.cpp. BOS/EOS are added only with add_special and only where the metadata (or llama.cpp's
// default for the tokenizer type) asks: tokenizer.ggml.add_bos_token / add_eos_token; SentencePiece and
// the llama3 pre-tokenizer family default to BOS; gemma4 always adds BOS.
//
// Deliberate differences from llama.cpp (docs/dependencies.md has the details):
//   - qwen2 / qwen35 text is NFC-normalised before pre-tokenization, as the Hugging Face tokenizer of
//     Qwen does (llama.cpp does not normalise, e.g. "e" + U+0301 tokenizes differently there).
//   - byte sequences that spell a value above U+10FFFF count as invalid (U+FFFD), where llama.cpp throws.
//   - decode() does not apply llama.cpp's clean_up_tokenization_spaces pass (llama_detokenize with
//     clean_spaces); pieces are concatenated exactly, which is what streaming output shows anyway.
//   - the LSTRIP/RSTRIP token attributes llama.cpp sets from model names (phi-3, jina, modern-bert) are
//     not implemented; no supported target uses them.
// Thread safety: a Tokenizer is immutable after from_gguf(); encode/decode may run concurrently.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fitmoe {

namespace gguf {
class File;
}

// Token attributes, the same bits as llama.cpp's llama_token_attr.
enum TokenAttr : uint32_t {
  TOKEN_ATTR_UNDEFINED = 0,
  TOKEN_ATTR_UNKNOWN = 1u << 0,
  TOKEN_ATTR_UNUSED = 1u << 1,
  TOKEN_ATTR_NORMAL = 1u << 2,
  TOKEN_ATTR_CONTROL = 1u << 3,
  TOKEN_ATTR_USER_DEFINED = 1u << 4,
  TOKEN_ATTR_BYTE = 1u << 5,
};

class Tokenizer {
 public:
  // Reads tokenizer.ggml.* (and tokenizer.chat_template) from an open GGUF; vocab-only files work (no
  // tensors are touched). Throws fitmoe::Error on missing or malformed keys and unsupported types.
  static std::unique_ptr<Tokenizer> from_gguf(const gguf::File& f);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Text (any bytes; invalid UTF-8 is handled like llama.cpp: each bad byte counts as U+FFFD for BPE, raw
  // bytes go to byte fallback for SentencePiece) to token ids.
  std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special = true) const;

  // Ids to bytes: the concatenated pieces (special = render CONTROL/UNKNOWN tokens as their text; USER_DEFINED
  // tokens are always rendered). The result may contain partial or invalid UTF-8 if the ids do.
  // For SentencePiece vocabularies with add_space_prefix, the first piece's leading space is dropped.
  // Throws fitmoe::Error for an id outside [0, n_vocab).
  std::string decode(std::span<const int32_t> ids, bool special = true) const;
  // One token's bytes (llama_token_to_piece with lstrip 0).
  std::string token_piece(int32_t id, bool special = true) const;
  // The vocabulary string as stored in the GGUF (e.g. "Ġhello", "▁the", "<0x0A>").
  const std::string& token_text(int32_t id) const;
  uint32_t token_attr(int32_t id) const;
  // Exact lookup of a vocabulary string; -1 if absent.
  int32_t token_id(std::string_view text) const;

  // -1 where the vocabulary has none.
  int32_t bos() const;
  int32_t eos() const;
  int32_t eot() const;
  int32_t pad() const;
  int32_t unk() const;
  // End-of-generation tokens as llama.cpp determines them: eos, eot, eom, the FIM pad/repo/file-separator
  // tokens, and every token whose text is one of llama.cpp's end markers (<|im_end|>, <|endoftext|>,
  // <end_of_turn>, <eos>, <turn|>, <|eot_id|>, ...). Sorted ascending.
  std::vector<int32_t> eog_tokens() const;
  bool is_eog(int32_t id) const;
  bool is_control(int32_t id) const;
  bool add_bos() const;
  bool add_eos() const;
  int n_vocab() const;
  std::string chat_template() const;  // "" when the GGUF has none
  std::string model() const;          // tokenizer.ggml.model
  std::string pre() const;            // the pre-tokenizer in effect ("" for SentencePiece)

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  friend class StreamDecoder;
};

// Streaming detokenizer for generation output: push ids one by one; each call returns the text that has
// become complete. It never returns a partial UTF-8 sequence: bytes of an unfinished character are held
// back until the next pieces finish it. Bytes that can never form a valid character are replaced by
// U+FFFD, so the concatenated output is always valid UTF-8. flush() returns what is held back (as U+FFFD
// if it is still unfinished) and resets the decoder.
// special: render CONTROL tokens (e.g. <|im_end|>) as text; off by default, like llama.cpp's console output.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool special = false) : tok_(tok), special_(special) {}
  std::string push(int32_t id);
  std::string flush();
  void reset() {
    pending_.clear();
    first_ = true;
  }

 private:
  const Tokenizer& tok_;
  bool special_;
  bool first_ = true;
  std::string pending_;
};

}  // namespace fitmoe

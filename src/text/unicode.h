// UTF-8 and Unicode helpers for the tokenizers and the chat-template interpreter.
//
// Two decoders on purpose:
//  - decode_lenient() reproduces how the reference (llama.cpp) turns bytes into code points before
//    pre-tokenizing: a byte that does not start a well-formed sequence becomes U+FFFD and only that one
//    byte is consumed; overlong forms and UTF-16 surrogates are accepted as the values they spell.
//    (fitmoe additionally turns values above U+10FFFF into U+FFFD where llama.cpp throws.)
//  - is_valid_utf8() is strict (RFC 3629) and is the fast path: valid text is used as is.
// Normalisation (NFC) and case mapping come from utf8proc.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fitmoe::text {

constexpr uint32_t kReplacementChar = 0xFFFD;

// Sequence length announced by a lead byte, by its high nibble only (1 for 0x00-0xBF, 2 for 0xC0-0xDF,
// 3 for 0xE0-0xEF, 4 for 0xF0-0xFF). This is how the reference splits text into "characters" for
// SentencePiece and BPE symbols, without validation.
inline int utf8_len_from_lead(uint8_t c) {
  static constexpr int8_t t[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return t[c >> 4];
}

// Appends cp (<= 0x10FFFF; surrogates are encoded like any other value) as UTF-8.
void append_utf8(std::string& out, uint32_t cp);
inline int utf8_encoded_len(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

// Decodes the code point at s[i] as the reference does (see above) and advances i. Returns false when
// the byte was invalid (cp = U+FFFD, i advanced by one).
bool decode_lenient(std::string_view s, size_t& i, uint32_t& cp);

// Strict validation: no overlongs, no surrogates, nothing above U+10FFFF, no truncated sequences.
bool is_valid_utf8(std::string_view s);

// Re-encodes s code point by code point through decode_lenient(): the byte string the reference
// actually tokenizes when the input is not valid UTF-8. Identity for valid UTF-8.
std::string canonicalize_lenient(std::string_view s);

// Length of the longest prefix of s made of complete sequences, treating the last (incomplete but so far
// well-formed) sequence, if any, as pending. Used by the streaming decoder.
size_t utf8_complete_prefix(std::string_view s);

// Replaces every ill-formed sequence by U+FFFD (one per maximal ill-formed subpart, as the Unicode
// standard recommends). Identity for valid UTF-8.
std::string sanitize_utf8(std::string_view s);

// NFC normalisation of UTF-8 text (utf8proc). Code points that cannot be normalised (surrogates) are
// kept and split the text into separately normalised runs. Fast path: text whose code points are all
// below U+0300 is returned unchanged.
std::string nfc(std::string_view s);
// True when nfc() could change s (it contains a code point >= U+0300).
bool may_need_nfc(std::string_view s);

// Python's str.isspace() for one code point (used by the template filters trim/strip/split).
bool py_isspace(uint32_t cp);
std::string utf8_upper(std::string_view s);
std::string utf8_lower(std::string_view s);
// Number of code points (invalid bytes count one each).
size_t utf8_length(std::string_view s);
// Decodes s (leniently) into code points.
std::vector<uint32_t> utf8_to_cps(std::string_view s);
std::string cps_to_utf8(const uint32_t* cps, size_t n);

// GPT-2 byte-level alphabet: byte b <-> the printable code point that stands for it in BPE vocabularies.
uint32_t byte_to_unicode(uint8_t b);
// Inverse; returns -1 for a code point that is not in the alphabet.
int unicode_to_byte(uint32_t cp);

// Unicode character classes as the reference tables (Unicode 15.1) define them. PCRE2 in Debian 12 knows
// Unicode 14 and counts U+180E as white space, so the pre-tokenizer rewrites the few code points on which
// the two disagree into stand-ins of the same class and UTF-8 length before matching (class_stand_in).
// Returns 0 when cp needs no stand-in.
uint32_t class_stand_in(uint32_t cp);

}  // namespace fitmoe::text

#include "text/unicode.h"

#include <utf8proc.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <cstring>
#include <memory>
#include <unordered_map>

#include "runtime/error.h"

namespace fitmoe::text {

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool decode_lenient(std::string_view s, size_t& i, uint32_t& cp) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  const uint8_t c = p[i];
  auto cont = [&](size_t k) { return i + k < n && (p[i + k] & 0xC0) == 0x80; };
  if (c < 0x80) {
    cp = c;
    i += 1;
    return true;
  }
  if ((c & 0xE0) == 0xC0) {
    if (cont(1)) {
      cp = ((c & 0x1Fu) << 6) | (p[i + 1] & 0x3Fu);
      i += 2;
      return true;
    }
  } else if ((c & 0xF0) == 0xE0) {
    if (cont(1) && cont(2)) {
      cp = ((c & 0x0Fu) << 12) | ((p[i + 1] & 0x3Fu) << 6) | (p[i + 2] & 0x3Fu);
      i += 3;
      return true;
    }
  } else if ((c & 0xF8) == 0xF0) {
    if (cont(1) && cont(2) && cont(3)) {
      uint32_t v = ((c & 0x07u) << 18) | ((p[i + 1] & 0x3Fu) << 12) | ((p[i + 2] & 0x3Fu) << 6) |
                   (p[i + 3] & 0x3Fu);
      if (v <= 0x10FFFF) {  // the reference throws on larger values; we treat the lead byte as invalid
        cp = v;
        i += 4;
        return true;
      }
    }
  }
  cp = kReplacementChar;
  i += 1;
  return false;
}

// Length of the well-formed sequence at p[0..n), or 0 if ill-formed (strict rules, Unicode Table 3-7).
static inline size_t strict_seq(const uint8_t* p, size_t n) {
  const uint8_t c = p[0];
  if (c < 0x80) return 1;
  if (c < 0xC2) return 0;
  auto in = [&](size_t k, uint8_t lo, uint8_t hi) { return k < n && p[k] >= lo && p[k] <= hi; };
  if (c < 0xE0) return in(1, 0x80, 0xBF) ? 2 : 0;
  if (c < 0xF0) {
    uint8_t lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    return in(1, lo, hi) && in(2, 0x80, 0xBF) ? 3 : 0;
  }
  if (c < 0xF5) {
    uint8_t lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    return in(1, lo, hi) && in(2, 0x80, 0xBF) && in(3, 0x80, 0xBF) ? 4 : 0;
  }
  return 0;
}

bool is_valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    size_t l = strict_seq(p + i, n - i);
    if (!l) return false;
    i += l;
  }
  return true;
}

std::string canonicalize_lenient(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  size_t i = 0;
  while (i < s.size()) {
    uint32_t cp;
    decode_lenient(s, i, cp);
    append_utf8(out, cp);
  }
  return out;
}

size_t utf8_complete_prefix(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  // Only the last up-to-3 bytes can be a pending (well-formed so far, but truncated) sequence.
  size_t start = n > 3 ? n - 3 : 0;
  for (size_t k = start; k < n; ++k) {
    const uint8_t c = p[k];
    if (c < 0xC2 || c > 0xF4) continue;  // not a multi-byte lead
    size_t need = c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    size_t have = n - k;
    if (have >= need) continue;
    // Check that the bytes present are a valid prefix.
    bool ok = true;
    for (size_t j = 1; j < have && ok; ++j) {
      uint8_t lo = 0x80, hi = 0xBF;
      if (j == 1) {
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
      }
      ok = p[k + j] >= lo && p[k + j] <= hi;
    }
    if (ok) return k;
  }
  return n;
}

std::string sanitize_utf8(std::string_view s) {
  if (is_valid_utf8(s)) return std::string(s);
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  std::string out;
  out.reserve(n + 8);
  size_t i = 0;
  while (i < n) {
    size_t l = strict_seq(p + i, n - i);
    if (l) {
      out.append(s.data() + i, l);
      i += l;
      continue;
    }
    // Maximal ill-formed subpart: the lead byte plus the continuation bytes that were still valid.
    const uint8_t c = p[i];
    size_t k = 1;
    if (c >= 0xC2 && c <= 0xF4) {
      size_t need = c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
      while (k < need && i + k < n) {
        uint8_t lo = 0x80, hi = 0xBF;
        if (k == 1) {
          if (c == 0xE0) lo = 0xA0;
          if (c == 0xED) hi = 0x9F;
          if (c == 0xF0) lo = 0x90;
          if (c == 0xF4) hi = 0x8F;
        }
        if (p[i + k] < lo || p[i + k] > hi) break;
        ++k;
      }
    }
    append_utf8(out, kReplacementChar);
    i += k;
  }
  return out;
}

bool may_need_nfc(std::string_view s) {
  // U+0300 is the first code point whose NFC quick-check is not "yes"; its lead byte is 0xCC.
  for (unsigned char c : s)
    if (c >= 0xCC) return true;
  return false;
}

static std::string nfc_valid(std::string_view s) {
  utf8proc_uint8_t* out = nullptr;
  utf8proc_ssize_t r = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                    static_cast<utf8proc_ssize_t>(s.size()), &out,
                                    static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (r < 0) {
    std::free(out);
    return std::string(s);  // cannot happen for valid UTF-8; keep the text rather than fail
  }
  std::string res(reinterpret_cast<const char*>(out), static_cast<size_t>(r));
  std::free(out);
  return res;
}

namespace {

// Code points near which NFC can change anything: non-zero combining class, canonical singletons and
// composition exclusions, and every code point that is a non-first part of a canonical decomposition
// (it may compose with what precedes it), plus the Hangul vowel and trailing jamo. Text without them is
// already in NFC (the standard quick-check argument), so only short spans around them go to utf8proc.
struct NfcRisk {
  std::vector<uint64_t> bits = std::vector<uint64_t>((0x110000 + 63) / 64, 0);
  void mark(uint32_t c) {
    if (c < 0x110000) bits[c >> 6] |= 1ull << (c & 63);
  }
  NfcRisk() {
    for (uint32_t c = 0x300; c < 0x110000; ++c) {
      if (c >= 0xD800 && c <= 0xDFFF) continue;
      const utf8proc_property_t* pr = utf8proc_get_property(static_cast<utf8proc_int32_t>(c));
      if (pr->combining_class) {
        mark(c);
        continue;
      }
      if (pr->decomp_seqindex == UINT16_MAX || pr->decomp_type != 0) continue;
      utf8proc_int32_t buf[16];
      int last = 0;
      utf8proc_ssize_t n = utf8proc_decompose_char(static_cast<utf8proc_int32_t>(c), buf, 16, UTF8PROC_DECOMPOSE, &last);
      if (n == 1 && static_cast<uint32_t>(buf[0]) != c) mark(c);
      for (utf8proc_ssize_t k = 1; k < n && k < 16; ++k) mark(static_cast<uint32_t>(buf[k]));
      if (pr->comp_exclusion) mark(c);
    }
    for (uint32_t c = 0x1161; c <= 0x1175; ++c) mark(c);
    for (uint32_t c = 0x11A8; c <= 0x11C2; ++c) mark(c);
  }
  bool at(uint32_t c) const { return c < 0x110000 && (bits[c >> 6] >> (c & 63) & 1); }
};

const NfcRisk& nfc_risk() {
  static const NfcRisk r;
  return r;
}

}  // namespace

std::string nfc(std::string_view s) {
  if (!may_need_nfc(s)) return std::string(s);
  const NfcRisk& risk = nfc_risk();
  std::string out;
  size_t copied = 0;        // s[0, copied) is in `out`
  size_t prev_start = 0;    // start of the previous code point if it can start a span, else npos
  bool prev_ok = false;
  size_t i = 0;
  while (i < s.size()) {
    size_t at = i;
    uint32_t cp;
    bool valid = decode_lenient(s, i, cp) && !(cp >= 0xD800 && cp <= 0xDFFF);
    if (!valid || !risk.at(cp)) {
      prev_ok = valid;
      prev_start = at;
      continue;
    }
    // A span: the starter before it (if usable), the risky code points, up to the next safe one.
    size_t b = prev_ok ? prev_start : at;
    size_t e = i;
    while (e < s.size()) {
      size_t j = e;
      uint32_t c2;
      bool v2 = decode_lenient(s, j, c2) && !(c2 >= 0xD800 && c2 <= 0xDFFF);
      if (!v2 || !risk.at(c2)) break;
      e = j;
    }
    out.append(s.data() + copied, b - copied);
    out += nfc_valid(s.substr(b, e - b));
    copied = e;
    i = e;
    prev_ok = false;  // what follows starts fresh after a normalised span
  }
  if (copied == 0) return std::string(s);
  out.append(s.data() + copied, s.size() - copied);
  return out;
}

bool py_isspace(uint32_t c) {
  return (c >= 9 && c <= 13) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

std::vector<uint32_t> utf8_to_cps(std::string_view s) {
  std::vector<uint32_t> v;
  v.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    uint32_t cp;
    decode_lenient(s, i, cp);
    v.push_back(cp);
  }
  return v;
}

std::string cps_to_utf8(const uint32_t* cps, size_t n) {
  std::string s;
  s.reserve(n);
  for (size_t k = 0; k < n; ++k) append_utf8(s, cps[k]);
  return s;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0, i = 0;
  while (i < s.size()) {
    uint32_t cp;
    decode_lenient(s, i, cp);
    ++n;
  }
  return n;
}

static std::string map_case(std::string_view s, bool upper) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    uint32_t cp;
    decode_lenient(s, i, cp);
    if (cp < 0x80) {
      char c = static_cast<char>(cp);
      if (upper && c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
      if (!upper && c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
      out.push_back(c);
    } else {
      append_utf8(out, static_cast<uint32_t>(upper ? utf8proc_toupper(static_cast<utf8proc_int32_t>(cp))
                                                   : utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))));
    }
  }
  return out;
}
std::string utf8_upper(std::string_view s) { return map_case(s, true); }
std::string utf8_lower(std::string_view s) { return map_case(s, false); }

// ---- GPT-2 byte alphabet ----------------------------------------------------------------------------

namespace {
struct ByteAlphabet {
  std::array<uint32_t, 256> to_cp{};
  std::array<int16_t, 512> to_byte{};  // every alphabet code point is below 512
  ByteAlphabet() {
    // Printable Latin-1 bytes stand for themselves; the others get 256, 257, ... in byte order.
    uint32_t next = 256;
    to_byte.fill(-1);
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_cp[b] = printable ? static_cast<uint32_t>(b) : next++;
      to_byte[to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};
const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet a;
  return a;
}
}  // namespace

uint32_t byte_to_unicode(uint8_t b) { return byte_alphabet().to_cp[b]; }
int unicode_to_byte(uint32_t cp) { return cp < 512 ? byte_alphabet().to_byte[cp] : -1; }

// ---- Character classes: reference tables vs PCRE2 ----------------------------------------------------

namespace {

// The classes the pre-tokenizer regexes use. OTHER = none of them (controls, format, unassigned, ...).
enum Cls : int { L = 0, N, M, P, S, WS, OTHER, NCLS };

bool ref_whitespace(uint32_t c) {
  // Unicode's White_Space property (the reference's whitespace set).
  return (c >= 9 && c <= 13) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// The reference's class of a code point: utf8proc's categories (Unicode 15.0) plus the few code points
// Unicode 15.1 assigned (CJK Extension I, the new ideographic description characters).
Cls ref_class(uint32_t c) {
  if (ref_whitespace(c)) return WS;
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  if (cat == UTF8PROC_CATEGORY_CN) {
    if (c >= 0x2EBF0 && c <= 0x2EE5D) return L;
    if ((c >= 0x2FFC && c <= 0x2FFF) || c == 0x31EF) return S;
    return OTHER;
  }
  switch (cat) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO:
      return L;
    case UTF8PROC_CATEGORY_MN: case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME:
      return M;
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO:
      return N;
    case UTF8PROC_CATEGORY_PC: case UTF8PROC_CATEGORY_PD: case UTF8PROC_CATEGORY_PS:
    case UTF8PROC_CATEGORY_PE: case UTF8PROC_CATEGORY_PI: case UTF8PROC_CATEGORY_PF:
    case UTF8PROC_CATEGORY_PO:
      return P;
    case UTF8PROC_CATEGORY_SM: case UTF8PROC_CATEGORY_SC: case UTF8PROC_CATEGORY_SK:
    case UTF8PROC_CATEGORY_SO:
      return S;
    default:
      return OTHER;
  }
}

struct StandIns {
  std::vector<uint64_t> bits;                  // code points that need a stand-in
  std::unordered_map<uint32_t, uint32_t> map;  // code point -> stand-in

  StandIns() : bits((0x110000 + 63) / 64, 0) {
    // The code points where assignments happen (planes 0-3 and 14; planes 4-13 are unassigned and 15-16
    // private use in every Unicode version) as one UTF-8 string; one PCRE2 pass tells their classes.
    std::string all;
    std::vector<uint32_t> cps, starts;
    all.reserve(1200000);
    cps.reserve(270000);
    starts.reserve(270000);
    auto add = [&](uint32_t c) {
      starts.push_back(static_cast<uint32_t>(all.size()));
      cps.push_back(c);
      append_utf8(all, c);
    };
    for (uint32_t c = 0; c < 0x40000; ++c)
      if (c < 0xD800 || c > 0xDFFF) add(c);
    for (uint32_t c = 0xE0000; c < 0xE1000; ++c) add(c);
    std::vector<uint8_t> pcre_cls(0x110000, OTHER);
    const char* pat = "(\\p{L}+)|(\\p{N}+)|(\\p{M}+)|(\\p{P}+)|(\\p{S}+)|(\\s+)";
    int err = 0;
    PCRE2_SIZE eoff = 0;
    pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                   &err, &eoff, nullptr);
    if (!re) throw Error("pcre2: cannot compile the Unicode class pattern");
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(re, nullptr);
    PCRE2_SIZE off = 0;
    size_t j = 0;
    while (off < all.size()) {
      int rc = pcre2_match(re, reinterpret_cast<PCRE2_SPTR>(all.data()), all.size(), off, PCRE2_NO_UTF_CHECK, md,
                           nullptr);
      if (rc < 2) break;
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      const int k = rc - 2;  // the group that matched is the last one set
      while (j < starts.size() && starts[j] < ov[0]) ++j;
      for (; j < starts.size() && starts[j] < ov[1]; ++j) pcre_cls[cps[j]] = static_cast<uint8_t>(k);
      off = ov[1] > ov[0] ? ov[1] : ov[0] + 1;
    }
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    // Stand-ins by (class, UTF-8 length); checked against PCRE2's own classification below.
    static const uint32_t reps[NCLS][5] = {
        /* L */ {0, 0, 0x00AA, 0x4E00, 0x20000},
        /* N */ {0, 0, 0x00B2, 0x0966, 0x10107},
        /* M */ {0, 0, 0x0300, 0x0900, 0x101FD},
        /* P */ {0, 0, 0x00A1, 0x2010, 0x10100},
        /* S */ {0, 0, 0x00A2, 0x2190, 0x1F600},
        /* WS */ {0, 0, 0x00A0, 0x2000, 0},
        /* OTHER */ {0, 0, 0x0080, 0xE000, 0xF0000},
    };
    for (int k = 0; k < NCLS; ++k)
      for (int l = 2; l <= 4; ++l)
        if (reps[k][l] && pcre_cls[reps[k][l]] != k) throw Error("pcre2: unexpected Unicode class of a stand-in");
    for (uint32_t c : cps) {
      if (c < 0x80) continue;
      Cls want = ref_class(c);
      if (pcre_cls[c] == want) continue;
      uint32_t r = reps[want][utf8_encoded_len(c)];
      if (!r) throw Error("pcre2: no stand-in for a code point whose class differs");
      bits[c >> 6] |= 1ull << (c & 63);
      map[c] = r;
    }
    // Surrogates (which lenient decoding lets through) are "other" code points of 3 bytes.
    for (uint32_t c = 0xD800; c <= 0xDFFF; ++c) {
      bits[c >> 6] |= 1ull << (c & 63);
      map[c] = reps[OTHER][3];
    }
  }
};

const StandIns& stand_ins() {
  static const StandIns s;
  return s;
}

}  // namespace

uint32_t class_stand_in(uint32_t cp) {
  if (cp < 0x80 || cp >= 0x110000) return 0;
  const auto& s = stand_ins();
  if (!(s.bits[cp >> 6] >> (cp & 63) & 1)) return 0;
  return s.map.at(cp);
}

}  // namespace fitmoe::text

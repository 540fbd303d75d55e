// Streaming text that may still turn into a marker (a stop string, "<think>", "<tool_call>"): how much of
// its end must be held back. Shared by the server's parsers and the public API's stop strings.
#pragma once
#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

namespace fitmoe {

// The length of the longest tail of text that is a proper prefix of marker (0: nothing to hold).
inline size_t held_prefix(std::string_view text, std::string_view marker) {
  if (marker.empty()) return 0;
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n)
    if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
  return 0;
}

inline size_t held_prefix(std::string_view text, const std::vector<std::string>& markers) {
  size_t h = 0;
  for (const std::string& m : markers) h = std::max(h, held_prefix(text, m));
  return h;
}

}  // namespace fitmoe

// One exception type for every user-facing failure (bad file, bad flag, budget too small).
// The CLI prints what() on one line and exits 1; library users catch fitmoe::Error.
#pragma once
#include <stdexcept>
#include <string>

namespace fitmoe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace fitmoe

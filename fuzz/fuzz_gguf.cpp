// libFuzzer target for the GGUF parser: any input must either parse into tensors that lie inside the
// buffer and metadata that can be read back, or throw fitmoe::Error. Crashes, leaks and sanitizer
// reports are failures.
#include <cstddef>
#include <cstdint>

#include "format/gguf.h"
#include "runtime/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto f = fitmoe::gguf::File::parse(data, size, "fuzz");
    for (const auto& t : f->tensors()) {
      // ASan checks that both ends lie in bounds; the volatile store keeps the reads.
      volatile uint8_t sink = 0;
      if (t.nbytes) sink = static_cast<uint8_t>(t.data[0] ^ t.data[t.nbytes - 1]);
      (void)sink;
    }
    for (const auto& [key, v] : f->metadata()) {
      try {
        if (v.is_array() && v.elem_type != fitmoe::gguf::ValueType::STRING) (void)f->get_float_array(key);
        if (v.is_array() && v.elem_type == fitmoe::gguf::ValueType::STRING) (void)f->get_string_array(key);
      } catch (const fitmoe::Error&) {
      }
    }
  } catch (const fitmoe::Error&) {
  }
  return 0;
}

// Fuzzes the safetensors reader with arbitrary file contents: it must return an error or a
// checkpoint whose every tensor addresses only bytes of the file.
#include <cstddef>
#include <cstdint>

#include "server/model/io/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace collabserve;
  model::io::FileBytes bytes = fuzz::ExactCopy(data, size);
  const uint8_t* file = bytes.data;
  auto checkpoint = model::io::ParseSafetensorsBytes(bytes, "fuzz.safetensors");
  if (!checkpoint.ok()) {
    if (checkpoint.status().message().empty()) std::abort();  // every refusal names its reason
    return 0;
  }
  for (const auto& [name, tensor] : checkpoint->tensors) {
    if (name.empty()) fuzz::Violation("empty name accepted", name);
    if (!tensor.is_contiguous()) fuzz::Violation("safetensors tensor is not contiguous", name);
    fuzz::CheckTensorInBounds(name, tensor, file, size);
  }
  return 0;
}

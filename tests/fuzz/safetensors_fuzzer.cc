// Fuzzes the safetensors reader with arbitrary file contents: it must return an error or a
// checkpoint whose every tensor addresses only bytes of the file.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

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
  // Round trip through the writer (names and metadata are valid UTF-8: the JSON parser checked).
  std::vector<std::string> storage;
  storage.reserve(checkpoint->tensors.size());
  std::vector<model::io::TensorToWrite> tensors;
  for (const auto& [name, tensor] : checkpoint->tensors) {
    storage.push_back(fuzz::ContiguousBytes(tensor));
    tensors.push_back({name, tensor.dtype, tensor.shape, storage.back().data()});
  }
  auto written = model::io::SerializeSafetensors(tensors, checkpoint->metadata);
  if (!written.ok()) {
    std::fprintf(stderr, "cannot write what was read: %s\n", std::string(written.status().message()).c_str());
    std::abort();
  }
  auto again = model::io::ParseSafetensors(std::make_shared<const std::string>(*std::move(written)), "again");
  if (!again.ok()) {
    std::fprintf(stderr, "cannot read what was written: %s\n", std::string(again.status().message()).c_str());
    std::abort();
  }
  fuzz::CheckSameTensors(*checkpoint, *again);
  if (again->metadata != checkpoint->metadata) fuzz::Violation("round trip changed the metadata", "");
  return 0;
}

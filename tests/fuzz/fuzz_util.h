// Helpers shared by the fuzz targets: the input as an exactly-sized heap buffer (so ASan sees any
// read past its end), and the bounds invariant every checkpoint reader promises (checkpoint.h).
#ifndef COLLABSERVE_TESTS_FUZZ_FUZZ_UTIL_H_
#define COLLABSERVE_TESTS_FUZZ_FUZZ_UTIL_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "server/model/io/checkpoint.h"

namespace collabserve::fuzz {

// A copy of the input in a heap block of exactly `size` bytes, as FileBytes owning it.
inline model::io::FileBytes ExactCopy(const uint8_t* data, size_t size) {
  model::io::FileBytes out;
  if (size == 0) return out;
  std::shared_ptr<uint8_t[]> copy(new uint8_t[size]);
  std::memcpy(copy.get(), data, size);
  out.data = copy.get();
  out.size = size;
  out.owner = std::shared_ptr<const void>(copy, copy.get());
  return out;
}

[[noreturn]] inline void Violation(const char* what, const std::string& tensor) {
  std::fprintf(stderr, "INVARIANT VIOLATED: tensor '%s': %s\n", tensor.c_str(), what);
  std::abort();
}

// Every element the tensor's shape and strides address lies in [data, data + storage_bytes_available)
// and that range lies inside the file bytes [file, file + file_size). Touches the first and last
// addressable bytes so that ASan also checks them.
inline void CheckTensorInBounds(const std::string& name, const model::io::RawTensor& t,
                                const uint8_t* file, size_t file_size) {
  if (t.shape.size() != t.strides.size()) Violation("rank of shape and strides differ", name);
  if (t.shape.size() > model::io::kMaxTensorRank) Violation("rank over the limit", name);
  const size_t esize = model::io::DTypeSize(t.dtype);
  __int128 lo = 0, hi = 0;
  bool empty = false;
  for (size_t k = 0; k < t.shape.size(); ++k) {
    if (t.shape[k] < 0) Violation("negative dim", name);
    if (t.shape[k] == 0) empty = true;
    const __int128 span = static_cast<__int128>(t.shape[k] - 1) * t.strides[k];
    if (span < 0) lo += span; else hi += span;
  }
  if (empty) return;
  if (t.data < file || t.data > file + file_size) Violation("data outside the file", name);
  if (t.storage_bytes_available > static_cast<size_t>(file + file_size - t.data)) {
    Violation("storage runs past the end of the file", name);
  }
  if (lo < 0) Violation("a negative stride reaches before data", name);
  if ((hi + 1) * static_cast<__int128>(esize) > static_cast<__int128>(t.storage_bytes_available)) {
    Violation("addressable elements run past storage_bytes_available", name);
  }
  volatile uint8_t sink = t.data[0];
  sink = t.data[static_cast<size_t>(hi) * esize + esize - 1];
  (void)sink;
  // numel() and nbytes() must not overflow for anything a reader accepted.
  __int128 n = 1;
  for (int64_t d : t.shape) {
    n *= d;
    if (n > (static_cast<__int128>(1) << 62)) Violation("numel overflows", name);
  }
  if (t.numel() != static_cast<int64_t>(n)) Violation("numel() disagrees with the shape", name);
}

}  // namespace collabserve::fuzz

#endif  // COLLABSERVE_TESTS_FUZZ_FUZZ_UTIL_H_

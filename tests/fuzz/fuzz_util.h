// Helpers shared by the fuzz targets: the input as an exactly-sized heap buffer (so ASan sees any
// read past its end), and the bounds invariant every checkpoint reader promises (checkpoint.h).
#ifndef COLLABSERVE_TESTS_FUZZ_FUZZ_UTIL_H_
#define COLLABSERVE_TESTS_FUZZ_FUZZ_UTIL_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

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

// Well-formed UTF-8 by the byte ranges of Unicode Table 3-7, independent of server/text/utf8.cc.
inline bool ValidUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    uint8_t b = p[i];
    if (b <= 0x7F) { ++i; continue; }
    int len;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) len = 2;
    else if (b == 0xE0) { len = 3; lo = 0xA0; }
    else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) len = 3;
    else if (b == 0xED) { len = 3; hi = 0x9F; }
    else if (b == 0xF0) { len = 4; lo = 0x90; }
    else if (b >= 0xF1 && b <= 0xF3) len = 4;
    else if (b == 0xF4) { len = 4; hi = 0x8F; }
    else return false;
    if (i + len > n) return false;
    if (p[i + 1] < lo || p[i + 1] > hi) return false;
    for (int k = 2; k < len; ++k) {
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return false;
    }
    i += len;
  }
  return true;
}

// The tensor's elements in row-major logical order, contiguous (strides honoured).
inline std::string ContiguousBytes(const model::io::RawTensor& t) {
  const size_t esize = model::io::DTypeSize(t.dtype);
  std::string out;
  const int64_t n = t.numel();
  if (n <= 0) return out;
  out.resize(static_cast<size_t>(n) * esize);
  std::vector<int64_t> index(t.shape.size(), 0);
  for (int64_t flat = 0; flat < n; ++flat) {
    int64_t offset = 0;
    for (size_t k = 0; k < index.size(); ++k) offset += index[k] * t.strides[k];
    std::memcpy(&out[static_cast<size_t>(flat) * esize], t.data + offset * esize, esize);
    for (size_t k = index.size(); k-- > 0;) {
      if (++index[k] < t.shape[k]) break;
      index[k] = 0;
    }
  }
  return out;
}

// What a reader accepted, our writer can write, and reading that back gives the same tensors
// (names, dtypes, shapes, element bytes).
inline void CheckSameTensors(const model::io::Checkpoint& a, const model::io::Checkpoint& b) {
  if (a.tensors.size() != b.tensors.size()) Violation("round trip changed the tensor count", "");
  for (const auto& [name, t] : a.tensors) {
    auto it = b.tensors.find(name);
    if (it == b.tensors.end()) Violation("round trip lost the tensor", name);
    if (it->second.dtype != t.dtype || it->second.shape != t.shape) {
      Violation("round trip changed dtype or shape", name);
    }
    if (ContiguousBytes(it->second) != ContiguousBytes(t)) Violation("round trip changed the data", name);
  }
}

}  // namespace collabserve::fuzz

#endif  // COLLABSERVE_TESTS_FUZZ_FUZZ_UTIL_H_

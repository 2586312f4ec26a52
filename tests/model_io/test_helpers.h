// Helpers shared by the model_io tests: the INVALID_ARGUMENT check, byte literals, temporary files,
// fixture paths, element access with dtype conversion, and the value formula the torch cross-checks
// use.
#ifndef COLLABSERVE_TESTS_MODEL_IO_TEST_HELPERS_H_
#define COLLABSERVE_TESTS_MODEL_IO_TEST_HELPERS_H_

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/io/checkpoint.h"

// Expects `status` to be INVALID_ARGUMENT with `text` in its message.
#define EXPECT_INVALID(status, text)                                                     \
  do {                                                                                   \
    absl::Status s_ = (status);                                                          \
    EXPECT_EQ(s_.code(), absl::StatusCode::kInvalidArgument) << s_;                      \
    EXPECT_THAT(std::string(s_.message()), ::testing::HasSubstr(text));                  \
  } while (0)

// The bytes of a string literal that may contain NULs.
#define B(lit) std::string(lit, sizeof(lit) - 1)

namespace collabserve::model::io::testing {

inline std::string SourcePath(const std::string& rel) {
  const char* dir = std::getenv("COLLABSERVE_SOURCE_DIR");
  return std::string(dir ? dir : ".") + "/" + rel;
}

// Removes the files TempPath() handed out when the test binary exits.
struct TempFiles {
  std::vector<std::string> paths;
  ~TempFiles() {
    for (const std::string& p : paths) std::remove(p.c_str());
  }
};
inline TempFiles temp_files;

// A fresh path under the test temp dir (unique per process and call), removed at exit.
inline std::string TempPath(const std::string& name) {
  static int counter = 0;
  std::string path = ::testing::TempDir() + "model_io_" + std::to_string(::getpid()) + "_" +
                     std::to_string(counter++) + "_" + name;
  temp_files.paths.push_back(path);
  return path;
}

inline void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant ? NAN : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(mant | 0x400), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}

// Exact for values representable in half precision (the tests use only those).
inline uint16_t FloatToHalf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  if (f == 0) return sign;
  int exp;
  float m = std::frexp(std::fabs(f), &exp);  // f = m * 2^exp, m in [0.5, 1)
  int e = exp + 14;                           // half exponent field
  uint16_t mant = static_cast<uint16_t>(std::lround((m * 2 - 1) * 1024));
  return static_cast<uint16_t>(sign | (e << 10) | mant);
}

inline float BF16ToFloat(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

// The element at flat position `flat` of `t` in row-major logical order, honouring strides, as a
// double (bool as 0/1). Checks the byte it reads is inside the storage.
inline double ElementAt(const RawTensor& t, int64_t flat) {
  int64_t offset = 0;
  for (size_t k = t.shape.size(); k-- > 0;) {
    offset += (flat % t.shape[k]) * t.strides[k];
    flat /= t.shape[k];
  }
  const size_t esize = DTypeSize(t.dtype);
  EXPECT_LE(static_cast<size_t>(offset + 1) * esize, t.storage_bytes_available);
  const uint8_t* p = t.data + offset * esize;
  switch (t.dtype) {
    case DType::kF64: { double v; std::memcpy(&v, p, 8); return v; }
    case DType::kF32: { float v; std::memcpy(&v, p, 4); return v; }
    case DType::kF16: { uint16_t v; std::memcpy(&v, p, 2); return HalfToFloat(v); }
    case DType::kBF16: { uint16_t v; std::memcpy(&v, p, 2); return BF16ToFloat(v); }
    case DType::kI64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
    case DType::kI32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    case DType::kI16: { int16_t v; std::memcpy(&v, p, 2); return v; }
    case DType::kI8: { int8_t v; std::memcpy(&v, p, 1); return v; }
    case DType::kU8: return *p;
    case DType::kBool: return *p ? 1 : 0;
  }
  return NAN;
}

inline std::vector<double> Values(const RawTensor& t) {
  std::vector<double> out;
  for (int64_t i = 0; i < t.numel(); ++i) out.push_back(ElementAt(t, i));
  return out;
}

// Element k of every tensor the writer tests write; must match formula() in
// tests/reference/make_torch_checkpoints.py.
inline double FormulaValue(DType dtype, int64_t k) {
  switch (dtype) {
    case DType::kF64: case DType::kF32: case DType::kF16: case DType::kBF16:
      return (static_cast<double>(k) - 3) * 0.25;
    case DType::kU8: return static_cast<double>(k % 256);
    case DType::kBool: return k % 3 == 0 ? 1 : 0;
    default: return static_cast<double>(k - 3);
  }
}

// numel elements of the formula, encoded as `dtype`'s bytes.
inline std::string FormulaBytes(DType dtype, int64_t numel) {
  std::string out;
  for (int64_t k = 0; k < numel; ++k) {
    const double v = FormulaValue(dtype, k);
    char buf[8];
    size_t n = DTypeSize(dtype);
    switch (dtype) {
      case DType::kF64: std::memcpy(buf, &v, 8); break;
      case DType::kF32: { float f = static_cast<float>(v); std::memcpy(buf, &f, 4); break; }
      case DType::kF16: { uint16_t h = FloatToHalf(static_cast<float>(v)); std::memcpy(buf, &h, 2); break; }
      case DType::kBF16: { uint16_t h = FloatToBF16(static_cast<float>(v)); std::memcpy(buf, &h, 2); break; }
      case DType::kI64: { int64_t x = static_cast<int64_t>(v); std::memcpy(buf, &x, 8); break; }
      case DType::kI32: { int32_t x = static_cast<int32_t>(v); std::memcpy(buf, &x, 4); break; }
      case DType::kI16: { int16_t x = static_cast<int16_t>(v); std::memcpy(buf, &x, 2); break; }
      case DType::kI8: { int8_t x = static_cast<int8_t>(v); std::memcpy(buf, &x, 1); break; }
      case DType::kU8: case DType::kBool: buf[0] = static_cast<char>(static_cast<int>(v)); break;
    }
    out.append(buf, n);
  }
  return out;
}

// One tensor of each dtype named "<prefix>.<DTYPE>", with shapes of rank 0..3 (including an empty
// one), holding FormulaBytes. `storage` keeps the bytes alive.
struct FormulaTensors {
  std::vector<std::string> storage;
  std::vector<TensorToWrite> tensors;
};
inline FormulaTensors MakeFormulaTensors(const std::string& prefix) {
  const std::vector<std::vector<int64_t>> shapes = {{2, 3}, {5}, {}, {2, 2, 3}, {3, 4}, {0, 4}, {7}, {4, 2}, {6}, {3, 3}};
  FormulaTensors out;
  out.storage.reserve(std::size(kAllDTypes));
  size_t i = 0;
  for (DType d : kAllDTypes) {
    const std::vector<int64_t>& shape = shapes[i++ % shapes.size()];
    int64_t numel = 1;
    for (int64_t s : shape) numel *= s;
    out.storage.push_back(FormulaBytes(d, numel));
    out.tensors.push_back({prefix + "." + std::string(DTypeName(d)), d, shape, out.storage.back().data()});
  }
  return out;
}

}  // namespace collabserve::model::io::testing

#endif  // COLLABSERVE_TESTS_MODEL_IO_TEST_HELPERS_H_

// Element types of checkpoint tensors, named as safetensors names them ("F32", "BF16", ...), with
// the element sizes the readers and writers use for bounds arithmetic. No torch dependency.
#ifndef COLLABSERVE_SERVER_MODEL_IO_DTYPE_H_
#define COLLABSERVE_SERVER_MODEL_IO_DTYPE_H_

#include <cstddef>
#include <optional>
#include <string_view>

namespace collabserve::model::io {

enum class DType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

// All dtypes, in declaration order (for tests and tables).
inline constexpr DType kAllDTypes[] = {DType::kF64, DType::kF32, DType::kF16, DType::kBF16,
                                       DType::kI64, DType::kI32, DType::kI16, DType::kI8,
                                       DType::kU8,  DType::kBool};

// Bytes per element: 8, 4, 2, 2, 8, 4, 2, 1, 1, 1.
size_t DTypeSize(DType dtype);

// The safetensors name: "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL".
std::string_view DTypeName(DType dtype);

// Inverse of DTypeName (exact, case-sensitive); nullopt for any other string, including
// safetensors dtypes we do not support (U16, U32, U64, F8_E4M3, F8_E5M2).
std::optional<DType> DTypeFromName(std::string_view name);

// The torch storage class name for `dtype` ("FloatStorage", "HalfStorage", "BFloat16Storage", ...)
// and its inverse (nullopt for a name that is not one of the ten).
std::string_view TorchStorageName(DType dtype);
std::optional<DType> DTypeFromTorchStorageName(std::string_view name);

}  // namespace collabserve::model::io

#endif  // COLLABSERVE_SERVER_MODEL_IO_DTYPE_H_

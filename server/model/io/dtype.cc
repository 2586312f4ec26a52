#include "server/model/io/dtype.h"

namespace collabserve::model::io {
namespace {

struct DTypeInfo {
  DType dtype;
  size_t size;
  std::string_view name;
  std::string_view torch_storage;
};

constexpr DTypeInfo kInfo[] = {
    {DType::kF64, 8, "F64", "DoubleStorage"},    {DType::kF32, 4, "F32", "FloatStorage"},
    {DType::kF16, 2, "F16", "HalfStorage"},      {DType::kBF16, 2, "BF16", "BFloat16Storage"},
    {DType::kI64, 8, "I64", "LongStorage"},      {DType::kI32, 4, "I32", "IntStorage"},
    {DType::kI16, 2, "I16", "ShortStorage"},     {DType::kI8, 1, "I8", "CharStorage"},
    {DType::kU8, 1, "U8", "ByteStorage"},        {DType::kBool, 1, "BOOL", "BoolStorage"},
};

const DTypeInfo& Info(DType dtype) {
  for (const DTypeInfo& info : kInfo) {
    if (info.dtype == dtype) return info;
  }
  return kInfo[0];  // unreachable for valid enum values
}

}  // namespace

size_t DTypeSize(DType dtype) { return Info(dtype).size; }
std::string_view DTypeName(DType dtype) { return Info(dtype).name; }
std::string_view TorchStorageName(DType dtype) { return Info(dtype).torch_storage; }

std::optional<DType> DTypeFromName(std::string_view name) {
  for (const DTypeInfo& info : kInfo) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

std::optional<DType> DTypeFromTorchStorageName(std::string_view name) {
  for (const DTypeInfo& info : kInfo) {
    if (info.torch_storage == name) return info.dtype;
  }
  return std::nullopt;
}

}  // namespace collabserve::model::io

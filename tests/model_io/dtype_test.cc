#include "server/model/io/dtype.h"

#include <set>
#include <string>

#include "gtest/gtest.h"

namespace collabserve::model::io {
namespace {

TEST(DTypeTest, NamesAndSizesMatchSafetensorsAndTorch) {
  EXPECT_EQ(DTypeName(DType::kBF16), "BF16");
  EXPECT_EQ(DTypeName(DType::kBool), "BOOL");
  EXPECT_EQ(DTypeSize(DType::kF64), 8u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBool), 1u);
  EXPECT_EQ(TorchStorageName(DType::kF32), "FloatStorage");
  EXPECT_EQ(TorchStorageName(DType::kI8), "CharStorage");
  EXPECT_EQ(TorchStorageName(DType::kU8), "ByteStorage");
}

TEST(DTypeTest, NameLookupsInvertEachOther) {
  std::set<std::string_view> names;
  for (DType d : kAllDTypes) {
    EXPECT_EQ(DTypeFromName(DTypeName(d)), d);
    EXPECT_EQ(DTypeFromTorchStorageName(TorchStorageName(d)), d);
    EXPECT_TRUE(names.insert(DTypeName(d)).second);
  }
  EXPECT_EQ(names.size(), 10u);
  EXPECT_FALSE(DTypeFromName("f32").has_value());
  EXPECT_FALSE(DTypeFromName("U16").has_value());
  EXPECT_FALSE(DTypeFromTorchStorageName("Storage").has_value());
}

}  // namespace
}  // namespace collabserve::model::io

// What the compression tests share: a checkpoint directory loaded as a classifier prepared on the
// CPU in float32 (what the compressor reads).
#ifndef COLLABSERVE_TESTS_COMPRESS_COMPRESS_TEST_UTIL_H_
#define COLLABSERVE_TESTS_COMPRESS_COMPRESS_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "server/compress/collaborative.h"
#include "server/model/bert.h"
#include "server/model/config.h"
#include "server/model/param_counts.h"

namespace collabserve::compress::compress_testing {

// `dir`'s config.json and weights, prepared (unpacked); null after a test failure naming the cause.
inline std::unique_ptr<model::BertClassifier> LoadPrepared(const std::string& dir) {
  auto c = model::BertConfig::FromFile(dir + "/config.json");
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return nullptr;
  auto m = model::LoadClassifier(dir, *c);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return nullptr;
  (*m)->Prepare(c10::Device(c10::kCPU), c10::kFloat, /*pack_weights=*/false);
  return *std::move(m);
}

// One rank for every layer.
inline CompressOptions Rank(int r) {
  CompressOptions o;
  o.spec.kind = RankSpec::Kind::kRank;
  o.spec.rank = r;
  return o;
}

}  // namespace collabserve::compress::compress_testing

#endif  // COLLABSERVE_TESTS_COMPRESS_COMPRESS_TEST_UTIL_H_

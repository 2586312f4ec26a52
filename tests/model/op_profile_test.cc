// OpProfile: top-level operator calls counted and timed by name on the observing thread only,
// nested calls counted but not timed twice, nothing after Stop(), one profile per thread; and the
// engine's forward pass dispatches no operator that reads a tensor's value back to the host
// (on CUDA each such read waits for the device and stalls the launches behind it).
#include "server/model/op_profile.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "server/model/bert.h"
#include "server/model/config.h"
#include "tests/model/small_model.h"

namespace collabserve::model {
namespace {

const OpProfile::Op* Find(const std::vector<OpProfile::Op>& ops, const std::string& name) {
  for (const auto& op : ops) {
    if (op.name == name) return &op;
  }
  return nullptr;
}

TEST(OpProfileTest, CountsAndTimesTopLevelCallsByName) {
  c10::InferenceMode guard;
  const at::Tensor x = at::randn({4, 8}), w = at::randn({3, 8}), b = at::randn({3});
  OpProfile profile;
  for (int i = 0; i < 3; ++i) at::linear(x, w, b);
  at::Tensor y = at::relu(x);
  profile.Stop();

  const auto ops = profile.Ops();
  const OpProfile::Op* linear = Find(ops, "aten::linear");
  const OpProfile::Op* relu = Find(ops, "aten::relu");
  ASSERT_NE(linear, nullptr);
  ASSERT_NE(relu, nullptr);
  EXPECT_EQ(linear->calls, 3);
  EXPECT_EQ(relu->calls, 1);
  // aten::linear's own addmm (and the transpose of w) are nested: counted, not top-level.
  const OpProfile::Op* addmm = Find(ops, "aten::addmm");
  ASSERT_NE(addmm, nullptr);
  EXPECT_EQ(addmm->calls, 0);
  EXPECT_EQ(addmm->nested, 3);
  EXPECT_EQ(addmm->seconds, 0);
  EXPECT_EQ(profile.top_level_calls(), 4);
  EXPECT_GT(profile.all_calls(), profile.top_level_calls());
  EXPECT_GT(linear->seconds, 0);
  double sum = 0;
  for (const auto& op : ops) sum += op.seconds;
  EXPECT_DOUBLE_EQ(profile.seconds(), sum);
  EXPECT_GT(linear->longest, 0);
  EXPECT_LE(linear->longest, linear->seconds);
  EXPECT_GE(3 * linear->longest, linear->seconds);
  EXPECT_DOUBLE_EQ(relu->longest, relu->seconds);
  // Most host time first.
  for (size_t i = 1; i < ops.size(); ++i) EXPECT_GE(ops[i - 1].seconds, ops[i].seconds);
}

TEST(OpProfileTest, ObservesNothingAfterStopNorOnOtherThreads) {
  c10::InferenceMode guard;
  const at::Tensor x = at::randn({16});
  OpProfile profile;
  std::thread other([&] {
    c10::InferenceMode g;
    for (int i = 0; i < 5; ++i) at::exp(x);
  });
  other.join();
  at::sin(x);
  profile.Stop();
  at::cos(x);
  profile.Stop();  // idempotent
  const auto ops = profile.Ops();
  ASSERT_NE(Find(ops, "aten::sin"), nullptr);
  EXPECT_EQ(Find(ops, "aten::sin")->calls, 1);
  EXPECT_EQ(Find(ops, "aten::exp"), nullptr);
  EXPECT_EQ(Find(ops, "aten::cos"), nullptr);
  EXPECT_EQ(profile.top_level_calls(), 1);
}

TEST(OpProfileTest, OneProfilePerThreadAtATime) {
  const at::Tensor x = at::ones({2});
  OpProfile first;
  EXPECT_THROW(OpProfile second, c10::Error);
  first.Stop();
  OpProfile third;  // the thread is free again
  at::neg(x);
  EXPECT_EQ(third.top_level_calls(), 1);
  EXPECT_EQ(first.top_level_calls(), 0);
}

// A forward pass, standard or collaborative, without a mask, with one of all ones and with
// padding, reads no tensor's value back on the host: on CUDA that read (aten::item,
// aten::_local_scalar_dense) would wait for the device mid-pass. Only the final copy of the logits
// to the CPU may wait. On the CPU, and on CUDA in float32 and float16 where there is a GPU
// (scripts/gpu-check.sh runs this test there).
TEST(OpProfileTest, ForwardPassReadsNoValueBack) {
  std::vector<std::pair<c10::Device, at::ScalarType>> targets = {{c10::Device(c10::kCPU), at::kFloat}};
  if (at::hasCUDA()) {
    targets.push_back({c10::Device(c10::kCUDA), at::kFloat});
    targets.push_back({c10::Device(c10::kCUDA), at::kHalf});
  }
  for (const auto& [device, dtype] : targets) {
    for (bool collaborative : {false, true}) {
      const auto m = SmallBertModel(collaborative ? std::vector<int>{24, 0} : std::vector<int>{}, 2, 3, device, dtype);
      c10::InferenceMode guard;
      const at::Tensor ids = at::randint(1000, 2000, {2, 9}, at::kLong), types = at::zeros({2, 9}, at::kLong);
      at::Tensor padded = at::ones({2, 9}, at::kLong);
      padded.narrow(0, 1, 1).narrow(1, 5, 4).zero_();
      for (const at::Tensor& mask : {at::Tensor(), at::ones({2, 9}, at::kLong), padded}) {
        const std::string what = device.str() + " " + std::string(c10::toString(dtype)) +
                                 (collaborative ? ", collaborative" : ", standard") +
                                 (!mask.defined() ? ", no mask" : mask.equal(padded) ? ", padded" : ", all ones");
        m->Forward(ids, types, mask);  // warm
        OpProfile profile;
        const at::Tensor logits = m->Forward(ids, types, mask);
        profile.Stop();
        EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 2})) << what;
        EXPECT_GT(profile.top_level_calls(), 0) << what;
        for (const char* name : {"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero"}) {
          EXPECT_EQ(Find(profile.Ops(), name), nullptr) << name << " (top-level or nested), " << what;
        }
      }
    }
  }
}

}  // namespace
}  // namespace collabserve::model

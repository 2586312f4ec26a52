// device.h. COLLABSERVE_WITH_CUDA (the caching allocator's readings and release): set by
// server/model/CMakeLists.txt where LibTorch has CUDA (2.2 or later); scripts/check-libtorch2.sh
// compiles this file both ways.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include <exception>
#include <optional>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/model/device.h"
#include "server/model/torch_status.h"

#if COLLABSERVE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#endif

namespace collabserve::model {

absl::StatusOr<c10::Device> ParseDevice(const std::string& s) {
  if (s == "cpu") return c10::Device(c10::kCPU);
  if (s == "cuda" || absl::StartsWith(s, "cuda:")) {
    int index = 0;
    if (s.size() > 5 && !absl::SimpleAtoi(s.substr(5), &index)) {
      return absl::InvalidArgumentError(absl::StrCat("device '", s, "': bad CUDA index"));
    }
    if (!torch::cuda::is_available()) {
      return absl::FailedPreconditionError(
          absl::StrCat("device '", s, "' requested but CUDA is not available in this build or machine"));
    }
    if (index < 0 || index >= static_cast<int>(torch::cuda::device_count())) {
      return absl::InvalidArgumentError(absl::StrCat("device '", s, "': only ",
                                                     torch::cuda::device_count(), " CUDA devices"));
    }
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  return absl::InvalidArgumentError(absl::StrCat("device '", s, "' is not cpu, cuda or cuda:N"));
}

#if COLLABSERVE_WITH_CUDA
namespace {

// The GPU's memory, queried once per device (cudaGetDeviceProperties reads every property, slowly);
// 0 if the query fails.
int64_t TotalBytes(c10::DeviceIndex index) {
  static std::mutex mu;
  static auto* totals = new std::map<c10::DeviceIndex, int64_t>();  // never destroyed: used at exit
  std::lock_guard<std::mutex> l(mu);
  auto it = totals->find(index);
  if (it == totals->end()) {
    cudaDeviceProp prop;
    int64_t total = 0;
    if (cudaGetDeviceProperties(&prop, index) == cudaSuccess) {
      total = static_cast<int64_t>(prop.totalGlobalMem);
    } else {
      (void)cudaGetLastError();  // clears the error for the thread's next CUDA call
    }
    it = totals->emplace(index, total).first;
  }
  return it->second;
}

}  // namespace
#endif

std::optional<DeviceMemory> ReadDeviceMemory(const c10::Device& device) {
#if COLLABSERVE_WITH_CUDA
  if (!device.is_cuda()) return std::nullopt;
  namespace alloc = c10::cuda::CUDACachingAllocator;
  alloc::CUDAAllocator* allocator = alloc::get();
  // Uninitialised until the process's first CUDA tensor (or its first CUDA call of any kind that
  // initialises LibTorch's CUDA state): nothing of ours is on any GPU yet.
  if (allocator == nullptr || !allocator->initialized()) return std::nullopt;
  const c10::DeviceIndex index = device.has_index() ? device.index() : 0;
  try {
    const auto stats = allocator->getDeviceStats(index);
    // Index 0 of each statistic is StatType::AGGREGATE (both pools), whose namespace moved between
    // LibTorch versions.
    DeviceMemory m;
    m.allocated_bytes = stats.allocated_bytes[0].current;
    m.reserved_bytes = stats.reserved_bytes[0].current;
    m.total_bytes = TotalBytes(index);
    return m;
  } catch (const c10::Error&) {
    return std::nullopt;  // an index the allocator does not know
  }
#else
  (void)device;
  return std::nullopt;
#endif
}

void ReleaseCachedMemory(const c10::Device& device) {
#if COLLABSERVE_WITH_CUDA
  if (!device.is_cuda()) return;
  c10::cuda::CUDACachingAllocator::CUDAAllocator* allocator = c10::cuda::CUDACachingAllocator::get();
  if (allocator == nullptr || !allocator->initialized()) return;
  c10::cuda::CUDACachingAllocator::emptyCache();  // every device's: the allocator has no other
#else
  (void)device;
#endif
}

namespace {
constexpr absl::string_view kDeviceFailureUrl = "type.collabserve.dev/device-failure";
}  // namespace

absl::Status CheckDevice(const c10::Device& device) {
  if (!device.is_cuda()) return absl::OkStatus();
  try {
    // Its own stream, so that the wait is for these two kernels only (a pass on another thread
    // need not end first) and never a device-wide synchronisation.
    const c10::Stream stream = c10::impl::getDeviceGuardImpl(device.type())->getStreamFromGlobalPool(device);
    const c10::StreamGuard on(stream);
    c10::InferenceMode guard;
    const at::Tensor two = at::full({1}, 2.0f, at::TensorOptions().device(device));
    const float four = at::mul(two, two).to(at::kCPU).item<float>();
    if (four != 4.0f) {
      return absl::UnavailableError(absl::StrCat(device.str(), " computed ", four, " for 2 * 2"));
    }
    return absl::OkStatus();
  } catch (const std::exception& e) {
    const absl::Status s = TorchErrorStatus(absl::StrCat(device.str(), " can run no more work"), e);
    if (s.code() == absl::StatusCode::kResourceExhausted) return absl::OkStatus();  // full, not broken
    return absl::UnavailableError(s.message());
  }
}

absl::Status WithDeviceCheck(absl::Status status, const c10::Device& device) {
  if (status.code() != absl::StatusCode::kInternal || !device.is_cuda()) return status;
  const absl::Status check = CheckDevice(device);
  if (check.ok()) return status;
  return MarkedDeviceFailure(absl::UnavailableError(absl::StrCat(
      status.message(), "; ", check.message(), " (a CUDA error that only a restart clears)")));
}

absl::Status DeviceErrorStatus(absl::string_view context, const std::exception& e,
                               const c10::Device& device) {
  return WithDeviceCheck(TorchErrorStatus(context, e), device);
}

bool IsDeviceFailure(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kDeviceFailureUrl).has_value();
}

absl::Status MarkedDeviceFailure(absl::Status status) {
  if (!status.ok()) status.SetPayload(kDeviceFailureUrl, absl::Cord("1"));
  return status;
}

absl::Status InitDevice(const c10::Device& device) {
  if (!device.is_cuda()) return absl::OkStatus();
  try {
    (void)at::empty({0}, at::TensorOptions().device(device));
  } catch (const std::exception& e) {
    return absl::FailedPreconditionError(
        TorchErrorStatus(absl::StrCat("cannot start CUDA on ", device.str()), e).message());
  }
  return absl::OkStatus();
}

}  // namespace collabserve::model

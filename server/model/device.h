// Parsing device names ("cpu", "cuda", "cuda:N") into LibTorch devices, with clear errors; what a
// GPU's memory holds; whether a GPU can still run work.
#ifndef COLLABSERVE_SERVER_MODEL_DEVICE_H_
#define COLLABSERVE_SERVER_MODEL_DEVICE_H_

#include <c10/core/Device.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace collabserve::model {

// INVALID_ARGUMENT for a malformed name or index; FAILED_PRECONDITION when CUDA is asked for and
// this build or machine has none. A CUDA device always comes back with its index ("cuda" is
// cuda:0).
absl::StatusOr<c10::Device> ParseDevice(const std::string& name);

// This process's share of one GPU's memory, as LibTorch's CUDA caching allocator keeps it. Every
// tensor of the process's on that GPU comes from the allocator: models' weights, passes in flight,
// CUDA graphs' pools, compression jobs.
struct DeviceMemory {
  int64_t allocated_bytes = 0;  // the blocks live tensors hold
  int64_t reserved_bytes = 0;   // what the allocator holds from the driver: the allocated blocks
                                // and the cached free ones (CUDA graphs' pools among them), kept
                                // for later passes; other processes cannot use it
  int64_t total_bytes = 0;      // the GPU's memory; 0 if the driver did not say
};

// nullopt for a CPU device, in a build whose LibTorch has no CUDA (or is older than 2.2, see
// server/model/CMakeLists.txt), and before anything of this process has used CUDA (the reading
// never initialises CUDA: a context costs hundreds of MB). Reads the allocator's counters only: no
// device synchronisation, no call that a CUDA graph capture in another thread forbids.
// Thread-safe once CUDA is initialised; not while another thread initialises it (LibTorch sizes
// the allocator's per-device state then, unguarded): a caller that may run before the first
// tensor is on the GPU calls InitDevice first.
std::optional<DeviceMemory> ReadDeviceMemory(const c10::Device& device);

// Initialises LibTorch's CUDA state and `device`'s context now, as the first tensor there would.
// OK at once for a CPU device; FAILED_PRECONDITION, naming the device and LibTorch's message, when
// CUDA cannot start.
absl::Status InitDevice(const c10::Device& device);

// Gives the free blocks LibTorch's CUDA caching allocator keeps back to the driver, for other
// processes (what live tensors and CUDA graphs hold stays). Nothing for a CPU device, before CUDA
// started, or in a build without COLLABSERVE_WITH_CUDA (ReadDeviceMemory's). Not while a CUDA
// graph is being captured on the device.
void ReleaseCachedMemory(const c10::Device& device);

// Whether `device` can still run work. OK at once for the CPU. On a GPU, runs a tiny kernel there
// and waits for it (its own stream: no device-wide synchronisation, which would break a CUDA graph
// capture in another thread): UNAVAILABLE, naming the device and the CUDA error, when that fails.
// Some CUDA errors stick to the process's context (an illegal memory access, a device-side assert,
// an uncorrectable ECC error, a GPU fallen off the bus): every later call on the device fails with
// them, and only a new process recovers. OK when the GPU merely has no memory left for the check.
absl::Status CheckDevice(const c10::Device& device);

// The status of work on `device` that failed with `status`: `status` itself, except where it is
// INTERNAL, `device` is a GPU and CheckDevice finds it unusable after the error. Then UNAVAILABLE
// with both messages, marked as a device failure (IsDeviceFailure), so that a caller can retry
// elsewhere and the server stop taking work.
absl::Status WithDeviceCheck(absl::Status status, const c10::Device& device);
// WithDeviceCheck(TorchErrorStatus(context, e), device), for a LibTorch exception `e` thrown by
// work on `device`.
absl::Status DeviceErrorStatus(absl::string_view context, const std::exception& e,
                               const c10::Device& device);

// Whether `status` (or a copy: the mark is a payload, see MarkedDeviceFailure) comes from a device
// that can run nothing more.
bool IsDeviceFailure(const absl::Status& status);
// `status` marked as a device failure.
absl::Status MarkedDeviceFailure(absl::Status status);

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_DEVICE_H_

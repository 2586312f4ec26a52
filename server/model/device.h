// Parsing device names ("cpu", "cuda", "cuda:N") into LibTorch devices, with clear errors.
#ifndef COLLABSERVE_SERVER_MODEL_DEVICE_H_
#define COLLABSERVE_SERVER_MODEL_DEVICE_H_

#include <c10/core/Device.h>

#include <string>

#include "absl/status/statusor.h"

namespace collabserve::model {

// INVALID_ARGUMENT for a malformed name or index; FAILED_PRECONDITION when CUDA is asked for and
// this build or machine has none.
absl::StatusOr<c10::Device> ParseDevice(const std::string& name);

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_DEVICE_H_

// LibTorch's exceptions as statuses, for the places that catch them.
#ifndef COLLABSERVE_SERVER_MODEL_TORCH_STATUS_H_
#define COLLABSERVE_SERVER_MODEL_TORCH_STATUS_H_

#include <c10/util/Exception.h>

#include <exception>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace collabserve::model {

// "`context`: what went wrong", without LibTorch's C++ backtrace (LibTorch 1.13 puts one in every
// c10::Error's what()). RESOURCE_EXHAUSTED where an allocation failed (c10::OutOfMemoryError: on
// a GPU, after the caching allocator gave back its cached blocks and tried again), so that a
// caller may retry later or elsewhere and an operator tell it from a bug; INTERNAL otherwise.
inline absl::Status TorchErrorStatus(absl::string_view context, const std::exception& e) {
  absl::string_view what = e.what();
  absl::StatusCode code = absl::StatusCode::kInternal;
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    what = error->what_without_backtrace();
    if (dynamic_cast<const c10::OutOfMemoryError*>(error) != nullptr) {
      code = absl::StatusCode::kResourceExhausted;
    }
  }
  return absl::Status(code, absl::StrCat(context, ": ", what));
}

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_TORCH_STATUS_H_

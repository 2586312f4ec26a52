// The raw BYTES layout of the Open Inference Protocol (raw_input_contents, raw_output_contents,
// and the REST binary extension): each element a 4-byte little-endian length, then its bytes.
// One codec for the gRPC service and its REST form.
#ifndef COLLABSERVE_SERVER_SERVICE_KSERVE_TENSORS_H_
#define COLLABSERVE_SERVER_SERVICE_KSERVE_TENSORS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace collabserve::service {

// Splits `raw` into exactly `count` elements; INVALID_ARGUMENT naming input `name` when it ends
// early, an element overruns it, or bytes are left over.
absl::Status DecodeRawBytes(const std::string& raw, int64_t count, const std::string& name,
                            std::vector<std::string>* out);

// Appends `element` to `raw` in the layout.
void AppendRawBytes(const std::string& element, std::string* raw);

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_KSERVE_TENSORS_H_

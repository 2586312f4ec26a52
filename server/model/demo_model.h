// The built-in demo model: the Debian-sections classifier trained by `make demo-model`
// (scripts/demo_model/), whose checkpoint in server/model/demo/ is compiled into every binary that
// links collabserve_model, so that `collabserve` with no flags serves a trained model anywhere.
#ifndef COLLABSERVE_SERVER_MODEL_DEMO_MODEL_H_
#define COLLABSERVE_SERVER_MODEL_DEMO_MODEL_H_

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace collabserve::model {

// The checkpoint's files as compiled in: (file name, bytes), for config.json, model.safetensors,
// tokenizer_config.json and vocab.txt. The views point into the binary's read-only data.
const std::vector<std::pair<std::string, std::string_view>>& DemoModelFiles();

// Writes the demo checkpoint into `out_dir` (created if missing), each file written atomically.
// The result loads like any Hugging Face checkpoint directory.
absl::Status WriteDemoCheckpoint(const std::string& out_dir);

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_DEMO_MODEL_H_

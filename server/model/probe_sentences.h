// A built-in set of varied English sentences: probes for the fidelity report of a compression and
// for calibrating generated checkpoints.
#ifndef COLLABSERVE_SERVER_MODEL_PROBE_SENTENCES_H_
#define COLLABSERVE_SERVER_MODEL_PROBE_SENTENCES_H_

#include <string>
#include <vector>

namespace collabserve::model {

const std::vector<std::string>& BuiltinProbeSentences();

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_PROBE_SENTENCES_H_

// A restricted unpickler for the data.pkl of a torch.save state dict. It interprets only the opcodes
// a state dict needs and builds plain values; it never imports or calls anything. The only globals
// it accepts are collections.OrderedDict, the torch._utils tensor/parameter rebuild functions and
// the ten torch.*Storage classes, and "calling" one of them (REDUCE) only builds the corresponding
// value here. Anything else (os.system, builtins.eval, ...) is refused.
#ifndef COLLABSERVE_SERVER_MODEL_IO_RESTRICTED_UNPICKLER_H_
#define COLLABSERVE_SERVER_MODEL_IO_RESTRICTED_UNPICKLER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "server/model/io/dtype.h"

namespace collabserve::model::io {

struct PickleLimits {
  uint64_t max_memo_index = uint64_t{1} << 20;  // memo keys must be below this
  size_t max_stack = size_t{1} << 20;           // values on the stack at once
  size_t max_marks = 1000;                      // MARKs open at once
  int max_nesting = 64;                         // container nesting depth
  size_t max_objects = size_t{1} << 22;         // values plus container items created
};

enum class PyKind { kNone, kBool, kInt, kFloat, kStr, kTuple, kList, kDict, kGlobal, kStorage, kTensor };

// One unpickled value. Values live in the PickleResult's arena and point at each other with raw
// pointers, so sharing (memo), self-reference and deep chains cost nothing to destroy.
struct PyValue {
  PyKind kind = PyKind::kNone;
  int depth = 0;             // nesting depth (1 for scalars)
  bool b = false;            // kBool
  int64_t i = 0;             // kInt; kTensor: storage offset in elements
  double f = 0;              // kFloat
  std::string s;             // kStr; kGlobal: "module.name"; kStorage: the storage key
  std::vector<PyValue*> items;                            // kTuple, kList
  std::vector<std::pair<PyValue*, PyValue*>> dict;        // kDict, in insertion order
  DType dtype = DType::kF32;                              // kStorage
  int64_t numel = 0;                                      // kStorage: elements
  const PyValue* storage = nullptr;                       // kTensor
  std::vector<int64_t> size, stride;                      // kTensor
};

struct PickleResult {
  std::vector<std::unique_ptr<PyValue>> arena;
  const PyValue* root = nullptr;
};

// Name of a kind for error messages ("str", "dict", "tensor", ...).
std::string_view PyKindName(PyKind kind);

// Interprets `pickle` (protocol 2 as torch.save writes it; opcodes up to protocol 5 that a state
// dict can use are accepted). Persistent ids must be ('storage', torch.<T>Storage, key: str,
// location: str, numel: int) and become kStorage values (the caller resolves the key); tensors
// become kTensor values whose size/stride/offset were checked to address only elements
// [0, storage numel) and whose element count is at most the storage's (a stride-0 or overlapping
// view may repeat elements, e.g. an expanded buffer, but not claim more than the storage holds). INVALID_ARGUMENT, prefixed with `name_for_errors` (e.g. "x.bin: data.pkl"),
// for: a global outside the allow-list ("global 'os.system' is not allowed in a state dict"), an
// unsupported opcode, a truncated or unterminated pickle, a memo index over the limit or unset,
// stack/mark/nesting/object limits, arguments of the wrong type, a tensor outside its storage.
absl::StatusOr<std::unique_ptr<PickleResult>> UnpickleStateDict(std::string_view pickle,
                                                                std::string_view name_for_errors,
                                                                const PickleLimits& limits = PickleLimits());

}  // namespace collabserve::model::io

#endif  // COLLABSERVE_SERVER_MODEL_IO_RESTRICTED_UNPICKLER_H_

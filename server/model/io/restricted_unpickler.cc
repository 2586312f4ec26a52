#include "server/model/io/restricted_unpickler.h"

#include <cstring>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/model/io/checked_math.h"
#include "server/model/io/str_util.h"
#include "server/model/io/checkpoint.h"

namespace collabserve::model::io {
namespace {

using internal::Cat;

using internal::CheckedAdd;
using internal::CheckedMul;

constexpr std::string_view kOrderedDict = "collections.OrderedDict";
constexpr std::string_view kRebuildTensorV2 = "torch._utils._rebuild_tensor_v2";
constexpr std::string_view kRebuildTensor = "torch._utils._rebuild_tensor";
constexpr std::string_view kRebuildParameter = "torch._utils._rebuild_parameter";
constexpr std::string_view kRebuildParameterWithState = "torch._utils._rebuild_parameter_with_state";

bool AllowedGlobal(std::string_view module, std::string_view name) {
  if (module == "collections") return name == "OrderedDict";
  if (module == "torch._utils") {
    return name == "_rebuild_tensor_v2" || name == "_rebuild_tensor" || name == "_rebuild_parameter" ||
           name == "_rebuild_parameter_with_state";
  }
  if (module == "torch") return DTypeFromTorchStorageName(name).has_value();
  return false;
}

class Unpickler {
 public:
  Unpickler(std::string_view pickle, std::string_view name, const PickleLimits& limits)
      : p_(pickle), name_(name), limits_(limits), result_(std::make_unique<PickleResult>()) {}

  absl::StatusOr<std::unique_ptr<PickleResult>> Run() {
    while (true) {
      if (pos_ >= p_.size()) return Error("pickle ends without STOP (truncated or unterminated)");
      op_pos_ = pos_;
      const uint8_t op = static_cast<uint8_t>(p_[pos_++]);
      absl::Status s = Step(op);
      if (!s.ok()) return s;
      if (done_) break;
    }
    return std::move(result_);
  }

 private:
  absl::Status Error(std::string_view problem) const {
    return absl::InvalidArgumentError(Cat(name_, ": ", problem, " (at byte ", op_pos_, ")"));
  }

  absl::Status Need(uint64_t n) const {
    if (n > p_.size() - pos_) return Error("pickle is truncated inside an opcode's argument");
    return absl::OkStatus();
  }
  uint64_t ReadLe(int n) {
    uint64_t v = 0;
    for (int k = n - 1; k >= 0; --k) v = (v << 8) | static_cast<uint8_t>(p_[pos_ + k]);
    pos_ += n;
    return v;
  }

  absl::StatusOr<PyValue*> New(PyKind kind) {
    if (++objects_ > limits_.max_objects) {
      return Error(Cat("more than ", limits_.max_objects, " objects"));
    }
    result_->arena.push_back(std::make_unique<PyValue>());
    PyValue* v = result_->arena.back().get();
    v->kind = kind;
    v->depth = 1;
    return v;
  }
  absl::Status Push(PyValue* v) {
    if (stack_.size() >= limits_.max_stack) {
      return Error(Cat("stack deeper than ", limits_.max_stack));
    }
    stack_.push_back(v);
    return absl::OkStatus();
  }
  absl::Status PushNew(PyKind kind, PyValue** out = nullptr) {
    auto v = New(kind);
    if (!v.ok()) return v.status();
    if (out) *out = *v;
    return Push(*v);
  }
  absl::StatusOr<PyValue*> Pop() {
    if (stack_.size() <= Floor()) return Error("stack underflow");
    PyValue* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  size_t Floor() const { return marks_.empty() ? 0 : marks_.back(); }
  absl::StatusOr<std::vector<PyValue*>> PopToMark() {
    if (marks_.empty()) return Error("no MARK to pop to");
    size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PyValue*> items(stack_.begin() + m, stack_.end());
    stack_.resize(m);
    return items;
  }
  absl::Status Adopt(PyValue* container, const PyValue* child) {
    if (++objects_ > limits_.max_objects) {
      return Error(Cat("more than ", limits_.max_objects, " objects"));
    }
    if (child->depth + 1 > container->depth) container->depth = child->depth + 1;
    if (container->depth > limits_.max_nesting) {
      return Error(Cat("containers nest deeper than ", limits_.max_nesting, " levels"));
    }
    return absl::OkStatus();
  }
  absl::Status PushTuple(std::vector<PyValue*> items) {
    PyValue* t;
    if (auto s = PushNew(PyKind::kTuple, &t); !s.ok()) return s;
    for (PyValue* v : items) {
      if (auto s = Adopt(t, v); !s.ok()) return s;
    }
    t->items = std::move(items);
    return absl::OkStatus();
  }
  absl::Status Memoize(uint64_t index) {
    if (index >= limits_.max_memo_index) {
      return Error(Cat("memo index ", index, " is over the limit of ", limits_.max_memo_index));
    }
    if (stack_.empty()) return Error("memo put with an empty stack");
    memo_[index] = stack_.back();
    return absl::OkStatus();
  }
  absl::Status Recall(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) return Error(Cat("memo index ", index, " was never set"));
    return Push(it->second);
  }
  absl::Status SetItems(PyValue* dict, const std::vector<PyValue*>& kv) {
    if (dict->kind != PyKind::kDict) {
      return Error(Cat("SETITEM(S) on a ", PyKindName(dict->kind), ", not a dict"));
    }
    if (kv.size() % 2 != 0) return Error("SETITEMS with an odd number of values");
    for (size_t k = 0; k < kv.size(); k += 2) {
      if (auto s = Adopt(dict, kv[k + 1]); !s.ok()) return s;
      dict->dict.emplace_back(kv[k], kv[k + 1]);
    }
    return absl::OkStatus();
  }
  absl::Status Appends(PyValue* list, const std::vector<PyValue*>& items) {
    if (list->kind != PyKind::kList) {
      return Error(Cat("APPEND(S) on a ", PyKindName(list->kind), ", not a list"));
    }
    for (PyValue* v : items) {
      if (auto s = Adopt(list, v); !s.ok()) return s;
      list->items.push_back(v);
    }
    return absl::OkStatus();
  }
  absl::Status Global(std::string_view module, std::string_view name) {
    if (!AllowedGlobal(module, name)) {
      return absl::InvalidArgumentError(Cat(name_, ": global '", module, ".", name,
                                                     "' is not allowed in a state dict"));
    }
    PyValue* g;
    if (auto s = PushNew(PyKind::kGlobal, &g); !s.ok()) return s;
    g->s = Cat(module, ".", name);
    return absl::OkStatus();
  }
  absl::StatusOr<std::string_view> ReadLine() {
    size_t nl = p_.find('\n', pos_);
    if (nl == std::string_view::npos) return Error("pickle is truncated inside a GLOBAL");
    std::string_view line = p_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return line;
  }

  absl::Status IntList(const PyValue* v, std::string_view what, std::vector<int64_t>* out) {
    if (v->kind != PyKind::kTuple && v->kind != PyKind::kList) {
      return Error(Cat("tensor ", what, " is a ", PyKindName(v->kind), ", not a tuple"));
    }
    if (v->items.size() > kMaxTensorRank) {
      return Error(Cat("tensor ", what, " has more than ", kMaxTensorRank, " dims"));
    }
    for (const PyValue* x : v->items) {
      if (x->kind != PyKind::kInt) return Error(Cat("tensor ", what, " holds a non-integer"));
      if (x->i < 0 || x->i > kMaxTensorDim) {
        return Error(Cat("tensor ", what, " has out-of-range value ", x->i));
      }
      out->push_back(x->i);
    }
    return absl::OkStatus();
  }

  absl::Status RebuildTensor(const std::vector<PyValue*>& args, bool v2) {
    const size_t n = args.size();
    if (v2 ? (n != 6 && n != 7) : n != 4) {
      return Error(Cat(v2 ? "_rebuild_tensor_v2" : "_rebuild_tensor", " takes ",
                                v2 ? "6 or 7" : "4", " arguments, got ", n));
    }
    if (args[0]->kind != PyKind::kStorage) {
      return Error(Cat("tensor storage is a ", PyKindName(args[0]->kind), ", not a storage"));
    }
    if (args[1]->kind != PyKind::kInt || args[1]->i < 0) return Error("tensor storage offset is not a non-negative int");
    PyValue* t;
    if (auto s = PushNew(PyKind::kTensor, &t); !s.ok()) return s;
    t->storage = args[0];
    t->i = args[1]->i;
    if (auto s = IntList(args[2], "size", &t->size); !s.ok()) return s;
    if (auto s = IntList(args[3], "stride", &t->stride); !s.ok()) return s;
    if (t->size.size() != t->stride.size()) {
      return Error(Cat("tensor size has ", t->size.size(), " dims but stride has ", t->stride.size()));
    }
    if (v2 && args[4]->kind != PyKind::kBool) return Error("tensor requires_grad is not a bool");
    // Every addressable element must be inside the storage.
    const int64_t storage_numel = t->storage->numel;
    bool empty = false;
    int64_t last = t->i, numel = 1;
    for (size_t k = 0; k < t->size.size(); ++k) {
      if (t->size[k] == 0) empty = true;
      int64_t reach;
      if (!CheckedMul(t->size[k], numel, &numel) ||
          (t->size[k] > 0 && (!CheckedMul(t->size[k] - 1, t->stride[k], &reach) || !CheckedAdd(last, reach, &last)))) {
        return Error("tensor size/stride overflow 64 bits");
      }
    }
    if (empty ? t->i > storage_numel : last >= storage_numel) {
      return Error(Cat("tensor with offset ", t->i, " reaches element ", last, " of storage '",
                                t->storage->s, "' which has ", storage_numel, " elements"));
    }
    // A view that repeats elements (stride 0 / overlapping) may not claim more elements than its
    // storage holds, so a tiny hostile file cannot make a consumer allocate terabytes.
    // (BERT's expanded position_ids buffer, shape (1, 512) stride (0, 1), stays within this.)
    if (numel > storage_numel) {
      return Error(Cat("tensor has ", numel, " elements but its storage '", t->storage->s, "' only ",
                       storage_numel, " (an overlapping view); refusing"));
    }
    return absl::OkStatus();
  }

  absl::Status Reduce() {
    auto args = Pop();
    if (!args.ok()) return args.status();
    auto callable = Pop();
    if (!callable.ok()) return callable.status();
    if ((*args)->kind != PyKind::kTuple) return Error("REDUCE arguments are not a tuple");
    if ((*callable)->kind != PyKind::kGlobal) {
      return Error(Cat("REDUCE on a ", PyKindName((*callable)->kind), ", not an allowed callable"));
    }
    const std::string& fn = (*callable)->s;
    const std::vector<PyValue*>& a = (*args)->items;
    if (fn == kOrderedDict) {
      if (!a.empty()) return Error("OrderedDict with arguments is not supported");
      return PushNew(PyKind::kDict);
    }
    if (fn == kRebuildTensorV2) return RebuildTensor(a, true);
    if (fn == kRebuildTensor) return RebuildTensor(a, false);
    if (fn == kRebuildParameter || fn == kRebuildParameterWithState) {
      if (a.size() != (fn == kRebuildParameter ? 3u : 4u) || a[0]->kind != PyKind::kTensor) {
        return Error(Cat(fn, " expects a tensor and ", fn == kRebuildParameter ? 2 : 3, " more arguments"));
      }
      return Push(a[0]);
    }
    return Error(Cat("calling '", fn, "' is not allowed in a state dict"));
  }

  absl::Status PersistentLoad() {
    auto pid = Pop();
    if (!pid.ok()) return pid.status();
    const PyValue* t = *pid;
    if (t->kind != PyKind::kTuple || t->items.size() != 5 || t->items[0]->kind != PyKind::kStr ||
        t->items[0]->s != "storage") {
      return Error("persistent id is not ('storage', type, key, location, numel)");
    }
    const PyValue* type = t->items[1];
    std::optional<DType> dtype;
    if (type->kind == PyKind::kGlobal && type->s.rfind("torch.", 0) == 0) {
      dtype = DTypeFromTorchStorageName(std::string_view(type->s).substr(6));
    }
    if (!dtype) return Error("persistent id's storage type is not a torch.*Storage class");
    if (t->items[2]->kind != PyKind::kStr || t->items[2]->s.empty()) return Error("storage key is not a non-empty str");
    if (t->items[3]->kind != PyKind::kStr) return Error("storage location is not a str");
    if (t->items[4]->kind != PyKind::kInt || t->items[4]->i < 0) return Error("storage numel is not a non-negative int");
    const std::string& key = t->items[2]->s;
    auto it = storages_.find(key);
    if (it != storages_.end()) {
      if (it->second->dtype != *dtype || it->second->numel != t->items[4]->i) {
        return Error(Cat("storage '", key, "' is referenced with two different types or sizes"));
      }
      return Push(it->second);
    }
    PyValue* s;
    if (auto st = PushNew(PyKind::kStorage, &s); !st.ok()) return st;
    s->s = key;
    s->dtype = *dtype;
    s->numel = t->items[4]->i;
    storages_[key] = s;
    return absl::OkStatus();
  }

  absl::Status Step(uint8_t op) {
    switch (op) {
      case 0x80: {  // PROTO
        if (auto s = Need(1); !s.ok()) return s;
        uint64_t v = ReadLe(1);
        if (v < 2 || v > 5) return Error(Cat("unsupported pickle protocol ", v));
        return absl::OkStatus();
      }
      case 0x95:  // FRAME
        if (auto s = Need(8); !s.ok()) return s;
        pos_ += 8;
        return absl::OkStatus();
      case '}':
        return PushNew(PyKind::kDict);
      case ']':
        return PushNew(PyKind::kList);
      case ')':
        return PushTuple({});
      case '(':
        if (marks_.size() >= limits_.max_marks) {
          return Error(Cat("more than ", limits_.max_marks, " nested MARKs"));
        }
        marks_.push_back(stack_.size());
        return absl::OkStatus();
      case 'X':
      case 0x8c:
      case 0x8d: {  // BINUNICODE, SHORT_BINUNICODE, BINUNICODE8
        int width = op == 'X' ? 4 : op == 0x8c ? 1 : 8;
        if (auto s = Need(width); !s.ok()) return s;
        uint64_t len = ReadLe(width);
        if (auto s = Need(len); !s.ok()) return s;
        PyValue* v;
        if (auto s = PushNew(PyKind::kStr, &v); !s.ok()) return s;
        v->s.assign(p_.data() + pos_, len);
        pos_ += len;
        return absl::OkStatus();
      }
      case 'J':
      case 'K':
      case 'M': {  // BININT (signed 32), BININT1 (u8), BININT2 (u16)
        int width = op == 'J' ? 4 : op == 'K' ? 1 : 2;
        if (auto s = Need(width); !s.ok()) return s;
        uint64_t raw = ReadLe(width);
        PyValue* v;
        if (auto s = PushNew(PyKind::kInt, &v); !s.ok()) return s;
        v->i = op == 'J' ? static_cast<int32_t>(static_cast<uint32_t>(raw)) : static_cast<int64_t>(raw);
        return absl::OkStatus();
      }
      case 0x8a: {  // LONG1: little-endian two's complement of n bytes
        if (auto s = Need(1); !s.ok()) return s;
        uint64_t n = ReadLe(1);
        if (n > 8) return Error("integer wider than 64 bits");
        if (auto s = Need(n); !s.ok()) return s;
        uint64_t raw = n == 0 ? 0 : ReadLe(static_cast<int>(n));
        if (n > 0 && n < 8 && (raw >> (8 * n - 1)) & 1) raw |= ~uint64_t{0} << (8 * n);  // sign-extend
        PyValue* v;
        if (auto s = PushNew(PyKind::kInt, &v); !s.ok()) return s;
        v->i = static_cast<int64_t>(raw);
        return absl::OkStatus();
      }
      case 'G': {  // BINFLOAT, big-endian double
        if (auto s = Need(8); !s.ok()) return s;
        uint64_t raw = 0;
        for (int k = 0; k < 8; ++k) raw = (raw << 8) | static_cast<uint8_t>(p_[pos_ + k]);
        pos_ += 8;
        PyValue* v;
        if (auto s = PushNew(PyKind::kFloat, &v); !s.ok()) return s;
        std::memcpy(&v->f, &raw, 8);
        return absl::OkStatus();
      }
      case 0x88:
      case 0x89: {
        PyValue* v;
        if (auto s = PushNew(PyKind::kBool, &v); !s.ok()) return s;
        v->b = op == 0x88;
        return absl::OkStatus();
      }
      case 'N':
        return PushNew(PyKind::kNone);
      case 't': {
        auto items = PopToMark();
        if (!items.ok()) return items.status();
        return PushTuple(std::move(*items));
      }
      case 0x85:
      case 0x86:
      case 0x87: {
        size_t n = op - 0x84;
        if (stack_.size() < Floor() + n) return Error("stack underflow");
        std::vector<PyValue*> items(stack_.end() - n, stack_.end());
        stack_.resize(stack_.size() - n);
        return PushTuple(std::move(items));
      }
      case 'q':
      case 'r': {  // BINPUT, LONG_BINPUT
        int width = op == 'q' ? 1 : 4;
        if (auto s = Need(width); !s.ok()) return s;
        return Memoize(ReadLe(width));
      }
      case 0x94:  // MEMOIZE
        return Memoize(memo_.size());
      case 'h':
      case 'j': {  // BINGET, LONG_BINGET
        int width = op == 'h' ? 1 : 4;
        if (auto s = Need(width); !s.ok()) return s;
        return Recall(ReadLe(width));
      }
      case 's': {  // SETITEM
        auto value = Pop();
        if (!value.ok()) return value.status();
        auto key = Pop();
        if (!key.ok()) return key.status();
        if (stack_.size() <= Floor()) return Error("SETITEM without a dict");
        return SetItems(stack_.back(), {*key, *value});
      }
      case 'u': {  // SETITEMS
        auto items = PopToMark();
        if (!items.ok()) return items.status();
        if (stack_.size() <= Floor()) return Error("SETITEMS without a dict");
        return SetItems(stack_.back(), *items);
      }
      case 'a': {  // APPEND
        auto value = Pop();
        if (!value.ok()) return value.status();
        if (stack_.size() <= Floor()) return Error("APPEND without a list");
        return Appends(stack_.back(), {*value});
      }
      case 'e': {  // APPENDS
        auto items = PopToMark();
        if (!items.ok()) return items.status();
        if (stack_.size() <= Floor()) return Error("APPENDS without a list");
        return Appends(stack_.back(), *items);
      }
      case 'c': {  // GLOBAL "module\nname\n"
        auto module = ReadLine();
        if (!module.ok()) return module.status();
        auto name = ReadLine();
        if (!name.ok()) return name.status();
        return Global(*module, *name);
      }
      case 0x93: {  // STACK_GLOBAL
        auto name = Pop();
        if (!name.ok()) return name.status();
        auto module = Pop();
        if (!module.ok()) return module.status();
        if ((*name)->kind != PyKind::kStr || (*module)->kind != PyKind::kStr) {
          return Error("STACK_GLOBAL needs two strs");
        }
        return Global((*module)->s, (*name)->s);
      }
      case 'R':
        return Reduce();
      case 'b': {  // BUILD: only OrderedDict's state (its `_metadata` attribute), which we drop
        auto state = Pop();
        if (!state.ok()) return state.status();
        if (stack_.size() <= Floor()) return Error("BUILD without an object");
        const PyValue* obj = stack_.back();
        if (obj->kind != PyKind::kDict || (*state)->kind != PyKind::kDict) {
          return Error(Cat("BUILD of a ", PyKindName(obj->kind), " with a ",
                                    PyKindName((*state)->kind), " is not supported in a state dict"));
        }
        return absl::OkStatus();
      }
      case 'Q':
        return PersistentLoad();
      case '.': {
        if (!marks_.empty()) return Error("STOP with an open MARK");
        if (stack_.size() != 1) return Error(Cat("STOP with ", stack_.size(), " values on the stack, not 1"));
        result_->root = stack_.back();
        done_ = true;
        return absl::OkStatus();
      }
      default:
        return Error(absl::StrFormat("opcode 0x%02x is not supported in a state dict", op));
    }
  }

  std::string_view p_;
  std::string_view name_;
  const PickleLimits& limits_;
  std::unique_ptr<PickleResult> result_;
  size_t pos_ = 0, op_pos_ = 0;
  size_t objects_ = 0;
  bool done_ = false;
  std::vector<PyValue*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PyValue*> memo_;
  std::unordered_map<std::string, PyValue*> storages_;
};

}  // namespace

std::string_view PyKindName(PyKind kind) {
  switch (kind) {
    case PyKind::kNone: return "None";
    case PyKind::kBool: return "bool";
    case PyKind::kInt: return "int";
    case PyKind::kFloat: return "float";
    case PyKind::kStr: return "str";
    case PyKind::kTuple: return "tuple";
    case PyKind::kList: return "list";
    case PyKind::kDict: return "dict";
    case PyKind::kGlobal: return "global";
    case PyKind::kStorage: return "storage";
    case PyKind::kTensor: return "tensor";
  }
  return "?";
}

absl::StatusOr<std::unique_ptr<PickleResult>> UnpickleStateDict(std::string_view pickle,
                                                                std::string_view name_for_errors,
                                                                const PickleLimits& limits) {
  return Unpickler(pickle, name_for_errors, limits).Run();
}

}  // namespace collabserve::model::io

#include "server/model/op_profile.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <utility>

namespace collabserve::model {

struct OpProfile::State {
  std::map<std::string, Op> ops;  // by name
  int64_t all_calls = 0;
  int depth = 0;  // operators open on this thread
};

namespace {

thread_local OpProfile::State* observed = nullptr;  // the profile this thread reports to

// One open operator call: its start, and whether it is a top-level one.
struct Call : at::ObserverContext {
  std::chrono::steady_clock::time_point start;
  bool top = false;
};

OpProfile::Op& Entry(OpProfile::State* s, const at::RecordFunction& fn) {
  const char* name = fn.name();
  const std::string key = name != nullptr ? name : "(unnamed)";
  OpProfile::Op& op = s->ops[key];
  if (op.name.empty()) op.name = key;
  return op;
}

std::unique_ptr<at::ObserverContext> OnEnter(const at::RecordFunction&) {
  OpProfile::State* s = observed;
  if (s == nullptr) return nullptr;
  auto call = std::make_unique<Call>();
  call->top = s->depth++ == 0;
  ++s->all_calls;
  call->start = std::chrono::steady_clock::now();
  return call;
}

void OnExit(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  const auto end = std::chrono::steady_clock::now();
  OpProfile::State* s = observed;
  auto* call = static_cast<Call*>(ctx);
  if (s == nullptr || call == nullptr) return;  // entered before the profile began
  --s->depth;
  OpProfile::Op& op = Entry(s, fn);
  if (!call->top) {
    ++op.nested;
    return;
  }
  const double seconds = std::chrono::duration<double>(end - call->start).count();
  ++op.calls;
  op.seconds += seconds;
  op.longest = std::max(op.longest, seconds);
}

}  // namespace

OpProfile::OpProfile() : state_(std::make_unique<State>()) {
  TORCH_CHECK(observed == nullptr, "OpProfile: this thread is already observed by another profile");
  observed = state_.get();
  handle_ = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&OnEnter, &OnExit).scopes({at::RecordScope::FUNCTION}));
}

OpProfile::~OpProfile() { Stop(); }

void OpProfile::Stop() {
  if (handle_ == 0) return;
  at::removeCallback(handle_);
  handle_ = 0;
  if (observed == state_.get()) observed = nullptr;
}

std::vector<OpProfile::Op> OpProfile::Ops() const {
  std::vector<Op> out;
  out.reserve(state_->ops.size());
  for (const auto& [name, op] : state_->ops) out.push_back(op);
  std::stable_sort(out.begin(), out.end(), [](const Op& a, const Op& b) { return a.seconds > b.seconds; });
  return out;
}

int64_t OpProfile::top_level_calls() const {
  int64_t n = 0;
  for (const auto& [name, op] : state_->ops) n += op.calls;
  return n;
}

int64_t OpProfile::all_calls() const { return state_->all_calls; }

double OpProfile::seconds() const {
  double t = 0;
  for (const auto& [name, op] : state_->ops) t += op.seconds;
  return t;
}

}  // namespace collabserve::model

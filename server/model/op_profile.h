// OpProfile: the ATen operators a piece of code dispatches on one thread, counted and timed by
// name. Where the device runs asynchronously (CUDA) a small pass costs what the host spends
// dispatching and launching its operators, not the device's arithmetic; this shows where that time
// goes and which operators a path runs (engine_bench --op_profile, scripts/gpu-check.sh).
//
// Contract:
//   - Observes the thread that constructs it, from construction until Stop() or destruction; other
//     threads (OpenMP workers, an encoder team's members) are not observed. At most one per thread.
//   - Every operator call that reaches the dispatcher (at::linear, at::add_, ..., including the
//     ones an operator calls inside it) is counted; the host time, from the operator's entry to its
//     return, is summed for the top-level calls only (the ones not made from inside another
//     operator on this thread), so the times add up without counting anything twice.
//   - Time in an operator includes any wait inside it: on CUDA, a copy to the CPU waits there for
//     the device to finish the work queued before it.
//   - Stop() and the destructor run on the observing thread (its callback is that thread's).
//   - Observing adds a callback to every operator call: 0.2-0.3 us each here, against 0.7-1.4 us
//     for dispatching a small at::neg.
#ifndef COLLABSERVE_SERVER_MODEL_OP_PROFILE_H_
#define COLLABSERVE_SERVER_MODEL_OP_PROFILE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace collabserve::model {

class OpProfile {
 public:
  struct Op {
    std::string name;    // the operator's name, e.g. "aten::linear"
    int64_t calls = 0;   // top-level calls
    double seconds = 0;  // host seconds in those calls, in all
    int64_t nested = 0;  // calls made from inside another operator (not timed)
    double longest = 0;  // host seconds of the longest top-level call
  };

  OpProfile();  // starts observing this thread
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  // Stops observing (idempotent); the figures stay readable.
  void Stop();

  // Every operator called, most host time first (then by name): the ones only ever called from
  // inside another have calls = 0 and seconds = 0.
  std::vector<Op> Ops() const;
  int64_t top_level_calls() const;
  // Every observed call, the nested ones included.
  int64_t all_calls() const;
  // Host seconds in top-level operators, in all.
  double seconds() const;

  struct State;  // what the operator callbacks fill in (op_profile.cc)

 private:
  std::unique_ptr<State> state_;
  uint64_t handle_ = 0;
};

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_OP_PROFILE_H_

// Linked into every executable of a COLLABSERVE_SANITIZE=thread tree that builds gRPC (tests/
// sanitizers/sanitizers.cmake): teaches ThreadSanitizer the one ordering that gRPC's completion
// queue guarantees and that TSan cannot see, because Debian's libgrpc is not instrumented:
//
//   everything a thread did before grpc_call_start_batch(call, ops, n, tag)
//   happens before whatever a thread does after it takes that batch's completion for `tag`
//   from grpc_completion_queue_next / grpc_completion_queue_pluck.
//
// That is the hand-off of gRPC's C++ callback API: a reactor's Finish / StartWrite / StartRead
// (on our batch or RPC threads) fills a CallbackWithSuccessTag and its CallOpSet in grpcpp's
// header code (instrumented, inlined into our binary) and starts the batch with the tag; the
// server's "nexting" threads take the completion from grpc_completion_queue_next and run the tag
// (CallbackWithSuccessTag::Run: the same header code). Without this edge TSan reported the tag's
// std::function, moved in by Set and read by Run, as a race (service_server_test, CI 2026-11-30);
// the tsan.supp line for Set did not match because the writer's stack could not be restored.
// The sync client API (the tests' stubs) takes its completions with pluck the same way.
//
// The executable's definitions interpose libgrpc's exported functions for every caller (libgrpc++
// calls them through the PLT); each forwards to the real one (dlsym RTLD_NEXT, looked up on first
// use). The release is on the tag's address before the batch starts (its completion may run on
// another thread before grpc_call_start_batch returns); the acquire on the same address once the
// event is in hand.
#include <dlfcn.h>
#include <grpc/grpc.h>

#include <cstdio>
#include <cstdlib>

extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);

namespace {

template <typename F>
F Real(const char* name) {
  void* p = dlsym(RTLD_NEXT, name);
  if (p == nullptr) {
    std::fprintf(stderr, "tsan_grpc_shim: cannot find %s\n", name);
    std::abort();
  }
  return reinterpret_cast<F>(p);
}

grpc_event Acquired(grpc_event ev) {
  if (ev.type == GRPC_OP_COMPLETE && ev.tag != nullptr) __tsan_acquire(ev.tag);
  return ev;
}

}  // namespace

extern "C" {

grpc_call_error grpc_call_start_batch(grpc_call* call, const grpc_op* ops, size_t nops, void* tag,
                                      void* reserved) {
  using Fn = grpc_call_error (*)(grpc_call*, const grpc_op*, size_t, void*, void*);
  static const Fn real = Real<Fn>("grpc_call_start_batch");
  if (tag != nullptr) __tsan_release(tag);
  return real(call, ops, nops, tag, reserved);
}

grpc_event grpc_completion_queue_next(grpc_completion_queue* cq, gpr_timespec deadline,
                                      void* reserved) {
  using Fn = grpc_event (*)(grpc_completion_queue*, gpr_timespec, void*);
  static const Fn real = Real<Fn>("grpc_completion_queue_next");
  return Acquired(real(cq, deadline, reserved));
}

grpc_event grpc_completion_queue_pluck(grpc_completion_queue* cq, void* tag,
                                       gpr_timespec deadline, void* reserved) {
  using Fn = grpc_event (*)(grpc_completion_queue*, void*, gpr_timespec, void*);
  static const Fn real = Real<Fn>("grpc_completion_queue_pluck");
  return Acquired(real(cq, tag, deadline, reserved));
}

}  // extern "C"

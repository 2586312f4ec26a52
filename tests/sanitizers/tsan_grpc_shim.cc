// Linked into every executable of a COLLABSERVE_SANITIZE=thread tree that builds gRPC (tests/
// sanitizers/sanitizers.cmake): teaches ThreadSanitizer the one ordering that gRPC's completion
// queue guarantees and that TSan cannot see, because Debian's libgrpc is not instrumented:
//
//   everything a thread did before it handed a tag to the queue, with grpc_call_start_batch(call,
//   ops, n, tag) or grpc_server_request_call / grpc_server_request_registered_call(..., tag)
//   happens before whatever a thread does after it takes that tag's completion from
//   grpc_completion_queue_next / grpc_completion_queue_pluck.
//
// That is the hand-off of gRPC's C++ callback API: a reactor's Finish / StartWrite / StartRead
// (on our batch or RPC threads) fills a CallbackWithSuccessTag and its CallOpSet in grpcpp's
// header code (instrumented, inlined into our binary) and starts the batch with the tag; the
// server's "nexting" threads take the completion from grpc_completion_queue_next and run the tag
// (CallbackWithSuccessTag::Run: the same header code). Without this edge TSan reported the tag's
// std::function, moved in by Set and read by Run, as a race (service_server_test, CI 2026-11-30);
// the tsan.supp line for Set did not match because the writer's stack could not be restored.
// The sync client API (the tests' stubs) takes its completions with pluck the same way. A server
// call starts the same way too: grpcpp builds a request object (its interceptor batch included) on
// whichever thread finished the previous one, possibly a client thread polling inside pluck in a
// test, and asks for the next call with grpc_server_request_*_call(..., tag); a nexting thread
// runs the tag, and with it the call's interceptors, once a call arrives (overload_test, CI
// 2026-11-30: our interceptor reading the batch's hook points vs its constructor).
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

grpc_call_error grpc_server_request_call(grpc_server* server, grpc_call** call,
                                         grpc_call_details* details,
                                         grpc_metadata_array* request_metadata,
                                         grpc_completion_queue* cq_bound_to_call,
                                         grpc_completion_queue* cq_for_notification, void* tag_new) {
  using Fn = grpc_call_error (*)(grpc_server*, grpc_call**, grpc_call_details*,
                                 grpc_metadata_array*, grpc_completion_queue*,
                                 grpc_completion_queue*, void*);
  static const Fn real = Real<Fn>("grpc_server_request_call");
  if (tag_new != nullptr) __tsan_release(tag_new);
  return real(server, call, details, request_metadata, cq_bound_to_call, cq_for_notification,
              tag_new);
}

grpc_call_error grpc_server_request_registered_call(
    grpc_server* server, void* registered_method, grpc_call** call, gpr_timespec* deadline,
    grpc_metadata_array* request_metadata, grpc_byte_buffer** optional_payload,
    grpc_completion_queue* cq_bound_to_call, grpc_completion_queue* cq_for_notification,
    void* tag_new) {
  using Fn = grpc_call_error (*)(grpc_server*, void*, grpc_call**, gpr_timespec*,
                                 grpc_metadata_array*, grpc_byte_buffer**, grpc_completion_queue*,
                                 grpc_completion_queue*, void*);
  static const Fn real = Real<Fn>("grpc_server_request_registered_call");
  if (tag_new != nullptr) __tsan_release(tag_new);
  return real(server, registered_method, call, deadline, request_metadata, optional_payload,
              cq_bound_to_call, cq_for_notification, tag_new);
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

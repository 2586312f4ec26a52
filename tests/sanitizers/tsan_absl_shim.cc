// Linked into every executable of a COLLABSERVE_SANITIZE=thread tree (tests/sanitizers/
// sanitizers.cmake): teaches ThreadSanitizer about absl::Mutex / CondVar / Notification when abseil
// itself was not built with TSan (Debian's shared libabsl). Without it TSan cannot see the
// happens-before edges of absl's futex-based locks and reports every guarded access as a race.
//
// The executable's definitions below interpose the shared library's exported entry points for every
// caller: our code, abseil itself (it calls them through the PLT, even internally) and gRPC (whose
// grpc_core::Mutex is an absl::Mutex). Each forwards to the real function (dlsym RTLD_NEXT) and
// tells TSan that the lock's address was released before / acquired after. The real function is
// looked up on first use, so an executable that never locks an absl::Mutex does not need abseil.
#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/base/options.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();

namespace {

#define SHIM_STR2(x) #x
#define SHIM_STR(x) SHIM_STR2(x)

// "_ZN4absl<len><inline namespace>" + rest: the Itanium mangling of absl::<ns>::...
std::string Mangled(const char* prefix, const char* rest) {
  const std::string ns = SHIM_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  return std::string(prefix) + "4absl" + std::to_string(ns.size()) + ns + rest;
}

template <typename F>
F Real(const char* prefix, const char* rest) {
  const std::string name = Mangled(prefix, rest);
  void* p = dlsym(RTLD_NEXT, name.c_str());
  if (p == nullptr) {
    std::fprintf(stderr, "tsan_absl_shim: cannot find %s\n", name.c_str());
    std::abort();
  }
  return reinterpret_cast<F>(p);
}

void* Addr(const void* p) { return const_cast<void*>(p); }

// absl::Notification is { Mutex mutex_; std::atomic<bool> notified_yet_; } (notification.h, both
// private); the mirror gives the flag's offset, and the static_assert catches another layout.
struct NotificationLayout {
  absl::Mutex mutex;
  std::atomic<bool> notified_yet;
};
static_assert(sizeof(NotificationLayout) == sizeof(absl::Notification),
              "absl::Notification's layout changed: update NotificationLayout");
void* NotifiedYet(const absl::Notification* n) {
  return static_cast<char*>(Addr(n)) + offsetof(NotificationLayout, notified_yet);
}

// Inside abseil, a thread that releases or waits for a lock evaluates the waiters' Conditions on
// their behalf, at points TSan cannot see: the accesses made inside the real calls are not
// recorded (they happen under the lock by construction); the annotations around them carry the
// ordering.
template <typename F, typename... A>
auto Quiet(F f, A&&... a) -> decltype(f(std::forward<A>(a)...)) {
  struct Ignore {
    Ignore() { __tsan_ignore_thread_begin(); }
    ~Ignore() { __tsan_ignore_thread_end(); }
  } ignore;
  return f(std::forward<A>(a)...);
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static auto real = Real<void (*)(Mutex*)>("_ZN", "5Mutex4LockEv");
  Quiet(real, this);
  __tsan_acquire(this);
}
void Mutex::Unlock() {
  static auto real = Real<void (*)(Mutex*)>("_ZN", "5Mutex6UnlockEv");
  __tsan_release(this);
  Quiet(real, this);
}
bool Mutex::TryLock() {
  static auto real = Real<bool (*)(Mutex*)>("_ZN", "5Mutex7TryLockEv");
  const bool locked = Quiet(real, this);
  if (locked) __tsan_acquire(this);
  return locked;
}
void Mutex::ReaderLock() {
  static auto real = Real<void (*)(Mutex*)>("_ZN", "5Mutex10ReaderLockEv");
  Quiet(real, this);
  __tsan_acquire(this);
}
void Mutex::ReaderUnlock() {
  static auto real = Real<void (*)(Mutex*)>("_ZN", "5Mutex12ReaderUnlockEv");
  __tsan_release(this);
  Quiet(real, this);
}
void Mutex::LockWhen(const Condition& cond) {
  static auto real =
      Real<void (*)(Mutex*, const Condition&)>("_ZN", "5Mutex8LockWhenERKNS0_9ConditionE");
  Quiet(real, this, cond);
  __tsan_acquire(this);
}
bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "_ZN", "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  const bool ok = Quiet(real, this, cond, timeout);
  __tsan_acquire(this);
  return ok;
}
void Mutex::Await(const Condition& cond) {
  static auto real =
      Real<void (*)(Mutex*, const Condition&)>("_ZN", "5Mutex5AwaitERKNS0_9ConditionE");
  __tsan_release(this);
  Quiet(real, this, cond);
  __tsan_acquire(this);
}
bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "_ZN", "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  __tsan_release(this);
  const bool ok = Quiet(real, this, cond, timeout);
  __tsan_acquire(this);
  return ok;
}
void CondVar::Wait(Mutex* mu) {
  static auto real = Real<void (*)(CondVar*, Mutex*)>("_ZN", "7CondVar4WaitEPNS0_5MutexE");
  __tsan_release(mu);
  Quiet(real, this, mu);
  __tsan_acquire(mu);
}
bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static auto real = Real<bool (*)(CondVar*, Mutex*, Duration)>(
      "_ZN", "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  __tsan_release(mu);
  const bool timed_out = Quiet(real, this, mu, timeout);
  __tsan_acquire(mu);
  return timed_out;
}
bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static auto real = Real<bool (*)(CondVar*, Mutex*, Time)>(
      "_ZN", "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  __tsan_release(mu);
  const bool timed_out = Quiet(real, this, mu, deadline);
  __tsan_acquire(mu);
  return timed_out;
}
void Notification::Notify() {
  static auto real = Real<void (*)(Notification*)>("_ZN", "12Notification6NotifyEv");
  __tsan_release(this);
  // HasBeenNotified() is inline (instrumented in the caller): an acquire load of notified_yet_,
  // which TSan pairs with a release on that address, not on `this`.
  __tsan_release(NotifiedYet(this));
  real(this);
}
void Notification::WaitForNotification() const {
  static auto real =
      Real<void (*)(const Notification*)>("_ZNK", "12Notification19WaitForNotificationEv");
  real(this);
  __tsan_acquire(Addr(this));
}
bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  static auto real = Real<bool (*)(const Notification*, Duration)>(
      "_ZNK", "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  const bool notified = real(this, timeout);
  if (notified) __tsan_acquire(Addr(this));
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl

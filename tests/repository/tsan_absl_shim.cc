// ThreadSanitizer build only. Debian's abseil is not built with -fsanitize=thread, so TSan cannot
// see absl::Mutex or absl::Notification synchronize and would report every access they guard as a
// race. This file wraps the calls the repository and its test make into those libraries
// (linked with -Wl,--wrap=<symbol>, see tests/repository/CMakeLists.txt) and tells TSan about the
// lock, unlock, notify and wait they perform. Symbol names are abseil 20220623 as Debian builds it
// (inline namespace debian3).
#include <sanitizer/tsan_interface.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#define MUTEX_LOCK _ZN4absl7debian35Mutex4LockEv
#define MUTEX_UNLOCK _ZN4absl7debian35Mutex6UnlockEv
#define MUTEX_READER_LOCK _ZN4absl7debian35Mutex10ReaderLockEv
#define MUTEX_READER_UNLOCK _ZN4absl7debian35Mutex12ReaderUnlockEv
#define CONDVAR_WAIT_WITH_DEADLINE _ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE
#define MUTEX_DESTROY _ZN4absl7debian35MutexD1Ev
#define NOTIFY _ZN4absl7debian312Notification6NotifyEv
#define WAIT _ZNK4absl7debian312Notification19WaitForNotificationEv
#define WAIT_WITH_TIMEOUT \
  _ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define REAL(sym) CAT(__real_, sym)
#define WRAP(sym) CAT(__wrap_, sym)

extern "C" {

void REAL(MUTEX_LOCK)(absl::Mutex* mu);
void REAL(MUTEX_UNLOCK)(absl::Mutex* mu);
void REAL(MUTEX_READER_LOCK)(absl::Mutex* mu);
void REAL(MUTEX_READER_UNLOCK)(absl::Mutex* mu);
bool REAL(CONDVAR_WAIT_WITH_DEADLINE)(absl::CondVar* cv, absl::Mutex* mu, absl::Time deadline);
void REAL(MUTEX_DESTROY)(absl::Mutex* mu);
void REAL(NOTIFY)(absl::Notification* n);
void REAL(WAIT)(const absl::Notification* n);
bool REAL(WAIT_WITH_TIMEOUT)(const absl::Notification* n, absl::Duration timeout);

void WRAP(MUTEX_LOCK)(absl::Mutex* mu) {
  __tsan_mutex_pre_lock(mu, 0);
  REAL(MUTEX_LOCK)(mu);
  __tsan_mutex_post_lock(mu, 0, 0);
}
void WRAP(MUTEX_UNLOCK)(absl::Mutex* mu) {
  __tsan_mutex_pre_unlock(mu, 0);
  REAL(MUTEX_UNLOCK)(mu);
  __tsan_mutex_post_unlock(mu, 0);
}
void WRAP(MUTEX_READER_LOCK)(absl::Mutex* mu) {
  __tsan_mutex_pre_lock(mu, __tsan_mutex_read_lock);
  REAL(MUTEX_READER_LOCK)(mu);
  __tsan_mutex_post_lock(mu, __tsan_mutex_read_lock, 0);
}
void WRAP(MUTEX_READER_UNLOCK)(absl::Mutex* mu) {
  __tsan_mutex_pre_unlock(mu, __tsan_mutex_read_lock);
  REAL(MUTEX_READER_UNLOCK)(mu);
  __tsan_mutex_post_unlock(mu, __tsan_mutex_read_lock);
}
// The wait releases the mutex and holds it again when it returns. (Mutex::Await is not wrapped:
// abseil evaluates its Condition with the mutex held but inside the wait, which this cannot show.)
bool WRAP(CONDVAR_WAIT_WITH_DEADLINE)(absl::CondVar* cv, absl::Mutex* mu, absl::Time deadline) {
  __tsan_mutex_pre_unlock(mu, 0);
  __tsan_mutex_post_unlock(mu, 0);
  const bool timed_out = REAL(CONDVAR_WAIT_WITH_DEADLINE)(cv, mu, deadline);
  __tsan_mutex_pre_lock(mu, 0);
  __tsan_mutex_post_lock(mu, 0, 0);
  return timed_out;
}
void WRAP(MUTEX_DESTROY)(absl::Mutex* mu) {
  __tsan_mutex_destroy(mu, 0);
  REAL(MUTEX_DESTROY)(mu);
}
void WRAP(NOTIFY)(absl::Notification* n) {
  __tsan_release(n);
  REAL(NOTIFY)(n);
}
void WRAP(WAIT)(const absl::Notification* n) {
  REAL(WAIT)(n);
  __tsan_acquire(const_cast<absl::Notification*>(n));
}
bool WRAP(WAIT_WITH_TIMEOUT)(const absl::Notification* n, absl::Duration timeout) {
  const bool notified = REAL(WAIT_WITH_TIMEOUT)(n, timeout);
  if (notified) __tsan_acquire(const_cast<absl::Notification*>(n));
  return notified;
}

}  // extern "C"

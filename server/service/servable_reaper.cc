#include "server/service/servable_reaper.h"

#include <utility>

#include <glog/logging.h>

#include "server/util/process_memory.h"

#if defined(__SANITIZE_ADDRESS__)
#define COLLABSERVE_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define COLLABSERVE_LSAN 1
#endif
#endif
#ifdef COLLABSERVE_LSAN
#include <sanitizer/lsan_interface.h>
#endif

namespace collabserve::service {

ServableReaper::ServableReaper() : thread_([this] { Loop(); }) {}

ServableReaper::~ServableReaper() { Stop(absl::ZeroDuration()); }

std::shared_ptr<repository::Servable> ServableReaper::Adopt(
    std::unique_ptr<repository::Servable> servable) {
  {
    absl::MutexLock lock(&mu_);
    ++alive_;
  }
  std::shared_ptr<ServableReaper> self = shared_from_this();
  return std::shared_ptr<repository::Servable>(
      servable.release(), [self](repository::Servable* s) { self->Release(s); });
}

void ServableReaper::Release(repository::Servable* servable) {
  absl::MutexLock lock(&mu_);
  if (stopped_) {
    LOG(WARNING) << "a servable was released after the server stopped; leaking it";
#ifdef COLLABSERVE_LSAN
    __lsan_ignore_object(servable);  // leaked on purpose: not a finding for LeakSanitizer
#endif
    return;
  }
  queue_.push_back(servable);
}

void ServableReaper::Loop() {
  for (;;) {
    repository::Servable* s = nullptr;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ServableReaper* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return r->stopped_ || !r->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopped, nothing left
      s = queue_.front();
      queue_.pop_front();
    }
    delete s;
    // A version's parameters were just freed: hand the pages back (util::ReleaseFreedMemory)
    // instead of leaving them in the allocator's arenas, where a swap a minute made RSS creep.
    util::ReleaseFreedMemory();
    absl::MutexLock lock(&mu_);
    --alive_;
  }
}

int64_t ServableReaper::Stop(absl::Duration timeout) {
  int64_t alive;
  {
    absl::MutexLock lock(&mu_);
    auto all_gone = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return alive_ == 0; };
    mu_.AwaitWithTimeout(absl::Condition(&all_gone), timeout);
    stopped_ = true;
    alive = alive_;
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  // Anything queued but not destroyed by the loop (none unless the loop already exited) stays
  // counted as alive and is leaked.
  if (alive > 0) LOG(WARNING) << alive << " servable(s) still held when the server stopped";
  return alive;
}

int64_t ServableReaper::num_alive() const {
  absl::MutexLock lock(&mu_);
  return alive_;
}

}  // namespace collabserve::service

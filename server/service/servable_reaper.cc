#include "server/service/servable_reaper.h"

#include <utility>

namespace collabserve::service {

ServableReaper::ServableReaper() : thread_([this] { Loop(); }) {}

ServableReaper::~ServableReaper() { Stop(); }

std::shared_ptr<repository::Servable> ServableReaper::Adopt(
    std::unique_ptr<repository::Servable> servable) {
  std::shared_ptr<ServableReaper> self = shared_from_this();
  return std::shared_ptr<repository::Servable>(
      servable.release(), [self](repository::Servable* s) { self->Release(s); });
}

void ServableReaper::Release(repository::Servable* servable) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      queue_.push_back(servable);
      return;
    }
  }
  delete servable;
}

void ServableReaper::Loop() {
  for (;;) {
    repository::Servable* s = nullptr;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ServableReaper* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return r->stopping_ || !r->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping and nothing left
      s = queue_.front();
      queue_.pop_front();
    }
    delete s;
  }
}

void ServableReaper::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

}  // namespace collabserve::service

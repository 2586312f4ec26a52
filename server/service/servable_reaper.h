// Destroys servables on a thread of its own. A ModelServable's destructor drains its batch
// scheduler, which must not run on one of that scheduler's batch threads (the last reference to an
// unloaded version is often dropped there, when its last call completes) nor on a gRPC handler
// thread (which must not block).
#ifndef COLLABSERVE_SERVER_SERVICE_SERVABLE_REAPER_H_
#define COLLABSERVE_SERVER_SERVICE_SERVABLE_REAPER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/repository/model_repository.h"

namespace collabserve::service {

// Thread-safe. Create with std::make_shared; the deleters it hands out keep it alive.
class ServableReaper : public std::enable_shared_from_this<ServableReaper> {
 public:
  ServableReaper();
  ~ServableReaper();

  // Wraps `servable` in a shared_ptr whose deleter queues it for destruction on the reaper thread.
  std::shared_ptr<repository::Servable> Adopt(std::unique_ptr<repository::Servable> servable);

  // Waits up to `timeout` until every adopted servable has been released and destroyed (in-flight
  // calls let go of theirs as they complete), then stops the thread. What its owner tears down
  // after Stop (metrics, say) is then no longer used by any servable. A servable still held after
  // the timeout is leaked when released (logged), never destroyed on the releasing thread.
  // Returns the number of servables still alive. Idempotent.
  int64_t Stop(absl::Duration timeout = absl::Seconds(60));

  int64_t num_alive() const;

 private:
  void Release(repository::Servable* servable);
  void Loop();

  mutable absl::Mutex mu_;
  std::deque<repository::Servable*> queue_ ABSL_GUARDED_BY(mu_);
  int64_t alive_ ABSL_GUARDED_BY(mu_) = 0;  // adopted and not yet destroyed
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_SERVABLE_REAPER_H_

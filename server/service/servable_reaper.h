// Destroys servables on a thread of its own. A ModelServable's destructor drains its batch
// scheduler, which must not run on one of that scheduler's batch threads (the last reference to an
// unloaded version is often dropped there, when its last call completes) nor on a gRPC handler
// thread (which must not block).
#ifndef COLLABSERVE_SERVER_SERVICE_SERVABLE_REAPER_H_
#define COLLABSERVE_SERVER_SERVICE_SERVABLE_REAPER_H_

#include <deque>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/repository/model_repository.h"

namespace collabserve::service {

// Thread-safe. Create with std::make_shared; the deleters it hands out keep it alive, so servables
// released after Stop() (or after the owner let go) are destroyed inline on the releasing thread.
class ServableReaper : public std::enable_shared_from_this<ServableReaper> {
 public:
  ServableReaper();
  ~ServableReaper();

  // Wraps `servable` in a shared_ptr whose deleter queues it for destruction on the reaper thread.
  std::shared_ptr<repository::Servable> Adopt(std::unique_ptr<repository::Servable> servable);

  // Destroys everything queued so far and stops the thread; later releases destroy inline.
  void Stop();

 private:
  void Release(repository::Servable* servable);
  void Loop();

  absl::Mutex mu_;
  std::deque<repository::Servable*> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_SERVABLE_REAPER_H_

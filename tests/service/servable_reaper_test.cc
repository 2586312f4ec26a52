#include "server/service/servable_reaper.h"

#include <memory>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace collabserve::service {
namespace {

class Probe : public repository::Servable {
 public:
  Probe(std::thread::id* destroyed_on, absl::Notification* done)
      : destroyed_on_(destroyed_on), done_(done) {}
  ~Probe() override {
    *destroyed_on_ = std::this_thread::get_id();
    done_->Notify();
  }

 private:
  std::thread::id* destroyed_on_;
  absl::Notification* done_;
};

TEST(ServableReaperTest, DestroysOnItsOwnThreadNotTheReleasingOne) {
  auto reaper = std::make_shared<ServableReaper>();
  std::thread::id destroyed_on;
  absl::Notification done;
  std::shared_ptr<repository::Servable> s = reaper->Adopt(std::make_unique<Probe>(&destroyed_on, &done));
  s.reset();
  done.WaitForNotification();
  EXPECT_NE(destroyed_on, std::this_thread::get_id());
  reaper->Stop();
}

TEST(ServableReaperTest, AfterStopReleasesDestroyInline) {
  auto reaper = std::make_shared<ServableReaper>();
  std::thread::id destroyed_on;
  absl::Notification done;
  std::shared_ptr<repository::Servable> s = reaper->Adopt(std::make_unique<Probe>(&destroyed_on, &done));
  reaper->Stop();
  reaper.reset();  // the deleter keeps the reaper alive
  s.reset();
  EXPECT_TRUE(done.HasBeenNotified());
  EXPECT_EQ(destroyed_on, std::this_thread::get_id());
}

}  // namespace
}  // namespace collabserve::service

#include "server/service/servable_reaper.h"

#include <memory>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
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

TEST(ServableReaperTest, StopWaitsForHoldersToLetGo) {
  auto reaper = std::make_shared<ServableReaper>();
  std::thread::id destroyed_on;
  absl::Notification done;
  std::shared_ptr<repository::Servable> s =
      reaper->Adopt(std::make_unique<Probe>(&destroyed_on, &done));
  EXPECT_EQ(reaper->num_alive(), 1);
  std::thread holder([&s] {
    absl::SleepFor(absl::Milliseconds(50));
    s.reset();  // an in-flight call completing after shutdown began
  });
  EXPECT_EQ(reaper->Stop(absl::Seconds(30)), 0);
  EXPECT_TRUE(done.HasBeenNotified());  // destroyed before Stop returned
  holder.join();
}

TEST(ServableReaperTest, AServableHeldPastTheTimeoutIsLeakedNotDestroyedByItsReleaser) {
  auto reaper = std::make_shared<ServableReaper>();
  std::thread::id destroyed_on;
  absl::Notification done;
  std::shared_ptr<repository::Servable> s =
      reaper->Adopt(std::make_unique<Probe>(&destroyed_on, &done));
  EXPECT_EQ(reaper->Stop(absl::Milliseconds(10)), 1);
  reaper.reset();  // the deleter keeps the reaper alive
  s.reset();
  EXPECT_FALSE(done.HasBeenNotified());
}

}  // namespace
}  // namespace collabserve::service

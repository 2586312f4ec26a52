// The allocator's retaining arena (util::BindThreadToRetainingArena), in a process that allocates
// with jemalloc as collabserve does (this test links it: tests/util/CMakeLists.txt). Page faults
// are counted per thread (getrusage(RUSAGE_THREAD)): a freed block whose pages went back to the
// system faults again when the next allocation writes it.
#include <sys/resource.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/compress/collaborative.h"
#include "server/model/checkpoint_maker.h"
#include "server/model/engine.h"
#include "server/model/pass_arena.h"
#include "server/util/process_memory.h"
#include "tests/testing/test_util.h"

#if COLLABSERVE_TEST_METRICS  // not in the engine-only build (-DCOLLABSERVE_WITH_GRPC=OFF)
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "server/metrics/process_metrics.h"
#endif

extern "C" int mallctl(const char* name, void* oldp, size_t* oldlenp, void* newp, size_t newlen);

namespace collabserve::util {
namespace {

constexpr size_t kBlock = size_t{64} << 20;  // 64 MiB: above jemalloc's 8 MiB "huge" threshold

int64_t ThreadFaults() {
  rusage ru{};
  EXPECT_EQ(getrusage(RUSAGE_THREAD, &ru), 0);
  return ru.ru_minflt;
}

// Allocates kBlock, writes every page, frees it; returns the page faults that took.
int64_t FaultsOfOneBlock() {
  const int64_t before = ThreadFaults();
  char* p = static_cast<char*>(std::malloc(kBlock));
  EXPECT_NE(p, nullptr);
  for (size_t i = 0; i < kBlock; i += 4096) p[i] = static_cast<char>(i);
  std::free(p);
  return ThreadFaults() - before;
}

int64_t BlockPages() { return static_cast<int64_t>(kBlock / static_cast<size_t>(sysconf(_SC_PAGESIZE))); }

unsigned ThreadArena() {
  unsigned ind = 0;
  size_t len = sizeof(ind);
  EXPECT_EQ(mallctl("thread.arena", &ind, &len, nullptr, 0), 0);
  return ind;
}

// Runs f on a thread of its own (each test starts from a thread on jemalloc's automatic arenas).
template <typename F>
void OnNewThread(F f) {
  std::thread t(f);
  t.join();
}

// collabserve_pass_memory_kept_bytes{part="allocator"} as /metrics would show it; -1 if absent.
// Without the metrics library, RetainingArenaFreeBytes (what the series exports).
double ScrapedFreeBytes() {
#if COLLABSERVE_TEST_METRICS
  for (const prometheus::MetricFamily& f : metrics::ProcessCollectable()->Collect()) {
    if (f.name != "collabserve_pass_memory_kept_bytes") continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      if (m.label.size() == 1 && m.label[0].name == "part" && m.label[0].value == "allocator") {
        return m.gauge.value;
      }
    }
  }
  return -1;
#else
  return static_cast<double>(RetainingArenaFreeBytes().value_or(0));
#endif
}

TEST(RetainingArenaTest, ThisProcessAllocatesWithJemalloc) {
  EXPECT_EQ(AllocatorName().rfind("jemalloc", 0), 0u) << AllocatorName();
}

// The premise: on jemalloc's defaults a large block's pages go back at free, so every round faults.
TEST(RetainingArenaTest, WithoutItEveryRoundFaultsTheBlockIn) {
  OnNewThread([] {
    FaultsOfOneBlock();
    for (int round = 0; round < 3; ++round) EXPECT_GE(FaultsOfOneBlock(), BlockPages() / 2) << round;
  });
}

TEST(RetainingArenaTest, KeepsFreedPagesForTheNextAllocationUntilPurged) {
  OnNewThread([] {
    ASSERT_TRUE(BindThreadToRetainingArena());
    EXPECT_TRUE(BindThreadToRetainingArena()) << "a second call on the same thread";
    FaultsOfOneBlock();  // the first round maps and faults the block in
    for (int round = 0; round < 3; ++round) EXPECT_LT(FaultsOfOneBlock(), BlockPages() / 8) << round;
    // What it keeps is measured, and exported at each scrape.
    ASSERT_TRUE(RetainingArenaFreeBytes().has_value());
    EXPECT_GE(*RetainingArenaFreeBytes(), kBlock);
    EXPECT_GE(ScrapedFreeBytes(), static_cast<double>(kBlock));
    // A purge gives the pages back: the next round faults them in again, and after it they stay.
    PurgeRetainingArena();
    EXPECT_LT(*RetainingArenaFreeBytes(), kBlock / 8);
    EXPECT_LT(ScrapedFreeBytes(), static_cast<double>(kBlock / 8));
    EXPECT_GE(FaultsOfOneBlock(), BlockPages() / 2);
    EXPECT_LT(FaultsOfOneBlock(), BlockPages() / 8);
  });
}

// Every bound thread shares the one arena: what one frees, another reuses resident while the first
// lives, as the server's batch and team threads do. (Bound one after the other, the second thread
// faulted the whole block in again: jemalloc purges an arena when the last thread on it exits.)
TEST(RetainingArenaTest, ThreadsShareOneArena) {
  unsigned first = 0, second = 0;
  std::mutex mu;
  std::condition_variable cv;
  bool freed = false, done = false;
  std::thread t1([&] {
    ASSERT_TRUE(BindThreadToRetainingArena());
    first = ThreadArena();
    FaultsOfOneBlock();
    std::unique_lock<std::mutex> l(mu);
    freed = true;
    cv.notify_all();
    cv.wait(l, [&] { return done; });
  });
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return freed; });
  }
  OnNewThread([&] {
    const unsigned automatic = ThreadArena();
    ASSERT_TRUE(BindThreadToRetainingArena());
    second = ThreadArena();
    EXPECT_NE(second, automatic);
    EXPECT_LT(FaultsOfOneBlock(), BlockPages() / 8);
  });
  {
    std::lock_guard<std::mutex> l(mu);
    done = true;
  }
  cv.notify_all();
  t1.join();
  EXPECT_EQ(first, second);
}

// The retaining arena's index (a new thread's, once bound).
unsigned RetainingArenaIndex() {
  unsigned index = 0;
  OnNewThread([&] {
    EXPECT_TRUE(BindThreadToRetainingArena());
    index = ThreadArena();
  });
  return index;
}

// The compression's passes (calibration statistics, fidelity probes) run on it too, the calling
// thread included.
TEST(RetainingArenaTest, CompressionPassesRunOnIt) {
  const collabserve::testing::TempDir dir;
  ASSERT_TRUE(model::MakeCheckpoint(dir.path(), model::MakeOptions{}).ok());
  auto engine = model::Engine::Load(dir.path());
  ASSERT_TRUE(engine.ok()) << engine.status();
  const model::BertClassifier& m = (*engine)->classifier();
  const std::vector<std::string> texts(20, "a short text to run through the model");
  const unsigned retaining = RetainingArenaIndex();
  OnNewThread([&] {
    EXPECT_NE(ThreadArena(), retaining);
    ASSERT_TRUE(compress::CollectCalibrationStats(m, dir.path(), texts).ok());
    EXPECT_EQ(ThreadArena(), retaining);
  });
  OnNewThread([&] {
    EXPECT_NE(ThreadArena(), retaining);
    ASSERT_TRUE(compress::MeasureFidelity(m, m, dir.path(), texts).ok());
    EXPECT_EQ(ThreadArena(), retaining);
  });
}

// The engine puts the threads that run its passes on the arena (Engine::Run's PassArena::Pass),
// and PassArena's release gives its pages back.
TEST(RetainingArenaTest, EngineRunsPassesOnItAndPassArenaReleasesIt) {
  const collabserve::testing::TempDir dir;
  ASSERT_TRUE(model::MakeCheckpoint(dir.path(), model::MakeOptions{}).ok());
  auto engine = model::Engine::Load(dir.path());
  ASSERT_TRUE(engine.ok()) << engine.status();
  const unsigned retaining = RetainingArenaIndex();
  OnNewThread([&] {
    EXPECT_NE(ThreadArena(), retaining);
    model::TokenizedInput in;
    in.input_ids = {101, 2023, 102};
    ASSERT_TRUE((*engine)->Run(std::vector<model::TokenizedInput>{in}).ok());
    EXPECT_EQ(ThreadArena(), retaining);
    FaultsOfOneBlock();
    EXPECT_LT(FaultsOfOneBlock(), BlockPages() / 8);
    model::PassArena::Shared().ReleaseIfIdle();
    EXPECT_GE(FaultsOfOneBlock(), BlockPages() / 2) << "ReleaseIfIdle purged the retaining arena";
  });
}

}  // namespace
}  // namespace collabserve::util

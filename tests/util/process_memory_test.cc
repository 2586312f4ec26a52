#include "server/util/process_memory.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace collabserve::util {
namespace {

using ::testing::HasSubstr;

TEST(ParseProcStatus, ReadsTheMemoryLines) {
  const char* text =
      "Name:\tcollabserve\n"
      "VmPeak:\t 2000000 kB\n"
      "VmHWM:\t   1500 kB\n"
      "VmRSS:\t   1200 kB\n"
      "RssAnon:\t    800 kB\n"
      "RssFile:\t    400 kB\n"
      "RssShmem:\t      0 kB\n"
      "Threads:\t3\n";
  absl::StatusOr<ProcessMemory> m = ParseProcStatus(text);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->hwm_bytes, 1500 * 1024);
  EXPECT_EQ(m->rss_bytes, 1200 * 1024);
  EXPECT_EQ(m->rss_anon_bytes, 800 * 1024);
  EXPECT_EQ(m->rss_file_bytes, 400 * 1024);
}

TEST(ParseProcStatus, RejectsMissingOrMalformedFigures) {
  EXPECT_EQ(ParseProcStatus("Name:\tx\n").status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<ProcessMemory> bad = ParseProcStatus("VmRSS:\t12x kB\n");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("VmRSS"), std::string::npos) << bad.status();
}

TEST(ReadProcessMemory, SeesThisProcess) {
  absl::StatusOr<ProcessMemory> m = ReadProcessMemory();
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_GT(m->rss_bytes, 0);
  EXPECT_GE(m->hwm_bytes, m->rss_bytes);
}

TEST(MemoryPhases, AttributesAnAllocationToItsPhase) {
  MemoryPhases phases(absl::Milliseconds(1));
  phases.Begin("small");
  phases.Begin("big");
  constexpr size_t kBytes = 64 << 20;
  {
    std::vector<char> block(kBytes);
    std::memset(block.data(), 1, block.size());  // make it resident
    phases.Begin("after");
  }
  std::vector<MemoryPhase> out = phases.Finish();
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].name, "small");
  EXPECT_EQ(out[1].name, "big");
  // The block was resident when "big" ended.
  EXPECT_GE(out[1].rss_peak_bytes - out[0].rss_peak_bytes, static_cast<int64_t>(kBytes) * 3 / 4);
  EXPECT_GE(out[1].hwm_end_bytes, out[1].rss_peak_bytes);
  for (const MemoryPhase& p : out) {
    EXPECT_GE(p.rss_peak_bytes, p.rss_start_bytes);
    EXPECT_GE(p.rss_peak_bytes, p.rss_end_bytes);
  }
  EXPECT_TRUE(phases.Finish().size() == 3u);  // idempotent
  EXPECT_NE(MemoryPhases::Format(out).find("big: "), std::string::npos);
}

#if defined(__GLIBC__)
TEST(ParseProcStat, ReadsCpuStartMemoryAndThreads) {
  // A command name with spaces and parentheses; utime 250 + stime 50 ticks, 7 threads, started
  // 1234 ticks after boot, 100 MiB virtual, 2560 resident pages.
  const std::string line =
      "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 50 0 0 20 0 7 0 1234 104857600 "
      "2560 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
  ProcessStats s;
  ASSERT_TRUE(ParseProcStat(line, 1700000000, 100, 4096, &s).ok());
  EXPECT_DOUBLE_EQ(s.cpu_seconds, 3.0);
  EXPECT_EQ(s.start_time, absl::FromUnixSeconds(1700000000) + absl::Milliseconds(12340));
  EXPECT_EQ(s.virtual_bytes, 104857600);
  EXPECT_EQ(s.resident_bytes, 2560 * 4096);
  EXPECT_EQ(s.threads, 7);
  // Without a boot time, everything but the start time.
  ProcessStats no_boot;
  ASSERT_TRUE(ParseProcStat(line, -1, 100, 4096, &no_boot).ok());
  EXPECT_FALSE(no_boot.start_time.has_value());
  EXPECT_DOUBLE_EQ(no_boot.cpu_seconds, 3.0);
  EXPECT_EQ(no_boot.resident_bytes, 2560 * 4096);
  EXPECT_THAT(ParseProcStat("4242 (x) S 1 2", 0, 100, 4096, &s).message(),
              HasSubstr("field 14 is missing"));
  EXPECT_THAT(ParseProcStat("no parenthesis", 0, 100, 4096, &s).message(), HasSubstr("')'"));
}

TEST(ReadProcessStats, SeesThisProcess) {
  absl::StatusOr<ProcessStats> s = ReadProcessStats();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_GT(s->resident_bytes, 0);
  EXPECT_GE(s->virtual_bytes, s->resident_bytes);
  EXPECT_GE(s->threads, 1);
  EXPECT_GE(s->open_fds, 3);  // stdin, stdout, stderr
  EXPECT_GE(s->max_fds, s->open_fds);
  EXPECT_GE(s->cpu_seconds, 0);
  ASSERT_TRUE(s->start_time.has_value());
  EXPECT_LE(*s->start_time, absl::Now());
  EXPECT_GT(*s->start_time, absl::Now() - absl::Hours(1));
  absl::StatusOr<ProcessStats> again = ReadProcessStats();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->start_time, s->start_time);
}

TEST(AllocatorNameTest, NamesTheAllocatorOfThisProcess) {
  // The test binaries are not linked with jemalloc (collabserve is): glibc's malloc here.
  EXPECT_EQ(AllocatorName().rfind("glibc malloc 2.", 0), 0u) << AllocatorName();
}

// Without jemalloc (this test allocates with glibc) there is no retaining arena: nothing changes.
TEST(RetainingArenaTest, IsJemallocsAlone) {
  EXPECT_FALSE(BindThreadToRetainingArena());
  PurgeRetainingArena();  // a no-op
  EXPECT_FALSE(BindThreadToRetainingArena());
  EXPECT_EQ(RetainingArenaFreeBytes(), std::nullopt);  // and no gauge to export
}

TEST(LimitMallocArenasTest, AppliesUnlessTheEnvironmentDecides) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "under ASan, malloc is ASan's and its mallopt() accepts no glibc option (the "
                  "normal build runs this test)";
#endif
  ::unsetenv("MALLOC_ARENA_MAX");
  EXPECT_FALSE(LimitMallocArenas(0));
  EXPECT_TRUE(LimitMallocArenas(4));
  ::setenv("MALLOC_ARENA_MAX", "8", 1);
  EXPECT_FALSE(LimitMallocArenas(2));  // an explicit setting is respected
  ::unsetenv("MALLOC_ARENA_MAX");
}

TEST(ReleaseFreedMemoryTest, GivesFreedHeapPagesBack) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "under ASan, malloc/free are ASan's (freed blocks wait in its quarantine), not "
                  "glibc's: there is no glibc heap for malloc_trim to give back (the normal build "
                  "runs this test)";
#endif
  // 96 MiB in 32 KiB blocks (below glibc's mmap threshold: they come from the heap), then every
  // block but the last is freed: the last one pins the top of the heap, so glibc keeps the freed
  // pages resident until ReleaseFreedMemory trims inside the arena.
  constexpr size_t kBlock = 32 << 10, kCount = 3072;
  std::vector<char*> blocks;
  blocks.reserve(kCount);
  for (size_t i = 0; i < kCount; ++i) {
    char* b = static_cast<char*>(std::malloc(kBlock));
    ASSERT_NE(b, nullptr);
    std::memset(b, 1, kBlock);
    blocks.push_back(b);
  }
  for (size_t i = 0; i + 1 < kCount; ++i) std::free(blocks[i]);
  auto before = ReadProcessMemory();
  ASSERT_TRUE(before.ok()) << before.status();
  ReleaseFreedMemory();
  auto after = ReadProcessMemory();
  ASSERT_TRUE(after.ok()) << after.status();
  std::free(blocks.back());
  EXPECT_GE(before->rss_bytes - after->rss_bytes, static_cast<int64_t>(kBlock * kCount) / 2)
      << "RSS " << before->rss_bytes << " -> " << after->rss_bytes;
}
#endif

}  // namespace
}  // namespace collabserve::util

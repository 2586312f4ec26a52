#include "server/util/process_memory.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"

namespace collabserve::util {
namespace {

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
TEST(AllocatorNameTest, NamesTheAllocatorOfThisProcess) {
  // The test binaries are not linked with jemalloc (collabserve is): glibc's malloc here.
  EXPECT_EQ(AllocatorName().rfind("glibc malloc 2.", 0), 0u) << AllocatorName();
}

// Without jemalloc (this test allocates with glibc) there is no retaining arena: nothing changes.
TEST(RetainingArenaTest, IsJemallocsAlone) {
  EXPECT_FALSE(BindThreadToRetainingArena());
  PurgeRetainingArena();  // a no-op
  EXPECT_FALSE(BindThreadToRetainingArena());
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

#include "server/metrics/http_exposer.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/service/test_util.h"

namespace collabserve::metrics {
namespace {

using ::testing::HasSubstr;

TEST(HttpExposerTest, ServesTheBodyOnMetricsEachTimeFresh) {
  int calls = 0;
  auto e = HttpExposer::Start("127.0.0.1", 0, [&calls] {
    return "# TYPE x counter\nx " + std::to_string(++calls) + "\n";
  });
  ASSERT_TRUE(e.ok()) << e.status();
  auto a = collabserve::testing::ScrapeMetrics((*e)->port());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, "# TYPE x counter\nx 1\n");
  auto b = collabserve::testing::ScrapeMetrics((*e)->port());
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, "# TYPE x counter\nx 2\n");
}

TEST(HttpExposerTest, RefusesABoundPortAndABadHost) {
  auto a = HttpExposer::Start("127.0.0.1", 0, [] { return std::string(); });
  ASSERT_TRUE(a.ok());
  auto b = HttpExposer::Start("127.0.0.1", (*a)->port(), [] { return std::string(); });
  EXPECT_EQ(b.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr(std::to_string((*a)->port())));
  auto c = HttpExposer::Start("not an address", 0, [] { return std::string(); });
  EXPECT_FALSE(c.ok());
}

TEST(HttpExposerTest, StopsPromptlyWhenDestroyed) {
  auto e = HttpExposer::Start("127.0.0.1", 0, [] { return std::string("x 1\n"); });
  ASSERT_TRUE(e.ok());
  const int port = (*e)->port();
  e->reset();
  EXPECT_FALSE(collabserve::testing::ScrapeMetrics(port).ok());
}

}  // namespace
}  // namespace collabserve::metrics

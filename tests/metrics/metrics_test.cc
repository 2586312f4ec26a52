#include "server/metrics/metrics.h"

#include <cstdint>
#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "server/metrics/process_metrics.h"

namespace collabserve::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(MetricsTest, ExportsEveryFamilyWithItsLabels) {
  Metrics m("0.1.0", "1.13.1");
  ModelMetrics mm = m.ForModel("sst2");
  mm.request_duration->Observe(0.01);
  mm.batch_size->Observe(4);
  m.CountRequest("sst2", "3", "OK");
  m.QueueDepth("sst2", 3)->Set(2);
  m.inflight_requests()->Increment();
  ModelVersionFacts facts;
  facts.parameters = {{"total", 100}, {"attention_qk", 10}};
  facts.layer_ranks = {64, 32};
  facts.compression_ratio = 2.0;
  facts.load_seconds = 0.5;
  m.SetVersionFacts("sst2", 3, facts);

  const std::string text = m.TextFormat();
  EXPECT_THAT(text, HasSubstr("collabserve_requests_total{code=\"OK\",model=\"sst2\",version=\"3\"} 1"));
  EXPECT_THAT(text, HasSubstr("collabserve_request_duration_seconds_count{model=\"sst2\"} 1"));
  EXPECT_THAT(text, HasSubstr("collabserve_batch_size_sum{model=\"sst2\"} 4"));
  EXPECT_THAT(text, HasSubstr("collabserve_queue_depth{model=\"sst2\",version=\"3\"} 2"));
  EXPECT_THAT(text, HasSubstr("collabserve_inflight_requests 1"));
  EXPECT_THAT(text, HasSubstr("collabserve_model_parameters{model=\"sst2\",part=\"attention_qk\",version=\"3\"} 10"));
  EXPECT_THAT(text, HasSubstr("collabserve_model_layer_rank{layer=\"1\",model=\"sst2\",version=\"3\"} 32"));
  EXPECT_THAT(text, HasSubstr("collabserve_model_compression_ratio{model=\"sst2\",version=\"3\"} 2"));
  EXPECT_THAT(text, HasSubstr("collabserve_model_load_seconds{model=\"sst2\",version=\"3\"} 0.5"));
  EXPECT_THAT(text, HasSubstr("collabserve_build_info{torch_version=\"1.13.1\",version=\"0.1.0\"} 1"));
  for (const char* name : {"collabserve_queue_duration_seconds", "collabserve_tokenization_duration_seconds",
                           "collabserve_inference_duration_seconds", "collabserve_batch_tokens",
                           "collabserve_batch_padding_ratio"}) {
    EXPECT_THAT(text, HasSubstr(std::string("# TYPE ") + name + " histogram")) << name;
  }
}

// histogram_quantile interpolates inside a bucket: a threshold that is not a bucket bound reads a
// quantile above it with no observation above it. The alerts' (p99 request 0.5 s, queue 0.1 s) and
// the chart's HPA target (queue p90 50 ms) must be bounds, written exactly; tokenization needs
// microsecond buckets.
TEST(MetricsTest, LatencyBucketsHaveTheAlertThresholdsAsBounds) {
  Metrics m("0.1.0", "1.13.1");
  ModelMetrics mm = m.ForModel("m");
  mm.request_duration->Observe(0.42);
  mm.queue_duration->Observe(0.055);
  mm.tokenization_duration->Observe(12e-6);
  const std::string text = m.TextFormat();
  for (const char* family : {"request", "queue", "tokenization", "inference"}) {
    for (const char* le : {"1e-05", "0.05", "0.1", "0.5", "25"}) {
      EXPECT_TRUE(text.find(std::string("collabserve_") + family +
                            "_duration_seconds_bucket{model=\"m\",le=\"" + le + "\"}") !=
                  std::string::npos)
          << family << " " << le;
    }
  }
  // 0.42 s is below the 0.5 s bound and above the 0.25 s one; 55 ms is above 50 ms, below 100 ms.
  EXPECT_THAT(text, HasSubstr("collabserve_request_duration_seconds_bucket{model=\"m\",le=\"0.5\"} 1"));
  EXPECT_THAT(text, HasSubstr("collabserve_request_duration_seconds_bucket{model=\"m\",le=\"0.25\"} 0"));
  EXPECT_THAT(text, HasSubstr("collabserve_queue_duration_seconds_bucket{model=\"m\",le=\"0.1\"} 1"));
  EXPECT_THAT(text, HasSubstr("collabserve_tokenization_duration_seconds_bucket{model=\"m\",le=\"2.5e-05\"} 1"));
  EXPECT_THAT(text, HasSubstr("collabserve_tokenization_duration_seconds_bucket{model=\"m\",le=\"1e-05\"} 0"));
}

// The process collector every Prometheus client library has, read at each scrape.
TEST(MetricsTest, ExportsTheStandardProcessFamilies) {
  Metrics m("0.1.0", "1.13.1");
  const std::string text = m.TextFormat();
  for (const char* name : {"process_resident_memory_bytes", "process_virtual_memory_bytes",
                           "process_start_time_seconds", "process_open_fds", "process_max_fds",
                           "process_threads"}) {
    EXPECT_THAT(text, HasSubstr(std::string("# TYPE ") + name + " gauge")) << name;
    EXPECT_THAT(text, Not(HasSubstr(std::string("\n") + name + " 0\n"))) << name;
  }
  EXPECT_THAT(text, HasSubstr("# TYPE process_cpu_seconds_total counter"));
  // The test links glibc's malloc (no retaining arena) and no pass arena source is set: no series.
  EXPECT_THAT(text, Not(HasSubstr("collabserve_pass_memory_kept_bytes")));
}

// The pass arena's series reads its source at each scrape (the server sets the model's).
TEST(MetricsTest, ExportsWhatThePassArenaKeepsOnceASourceIsSet) {
  Metrics m("0.1.0", "1.13.1");
  int64_t bytes = 4096;
  SetPassArenaBytesSource([&bytes] { return bytes; });
  EXPECT_THAT(m.TextFormat(), HasSubstr("\ncollabserve_pass_memory_kept_bytes{part=\"arena\"} 4096\n"));
  bytes = 0;
  EXPECT_THAT(m.TextFormat(), HasSubstr("\ncollabserve_pass_memory_kept_bytes{part=\"arena\"} 0\n"));
  SetPassArenaBytesSource(nullptr);
  EXPECT_THAT(m.TextFormat(), Not(HasSubstr("collabserve_pass_memory_kept_bytes")));
}

// The GPU's three gauges read their source at each scrape (the server sets its device's); a source
// that reads nothing, and no source, export no series.
TEST(MetricsTest, ExportsTheGpuMemoryThatItsSourceReads) {
  Metrics m("0.1.0", "1.13.1");
  EXPECT_THAT(m.TextFormat(), Not(HasSubstr("collabserve_gpu_memory")));
  std::optional<GpuMemoryReading> reading;
  SetGpuMemorySource([&reading] { return reading; });
  EXPECT_THAT(m.TextFormat(), Not(HasSubstr("collabserve_gpu_memory")));
  reading = GpuMemoryReading{"cuda:1", 3 << 20, 5 << 20, int64_t{80} << 30};
  std::string text = m.TextFormat();
  EXPECT_THAT(text, HasSubstr("# TYPE collabserve_gpu_memory_allocated_bytes gauge\n"
                              "collabserve_gpu_memory_allocated_bytes{device=\"cuda:1\"} 3145728\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE collabserve_gpu_memory_reserved_bytes gauge\n"
                              "collabserve_gpu_memory_reserved_bytes{device=\"cuda:1\"} 5242880\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE collabserve_gpu_memory_total_bytes gauge\n"
                              "collabserve_gpu_memory_total_bytes{device=\"cuda:1\"} 85899345920\n"));
  reading->allocated_bytes = 0;
  reading->total_bytes = 0;  // unknown: left out, not a 0 to divide by
  text = m.TextFormat();
  EXPECT_THAT(text, HasSubstr("\ncollabserve_gpu_memory_allocated_bytes{device=\"cuda:1\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("\ncollabserve_gpu_memory_reserved_bytes{device=\"cuda:1\"} 5242880\n"));
  EXPECT_THAT(text, Not(HasSubstr("collabserve_gpu_memory_total_bytes")));
  SetGpuMemorySource(nullptr);
  EXPECT_THAT(m.TextFormat(), Not(HasSubstr("collabserve_gpu_memory")));
}

TEST(MetricsTest, RemoveVersionDropsOnlyThatVersionsSeries) {
  Metrics m("0.1.0", "1.13.1");
  ModelVersionFacts facts;
  facts.parameters = {{"total", 100}};
  facts.layer_ranks = {8, 0};
  facts.layer_errors = {{0, 0.25}};
  facts.fidelity_agreement = 0.75;
  m.SetVersionFacts("a", 1, facts);
  m.SetVersionFacts("a", 2, facts);
  m.QueueDepth("a", 1)->Set(1);
  m.CountRequest("a", "1", "OK");
  m.CountRequest("a", "2", "OK");
  m.RemoveVersion("a", 1);
  const std::string text = m.TextFormat();
  EXPECT_THAT(text, Not(HasSubstr("version=\"1\"")));
  EXPECT_THAT(text, HasSubstr("collabserve_model_parameters{model=\"a\",part=\"total\",version=\"2\"} 100"));
  EXPECT_THAT(text, HasSubstr("collabserve_layer_reconstruction_error{layer=\"0\",model=\"a\",version=\"2\"} 0.25"));
  EXPECT_THAT(text, Not(HasSubstr("collabserve_layer_reconstruction_error{layer=\"1\"")));
  EXPECT_THAT(text, HasSubstr("collabserve_model_fidelity_agreement{model=\"a\",version=\"2\"} 0.75"));
  EXPECT_THAT(text, HasSubstr("collabserve_requests_total{code=\"OK\",model=\"a\",version=\"2\"} 1"));
}

TEST(MetricsTest, ExposerPicksAPortWhenAskedForZero) {
  Metrics m("0.1.0", "1.13.1");
  int port = 0;
  ASSERT_TRUE(m.StartExposer("127.0.0.1", 0, &port).ok());
  EXPECT_GT(port, 0);
  EXPECT_FALSE(m.StartExposer("127.0.0.1", 0, &port).ok());
}

TEST(MetricsTest, ExposerReportsAnUnbindableAddress) {
  Metrics a("0.1.0", "1.13.1");
  int port = 0;
  ASSERT_TRUE(a.StartExposer("127.0.0.1", 0, &port).ok());
  Metrics b("0.1.0", "1.13.1");
  int port_b = 0;
  absl::Status s = b.StartExposer("127.0.0.1", port, &port_b);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(std::to_string(port)));
}

}  // namespace
}  // namespace collabserve::metrics

namespace collabserve::metrics {
namespace {

TEST(MetricsTest, ReloadedVersionKeepsItsSeriesUntilTheLastHolderGoes) {
  Metrics m("0.1.0", "1.13.1");
  ModelVersionFacts facts;
  facts.parameters = {{"total", 7}};
  m.SetVersionFacts("a", 1, facts);  // old servable
  m.SetVersionFacts("a", 1, facts);  // reloaded servable
  m.RemoveVersion("a", 1);           // old one drained
  EXPECT_THAT(m.TextFormat(), ::testing::HasSubstr("part=\"total\",version=\"1\"} 7"));
  m.RemoveVersion("a", 1);
  EXPECT_THAT(m.TextFormat(), ::testing::Not(::testing::HasSubstr("version=\"1\"")));
}

}  // namespace
}  // namespace collabserve::metrics

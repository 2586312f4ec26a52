#include "server/metrics/process_metrics.h"

#include <optional>
#include <utility>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "server/util/process_memory.h"

namespace collabserve::metrics {
namespace {

prometheus::MetricFamily OneValue(const char* name, const char* help, prometheus::MetricType type,
                                  double value) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  prometheus::ClientMetric m;
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
  return f;
}

prometheus::ClientMetric Labelled(const char* label, const char* value, double gauge) {
  prometheus::ClientMetric m;
  m.label.push_back({label, value});
  m.gauge.value = gauge;
  return m;
}

ABSL_CONST_INIT absl::Mutex arena_source_mu(absl::kConstInit);
std::function<int64_t()>* arena_source ABSL_GUARDED_BY(arena_source_mu) = nullptr;

// The registry's families, and what is read from /proc and the allocator at each scrape.
class ProcessCollectableImpl : public prometheus::Collectable {
 public:
  explicit ProcessCollectableImpl(std::shared_ptr<prometheus::Registry> registry)
      : registry_(std::move(registry)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    std::vector<prometheus::MetricFamily> families = registry_->Collect();
    // The names and meanings every Prometheus client library's process collector uses.
    if (absl::StatusOr<util::ProcessStats> p = util::ReadProcessStats(); p.ok()) {
      families.push_back(OneValue("process_cpu_seconds_total",
                                  "Total user and system CPU time spent in seconds.",
                                  MetricType::Counter, p->cpu_seconds));
      if (p->start_time) {
        families.push_back(OneValue(
            "process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
            MetricType::Gauge, static_cast<double>(absl::ToUnixMicros(*p->start_time)) / 1e6));
      }
      families.push_back(OneValue("process_virtual_memory_bytes",
                                  "Virtual memory size in bytes.", MetricType::Gauge,
                                  static_cast<double>(p->virtual_bytes)));
      families.push_back(OneValue("process_resident_memory_bytes",
                                  "Resident memory size in bytes.", MetricType::Gauge,
                                  static_cast<double>(p->resident_bytes)));
      if (p->open_fds >= 0) {
        families.push_back(OneValue("process_open_fds", "Number of open file descriptors.",
                                    MetricType::Gauge, static_cast<double>(p->open_fds)));
      }
      if (p->max_fds > 0) {
        families.push_back(OneValue("process_max_fds",
                                    "Maximum number of open file descriptors.",
                                    MetricType::Gauge, static_cast<double>(p->max_fds)));
      }
      families.push_back(OneValue("process_threads", "Number of OS threads in the process.",
                                  MetricType::Gauge, static_cast<double>(p->threads)));
    }
    prometheus::MetricFamily kept;
    kept.name = "collabserve_pass_memory_kept_bytes";
    kept.help =
        "Memory forward passes keep resident for the next pass, given back after 10 s without "
        "one: part=arena the pass arena's buffers (in use during a team pass), part=allocator "
        "the freed pages of the allocator's retaining arena.";
    kept.type = MetricType::Gauge;
    {
      absl::MutexLock l(&arena_source_mu);
      if (arena_source != nullptr) {
        kept.metric.push_back(Labelled("part", "arena", static_cast<double>((*arena_source)())));
      }
    }
    if (std::optional<size_t> bytes = util::RetainingArenaFreeBytes()) {
      kept.metric.push_back(Labelled("part", "allocator", static_cast<double>(*bytes)));
    }
    if (!kept.metric.empty()) families.push_back(std::move(kept));
    return families;
  }

 private:
  const std::shared_ptr<prometheus::Registry> registry_;
};

struct ProcessFamilies {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  prometheus::Family<prometheus::Counter>& load_failures =
      prometheus::BuildCounter()
          .Name("collabserve_repository_load_failures_total")
          .Help("Version directories the model repository could not load, by model and reason "
                "(the load error's status code).")
          .Register(*registry);
  std::shared_ptr<prometheus::Collectable> collectable =
      std::make_shared<ProcessCollectableImpl>(registry);
};

ProcessFamilies& Families() {
  static ProcessFamilies* families = new ProcessFamilies();  // never destroyed: used at exit
  return *families;
}

}  // namespace

void CountRepositoryLoadFailure(const std::string& model, const std::string& reason) {
  // Family::Add is thread-safe and returns the existing series for known labels.
  Families().load_failures.Add({{"model", model}, {"reason", reason}}).Increment();
}

std::shared_ptr<prometheus::Collectable> ProcessCollectable() { return Families().collectable; }

void SetPassArenaBytesSource(std::function<int64_t()> source) {
  auto* next = source ? new std::function<int64_t()>(std::move(source)) : nullptr;
  absl::MutexLock l(&arena_source_mu);
  delete arena_source;
  arena_source = next;
}

}  // namespace collabserve::metrics

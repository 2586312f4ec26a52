#include "server/metrics/process_metrics.h"

#include <optional>
#include <utility>
#include <vector>

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


prometheus::ClientMetric Labelled(const char* label, const char* value, double gauge) {
  prometheus::ClientMetric m;
  m.label.push_back({label, value});
  m.gauge.value = gauge;
  return m;
}

// A reading that another module sets at run time (this library does not link the model), taken at
// each scrape. Set and Read are thread-safe; a source runs under the lock, so that Set(nullptr)
// returning means the old one is no longer running.
template <typename R>
class ScrapeSource {
 public:
  void Set(std::function<R()> source) {
    absl::MutexLock l(&mu_);
    source_ = std::move(source);
  }
  // nullopt when none is set.
  std::optional<R> Read() const {
    absl::MutexLock l(&mu_);
    if (!source_) return std::nullopt;
    return source_();
  }

 private:
  mutable absl::Mutex mu_;
  std::function<R()> source_ ABSL_GUARDED_BY(mu_);
};

struct Sources {
  ScrapeSource<int64_t> pass_arena_bytes;
  ScrapeSource<std::optional<GpuMemoryReading>> gpu_memory;
};

// The registry's families, and what is read from /proc, the allocator and the sources at each
// scrape.
class ProcessCollectableImpl : public prometheus::Collectable {
 public:
  ProcessCollectableImpl(std::shared_ptr<prometheus::Registry> registry, const Sources* sources)
      : registry_(std::move(registry)), sources_(sources) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    std::vector<prometheus::MetricFamily> families = registry_->Collect();
    // The names and meanings every Prometheus client library's process collector uses.
    if (absl::StatusOr<util::ProcessStats> p = util::ReadProcessStats(); p.ok()) {
      families.push_back(OneValueFamily("process_cpu_seconds_total",
                                  "Total user and system CPU time spent in seconds.",
                                  MetricType::Counter, p->cpu_seconds));
      if (p->start_time) {
        families.push_back(OneValueFamily(
            "process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
            MetricType::Gauge, static_cast<double>(absl::ToUnixMicros(*p->start_time)) / 1e6));
      }
      families.push_back(OneValueFamily("process_virtual_memory_bytes",
                                  "Virtual memory size in bytes.", MetricType::Gauge,
                                  static_cast<double>(p->virtual_bytes)));
      families.push_back(OneValueFamily("process_resident_memory_bytes",
                                  "Resident memory size in bytes.", MetricType::Gauge,
                                  static_cast<double>(p->resident_bytes)));
      if (p->open_fds >= 0) {
        families.push_back(OneValueFamily("process_open_fds", "Number of open file descriptors.",
                                    MetricType::Gauge, static_cast<double>(p->open_fds)));
      }
      if (p->max_fds > 0) {
        families.push_back(OneValueFamily("process_max_fds",
                                    "Maximum number of open file descriptors.",
                                    MetricType::Gauge, static_cast<double>(p->max_fds)));
      }
      families.push_back(OneValueFamily("process_threads", "Number of OS threads in the process.",
                                  MetricType::Gauge, static_cast<double>(p->threads)));
    }
    prometheus::MetricFamily kept;
    kept.name = "collabserve_pass_memory_kept_bytes";
    kept.help =
        "Memory forward passes keep resident for the next pass, given back after 10 s without "
        "one: part=arena the pass arena's buffers (in use during a team pass), part=allocator "
        "the freed pages of the allocator's retaining arena.";
    kept.type = MetricType::Gauge;
    if (std::optional<int64_t> bytes = sources_->pass_arena_bytes.Read()) {
      kept.metric.push_back(Labelled("part", "arena", static_cast<double>(*bytes)));
    }
    if (std::optional<size_t> bytes = util::RetainingArenaFreeBytes()) {
      kept.metric.push_back(Labelled("part", "allocator", static_cast<double>(*bytes)));
    }
    if (!kept.metric.empty()) families.push_back(std::move(kept));
    if (std::optional<std::optional<GpuMemoryReading>> gpu = sources_->gpu_memory.Read();
        gpu && *gpu) {
      const GpuMemoryReading& r = **gpu;
      auto add = [&](const char* name, const char* help, int64_t bytes) {
        prometheus::MetricFamily f;
        f.name = name;
        f.help = help;
        f.type = MetricType::Gauge;
        f.metric.push_back(Labelled("device", r.device.c_str(), static_cast<double>(bytes)));
        families.push_back(std::move(f));
      };
      add("collabserve_gpu_memory_allocated_bytes",
          "GPU memory this process's live tensors hold (models' weights, passes in flight), from "
          "LibTorch's CUDA caching allocator.",
          r.allocated_bytes);
      add("collabserve_gpu_memory_reserved_bytes",
          "GPU memory LibTorch's CUDA caching allocator holds from the driver: the allocated "
          "blocks and the cached free ones (CUDA graphs' pools among them).",
          r.reserved_bytes);
      // Unknown (0) is left out rather than divided by.
      if (r.total_bytes > 0) {
        add("collabserve_gpu_memory_total_bytes", "The GPU's memory.", r.total_bytes);
      }
    }
    return families;
  }

 private:
  const std::shared_ptr<prometheus::Registry> registry_;
  const Sources* const sources_;
};

struct ProcessFamilies {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  prometheus::Family<prometheus::Counter>& load_failures =
      prometheus::BuildCounter()
          .Name("collabserve_repository_load_failures_total")
          .Help("Version directories the model repository could not load, by model and reason "
                "(the load error's status code).")
          .Register(*registry);
  Sources sources;
  std::shared_ptr<prometheus::Collectable> collectable =
      std::make_shared<ProcessCollectableImpl>(registry, &sources);
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
  Families().sources.pass_arena_bytes.Set(std::move(source));
}

void SetGpuMemorySource(std::function<std::optional<GpuMemoryReading>()> source) {
  Families().sources.gpu_memory.Set(std::move(source));
}

prometheus::MetricFamily OneValueFamily(const char* name, const char* help, prometheus::MetricType type,
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

}  // namespace collabserve::metrics

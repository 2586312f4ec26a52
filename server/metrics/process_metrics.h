// Process-wide metric families: counted by modules that hold no Metrics instance (the model
// repository is generic and the service creates it), and exported by every Metrics.
#ifndef COLLABSERVE_SERVER_METRICS_PROCESS_METRICS_H_
#define COLLABSERVE_SERVER_METRICS_PROCESS_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "prometheus/metric_family.h"

namespace prometheus {
class Collectable;
}  // namespace prometheus

namespace collabserve::metrics {

// collabserve_repository_load_failures_total{model,reason} += 1: a version directory that the
// repository tried to load and could not (a corrupt or incomplete version, a failed warm-up).
// `reason` is a short snake_case word (the repository uses the load error's status code, e.g.
// "invalid_argument", "not_found"). Thread-safe; the series live for the whole process.
void CountRepositoryLoadFailure(const std::string& model, const std::string& reason);

// The process-wide families, for Metrics to export next to its own (never null): the load failures
// above and, read at each scrape, the standard process_* families of Prometheus client libraries
// (process_cpu_seconds_total, process_start_time_seconds, process_virtual_memory_bytes,
// process_resident_memory_bytes, process_open_fds, process_max_fds, process_threads; absent where
// /proc cannot be read), and collabserve_pass_memory_kept_bytes{part}: the memory forward passes
// keep resident for the next pass, given back after 10 s without one: part="arena" the pass
// arena's pages (the team passes' buffers, in use during a team pass; once a source is set
// below), part="allocator" the freed pages of the allocator's retaining arena
// (util::RetainingArenaFreeBytes; absent without jemalloc).
std::shared_ptr<prometheus::Collectable> ProcessCollectable();

// A family of one unlabelled sample: `value` as a counter or a gauge (for collectables that
// export counts they keep themselves).
prometheus::MetricFamily OneValueFamily(const char* name, const char* help,
                                        prometheus::MetricType type, double value);

// Sets what part="arena" reads at each scrape (the service sets model::PassArenaResidentBytes; this
// library does not link the model). Thread-safe; a later call replaces the source.
void SetPassArenaBytesSource(std::function<int64_t()> source);

// The server's GPU: what LibTorch's CUDA caching allocator holds there (model::DeviceMemory).
struct GpuMemoryReading {
  std::string device;  // "cuda:0"
  int64_t allocated_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t total_bytes = 0;  // 0: unknown (no _total_bytes series)
};

// Sets what is read at each scrape for three gauges with a `device` label:
// collabserve_gpu_memory_allocated_bytes (what live tensors hold), _reserved_bytes (what the
// allocator holds from the driver, cached free blocks included) and _total_bytes (the GPU's). No
// source, or a source that reads nothing (a CPU server, CUDA not used yet): no series. The service
// sets model::ReadDeviceMemory of its --device. Thread-safe; a later call replaces the source.
void SetGpuMemorySource(std::function<std::optional<GpuMemoryReading>()> source);

}  // namespace collabserve::metrics

#endif  // COLLABSERVE_SERVER_METRICS_PROCESS_METRICS_H_

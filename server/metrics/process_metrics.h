// Process-wide metric families: counted by modules that hold no Metrics instance (the model
// repository is generic and the service creates it), and exported by every Metrics.
#ifndef COLLABSERVE_SERVER_METRICS_PROCESS_METRICS_H_
#define COLLABSERVE_SERVER_METRICS_PROCESS_METRICS_H_

#include <memory>
#include <string>

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
// /proc cannot be read), and collabserve_pass_arena_free_bytes (absent without jemalloc): the freed
// pages forward passes' allocator arena keeps for the next pass (util::RetainingArenaFreeBytes).
std::shared_ptr<prometheus::Collectable> ProcessCollectable();

}  // namespace collabserve::metrics

#endif  // COLLABSERVE_SERVER_METRICS_PROCESS_METRICS_H_

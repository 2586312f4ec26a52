// The Admin service's Prometheus families: jobs by outcome, job duration, uploaded bytes. (A
// compressed version's layer errors and fidelity are per-version facts of the model it wrote: the
// server's metrics export them whenever that version is loaded - metrics::ModelVersionFacts.)
#ifndef COLLABSERVE_SERVER_SERVICE_ADMIN_METRICS_H_
#define COLLABSERVE_SERVER_SERVICE_ADMIN_METRICS_H_

#include <cstdint>
#include <memory>
#include <string>

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace collabserve::service {

// Thread-safe. Registers its families on `registry` (shared with the server's other metrics so
// that one /metrics shows them all).
//   collabserve_jobs_total{outcome="succeeded|failed|cancelled"}
//   collabserve_job_duration_seconds (histogram, created to ended)
//   collabserve_upload_bytes_total
class AdminMetrics {
 public:
  explicit AdminMetrics(std::shared_ptr<prometheus::Registry> registry);
  AdminMetrics(const AdminMetrics&) = delete;
  AdminMetrics& operator=(const AdminMetrics&) = delete;

  void JobEnded(const std::string& outcome, double seconds);
  void UploadBytes(int64_t bytes);
  // The registry's content in the Prometheus text format.
  std::string TextFormat() const;
  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* jobs_total_;
  prometheus::Family<prometheus::Histogram>* job_duration_;
  prometheus::Histogram* job_duration_all_;
  prometheus::Counter* upload_bytes_;
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_ADMIN_METRICS_H_

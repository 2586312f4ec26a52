// The Admin service's Prometheus families: jobs by outcome, job duration, uploaded bytes, and the
// per-layer reconstruction error and fidelity of each published compressed version.
#ifndef COLLABSERVE_SERVER_SERVICE_ADMIN_METRICS_H_
#define COLLABSERVE_SERVER_SERVICE_ADMIN_METRICS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

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
//   collabserve_layer_reconstruction_error{model,version,layer}
//   collabserve_model_fidelity_agreement{model,version}
class AdminMetrics {
 public:
  explicit AdminMetrics(std::shared_ptr<prometheus::Registry> registry);
  ~AdminMetrics();
  AdminMetrics(const AdminMetrics&) = delete;
  AdminMetrics& operator=(const AdminMetrics&) = delete;

  void JobEnded(const std::string& outcome, double seconds);
  void UploadBytes(int64_t bytes);
  // Replaces the version's gauges: one error per compressed layer (rank > 0) and the top-1
  // agreement of the fidelity probes.
  void SetVersionReport(const std::string& model, int64_t version,
                        const std::vector<std::pair<int, double>>& layer_errors,
                        double top1_agreement);
  // Removes the version's gauges (after DeleteVersion).
  void RemoveVersion(const std::string& model, int64_t version);

  // The registry's content in the Prometheus text format.
  std::string TextFormat() const;
  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

 private:
  void RemoveVersionLocked(const std::string& model, int64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* jobs_total_;
  prometheus::Family<prometheus::Histogram>* job_duration_;
  prometheus::Histogram* job_duration_all_;
  prometheus::Counter* upload_bytes_;
  prometheus::Family<prometheus::Gauge>* layer_error_;
  prometheus::Family<prometheus::Gauge>* fidelity_;

  absl::Mutex mu_;
  std::map<std::pair<std::string, int64_t>,
           std::vector<std::pair<prometheus::Family<prometheus::Gauge>*, prometheus::Gauge*>>>
      version_gauges_ ABSL_GUARDED_BY(mu_);
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_ADMIN_METRICS_H_

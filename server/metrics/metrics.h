// The server's Prometheus metrics: one registry holding every collabserve_* family, per-model and
// per-version handles, and the optional HTTP exposer serving them on /metrics.
#ifndef COLLABSERVE_SERVER_METRICS_METRICS_H_
#define COLLABSERVE_SERVER_METRICS_METRICS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/metrics/http_exposer.h"

namespace prometheus {
class Collectable;
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace collabserve::metrics {

// Static facts about a loaded model version, exported as gauges.
struct ModelVersionFacts {
  // part name ("total", "embeddings", "attention_qk", "attention_vo", "ffn", "layer_norm", "head")
  // -> parameter count.
  std::vector<std::pair<std::string, int64_t>> parameters;
  // Shared key/query rank per layer (collaborative), or the full rank (heads * head_size) per layer.
  std::vector<int> layer_ranks;
  double compression_ratio = 1.0;
  double load_seconds = 0.0;
  // Collaborative versions, from what their compression recorded in config.json: the relative
  // reconstruction error of each compressed layer (layer index, error), and the top-1 agreement
  // with the original on the fidelity probes (absent for models written before it was recorded).
  std::vector<std::pair<int, double>> layer_errors;
  std::optional<double> fidelity_agreement;
};

// Histograms for one model (all versions share them). Pointers stay valid for the life of Metrics.
struct ModelMetrics {
  prometheus::Histogram* request_duration = nullptr;
  prometheus::Histogram* queue_duration = nullptr;
  prometheus::Histogram* tokenization_duration = nullptr;
  prometheus::Histogram* inference_duration = nullptr;
  prometheus::Histogram* batch_size = nullptr;
  prometheus::Histogram* batch_tokens = nullptr;
  prometheus::Histogram* batch_padding_ratio = nullptr;
};

// Thread-safe. Owns its registry; handles it returns are valid until the series is removed
// (RemoveVersion) or Metrics is destroyed.
class Metrics {
 public:
  // `build_version` and `torch_version` label collabserve_build_info.
  Metrics(const std::string& build_version, const std::string& torch_version);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Serves /metrics on `host`:`port` (port 0 picks one; see HttpExposer). Returns the bound port
  // through `bound_port`. UNAVAILABLE if the address cannot be bound. Call at most once.
  // `other` answers the paths besides /metrics (HttpExposer::Handler; the server's probes).
  absl::Status StartExposer(const std::string& host, int port, int* bound_port,
                            HttpExposer::Handler other = nullptr);
  // Stops serving (joins the exposer's thread); nothing when none runs. Its owner calls it before
  // what `other` reads goes away.
  void StopExposer();

  // The metrics in the Prometheus text format (what /metrics returns).
  std::string TextFormat() const;

  ModelMetrics ForModel(const std::string& model);

  // Adds another source of metric families (e.g. the admin service's registry) to what
  // TextFormat() and /metrics return. Kept alive until Metrics is destroyed.
  void AddCollectable(std::shared_ptr<prometheus::Collectable> collectable);

  // collabserve_requests_total{model,version,code} += 1. `version` may be "" when no version was
  // resolved (e.g. unknown model).
  void CountRequest(const std::string& model, const std::string& version, const std::string& code);

  // Gauge collabserve_queue_depth{model,version}; created on first use.
  prometheus::Gauge* QueueDepth(const std::string& model, int64_t version);
  prometheus::Gauge* inflight_requests() { return inflight_; }

  // Gauge collabserve_device_failed{device}: 1 once the server's model device (`device`: "cpu",
  // "cuda:0") has failed for good (Server::OnDeviceFailure), else 0. Created on first use.
  prometheus::Gauge* DeviceFailed(const std::string& device);

  // Sets the per-version static gauges (parameters, ranks, compression ratio, load time, and for a
  // collaborative version its layers' reconstruction errors and its fidelity agreement) and takes
  // one reference on the version's series.
  void SetVersionFacts(const std::string& model, int64_t version, const ModelVersionFacts& facts);

  // Drops one reference taken by SetVersionFacts; when the last one goes, removes every series
  // labelled with this model version (gauges, including queue depth, and request counters). The
  // count lets a reloaded version (new servable, same id) keep its series while the old servable
  // drains.
  void RemoveVersion(const std::string& model, int64_t version);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<HttpExposer> exposer_;

  prometheus::Family<prometheus::Counter>* requests_total_;
  prometheus::Family<prometheus::Histogram>* request_duration_;
  prometheus::Family<prometheus::Histogram>* queue_duration_;
  prometheus::Family<prometheus::Histogram>* tokenization_duration_;
  prometheus::Family<prometheus::Histogram>* inference_duration_;
  prometheus::Family<prometheus::Histogram>* batch_size_;
  prometheus::Family<prometheus::Histogram>* batch_tokens_;
  prometheus::Family<prometheus::Histogram>* batch_padding_ratio_;
  prometheus::Family<prometheus::Gauge>* queue_depth_;
  prometheus::Family<prometheus::Gauge>* device_failed_;
  prometheus::Family<prometheus::Gauge>* model_parameters_;
  prometheus::Family<prometheus::Gauge>* model_layer_rank_;
  prometheus::Family<prometheus::Gauge>* compression_ratio_;
  prometheus::Family<prometheus::Gauge>* layer_error_;
  prometheus::Family<prometheus::Gauge>* fidelity_agreement_;
  prometheus::Family<prometheus::Gauge>* load_seconds_;
  prometheus::Gauge* inflight_;

  mutable absl::Mutex extra_mu_;
  std::vector<std::shared_ptr<prometheus::Collectable>> extra_ ABSL_GUARDED_BY(extra_mu_);

  absl::Mutex mu_;
  std::map<std::string, ModelMetrics> models_ ABSL_GUARDED_BY(mu_);
  // (model, version) -> every gauge labelled with it, with its family, for RemoveVersion.
  std::map<std::pair<std::string, int64_t>,
           std::vector<std::pair<prometheus::Family<prometheus::Gauge>*, prometheus::Gauge*>>>
      version_gauges_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::string>, std::vector<prometheus::Counter*>> version_counters_
      ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, int64_t>, int> version_refs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace collabserve::metrics

#endif  // COLLABSERVE_SERVER_METRICS_METRICS_H_

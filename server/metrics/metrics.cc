#include "server/metrics/metrics.h"

#include <sstream>

#include "absl/strings/str_cat.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "server/metrics/process_metrics.h"

namespace collabserve::metrics {
namespace {

using prometheus::Histogram;

Histogram::BucketBoundaries SecondsBuckets() {
  // 10us .. 25s in 1-2.5-5 steps. The thresholds the alerts, the dashboard and the chart's HPA use
  // (100 ms and 500 ms p99, a 50 ms p90) are bucket bounds: histogram_quantile interpolates inside a
  // bucket, so a threshold inside one (0.5 s between 0.41 and 0.82 s) fired with no input above it.
  // 10us resolves tokenization, which takes microseconds.
  // Literals: products like 1e-5 * 10^4 are not exactly 0.1, and a bound a hair above a threshold
  // would put the quantile above it.
  return {1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01,
          0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25};
}
Histogram::BucketBoundaries CountBuckets(double max) {
  Histogram::BucketBoundaries b;
  for (double v = 1; v <= max; v *= 2) b.push_back(v);
  return b;
}
Histogram::BucketBoundaries RatioBuckets() {
  return {0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0};
}

}  // namespace

Metrics::Metrics(const std::string& build_version, const std::string& torch_version)
    : registry_(std::make_shared<prometheus::Registry>()) {
  auto& r = *registry_;
  requests_total_ = &prometheus::BuildCounter()
                         .Name("collabserve_requests_total")
                         .Help("Inference calls by model, version and final gRPC status code.")
                         .Register(r);
  request_duration_ = &prometheus::BuildHistogram()
                           .Name("collabserve_request_duration_seconds")
                           .Help("Time from a call's arrival to its response.")
                           .Register(r);
  queue_duration_ = &prometheus::BuildHistogram()
                         .Name("collabserve_queue_duration_seconds")
                         .Help("Time each input waited in the batch queue, those failed there (deadline, "
                               "cancellation, shutdown) included.")
                         .Register(r);
  tokenization_duration_ = &prometheus::BuildHistogram()
                                .Name("collabserve_tokenization_duration_seconds")
                                .Help("Time to tokenize one request's inputs.")
                                .Register(r);
  inference_duration_ = &prometheus::BuildHistogram()
                             .Name("collabserve_inference_duration_seconds")
                             .Help("Time of one batched forward pass.")
                             .Register(r);
  batch_size_ = &prometheus::BuildHistogram()
                     .Name("collabserve_batch_size")
                     .Help("Inputs per batched forward pass.")
                     .Register(r);
  batch_tokens_ = &prometheus::BuildHistogram()
                       .Name("collabserve_batch_tokens")
                       .Help("Real (unpadded) tokens per batched forward pass.")
                       .Register(r);
  batch_padding_ratio_ = &prometheus::BuildHistogram()
                              .Name("collabserve_batch_padding_ratio")
                              .Help("Fraction of a padded batch that is padding.")
                              .Register(r);
  queue_depth_ = &prometheus::BuildGauge()
                      .Name("collabserve_queue_depth")
                      .Help("Inputs waiting in a model version's batch queue.")
                      .Register(r);
  inflight_ = &prometheus::BuildGauge()
                   .Name("collabserve_inflight_requests")
                   .Help("Inference calls being processed.")
                   .Register(r)
                   .Add({});
  device_failed_ = &prometheus::BuildGauge()
                        .Name("collabserve_device_failed")
                        .Help("1 once the server's model device has failed for good (a CUDA error "
                              "that only a restart clears: health is NOT_SERVING, calls are "
                              "UNAVAILABLE), else 0.")
                        .Register(r);
  model_parameters_ = &prometheus::BuildGauge()
                           .Name("collabserve_model_parameters")
                           .Help("Parameter count of a model version by part.")
                           .Register(r);
  model_layer_rank_ = &prometheus::BuildGauge()
                           .Name("collabserve_model_layer_rank")
                           .Help("Shared key/query rank of each layer (heads*head_size if standard).")
                           .Register(r);
  compression_ratio_ = &prometheus::BuildGauge()
                            .Name("collabserve_model_compression_ratio")
                            .Help("Query/key parameters of a standard layer over the actual ones.")
                            .Register(r);
  layer_error_ = &prometheus::BuildGauge()
                      .Name("collabserve_layer_reconstruction_error")
                      .Help("Relative Frobenius error of each compressed layer's CP decomposition "
                            "(collaborative versions)")
                      .Register(r);
  fidelity_agreement_ = &prometheus::BuildGauge()
                             .Name("collabserve_model_fidelity_agreement")
                             .Help("Top-1 agreement of a compressed version with its original on the "
                                   "fidelity probes, as measured when it was compressed")
                             .Register(r);
  load_seconds_ = &prometheus::BuildGauge()
                       .Name("collabserve_model_load_seconds")
                       .Help("Time to load and warm up a model version.")
                       .Register(r);
  prometheus::BuildGauge()
      .Name("collabserve_build_info")
      .Help("Build facts; the value is always 1.")
      .Register(r)
      .Add({{"version", build_version}, {"torch_version", torch_version}})
      .Set(1);
  AddCollectable(ProcessCollectable());  // e.g. the repository's load failures
}

Metrics::~Metrics() = default;

absl::Status Metrics::StartExposer(const std::string& host, int port, int* bound_port,
                                   HttpExposer::Handler other) {
  if (exposer_ != nullptr) return absl::FailedPreconditionError("metrics exposer already started");
  auto exposer = HttpExposer::Start(host, port, [this] { return TextFormat(); }, std::move(other));
  if (!exposer.ok()) return exposer.status();
  exposer_ = std::move(exposer).value();
  if (bound_port != nullptr) *bound_port = exposer_->port();
  return absl::OkStatus();
}

void Metrics::StopExposer() { exposer_.reset(); }

void Metrics::AddCollectable(std::shared_ptr<prometheus::Collectable> collectable) {
  absl::MutexLock lock(&extra_mu_);
  extra_.push_back(std::move(collectable));
}

std::string Metrics::TextFormat() const {
  prometheus::TextSerializer serializer;
  auto families = registry_->Collect();
  absl::MutexLock lock(&extra_mu_);
  for (const auto& c : extra_) {
    auto more = c->Collect();
    families.insert(families.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
  }
  return serializer.Serialize(families);
}

ModelMetrics Metrics::ForModel(const std::string& model) {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(model);
  if (it != models_.end()) return it->second;
  ModelMetrics m;
  const prometheus::Labels l{{"model", model}};
  m.request_duration = &request_duration_->Add(l, SecondsBuckets());
  m.queue_duration = &queue_duration_->Add(l, SecondsBuckets());
  m.tokenization_duration = &tokenization_duration_->Add(l, SecondsBuckets());
  m.inference_duration = &inference_duration_->Add(l, SecondsBuckets());
  m.batch_size = &batch_size_->Add(l, CountBuckets(1024));
  m.batch_tokens = &batch_tokens_->Add(l, CountBuckets(65536));
  m.batch_padding_ratio = &batch_padding_ratio_->Add(l, RatioBuckets());
  models_[model] = m;
  return m;
}

void Metrics::CountRequest(const std::string& model, const std::string& version,
                           const std::string& code) {
  // Under mu_ so that RemoveVersion cannot free the counter between Add and Increment.
  absl::MutexLock lock(&mu_);
  auto& c = requests_total_->Add({{"model", model}, {"version", version}, {"code", code}});
  c.Increment();
  auto& v = version_counters_[{model, version}];
  for (auto* p : v) {
    if (p == &c) return;
  }
  v.push_back(&c);
}

prometheus::Gauge* Metrics::QueueDepth(const std::string& model, int64_t version) {
  auto* g = &queue_depth_->Add({{"model", model}, {"version", std::to_string(version)}});
  absl::MutexLock lock(&mu_);
  auto& v = version_gauges_[{model, version}];
  for (auto& [f, p] : v) {
    if (p == g) return g;
  }
  v.emplace_back(queue_depth_, g);
  return g;
}

prometheus::Gauge* Metrics::DeviceFailed(const std::string& device) {
  return &device_failed_->Add({{"device", device}});
}

void Metrics::SetVersionFacts(const std::string& model, int64_t version,
                              const ModelVersionFacts& facts) {
  const std::string ver = std::to_string(version);
  // Held from the first Add: RemoveVersion of the same version (the copy a reload replaces, freed
  // on the reaper's thread) removes these very gauges when it drops the last reference.
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<prometheus::Family<prometheus::Gauge>*, prometheus::Gauge*>> added;
  for (const auto& [part, count] : facts.parameters) {
    auto& g = model_parameters_->Add({{"model", model}, {"version", ver}, {"part", part}});
    g.Set(static_cast<double>(count));
    added.emplace_back(model_parameters_, &g);
  }
  for (size_t i = 0; i < facts.layer_ranks.size(); ++i) {
    auto& g = model_layer_rank_->Add(
        {{"model", model}, {"version", ver}, {"layer", std::to_string(i)}});
    g.Set(facts.layer_ranks[i]);
    added.emplace_back(model_layer_rank_, &g);
  }
  auto& cr = compression_ratio_->Add({{"model", model}, {"version", ver}});
  cr.Set(facts.compression_ratio);
  added.emplace_back(compression_ratio_, &cr);
  auto& ls = load_seconds_->Add({{"model", model}, {"version", ver}});
  ls.Set(facts.load_seconds);
  added.emplace_back(load_seconds_, &ls);
  for (const auto& [layer, error] : facts.layer_errors) {
    auto& g = layer_error_->Add({{"model", model}, {"version", ver}, {"layer", std::to_string(layer)}});
    g.Set(error);
    added.emplace_back(layer_error_, &g);
  }
  if (facts.fidelity_agreement.has_value()) {
    auto& g = fidelity_agreement_->Add({{"model", model}, {"version", ver}});
    g.Set(*facts.fidelity_agreement);
    added.emplace_back(fidelity_agreement_, &g);
  }
  ++version_refs_[{model, version}];
  auto& v = version_gauges_[{model, version}];
  for (auto& a : added) {
    bool seen = false;
    for (auto& e : v) seen = seen || e.second == a.second;
    if (!seen) v.push_back(a);
  }
}

void Metrics::RemoveVersion(const std::string& model, int64_t version) {
  absl::MutexLock lock(&mu_);
  auto ref = version_refs_.find({model, version});
  if (ref != version_refs_.end()) {
    if (--ref->second > 0) return;
    version_refs_.erase(ref);
  }
  auto it = version_gauges_.find({model, version});
  if (it != version_gauges_.end()) {
    for (auto& [family, gauge] : it->second) family->Remove(gauge);
    version_gauges_.erase(it);
  }
  auto ct = version_counters_.find({model, std::to_string(version)});
  if (ct != version_counters_.end()) {
    for (auto* c : ct->second) requests_total_->Remove(c);
    version_counters_.erase(ct);
  }
}

}  // namespace collabserve::metrics

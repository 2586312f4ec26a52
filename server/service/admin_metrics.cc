#include "server/service/admin_metrics.h"

#include "absl/strings/str_cat.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace collabserve::service {

AdminMetrics::AdminMetrics(std::shared_ptr<prometheus::Registry> registry)
    : registry_(std::move(registry)) {
  auto& r = *registry_;
  jobs_total_ = &prometheus::BuildCounter()
                     .Name("collabserve_jobs_total")
                     .Help("Admin jobs (uploads, compressions) that ended, by outcome")
                     .Register(r);
  for (const char* outcome : {"succeeded", "failed", "cancelled"}) {
    jobs_total_->Add({{"outcome", outcome}});  // so that rate() sees the first one
  }
  job_duration_ = &prometheus::BuildHistogram()
                       .Name("collabserve_job_duration_seconds")
                       .Help("Admin job duration from creation to its end")
                       .Register(r);
  job_duration_all_ = &job_duration_->Add(
      {}, prometheus::Histogram::BucketBoundaries{0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600});
  upload_bytes_ = &prometheus::BuildCounter()
                       .Name("collabserve_upload_bytes_total")
                       .Help("Checkpoint bytes received by UploadModel")
                       .Register(r)
                       .Add({});
  layer_error_ = &prometheus::BuildGauge()
                      .Name("collabserve_layer_reconstruction_error")
                      .Help("Relative Frobenius error of each compressed layer's CP decomposition")
                      .Register(r);
  fidelity_ = &prometheus::BuildGauge()
                   .Name("collabserve_model_fidelity_agreement")
                   .Help("Top-1 agreement of a compressed version with its original on the probes")
                   .Register(r);
}

AdminMetrics::~AdminMetrics() {
  absl::MutexLock l(&mu_);
  while (!version_gauges_.empty()) {
    auto key = version_gauges_.begin()->first;
    RemoveVersionLocked(key.first, key.second);
  }
}

void AdminMetrics::JobEnded(const std::string& outcome, double seconds) {
  jobs_total_->Add({{"outcome", outcome}}).Increment();
  job_duration_all_->Observe(seconds);
}

void AdminMetrics::UploadBytes(int64_t bytes) {
  if (bytes > 0) upload_bytes_->Increment(static_cast<double>(bytes));
}

void AdminMetrics::SetVersionReport(const std::string& model, int64_t version,
                                    const std::vector<std::pair<int, double>>& layer_errors,
                                    double top1_agreement) {
  absl::MutexLock l(&mu_);
  RemoveVersionLocked(model, version);
  auto& gauges = version_gauges_[{model, version}];
  const std::string v = absl::StrCat(version);
  for (const auto& [layer, error] : layer_errors) {
    prometheus::Gauge* g =
        &layer_error_->Add({{"model", model}, {"version", v}, {"layer", absl::StrCat(layer)}});
    g->Set(error);
    gauges.emplace_back(layer_error_, g);
  }
  prometheus::Gauge* g = &fidelity_->Add({{"model", model}, {"version", v}});
  g->Set(top1_agreement);
  gauges.emplace_back(fidelity_, g);
}

void AdminMetrics::RemoveVersion(const std::string& model, int64_t version) {
  absl::MutexLock l(&mu_);
  RemoveVersionLocked(model, version);
}

void AdminMetrics::RemoveVersionLocked(const std::string& model, int64_t version) {
  auto it = version_gauges_.find({model, version});
  if (it == version_gauges_.end()) return;
  for (auto& [family, gauge] : it->second) family->Remove(gauge);
  version_gauges_.erase(it);
}

std::string AdminMetrics::TextFormat() const {
  prometheus::TextSerializer serializer;
  return serializer.Serialize(registry_->Collect());
}

}  // namespace collabserve::service

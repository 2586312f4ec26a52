#include "server/service/admin_metrics.h"

#include <utility>

#include "prometheus/counter.h"
#include "prometheus/family.h"
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
}

void AdminMetrics::JobEnded(const std::string& outcome, double seconds) {
  jobs_total_->Add({{"outcome", outcome}}).Increment();
  job_duration_all_->Observe(seconds);
}

void AdminMetrics::UploadBytes(int64_t bytes) {
  if (bytes > 0) upload_bytes_->Increment(static_cast<double>(bytes));
}

std::string AdminMetrics::TextFormat() const {
  prometheus::TextSerializer serializer;
  return serializer.Serialize(registry_->Collect());
}

}  // namespace collabserve::service

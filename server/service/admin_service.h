// The collabserve.v1.Admin gRPC service (callback API): uploads as tracked compression jobs, job
// queries, and version management, every call behind the bearer token.
#ifndef COLLABSERVE_SERVER_SERVICE_ADMIN_SERVICE_H_
#define COLLABSERVE_SERVER_SERVICE_ADMIN_SERVICE_H_

#include <cstdint>
#include <atomic>
#include <functional>
#include <list>
#include <thread>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "collabserve/v1/admin.grpc.pb.h"
#include "server/service/admin_auth.h"
#include "server/service/admin_jobs.h"
#include "server/service/admin_metrics.h"

namespace collabserve::service {

struct AdminServiceOptions {
  // Largest upload (sum of the declared file sizes).
  int64_t max_upload_bytes = int64_t{2} << 30;
  JobManagerOptions jobs;
};

// Thread-safe; handlers never block a gRPC thread (uploads are written as chunks arrive, which is
// quick; validation, compression and repository changes run on the job workers or a helper
// thread). Must outlive the gRPC server it is registered with; Shutdown() (or the destructor)
// cancels the jobs and waits for the workers.
class AdminService final : public v1::Admin::CallbackService {
 public:
  // `repository` returns the server's repository or null while it is not loaded (calls then get
  // UNAVAILABLE). `auth` must not be null. `metrics` may be null.
  AdminService(AdminServiceOptions options, std::unique_ptr<AdminAuth> auth,
               JobManager::RepositoryFn repository, AdminMetrics* metrics);
  ~AdminService() override;

  // Cancels every job and waits for the workers and the helper threads; later calls get
  // UNAVAILABLE. Idempotent.
  void Shutdown();

  JobManager& jobs() { return *jobs_; }

  grpc::ServerReadReactor<v1::UploadModelRequest>* UploadModel(
      grpc::CallbackServerContext* context, v1::UploadModelResponse* response) override;
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* context,
                                   const v1::GetJobRequest* request,
                                   v1::GetJobResponse* response) override;
  grpc::ServerWriteReactor<v1::WatchJobResponse>* WatchJob(
      grpc::CallbackServerContext* context, const v1::WatchJobRequest* request) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* context,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override;
  grpc::ServerUnaryReactor* CancelJob(grpc::CallbackServerContext* context,
                                      const v1::CancelJobRequest* request,
                                      v1::CancelJobResponse* response) override;
  grpc::ServerUnaryReactor* CompressModel(grpc::CallbackServerContext* context,
                                          const v1::CompressModelRequest* request,
                                          v1::CompressModelResponse* response) override;
  grpc::ServerUnaryReactor* LoadModel(grpc::CallbackServerContext* context,
                                      const v1::LoadModelRequest* request,
                                      v1::LoadModelResponse* response) override;
  grpc::ServerUnaryReactor* UnloadModel(grpc::CallbackServerContext* context,
                                        const v1::UnloadModelRequest* request,
                                        v1::UnloadModelResponse* response) override;
  grpc::ServerUnaryReactor* DeleteVersion(grpc::CallbackServerContext* context,
                                          const v1::DeleteVersionRequest* request,
                                          v1::DeleteVersionResponse* response) override;

 private:
  class UploadReactor;
  class WatchReactor;

  // OK, UNAUTHENTICATED, or UNAVAILABLE after Shutdown().
  absl::Status Admit(grpc::CallbackServerContext* context);
  // Runs a blocking repository operation on a helper thread and finishes `reactor` with its status.
  grpc::ServerUnaryReactor* RunBlocking(grpc::CallbackServerContext* context,
                                        std::function<absl::Status()> op);

  const AdminServiceOptions options_;
  const std::unique_ptr<AdminAuth> auth_;
  const JobManager::RepositoryFn repository_;
  AdminMetrics* const metrics_;
  std::unique_ptr<JobManager> jobs_;

  absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  struct Helper {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::list<Helper> helpers_ ABSL_GUARDED_BY(mu_);  // RunBlocking threads not yet joined
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_ADMIN_SERVICE_H_

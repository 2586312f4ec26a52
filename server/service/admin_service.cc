#include "server/service/admin_service.h"

#include <deque>
#include <list>
#include <thread>

#include <glog/logging.h>

#include "absl/strings/str_cat.h"
#include "server/service/admin_upload.h"
#include "server/service/server.h"
#include "server/service/status_mapping.h"
#include "server/util/files.h"

namespace collabserve::service {
namespace {

// A streaming call refused before it started (auth, shutdown).
template <typename Base>
class RefusedReactor : public Base {
 public:
  explicit RefusedReactor(const absl::Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* context, const absl::Status& status) {
  return FinishUnary(context, [&] { return ToGrpcStatus(status); });
}

}  // namespace

// ------------------------------------------------------------------------------- UploadModel

// Reads the header, reserves the job, writes the chunks into root/.staging/<job>/upload, verifies
// them, hands the job to the workers and answers once the engine has accepted the checkpoint.
class AdminService::UploadReactor : public grpc::ServerReadReactor<v1::UploadModelRequest> {
 public:
  UploadReactor(AdminService* service, grpc::CallbackServerContext* context,
                v1::UploadModelResponse* response)
      : service_(service), context_(context), response_(response) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      AllRead();
      return;
    }
    absl::Status s = request_.has_header() ? OnHeader() : OnChunk();
    if (!s.ok()) {
      Fail(s);
      return;
    }
    StartRead(&request_);
  }

  // Before the whole upload is read, the failed read ends the job (AllRead). After it, the call
  // waits for the validation: a client that gives up then (its deadline, or a cancel) never learns
  // the job's id, so the job is cancelled rather than compressed and published behind its back.
  void OnCancel() override {
    // The idle watchdog's end is AllRead's to record (the job fails saying why), not a cancel:
    // it marks the call before cancelling it, so it is known here.
    if (!StreamIdleWatchdog::WhyEnded(*context_).empty()) return;
    std::string id;
    {
      absl::MutexLock l(&mu_);
      if (!all_read_ || answered_ || job_ == nullptr) return;
      id = job_->id();
    }
    // FAILED_PRECONDITION once it has ended or is publishing: then it stands.
    if (service_->jobs_->Cancel(id).ok()) {
      LOG(INFO) << "admin: upload job " << id << " cancelled: its client went away";
    }
  }

  void OnDone() override { delete this; }

 private:
  absl::Status OnHeader() {
    if (job_ != nullptr) return absl::InvalidArgumentError("a second header in one upload");
    const v1::UploadHeader& h = request_.header();
    if (absl::Status s = UploadSession::ValidateHeader(h, service_->options_.max_upload_bytes);
        !s.ok()) {
      return s;
    }
    JobSpec spec;
    spec.kind = v1::Job::UPLOAD;
    spec.model_name = h.model_name();
    spec.version = h.has_version() ? h.version() : 0;
    spec.compression = h.compression();
    spec.has_min_agreement = h.has_min_agreement();
    spec.min_agreement = h.min_agreement();
    spec.activate = h.activate();
    spec.probes.assign(h.probes().begin(), h.probes().end());
    absl::StatusOr<std::shared_ptr<Job>> job = service_->jobs_->Create(spec);
    if (!job.ok()) return job.status();
    job_ = *job;
    dir_ = util::JoinPath(service_->jobs_->StagingDir(*job_), "upload");
    absl::StatusOr<std::unique_ptr<UploadSession>> session =
        UploadSession::Create(h, dir_, service_->options_.max_upload_bytes);
    if (!session.ok()) return session.status();
    session_ = std::move(*session);
    job_->Update([&](v1::Job* j) { j->set_bytes_total(session_->bytes_total()); });
    LOG(INFO) << "admin: upload job " << job_->id() << " for " << h.model_name() << ":"
              << job_->Snapshot(false).version() << ", " << session_->bytes_total() << " bytes";
    return absl::OkStatus();
  }

  absl::Status OnChunk() {
    if (job_ == nullptr) {
      return absl::InvalidArgumentError("the first UploadModelRequest must be the header");
    }
    if (job_->terminal()) return job_->EndStatus();  // cancelled, or the server stops
    if (!request_.has_chunk()) return absl::InvalidArgumentError("an empty UploadModelRequest");
    const int64_t before = session_->bytes_received();
    if (absl::Status s = session_->Append(request_.chunk()); !s.ok()) return s;
    if (service_->metrics_ != nullptr) {
      service_->metrics_->UploadBytes(session_->bytes_received() - before);
    }
    const int64_t received = session_->bytes_received();
    job_->Update([received](v1::Job* j) { j->set_bytes_received(received); });
    const int64_t total = session_->bytes_total();
    const int64_t step = std::max<int64_t>(total / 50, 1 << 20);
    if (session_->bytes_received() - last_reported_ >= step ||
        session_->bytes_received() == total) {
      ReportBytes();
    }
    return absl::OkStatus();
  }

  void ReportBytes() {
    if (session_->bytes_received() == last_reported_ && last_reported_ != 0) return;
    last_reported_ = session_->bytes_received();
    v1::JobEvent e;
    e.set_kind(v1::JobEvent::BYTES_RECEIVED);
    e.set_bytes_received(session_->bytes_received());
    e.set_bytes_total(session_->bytes_total());
    e.set_message(absl::StrCat(session_->bytes_received(), " of ", session_->bytes_total(),
                               " bytes received"));
    const int64_t received = session_->bytes_received();
    job_->Record(e, [received](v1::Job* j) { j->set_bytes_received(received); });
  }

  void AllRead() {
    {
      // Set before IsCancelled is read: a cancel after that read finds it set (OnCancel).
      absl::MutexLock l(&mu_);
      all_read_ = true;
    }
    // The idle watchdog's end first: its cancel fails the read before IsCancelled need say so.
    if (const std::string idle = StreamIdleWatchdog::WhyEnded(*context_); !idle.empty()) {
      Fail(absl::DeadlineExceededError(absl::StrCat("upload ended: ", idle)));
      return;
    }
    if (context_->IsCancelled()) {
      Fail(absl::CancelledError("the client went away during the upload"));
      return;
    }
    if (job_ == nullptr) {
      Fail(absl::InvalidArgumentError("an upload without a header"));
      return;
    }
    if (job_->terminal()) {
      Fail(job_->EndStatus());
      return;
    }
    const v1::Job j = job_->Snapshot(false);
    response_->set_job_id(j.id());
    response_->set_model_name(j.model_name());
    response_->set_version(j.version());
    // From here on a worker owns the job and the session: it verifies the checksums (and flushes
    // the files) off the gRPC threads, then calls back exactly once.
    std::shared_ptr<UploadSession> session(std::move(session_));
    service_->jobs_->Enqueue(
        job_, dir_,
        [session] {
          absl::Status s = session->Finish();
          return s;
        },
        [this, session](const absl::Status& s) {
          {
            absl::MutexLock l(&mu_);
            answered_ = true;
          }
          Finish(ToGrpcStatus(s));
        });
  }

  void Fail(const absl::Status& s) {
    session_.reset();
    if (job_ != nullptr) service_->jobs_->Abandon(job_, s);
    Finish(ToGrpcStatus(s));
  }

  AdminService* const service_;
  grpc::CallbackServerContext* const context_;
  v1::UploadModelResponse* const response_;
  v1::UploadModelRequest request_;
  std::shared_ptr<Job> job_;
  std::string dir_;
  std::unique_ptr<UploadSession> session_;
  int64_t last_reported_ = 0;
  absl::Mutex mu_;
  bool all_read_ ABSL_GUARDED_BY(mu_) = false;  // the upload is read; the call awaits validation
  bool answered_ ABSL_GUARDED_BY(mu_) = false;  // the validation's outcome reached Finish
};

// ---------------------------------------------------------------------------------- WatchJob

// Writes the job's events one at a time; finishes after the event that ends the job.
class AdminService::WatchReactor : public grpc::ServerWriteReactor<v1::WatchJobResponse> {
 public:
  explicit WatchReactor(std::shared_ptr<Job> job) : job_(std::move(job)) {
    handle_ = job_->Subscribe([this](const v1::JobEvent& event, v1::Job::State state) {
      absl::MutexLock l(&mu_);
      v1::WatchJobResponse r;
      *r.mutable_event() = event;
      r.set_state(state);
      pending_.push_back(std::move(r));
      if (state == v1::Job::SUCCEEDED || state == v1::Job::FAILED ||
          state == v1::Job::CANCELLED) {
        ended_ = true;
      }
      NextLocked();
    });
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock l(&mu_);
    writing_ = false;
    if (!ok) cancelled_ = true;
    NextLocked();
  }

  void OnCancel() override {
    absl::MutexLock l(&mu_);
    cancelled_ = true;
    NextLocked();
  }

  void OnDone() override {
    job_->Unsubscribe(handle_);
    delete this;
  }

 private:
  void NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || finished_) return;
    if (cancelled_) {
      finished_ = true;
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
      return;
    }
    if (pending_.empty()) {
      if (ended_) {
        finished_ = true;
        Finish(grpc::Status::OK);
      }
      return;
    }
    current_ = std::move(pending_.front());
    pending_.pop_front();
    writing_ = true;
    StartWrite(&current_);
  }

  const std::shared_ptr<Job> job_;
  int handle_ = -1;
  absl::Mutex mu_;
  std::deque<v1::WatchJobResponse> pending_ ABSL_GUARDED_BY(mu_);
  v1::WatchJobResponse current_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

// ------------------------------------------------------------------------------- AdminService

AdminService::AdminService(AdminServiceOptions options, std::unique_ptr<AdminAuth> auth,
                           JobManager::RepositoryFn repository, AdminMetrics* metrics)
    : options_(std::move(options)),
      auth_(std::move(auth)),
      repository_(std::move(repository)),
      metrics_(metrics),
      jobs_(std::make_unique<JobManager>(options_.jobs, repository_, metrics)) {
  CHECK(auth_ != nullptr) << "AdminService needs an AdminAuth";
}

AdminService::~AdminService() { Shutdown(); }

void AdminService::Shutdown() {
  {
    absl::MutexLock l(&mu_);
    shut_down_ = true;
  }
  jobs_->Shutdown();
  std::list<Helper> helpers;
  {
    absl::MutexLock l(&mu_);
    helpers.swap(helpers_);
  }
  for (Helper& h : helpers) h.thread.join();
}

absl::Status AdminService::Admit(grpc::CallbackServerContext* context) {
  if (absl::Status s = auth_->Check(context->client_metadata()); !s.ok()) {
    LOG(WARNING) << "admin: refused a call from " << context->peer() << ": " << s.message();
    return s;
  }
  absl::MutexLock l(&mu_);
  if (shut_down_) return absl::UnavailableError("the admin service is shutting down");
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AdminService::RunBlocking(grpc::CallbackServerContext* context,
                                                    std::function<absl::Status()> op) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::MutexLock l(&mu_);
  // Admitted before Shutdown began but here after it took the helper list: a helper started now
  // would outlive Shutdown and run on a repository being torn down.
  if (shut_down_) {
    reactor->Finish(ToGrpcStatus(absl::UnavailableError("the admin service is shutting down")));
    return reactor;
  }
  // Join the helpers that are done (admin calls are rare: the list stays short).
  for (auto it = helpers_.begin(); it != helpers_.end();) {
    if (it->done->load()) {
      it->thread.join();
      it = helpers_.erase(it);
    } else {
      ++it;
    }
  }
  auto done = std::make_shared<std::atomic<bool>>(false);
  helpers_.push_back({std::thread([reactor, done, op = std::move(op)] {
                        absl::Status s;
                        try {
                          s = op();
                        } catch (const std::exception& e) {
                          s = absl::InternalError(e.what());
                        }
                        reactor->Finish(ToGrpcStatus(s));
                        done->store(true);
                      }),
                      done});
  return reactor;
}

grpc::ServerReadReactor<v1::UploadModelRequest>* AdminService::UploadModel(
    grpc::CallbackServerContext* context, v1::UploadModelResponse* response) {
  if (absl::Status s = Admit(context); !s.ok()) {
    return new RefusedReactor<grpc::ServerReadReactor<v1::UploadModelRequest>>(s);
  }
  return new UploadReactor(this, context, response);
}

grpc::ServerUnaryReactor* AdminService::GetJob(grpc::CallbackServerContext* context,
                                               const v1::GetJobRequest* request,
                                               v1::GetJobResponse* response) {
  if (absl::Status s = Admit(context); !s.ok()) return Done(context, s);
  std::shared_ptr<Job> job = jobs_->Get(request->job_id());
  if (job == nullptr) {
    return Done(context, absl::NotFoundError(absl::StrCat("no job '", request->job_id(), "'")));
  }
  *response->mutable_job() = job->Snapshot(true);
  return Done(context, absl::OkStatus());
}

grpc::ServerWriteReactor<v1::WatchJobResponse>* AdminService::WatchJob(
    grpc::CallbackServerContext* context, const v1::WatchJobRequest* request) {
  using Refused = RefusedReactor<grpc::ServerWriteReactor<v1::WatchJobResponse>>;
  if (absl::Status s = Admit(context); !s.ok()) return new Refused(s);
  std::shared_ptr<Job> job = jobs_->Get(request->job_id());
  if (job == nullptr) {
    return new Refused(absl::NotFoundError(absl::StrCat("no job '", request->job_id(), "'")));
  }
  return new WatchReactor(std::move(job));
}

grpc::ServerUnaryReactor* AdminService::ListJobs(grpc::CallbackServerContext* context,
                                                 const v1::ListJobsRequest* request,
                                                 v1::ListJobsResponse* response) {
  if (absl::Status s = Admit(context); !s.ok()) return Done(context, s);
  for (const auto& job : jobs_->List()) *response->add_jobs() = job->Snapshot(false);
  return Done(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminService::CancelJob(grpc::CallbackServerContext* context,
                                                  const v1::CancelJobRequest* request,
                                                  v1::CancelJobResponse* response) {
  if (absl::Status s = Admit(context); !s.ok()) return Done(context, s);
  absl::StatusOr<v1::Job> job = jobs_->Cancel(request->job_id());
  if (!job.ok()) return Done(context, job.status());
  *response->mutable_job() = std::move(*job);
  return Done(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminService::CompressModel(grpc::CallbackServerContext* context,
                                                      const v1::CompressModelRequest* request,
                                                      v1::CompressModelResponse* response) {
  if (absl::Status s = Admit(context); !s.ok()) return Done(context, s);
  JobSpec spec;
  spec.kind = v1::Job::COMPRESS;
  spec.model_name = request->model_name();
  if (request->has_source_version() && request->source_version() <= 0) {
    return Done(context, absl::InvalidArgumentError("source_version must be positive"));
  }
  if (request->has_version() && request->version() <= 0) {
    return Done(context, absl::InvalidArgumentError("version must be positive"));
  }
  spec.source_version = request->has_source_version() ? request->source_version() : 0;
  spec.version = request->has_version() ? request->version() : 0;
  spec.compression = request->compression();
  spec.has_min_agreement = request->has_min_agreement();
  spec.min_agreement = request->min_agreement();
  spec.activate = request->activate();
  spec.probes.assign(request->probes().begin(), request->probes().end());
  spec.calibration.assign(request->calibration().begin(), request->calibration().end());
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Create(spec);
  if (!job.ok()) return Done(context, job.status());
  const v1::Job j = (*job)->Snapshot(false);
  response->set_job_id(j.id());
  response->set_model_name(j.model_name());
  response->set_version(j.version());
  return Done(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminService::LoadModel(grpc::CallbackServerContext* context,
                                                  const v1::LoadModelRequest* request,
                                                  v1::LoadModelResponse* response) {
  if (absl::Status s = Admit(context); !s.ok()) return Done(context, s);
  repository::ModelRepository* repo = repository_();
  if (repo == nullptr) return Done(context, absl::UnavailableError("the repository is not loaded yet"));
  repository::ServableId id{request->model_name(), request->version()};
  return RunBlocking(context, [repo, id] { return repo->LoadVersion(id); });
}

grpc::ServerUnaryReactor* AdminService::UnloadModel(grpc::CallbackServerContext* context,
                                                    const v1::UnloadModelRequest* request,
                                                    v1::UnloadModelResponse* response) {
  if (absl::Status s = Admit(context); !s.ok()) return Done(context, s);
  repository::ModelRepository* repo = repository_();
  if (repo == nullptr) return Done(context, absl::UnavailableError("the repository is not loaded yet"));
  repository::ServableId id{request->model_name(), request->version()};
  return RunBlocking(context, [repo, id] { return repo->UnloadVersion(id); });
}

grpc::ServerUnaryReactor* AdminService::DeleteVersion(grpc::CallbackServerContext* context,
                                                      const v1::DeleteVersionRequest* request,
                                                      v1::DeleteVersionResponse* response) {
  if (absl::Status s = Admit(context); !s.ok()) return Done(context, s);
  repository::ModelRepository* repo = repository_();
  if (repo == nullptr) return Done(context, absl::UnavailableError("the repository is not loaded yet"));
  repository::ServableId id{request->model_name(), request->version()};
  // (The version's gauges go with its servable, when the repository unloads it.)
  return RunBlocking(context, [repo, id] { return repo->DeleteVersion(id); });
}

}  // namespace collabserve::service

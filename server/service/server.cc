#include "server/service/server.h"

#include <chrono>
#include <utility>

#include <glog/logging.h>

#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "server/service/servable_reaper.h"
#include "server/util/files.h"
#include "server/util/status_macros.h"

namespace collabserve::service {

Server::Server(ServerOptions options)
    : options_(std::move(options)),
      metrics_(std::make_unique<metrics::Metrics>(options_.build_version, options_.torch_version)),
      inference_(std::make_unique<InferenceService>(options_.inference, metrics_.get())),
      reaper_(std::make_shared<ServableReaper>()) {}

Server::~Server() { Shutdown(); }

absl::Status Server::Start() {
  RETURN_IF_ERROR(StartServing());
  return LoadModels();
}

absl::Status Server::StartServing() {
  if (server_ != nullptr) return absl::FailedPreconditionError("server already started");
  if (options_.model_repository.empty()) {
    return absl::InvalidArgumentError("no model repository given (--model_repository)");
  }
  if (options_.tls_cert_file.empty() != options_.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key must be given together");
  }
  if (options_.metrics_port >= 0) {
    RETURN_IF_ERROR(
        metrics_->StartExposer(options_.metrics_host, options_.metrics_port, &metrics_port_));
  }

  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!options_.tls_cert_file.empty()) {
    grpc::SslServerCredentialsOptions ssl;
    ASSIGN_OR_RETURN(std::string cert, util::ReadFile(options_.tls_cert_file, 1 << 20));
    ASSIGN_OR_RETURN(std::string key, util::ReadFile(options_.tls_key_file, 1 << 20));
    ssl.pem_key_cert_pairs.push_back({key, cert});
    creds = grpc::SslServerCredentials(ssl);
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string address = absl::StrCat(options_.host, ":", options_.port);
  builder.AddListeningPort(address, creds, &port_);
  builder.SetMaxReceiveMessageSize(options_.max_message_bytes);
  builder.SetMaxSendMessageSize(options_.max_message_bytes);
  builder.RegisterService(inference_.get());
  for (grpc::Service* s : options_.extra_services) builder.RegisterService(s);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    server_.reset();
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address,
                                               " (in use, or not a local address?)"));
  }
  // The default health service starts with "" SERVING; nothing is loaded yet.
  SetHealth("", false);
  LOG(INFO) << "gRPC listening on " << options_.host << ":" << port_
            << (options_.tls_cert_file.empty() ? "" : " (TLS)")
            << (metrics_port_ >= 0 ? absl::StrCat(", /metrics on port ", metrics_port_) : "");
  return absl::OkStatus();
}

absl::Status Server::LoadModels() {
  if (server_ == nullptr) return absl::FailedPreconditionError("StartServing() first");
  repository::RepositoryOptions ro;
  ro.root = options_.model_repository;
  ro.versions_to_keep = options_.versions_to_keep;
  ro.poll_interval = options_.poll_interval;
  ro.num_load_threads = options_.num_load_threads;
  ro.on_event = [this](const repository::ServableId& id, repository::VersionEvent event,
                       const absl::Status& status) {
    if (event == repository::VersionEvent::kLoadFailed) {
      LOG(ERROR) << "cannot load " << id.DebugString() << ": " << status;
    }
    OnVersionEvent(id, event);
  };
  std::shared_ptr<ServableReaper> reaper = reaper_;
  metrics::Metrics* metrics = metrics_.get();
  const ServableOptions servable_options = options_.servable;
  auto loader = [reaper, metrics, servable_options](const repository::ServableId& id,
                                                    const std::string& path)
      -> absl::StatusOr<std::shared_ptr<repository::Servable>> {
    ASSIGN_OR_RETURN(std::unique_ptr<ModelServable> s,
                     ModelServable::Load(id, path, servable_options, metrics));
    return reaper->Adopt(std::move(s));
  };
  ASSIGN_OR_RETURN(repository_, repository::ModelRepository::Create(ro, loader));
  inference_->AttachRepository(repository_.get());
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return absl::UnavailableError("shut down while loading models");
    serving_ = true;
  }
  SetHealth("", true);
  size_t num_models = 0;
  for (const auto& [model, versions] : repository_->List()) {
    ++num_models;
    for (const auto& v : versions) {
      if (v.state == repository::ModelRepository::VersionStatus::State::kFailed) {
        LOG(WARNING) << "model " << model << " version " << v.version << " failed to load: "
                     << v.error;
      }
    }
  }
  LOG(INFO) << "serving " << num_models << " model(s) from " << options_.model_repository;
  return absl::OkStatus();
}

void Server::OnVersionEvent(const repository::ServableId& id, repository::VersionEvent event) {
  // A model is SERVING while at least one of its versions is available.
  bool serving;
  {
    absl::MutexLock lock(&mu_);
    auto& versions = available_[id.model];
    if (event == repository::VersionEvent::kAvailable) {
      versions.insert(id.version);
    } else if (event == repository::VersionEvent::kUnloaded) {
      versions.erase(id.version);
    }
    serving = !versions.empty() && !shutting_down_;
  }
  SetHealth(id.model, serving);
}

void Server::SetHealth(const std::string& service, bool serving) {
  if (server_ == nullptr) return;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health != nullptr) health->SetServingStatus(service, serving);
}

void Server::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) {
      mu_.Await(absl::Condition(&shut_down_));
      return;
    }
    shutting_down_ = true;
  }
  inference_->StartDraining();
  if (server_ != nullptr) {
    // Every service NOT_SERVING, and it stays so.
    grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
    if (health != nullptr) {
      health->SetServingStatus(false);
      health->Shutdown();
    }
    const absl::Time give_up = absl::Now() + options_.drain_timeout;
    while (inference_->inflight() > 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
    if (inference_->inflight() > 0) {
      LOG(WARNING) << inference_->inflight() << " call(s) still in flight after the "
                   << absl::FormatDuration(options_.drain_timeout) << " drain timeout; cancelling";
    }
    // Cancels whatever is left (streams that stay open, calls past the drain timeout).
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
  }
  if (repository_ != nullptr) repository_->StopPolling();
  repository_.reset();  // servables go to the reaper, which drains their schedulers
  // In-flight completions may still hold a servable for a moment; they must all be gone before
  // the metrics (which a servable's destructor updates) are.
  reaper_->Stop(options_.drain_timeout + absl::Seconds(10));
  LOG(INFO) << "shut down";
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
}

void Server::Wait() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(&shut_down_));
}

}  // namespace collabserve::service

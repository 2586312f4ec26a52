#include "server/service/admin_server.h"

#include <glog/logging.h>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/server_interceptor.h"
#include "prometheus/registry.h"
#include "server/service/status_mapping.h"
#include "server/util/files.h"
#include "server/util/status_macros.h"

namespace collabserve::service {

absl::StatusOr<std::unique_ptr<AdminServer>> AdminServer::Create(AdminServerOptions options,
                                                                 ServerOptions* server_options) {
  if (options.token.empty() == options.token_file.empty()) {
    return absl::InvalidArgumentError("the admin service needs exactly one of token / token_file");
  }
  absl::StatusOr<std::unique_ptr<AdminAuth>> auth =
      options.token_file.empty() ? AdminAuth::FromToken(options.token)
                                 : AdminAuth::FromTokenFile(options.token_file);
  if (!auth.ok()) return auth.status();
  if (options.service.max_upload_bytes <= 0) {
    return absl::InvalidArgumentError("--max_upload_bytes must be positive");
  }
  if (options.service.jobs.max_concurrent_jobs < 1 || options.service.jobs.max_queued_jobs < 1) {
    return absl::InvalidArgumentError("--max_concurrent_jobs and --max_queued_jobs must be >= 1");
  }
  if (!options.own_port && server_options == nullptr) {
    return absl::InvalidArgumentError("sharing the inference port needs the ServerOptions");
  }
  std::unique_ptr<AdminServer> admin(new AdminServer(options));
  std::shared_ptr<prometheus::Registry> registry =
      options.registry != nullptr ? options.registry : std::make_shared<prometheus::Registry>();
  admin->metrics_ = std::make_unique<AdminMetrics>(registry);
  AdminServer* self = admin.get();
  // A job that finds the GPU failed stops the server, as a failing batch does.
  options.service.jobs.on_device_failure = [self](const absl::Status& failure) {
    if (Server* s = self->server_.load(); s != nullptr) s->OnDeviceFailure(failure);
  };
  // New jobs are refused when new inference calls are.
  options.service.jobs.refusal = [self]() -> absl::Status {
    Server* s = self->server_.load();
    return s == nullptr ? absl::OkStatus() : FromGrpcStatus(s->inference_service().Refusal());
  };
  admin->service_ = std::make_unique<AdminService>(
      options.service, std::move(*auth),
      [self]() -> repository::ModelRepository* {
        Server* s = self->server_.load();
        return s == nullptr ? nullptr : s->repository();
      },
      admin->metrics_.get());
  if (!options.own_port) server_options->extra_services.push_back(admin->service_.get());
  return admin;
}

AdminServer::~AdminServer() { Shutdown(); }

absl::Status AdminServer::Start(Server* server) {
  server_.store(server);
  // The admin families appear on the server's /metrics next to the inference ones. A registry
  // the server already collects (options.registry) must not be added twice.
  if (server != nullptr && !options_.registry) server->metrics().AddCollectable(metrics_->registry());
  if (!options_.own_port) return absl::OkStatus();
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (options_.tls.enabled()) {
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> tls =
        FollowedServerCredentials(options_.tls);
    if (!tls.ok()) return tls.status();
    creds = *std::move(tls);
  }
  grpc::ServerBuilder builder;
  const std::string address = ListeningAddress(options_.host, options_.port);
  builder.AddListeningPort(address, creds, &port_);
  builder.SetMaxReceiveMessageSize(options_.max_message_bytes);
  builder.SetMaxSendMessageSize(options_.max_message_bytes);
  RETURN_IF_ERROR(ApplyKeepalive(options_.keepalive, &builder));
  builder.RegisterService(service_.get());
  if (server != nullptr) {
    // Stalled uploads end after --upload_idle_timeout_s on the admin port too: the same watchdog
    // as the inference port's (it matches calls by method).
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(server->idle_watchdog().NewInterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(creators));
  }
  grpc_server_ = builder.BuildAndStart();
  if (grpc_server_ == nullptr || port_ == 0) {
    port_ = -1;
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address, " (admin port)"));
  }
  LOG(INFO) << "admin service on " << options_.host << ":" << port_;
  return absl::OkStatus();
}

void AdminServer::Shutdown() {
  if (service_ != nullptr) service_->Shutdown();
  if (grpc_server_ != nullptr) {
    grpc_server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc_server_->Wait();
    grpc_server_.reset();
  }
}

}  // namespace collabserve::service

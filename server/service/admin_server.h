// The Admin service wired to a collabserve Server: on the inference port (registered through
// ServerOptions::extra_services) or on its own --admin_port, which a cluster can keep private.
#ifndef COLLABSERVE_SERVER_SERVICE_ADMIN_SERVER_H_
#define COLLABSERVE_SERVER_SERVICE_ADMIN_SERVER_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/server.h"
#include "server/service/admin_service.h"
#include "server/service/server.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace collabserve::service {

struct AdminServerOptions {
  AdminServiceOptions service;
  // The bearer token (exactly one of token / token_file).
  std::string token;
  std::string token_file;
  // false: served on the inference server's port. true: its own gRPC server on host:port (port 0
  // picks a free one; see AdminServer::port()).
  bool own_port = false;
  std::string host = "0.0.0.0";
  int port = 0;
  // TLS for the own port, as for inference (the same files, followed the same way).
  TlsFiles tls;
  KeepaliveOptions keepalive;
  int max_message_bytes = 16 << 20;
  // Where the admin metric families are registered; null: a registry of its own (see metrics()).
  std::shared_ptr<prometheus::Registry> registry;
};

// Create() before the Server is constructed (it may add the service to its options), Start()
// once the Server is serving, Shutdown() before the Server shuts down (it cancels the jobs, so that
// the Server's drain does not wait for them). Not thread-safe between those three calls; the
// service itself is.
class AdminServer {
 public:
  // INVALID_ARGUMENT / NOT_FOUND for a bad token or token file. When !own_port, appends the
  // service to `server_options->extra_services` (which must then not be null).
  static absl::StatusOr<std::unique_ptr<AdminServer>> Create(AdminServerOptions options,
                                                             ServerOptions* server_options);
  ~AdminServer();  // Shutdown()

  // Jobs use `server`'s repository (UNAVAILABLE until its LoadModels() finished). With own_port,
  // binds it: UNAVAILABLE if it cannot, NOT_FOUND for unreadable TLS files.
  absl::Status Start(Server* server);

  // Cancels the jobs, waits for them, and stops the own port (if any). Idempotent.
  void Shutdown();

  // The own port once started; -1 when served on the inference port.
  int port() const { return port_; }
  AdminService& service() { return *service_; }
  AdminMetrics& metrics() { return *metrics_; }

 private:
  explicit AdminServer(AdminServerOptions options) : options_(std::move(options)) {}

  const AdminServerOptions options_;
  std::atomic<Server*> server_{nullptr};
  std::unique_ptr<AdminMetrics> metrics_;
  std::unique_ptr<AdminService> service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  int port_ = -1;
};

// The admin flags (--admin_port, --admin_token_file, --max_upload_bytes, --max_concurrent_jobs,
// --max_queued_jobs) as AdminServer::Create would take them: null when --admin_token_file is
// empty (no admin service: there is no safe default token). Call after filling `server_options`
// (TLS files and message size are taken from it) and before constructing the Server.
absl::StatusOr<std::unique_ptr<AdminServer>> CreateAdminFromFlags(ServerOptions* server_options);

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_ADMIN_SERVER_H_

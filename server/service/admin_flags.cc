// The admin flags and CreateAdminFromFlags (declared in admin_server.h).
#include <glog/logging.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "server/service/admin_server.h"

ABSL_FLAG(int, admin_port, 0,
          "Admin service port: 0 = on the inference --port; N = its own port (keep it private)");
ABSL_FLAG(std::string, admin_token_file, "",
          "file holding the admin bearer token, read again when it changes (a Secret's update); "
          "empty = no Admin service");
ABSL_FLAG(int64_t, max_upload_bytes, int64_t{2} << 30, "largest checkpoint upload, in bytes");
ABSL_FLAG(int, max_concurrent_jobs, 1,
          "admin jobs (validation, compression) running at once; keep it below the inference threads");
ABSL_FLAG(bool, admin_job_idle_priority, true,
          "run admin jobs at Linux SCHED_IDLE priority: any other runnable thread on their CPUs "
          "(inference, or another process in the same cgroup) preempts them, so a job may use every "
          "idle core but all but stops while the CPUs are busy; false = nice 10");
ABSL_FLAG(int, max_queued_jobs, 4,
          "admin jobs receiving or waiting for a worker; one more is RESOURCE_EXHAUSTED");

namespace collabserve::service {

absl::StatusOr<std::unique_ptr<AdminServer>> CreateAdminFromFlags(ServerOptions* server_options) {
  AdminServerOptions o;
  o.token_file = absl::GetFlag(FLAGS_admin_token_file);
  if (o.token_file.empty()) {
    LOG(INFO) << "no --admin_token_file: the Admin service is off";
    return std::unique_ptr<AdminServer>();
  }
  o.service.max_upload_bytes = absl::GetFlag(FLAGS_max_upload_bytes);
  o.service.jobs.max_concurrent_jobs = absl::GetFlag(FLAGS_max_concurrent_jobs);
  o.service.jobs.max_queued_jobs = absl::GetFlag(FLAGS_max_queued_jobs);
  o.service.jobs.intra_op_threads = 1;
  o.service.jobs.idle_priority = absl::GetFlag(FLAGS_admin_job_idle_priority);
  o.service.jobs.device = server_options->servable.engine.device;
  const int port = absl::GetFlag(FLAGS_admin_port);
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--admin_port=", port, " is not a port number (0-65535; 0 serves the Admin service on --port)"));
  }
  o.own_port = port != 0 && port != server_options->port;
  o.host = server_options->host;
  o.port = port;
  o.tls = server_options->tls;
  o.keepalive = server_options->keepalive;
  o.max_message_bytes = server_options->max_message_bytes;
  return AdminServer::Create(std::move(o), server_options);
}

}  // namespace collabserve::service

// The collabserve server: the Inference service, grpc.health.v1 and server reflection on one port,
// the model repository with its batching servables, and /metrics. main() and the tests use it.
#ifndef COLLABSERVE_SERVER_SERVICE_SERVER_H_
#define COLLABSERVE_SERVER_SERVICE_SERVER_H_

#include <atomic>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/metrics/metrics.h"
#include "server/repository/model_repository.h"
#include "server/service/inference_service.h"
#include "server/service/model_servable.h"
#include "server/service/tls.h"

namespace grpc {
class Channel;
class Server;
class ServerBuilder;
class ServerContextBase;
class Service;
namespace experimental {
class ServerInterceptorFactoryInterface;
}  // namespace experimental
}  // namespace grpc

namespace collabserve::service {

class ServableReaper;
class ModelVersionsCollectable;

// Ends streaming calls whose client has stalled, so that a stalled client holds neither a thread
// (the callback API holds none anyway) nor memory for longer than a bound. A watched call is idle
// when, for its method's timeout, it has received no message from the client and completed no
// write to it; the clock restarts at every message either way, and stops once the client has
// half-closed or the server has begun to send the final status (from then on the server works
// and the call's deadline governs). An idle call is ended with DEADLINE_EXCEEDED and a message
// naming the limit's flag; the handler sees a cancelled call (its pending read or write fails),
// and WhyEnded says why.
//
// Thread-safe. Start() starts one checking thread; Stop() (or the destructor) joins it. The
// interceptor factory (install it on a grpc::ServerBuilder) may outlive the watchdog: calls it
// watches after Stop() are simply not ended.
class StreamIdleWatchdog {
 public:
  struct Limit {
    absl::Duration timeout;  // > 0
    std::string flag;        // named in the status message, e.g. "--upload_idle_timeout_s"
    std::string what;        // what the client did not do, e.g. "sent no upload data"
  };
  // `limits`: full method name ("/collabserve.v1.Admin/UploadModel") -> its limit.
  explicit StreamIdleWatchdog(std::map<std::string, Limit> limits);
  ~StreamIdleWatchdog();  // Stop()
  StreamIdleWatchdog(const StreamIdleWatchdog&) = delete;
  StreamIdleWatchdog& operator=(const StreamIdleWatchdog&) = delete;

  void Start();
  void Stop();
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewInterceptorFactory();
  // Calls ended for idleness so far.
  int64_t calls_ended() const;
  // While the call of `context` lives: the status message its client got when a watchdog ended it
  // for idleness, else empty (e.g. the client cancelled it). For a handler that reports the end
  // where the client does not look (an upload's job says why it failed).
  static std::string WhyEnded(const grpc::ServerContextBase& context);
  // Watched calls now open.
  int64_t calls_watched() const;

  class Core;  // shared with the interceptors

 private:
  std::shared_ptr<Core> core_;
};

// HTTP/2 keepalive of the gRPC ports (--keepalive_*; the defaults are gRPC's own). A client that
// pings more often than the server accepts (a third early ping) is sent GOAWAY "too_many_pings"
// and its connection closed: clients that set a keepalive time (to outlive a load balancer's idle
// timeout, for example) need min_client_ping_interval at or below it, and permit_without_calls if
// they ping while no call is in flight (without it, one such ping per 2 hours is accepted).
struct KeepaliveOptions {
  // The server pings a connection quiet for this long and closes it when the ping is not answered
  // within `timeout`: connections with a call in flight, and idle ones too with
  // permit_without_calls. Zero: the server never pings.
  absl::Duration time = absl::Hours(2);
  absl::Duration timeout = absl::Seconds(20);
  // The shortest interval between a client's pings that the server accepts (zero: any).
  absl::Duration min_client_ping_interval = absl::Minutes(5);
  // Accept client pings on a connection with no call in flight, and ping such connections too.
  bool permit_without_calls = false;
};

// Durations up to 2147483 s (gRPC's int milliseconds), the timeout at least 1 ms; errors name the
// flag.
absl::Status CheckKeepalive(const KeepaliveOptions& keepalive);
// CheckKeepalive, then the options set on `builder`.
absl::Status ApplyKeepalive(const KeepaliveOptions& keepalive, grpc::ServerBuilder* builder);

struct ServerOptions {
  // gRPC address; port 0 picks a free one (see Server::port()).
  std::string host = "0.0.0.0";
  int port = 8500;
  // /metrics: port 0 picks one, -1 disables it.
  std::string metrics_host = "0.0.0.0";
  int metrics_port = 9090;
  // Directory of models (root/<model>/<version>/). Required.
  std::string model_repository;
  absl::Duration poll_interval = absl::Seconds(30);
  // A version directory that changed less than this long ago is not loaded yet
  // (repository::RepositoryOptions::settle_time).
  absl::Duration version_settle = absl::Seconds(2);
  int versions_to_keep = 1;
  int num_load_threads = 1;
  ServableOptions servable;
  InferenceServiceOptions inference;
  // Largest gRPC message in either direction; a bigger one ends its call with RESOURCE_EXHAUSTED
  // ("received message larger than max (N vs. LIMIT)").
  int max_message_bytes = 16 << 20;
  // A ClassifyStream with no request sent and no response read for this long is ended
  // (StreamIdleWatchdog). Zero or infinite: never.
  absl::Duration stream_idle_timeout = absl::Minutes(5);
  // An Admin UploadModel stream (served on this port) that sends no data for this long is ended;
  // its job fails and its staging directory is removed. Zero or infinite: never.
  absl::Duration upload_idle_timeout = absl::Minutes(1);
  // A connection this old is asked to go away (HTTP/2 GOAWAY, gRPC's max connection age, with
  // ±10% jitter): its calls in flight and open streams finish on it, and the client's next call
  // opens a new connection, which a Kubernetes Service may send to another pod (a pod added by
  // the autoscaler gets traffic from clients that were already connected). Zero or infinite:
  // never.
  absl::Duration max_connection_age = absl::ZeroDuration();
  KeepaliveOptions keepalive;
  // TLS (--tls_cert, --tls_key, --tls_reload_s): both files set = TLS, both empty = plaintext.
  // The files are followed: a renewed pair serves new connections without a restart.
  TlsFiles tls;
  // How long Shutdown waits for in-flight calls before cancelling them.
  absl::Duration drain_timeout = absl::Seconds(30);
  std::string build_version = "0.1.0";
  std::string torch_version = "unknown";
  // Extra services served on the same port (e.g. Admin); not owned, must outlive the Server.
  std::vector<grpc::Service*> extra_services;
};

// The options' values that StartServing refuses (INVALID_ARGUMENT naming the flag): ports,
// limits, durations, and the batching and engine options that every version's load would refuse.
absl::Status ValidateServerOptions(const ServerOptions& options);

// "host:port" as gRPC parses a listening address: an IPv6 literal in brackets ("::" ->
// "[::]:8500"; one already in brackets stays as it is).
std::string ListeningAddress(const std::string& host, int port);

// Start() then Shutdown() (or destroy). Thread-safe after Start: Shutdown may be called from a
// signal-watching thread while other threads use the accessors.
class Server {
 public:
  explicit Server(ServerOptions options);
  ~Server();  // Shutdown()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // StartServing() then LoadModels().
  absl::Status Start();

  // Binds the ports and starts answering: health is NOT_SERVING and Inference calls get
  // UNAVAILABLE until LoadModels() finishes. Errors: UNAVAILABLE if a port cannot be bound,
  // INVALID_ARGUMENT for bad options, NOT_FOUND for unreadable TLS files.
  absl::Status StartServing();
  // Creates the repository (loading and warming up every model's newest versions), then turns
  // health to SERVING for "" and each model. The repository's error if the root is unusable.
  absl::Status LoadModels();

  // The drain's first step, at once: health -> NOT_SERVING and new calls -> UNAVAILABLE, while the
  // calls in flight go on; drain_timeout counts from here. For what must stop before the
  // repository does (the Admin service's jobs), so that the pod leaves its Service meanwhile.
  // Idempotent; Shutdown() begins it if nobody did.
  void BeginDrain();
  // BeginDrain(), waits until drain_timeout after it for in-flight calls, then stops gRPC
  // (cancelling what is left), the repository and /metrics. Idempotent.
  void Shutdown();

  // Blocks until Shutdown() has completed.
  void Wait();

  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  metrics::Metrics& metrics() { return *metrics_; }
  // Null before LoadModels() and once Shutdown() tears the repository down. Safe from any thread:
  // admin calls on the serving port may arrive while LoadModels() runs.
  repository::ModelRepository* repository() const {
    return repository_view_.load(std::memory_order_acquire);
  }
  InferenceService& inference_service() { return *inference_; }
  StreamIdleWatchdog& idle_watchdog() { return *idle_watchdog_; }
  // A channel to this server's services that skips the network (grpc::Server::InProcessChannel)
  // with the server's message limit both ways, for front ends in the same process (the REST
  // endpoint, kserve_http.h): their calls pass the same limits, interceptors and metrics. Null
  // before StartServing(); calls fail UNAVAILABLE once Shutdown() has stopped gRPC.
  std::shared_ptr<grpc::Channel> InProcessChannel();

  // The model device failed for good (model::IsDeviceFailure; a servable's pass, load or warm-up
  // found it, or an admin job): every health service NOT_SERVING from now on (so that Kubernetes'
  // readiness probe drops the pod and its liveness probe restarts it), new calls UNAVAILABLE. What
  // is in flight fails on its own. Idempotent; thread-safe.
  void OnDeviceFailure(const absl::Status& failure);

  // The probes the metrics port answers in plain HTTP (for probes that cannot speak TLS; an
  // HttpExposer::Handler): /livez, 200 until the device fails for good; /readyz and
  // /readyz/<model>, 200 while grpc.health.v1 says SERVING for "" or that model, else 503 saying
  // why (loading, draining, the device failed, no version served), 404 for a model it never named.
  // nullopt for any other path.
  std::optional<metrics::HttpExposer::Response> Probe(const std::string& path);

 private:
  void OnVersionEvent(const repository::ServableId& id, repository::VersionEvent event);
  // SERVING only while neither shutting down nor failed.
  void SetHealth(const std::string& service, bool serving);

  const ServerOptions options_;
  std::unique_ptr<metrics::Metrics> metrics_;
  std::unique_ptr<InferenceService> inference_;
  std::shared_ptr<ServableReaper> reaper_;
  std::unique_ptr<StreamIdleWatchdog> idle_watchdog_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<repository::ModelRepository> repository_;
  std::atomic<repository::ModelRepository*> repository_view_{nullptr};  // repository_.get()
  // collabserve_model_versions{model,state}, read from repository_ at each scrape.
  std::shared_ptr<ModelVersionsCollectable> versions_collectable_;
  int port_ = 0;
  int metrics_port_ = -1;

  absl::Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;  // models loaded: "" is SERVING
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<absl::Time> drain_began_ ABSL_GUARDED_BY(mu_);
  bool device_failed_ ABSL_GUARDED_BY(mu_) = false;
  prometheus::Gauge* device_failed_gauge_ = nullptr;  // collabserve_device_failed{device}
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, std::set<int64_t>> available_ ABSL_GUARDED_BY(mu_);  // served versions
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_SERVER_H_

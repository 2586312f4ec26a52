#include "server/service/server.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <glog/logging.h>
#include <grpc/grpc.h>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "grpcpp/channel.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/server_interceptor.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/gauge.h"
#include "prometheus/metric_family.h"
#include "server/batching/batch_scheduler.h"
#include "server/metrics/process_metrics.h"
#include "server/model/device.h"
#include "server/model/engine.h"
#include "server/service/servable_reaper.h"
#include "server/service/tls.h"
#include "server/util/files.h"
#include "server/util/status_macros.h"

namespace collabserve::service {

// collabserve_model_versions{model,state}: how many version directories of each model the
// repository knows in each state, read at each scrape. Every state is exported for every model, 0
// included, so that an alert can ask for a model with no available version. Attach(nullptr) before
// the repository goes: a scrape then exports nothing.
class ModelVersionsCollectable : public prometheus::Collectable {
 public:
  void Attach(const repository::ModelRepository* repository) {
    absl::MutexLock l(&mu_);
    repository_ = repository;
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    absl::MutexLock l(&mu_);
    if (repository_ == nullptr) return {};
    prometheus::MetricFamily f;
    f.name = "collabserve_model_versions";
    f.help =
        "Version directories of each model in the model repository, by state: available (served), "
        "loading, settling (changed on disk within --version_settle_s), failed (its load failed: "
        "collabctl models lists why), unloaded.";
    f.type = prometheus::MetricType::Gauge;
    for (const auto& [model, versions] : repository_->List()) {
      std::map<std::string, int> counts;
      for (const char* state : repository::ModelRepository::StateNames()) counts[state] = 0;
      for (const auto& v : versions) ++counts[repository::ModelRepository::StateName(v)];
      for (const auto& [state, count] : counts) {
        prometheus::ClientMetric m;
        m.label = {{"model", model}, {"state", state}};
        m.gauge.value = count;
        f.metric.push_back(std::move(m));
      }
    }
    return {std::move(f)};
  }

 private:
  mutable absl::Mutex mu_;
  const repository::ModelRepository* repository_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// ---------------------------------------------------------------------------------------------
// StreamIdleWatchdog

namespace {

// The calls a watchdog ended, and their messages, until their interceptors go (with the call).
// Process-wide: a handler asks without knowing which watchdog (the inference or the admin port's)
// watched its call.
absl::Mutex ended_calls_mu(absl::kConstInit);
std::map<const grpc_call*, std::string>& EndedCalls() ABSL_EXCLUSIVE_LOCKS_REQUIRED(ended_calls_mu) {
  static auto* calls = new std::map<const grpc_call*, std::string>();
  return *calls;
}

}  // namespace

std::string StreamIdleWatchdog::WhyEnded(const grpc::ServerContextBase& context) {
  const grpc_call* call = const_cast<grpc::ServerContextBase&>(context).c_call();
  absl::MutexLock lock(&ended_calls_mu);
  auto it = EndedCalls().find(call);
  return it == EndedCalls().end() ? std::string() : it->second;
}

class StreamIdleWatchdog::Core {
 public:
  explicit Core(std::map<std::string, Limit> limits) : limits_(std::move(limits)) {
    absl::Duration shortest = absl::InfiniteDuration();
    for (const auto& [method, limit] : limits_) shortest = std::min(shortest, limit.timeout);
    // Checked a few times per timeout: an idle call ends between 1x and 1.25x its timeout.
    tick_ = std::clamp(shortest / 4, absl::Milliseconds(10), absl::Seconds(1));
  }

  // Null for a method that is not watched.
  const Limit* LimitFor(const char* method) const {
    if (method == nullptr) return nullptr;
    auto it = limits_.find(method);
    return it == limits_.end() ? nullptr : &it->second;
  }

  uint64_t Register(grpc_call* call, const Limit* limit) {
    absl::MutexLock lock(&mu_);
    const uint64_t id = next_id_++;
    calls_[id] = Entry{call, limit, absl::Now(), /*watching=*/true};
    return id;
  }
  void Touch(uint64_t id) {
    absl::MutexLock lock(&mu_);
    auto it = calls_.find(id);
    if (it != calls_.end()) it->second.last_activity = absl::Now();
  }
  void Unwatch(uint64_t id) {
    absl::MutexLock lock(&mu_);
    auto it = calls_.find(id);
    if (it != calls_.end()) it->second.watching = false;
  }
  void Remove(uint64_t id) {
    absl::MutexLock lock(&mu_);
    auto it = calls_.find(id);
    if (it == calls_.end()) return;
    {
      absl::MutexLock ended(&ended_calls_mu);
      EndedCalls().erase(it->second.call);  // if it was ended for idleness
    }
    calls_.erase(it);
  }

  void Start() {
    absl::MutexLock lock(&mu_);
    if (thread_.joinable() || stop_) return;
    thread_ = std::thread([this] { Run(); });
  }
  void Stop() {
    std::thread t;
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      cv_.SignalAll();
      t.swap(thread_);
    }
    if (t.joinable()) t.join();
  }

  int64_t calls_ended() const {
    absl::MutexLock lock(&mu_);
    return ended_;
  }
  int64_t calls_watched() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int64_t>(calls_.size());
  }

 private:
  struct Entry {
    grpc_call* call;
    const Limit* limit;
    absl::Time last_activity;
    bool watching;
  };
  struct Expired {
    grpc_call* call;  // referenced: the call may finish while it is being cancelled
    std::string message;
  };

  void Run() {
    for (;;) {
      std::vector<Expired> expired;
      {
        absl::MutexLock lock(&mu_);
        cv_.WaitWithTimeout(&mu_, tick_);
        if (stop_) return;
        const absl::Time now = absl::Now();
        for (auto& [id, e] : calls_) {
          if (!e.watching || now - e.last_activity < e.limit->timeout) continue;
          e.watching = false;
          ++ended_;
          grpc_call_ref(e.call);
          const absl::Duration idle = absl::Trunc(now - e.last_activity, absl::Milliseconds(1));
          std::string why = absl::StrCat("the client ", e.limit->what, " for ", absl::FormatDuration(idle),
                                         "; this server ends such calls after ",
                                         absl::FormatDuration(e.limit->timeout), " (", e.limit->flag, ")");
          {
            // Before the cancel, so that the handler's failed read finds it; Remove erases it.
            absl::MutexLock ended(&ended_calls_mu);
            EndedCalls()[e.call] = why;
          }
          expired.push_back(Expired{e.call, std::move(why)});
        }
      }
      // Outside mu_: cancelling may run the call's reactions, and so the interceptor, inline.
      for (Expired& x : expired) {
        LOG(WARNING) << "ending an idle call: " << x.message;
        grpc_call_cancel_with_status(x.call, GRPC_STATUS_DEADLINE_EXCEEDED, x.message.c_str(),
                                     nullptr);
        grpc_call_unref(x.call);
      }
    }
  }

  const std::map<std::string, Limit> limits_;
  absl::Duration tick_;
  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  std::map<uint64_t, Entry> calls_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t ended_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_ ABSL_GUARDED_BY(mu_);
};

namespace {

// One per watched call: registers it on its first hook and reports its traffic.
class IdleInterceptor final : public grpc::experimental::Interceptor {
 public:
  IdleInterceptor(std::shared_ptr<StreamIdleWatchdog::Core> core,
                  grpc::experimental::ServerRpcInfo* info, const StreamIdleWatchdog::Limit* limit)
      : core_(std::move(core)), info_(info), limit_(limit) {}
  ~IdleInterceptor() override {
    uint64_t id;
    {
      absl::MutexLock lock(&mu_);
      id = id_;
    }
    if (id != 0) core_->Remove(id);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    const bool ending =
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS) ||
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_CLOSE);
    const uint64_t id = Id(ending);
    if (id != 0) {
      if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
        // No message: the client half-closed (or the call failed); nothing more to wait for.
        if (methods->GetRecvMessage() == nullptr) {
          core_->Unwatch(id);
        } else {
          core_->Touch(id);
        }
      }
      if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_SEND_MESSAGE)) {
        core_->Touch(id);
      }
      if (ending) core_->Unwatch(id);
    }
    methods->Proceed();
  }

 private:
  // Registers the call on its first hook (gRPC may run the hooks of a read and a write batch
  // concurrently). 0 once the call is ending without having been registered.
  uint64_t Id(bool ending) {
    absl::MutexLock lock(&mu_);
    if (id_ == 0 && !ended_) {
      grpc_call* call = info_->server_context()->c_call();
      if (call != nullptr) id_ = core_->Register(call, limit_);
    }
    if (ending) ended_ = true;
    return id_;
  }

  const std::shared_ptr<StreamIdleWatchdog::Core> core_;
  grpc::experimental::ServerRpcInfo* const info_;
  const StreamIdleWatchdog::Limit* const limit_;
  absl::Mutex mu_;
  uint64_t id_ ABSL_GUARDED_BY(mu_) = 0;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

class IdleInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit IdleInterceptorFactory(std::shared_ptr<StreamIdleWatchdog::Core> core)
      : core_(std::move(core)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const StreamIdleWatchdog::Limit* limit = core_->LimitFor(info->method());
    if (limit == nullptr) return nullptr;
    return new IdleInterceptor(core_, info, limit);
  }

 private:
  const std::shared_ptr<StreamIdleWatchdog::Core> core_;
};

bool IsLimit(absl::Duration d) { return d > absl::ZeroDuration() && d != absl::InfiniteDuration(); }

}  // namespace

StreamIdleWatchdog::StreamIdleWatchdog(std::map<std::string, Limit> limits)
    : core_(std::make_shared<Core>(std::move(limits))) {}
StreamIdleWatchdog::~StreamIdleWatchdog() { Stop(); }
void StreamIdleWatchdog::Start() { core_->Start(); }
void StreamIdleWatchdog::Stop() { core_->Stop(); }
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
StreamIdleWatchdog::NewInterceptorFactory() {
  return std::make_unique<IdleInterceptorFactory>(core_);
}
int64_t StreamIdleWatchdog::calls_ended() const { return core_->calls_ended(); }
int64_t StreamIdleWatchdog::calls_watched() const { return core_->calls_watched(); }

// ---------------------------------------------------------------------------------------------
// Server

namespace {

std::map<std::string, StreamIdleWatchdog::Limit> IdleLimits(const ServerOptions& o) {
  std::map<std::string, StreamIdleWatchdog::Limit> limits;
  if (IsLimit(o.stream_idle_timeout)) {
    limits["/collabserve.v1.Inference/ClassifyStream"] = {
        o.stream_idle_timeout, "--stream_idle_timeout_s", "sent no request and read no response"};
  }
  if (IsLimit(o.upload_idle_timeout)) {
    limits["/collabserve.v1.Admin/UploadModel"] = {o.upload_idle_timeout,
                                                   "--upload_idle_timeout_s",
                                                   "sent no upload data"};
  }
  return limits;
}

// What /metrics reads of the server's GPU at each scrape: nothing for a CPU server, or for a
// --device that does not parse or where CUDA cannot start (no model loads then). CUDA starts here,
// before the first scrape (ReadDeviceMemory must not race with its start), rather than with the
// first model.
std::function<std::optional<metrics::GpuMemoryReading>()> GpuMemorySource(
    const absl::StatusOr<c10::Device>& device) {
  if (!device.ok()) return nullptr;
  if (absl::Status s = model::InitDevice(*device); !s.ok()) {
    LOG(WARNING) << "no GPU memory metrics: " << s;
    return nullptr;
  }
  return [device = *device]() -> std::optional<metrics::GpuMemoryReading> {
    std::optional<model::DeviceMemory> m = model::ReadDeviceMemory(device);
    if (!m) return std::nullopt;
    return metrics::GpuMemoryReading{device.str(), m->allocated_bytes, m->reserved_bytes,
                                     m->total_bytes};
  };
}

}  // namespace

Server::Server(ServerOptions options)
    : options_(std::move(options)),
      metrics_(std::make_unique<metrics::Metrics>(options_.build_version, options_.torch_version)),
      inference_(std::make_unique<InferenceService>(options_.inference, metrics_.get())),
      reaper_(std::make_shared<ServableReaper>()),
      idle_watchdog_(std::make_unique<StreamIdleWatchdog>(IdleLimits(options_))) {
  metrics::SetPassArenaBytesSource(&model::PassArenaResidentBytes);
  const std::string& name = options_.servable.engine.device;
  const absl::StatusOr<c10::Device> device = model::ParseDevice(name);
  metrics::SetGpuMemorySource(GpuMemorySource(device));
  device_failed_gauge_ = metrics_->DeviceFailed(device.ok() ? device->str() : name);
}

Server::~Server() {
  Shutdown();
  metrics_->StopExposer();  // before the members its probes read go
}

absl::Status Server::Start() {
  RETURN_IF_ERROR(StartServing());
  return LoadModels();
}

absl::Status ValidateServerOptions(const ServerOptions& o) {
  if (o.model_repository.empty()) {
    return absl::InvalidArgumentError("no model repository given (--model_repository)");
  }
  if (o.port < 0 || o.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--port=", o.port, " is not a port number (0-65535; 0 picks a free one)"));
  }
  if (o.metrics_port != -1 && (o.metrics_port < 0 || o.metrics_port > 65535)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_port=", o.metrics_port,
        " is not a port number (0-65535; 0 picks a free one, -1 turns /metrics off)"));
  }
  if (o.tls.cert_file.empty() != o.tls.key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key must be given together");
  }
  RETURN_IF_ERROR(CheckReloadInterval(o.tls.reload_interval));
  RETURN_IF_ERROR(CheckKeepalive(o.keepalive));
  if (!o.tls.client_ca_file.empty() && o.tls.cert_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_client_ca needs --tls_cert and --tls_key (client certificates are asked for over TLS)");
  }
  if (o.max_message_bytes < 1024) {
    return absl::InvalidArgumentError(absl::StrCat("--max_message_bytes=", o.max_message_bytes,
                                                   " is below 1024; requests would not fit"));
  }
  if (o.inference.max_inputs_per_request < 1 || o.inference.max_text_bytes < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_inputs_per_request=", o.inference.max_inputs_per_request, " and --max_text_bytes=",
        o.inference.max_text_bytes, " must both be >= 1"));
  }
  if (o.inference.max_concurrent_streams < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_concurrent_streams=", o.inference.max_concurrent_streams, " must be >= 1"));
  }
  if (o.inference.stream_max_pending_responses < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--stream_max_pending_responses=", o.inference.stream_max_pending_responses, " must be >= 1"));
  }
  if (o.stream_idle_timeout < absl::ZeroDuration() || o.upload_idle_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "--stream_idle_timeout_s and --upload_idle_timeout_s must be >= 0 (0 = no limit)");
  }
  if (o.poll_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--poll_interval_s must not be negative");
  }
  if (o.version_settle < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--version_settle_s must not be negative");
  }
  if (o.drain_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--drain_timeout_s must not be negative");
  }
  if (o.max_connection_age < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--max_connection_age_s must not be negative");
  }
  // What every version's load would refuse: refused here, the server stops at start-up instead of
  // serving with no model loaded.
  RETURN_IF_ERROR(util::Prefixed(batching::ValidateSchedulerOptions(o.servable.batching, "--"),
                                 "batching flags: "));
  return util::Prefixed(model::ValidateEngineOptions(o.servable.engine), "engine flags: ");
}

std::string ListeningAddress(const std::string& host, int port) {
  const bool ipv6 = host.find(':') != std::string::npos && !absl::StartsWith(host, "[");
  return ipv6 ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

namespace {
// gRPC takes milliseconds in an int, and INT_MAX as "never".
constexpr int kNeverMs = std::numeric_limits<int>::max();
}  // namespace

absl::Status CheckKeepalive(const KeepaliveOptions& k) {
  struct Bound {
    const char* flag;
    absl::Duration d;
    absl::Duration min;
  };
  const Bound bounds[] = {
      {"keepalive_time_s", k.time, absl::ZeroDuration()},  // 0 = the server never pings
      {"keepalive_timeout_s", k.timeout, absl::Milliseconds(1)},
      {"keepalive_min_client_ping_s", k.min_client_ping_interval, absl::ZeroDuration()}};
  for (const Bound& b : bounds) {
    if (b.d < b.min || b.d >= absl::Milliseconds(kNeverMs)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", b.flag, "=", absl::StrFormat("%.10g", absl::ToDoubleSeconds(b.d)),
                       " is not within ", b.min == absl::ZeroDuration() ? "0" : "0.001",
                       " to 2147483 seconds"));
    }
  }
  return absl::OkStatus();
}

absl::Status ApplyKeepalive(const KeepaliveOptions& k, grpc::ServerBuilder* builder) {
  RETURN_IF_ERROR(CheckKeepalive(k));
  auto ms = [](absl::Duration d) { return static_cast<int>(absl::ToInt64Milliseconds(d)); };
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                              k.time == absl::ZeroDuration() ? kNeverMs : ms(k.time));
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms(k.timeout));
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                              ms(k.min_client_ping_interval));
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
                              k.permit_without_calls ? 1 : 0);
  return absl::OkStatus();
}

absl::Status Server::StartServing() {
  if (server_ != nullptr) return absl::FailedPreconditionError("server already started");
  RETURN_IF_ERROR(ValidateServerOptions(options_));
  // The certificate files are checked before anything listens.
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (options_.tls.enabled()) {
    ASSIGN_OR_RETURN(creds, FollowedServerCredentials(options_.tls));
  }
  if (options_.metrics_port >= 0) {
    RETURN_IF_ERROR(
        metrics_->StartExposer(options_.metrics_host, options_.metrics_port, &metrics_port_,
                               [this](const std::string& path) { return Probe(path); }));
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string address = ListeningAddress(options_.host, options_.port);
  builder.AddListeningPort(address, creds, &port_);
  builder.SetMaxReceiveMessageSize(options_.max_message_bytes);
  builder.SetMaxSendMessageSize(options_.max_message_bytes);
  if (options_.max_connection_age > absl::ZeroDuration() &&
      options_.max_connection_age != absl::InfiniteDuration()) {
    // The grace after the GOAWAY stays gRPC's default, unlimited: long streams are not cut.
    builder.AddChannelArgument(
        GRPC_ARG_MAX_CONNECTION_AGE_MS,
        static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(options_.max_connection_age),
                                             1, std::numeric_limits<int>::max())));
  }
  RETURN_IF_ERROR(ApplyKeepalive(options_.keepalive, &builder));
  builder.RegisterService(inference_.get());
  for (grpc::Service* s : options_.extra_services) builder.RegisterService(s);
  {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(idle_watchdog_->NewInterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(creators));
  }
  idle_watchdog_->Start();
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    server_.reset();
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address,
                                               " (in use, or not a local address?)"));
  }
  // Once: a retried start must not export the families twice.
  if (options_.tls.enabled()) metrics_->AddCollectable(NewCertificateCollectable(options_.tls));
  // The default health service starts with "" SERVING; nothing is loaded yet.
  SetHealth("", false);
  LOG(INFO) << "gRPC listening on " << ListeningAddress(options_.host, port_)
            << (options_.tls.enabled() ? " (TLS)" : "")
            << (metrics_port_ >= 0 ? absl::StrCat(", /metrics on port ", metrics_port_) : "");
  return absl::OkStatus();
}

std::shared_ptr<grpc::Channel> Server::InProcessChannel() {
  if (server_ == nullptr) return nullptr;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options_.max_message_bytes);
  args.SetMaxSendMessageSize(options_.max_message_bytes);
  return server_->InProcessChannel(args);
}

absl::Status Server::LoadModels() {
  if (server_ == nullptr) return absl::FailedPreconditionError("StartServing() first");
  repository::RepositoryOptions ro;
  ro.root = options_.model_repository;
  ro.versions_to_keep = options_.versions_to_keep;
  ro.poll_interval = options_.poll_interval;
  ro.settle_time = options_.version_settle;
  ro.num_load_threads = options_.num_load_threads;
  // The repository logs a failed load, with its path and status.
  ro.on_event = [this](const repository::ServableId& id, repository::VersionEvent event,
                       const absl::Status&) { OnVersionEvent(id, event); };
  std::shared_ptr<ServableReaper> reaper = reaper_;
  metrics::Metrics* metrics = metrics_.get();
  ServableOptions servable_options = options_.servable;
  // The Server outlives its servables (Shutdown stops the reaper).
  servable_options.on_device_failure = [this](const absl::Status& failure) { OnDeviceFailure(failure); };
  auto loader = [reaper, metrics, servable_options](const repository::ServableId& id,
                                                    const std::string& path)
      -> absl::StatusOr<std::shared_ptr<repository::Servable>> {
    ASSIGN_OR_RETURN(std::unique_ptr<ModelServable> s,
                     ModelServable::Load(id, path, servable_options, metrics));
    return reaper->Adopt(std::move(s));
  };
  ASSIGN_OR_RETURN(repository_, repository::ModelRepository::Create(ro, loader));
  repository_view_.store(repository_.get(), std::memory_order_release);
  inference_->AttachRepository(repository_.get());
  versions_collectable_ = std::make_shared<ModelVersionsCollectable>();
  versions_collectable_->Attach(repository_.get());
  metrics_->AddCollectable(versions_collectable_);
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return absl::UnavailableError("shut down while loading models");
    serving_ = true;
  }
  SetHealth("", true);
  // One line: what is served, and which versions failed (each logged with its error above).
  size_t num_models = 0, num_serving = 0;
  std::vector<std::string> failed;
  for (const auto& [model, versions] : repository_->List()) {
    ++num_models;
    bool available = false;
    for (const auto& v : versions) {
      using State = repository::ModelRepository::VersionStatus::State;
      available |= v.state == State::kAvailable;
      if (v.state == State::kFailed) failed.push_back(absl::StrCat(model, ":", v.version));
    }
    num_serving += available;
  }
  std::string summary = absl::StrCat("serving ", num_serving, " of ", num_models, " model(s) from ",
                                     options_.model_repository);
  if (!failed.empty()) {
    absl::StrAppend(&summary, "; failed to load: ", absl::StrJoin(failed, ", "),
                    " (see above; `collabctl models` lists why)");
    LOG(WARNING) << summary;
  } else if (num_models == 0) {
    absl::StrAppend(&summary, ": it holds no model yet (a model is MODEL/VERSION/, e.g. ",
                    util::JoinPath(options_.model_repository, "mymodel/1/config.json"), "); ",
                    options_.poll_interval > absl::ZeroDuration()
                        ? absl::StrCat("it is scanned again every ",
                                       absl::FormatDuration(options_.poll_interval))
                        : std::string("--poll_interval_s=0: it is not scanned again"));
    LOG(WARNING) << summary;
  } else {
    LOG(INFO) << summary;
  }
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

void Server::OnDeviceFailure(const absl::Status& failure) {
  {
    absl::MutexLock lock(&mu_);
    if (device_failed_) return;
    device_failed_ = true;
    device_failed_gauge_->Set(1);
    if (server_ != nullptr && !shutting_down_) {
      grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
      if (health != nullptr) health->SetServingStatus(false);  // every service, "" included
    }
  }
  inference_->StopForDeviceFailure(failure);
  LOG(ERROR) << "the model device failed and no new work can run on it; health is NOT_SERVING and "
                "new calls are UNAVAILABLE until the process restarts: "
             << failure;
}

void Server::SetHealth(const std::string& service, bool serving) {
  if (server_ == nullptr) return;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  // Under mu_, so that a model that becomes available cannot turn SERVING after a device failure.
  absl::MutexLock lock(&mu_);
  health->SetServingStatus(service, serving && !device_failed_);
}

std::optional<metrics::HttpExposer::Response> Server::Probe(const std::string& path) {
  using Response = metrics::HttpExposer::Response;
  std::string service;  // "" for the server
  if (absl::StartsWith(path, "/readyz/") && path.size() > 8) {
    service = path.substr(8);
  } else if (path != "/readyz" && path != "/livez") {
    return std::nullopt;
  }
  absl::MutexLock lock(&mu_);
  if (device_failed_) {
    return Response{503, "NOT_SERVING: the model device failed; only a restart brings it back\n"};
  }
  if (path == "/livez") return Response{200, "LIVE\n"};
  if (drain_began_.has_value()) return Response{503, "NOT_SERVING: shutting down\n"};
  // What SetHealth was told: "" once the models loaded, a model while a version of it is available.
  if (service.empty()) {
    return serving_ ? Response{200, "SERVING\n"} : Response{503, "NOT_SERVING: loading its models\n"};
  }
  auto it = available_.find(service);
  if (it == available_.end()) {
    return Response{404, absl::StrCat("no model \"", absl::CHexEscape(service), "\"\n")};
  }
  if (it->second.empty()) {
    return Response{503, absl::StrCat("NOT_SERVING: no version of \"", absl::CHexEscape(service),
                                      "\" is served\n")};
  }
  return Response{200, "SERVING\n"};
}

void Server::BeginDrain() {
  {
    absl::MutexLock lock(&mu_);
    if (drain_began_.has_value()) return;
    drain_began_ = absl::Now();
  }
  inference_->StartDraining();
  if (server_ != nullptr) {
    // Every service NOT_SERVING, and it stays so.
    grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
    if (health != nullptr) {
      health->SetServingStatus(false);
      health->Shutdown();
    }
  }
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
  BeginDrain();
  absl::Time began;
  {
    absl::MutexLock lock(&mu_);
    began = *drain_began_;
  }
  if (server_ != nullptr) {
    const absl::Time give_up = began + options_.drain_timeout;
    while (inference_->inflight() > 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
    if (inference_->inflight() > 0) {
      LOG(WARNING) << inference_->inflight() << " call(s) still in flight after the "
                   << absl::FormatDuration(options_.drain_timeout) << " drain timeout; cancelling";
    }
    // Cancels whatever is left (streams that stay open, calls past the drain timeout).
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
  }
  idle_watchdog_->Stop();
  if (repository_ != nullptr) repository_->StopPolling();
  if (versions_collectable_ != nullptr) versions_collectable_->Attach(nullptr);
  repository_view_.store(nullptr, std::memory_order_release);
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

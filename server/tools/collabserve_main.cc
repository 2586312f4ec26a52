// collabserve: the gRPC inference server. Without --model_repository it serves the built-in demo
// model ("demo", version 1: the Debian package-section classifier of server/model/demo/, compiled
// in) from a temporary directory.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include <ATen/Parallel.h>
#include <glog/logging.h>
#include <torch/version.h>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/batching/thread_plan.h"
#include "server/model/demo_model.h"
#include "server/service/admin_server.h"
#include "server/service/http_server.h"
#include "server/service/kserve_service.h"
#include "server/service/server.h"
#include "server/service/tei_http.h"
#include "server/tools/log_flags.h"
#include "server/util/files.h"
#include "server/util/process_env.h"
#include "server/util/process_memory.h"

ABSL_FLAG(std::string, host, "0.0.0.0",
          "address to listen on; :: for every IPv6 (and on a dual-stack host IPv4) address");
ABSL_FLAG(int, port, 8500, "gRPC port (0 = pick a free one; printed on stdout)");
ABSL_FLAG(int, metrics_port, 9090, "Prometheus /metrics port (0 = pick, printed; -1 = off)");
ABSL_FLAG(int, http_port, 8000,
          "HTTP/REST port: the Open Inference Protocol (KServe v2, Triton's /v2 routes) and "
          "text-embeddings-inference's routes (/predict, /rerank, /info, /health); TLS as the gRPC "
          "port (0 = pick, printed; -1 = off)");
ABSL_FLAG(std::string, http_default_model, "",
          "the model text-embeddings-inference's routes at the root serve (/predict...; "
          "/models/NAME/predict names one); empty = the only model served");
ABSL_FLAG(int, http_max_connections, 256,
          "HTTP connections open at once (a thread each); one more is answered 503 and closed");
ABSL_FLAG(double, http_idle_timeout_s, 60,
          "HTTP connections' deadline per phase: the wait for a request, and the read of its head, "
          "each this long; its body and the response this long plus their size at 64 KiB/s; past "
          "it the connection is closed");
ABSL_FLAG(std::string, model_repository, "",
          "directory of <model>/<version>/ checkpoints; empty = the built-in demo model");
ABSL_FLAG(double, poll_interval_s, 30, "seconds between repository scans (0 = only at start)");
ABSL_FLAG(double, version_settle_s, 2,
          "a version directory loads once it has not changed for this long, so one copied in file "
          "by file is not loaded half-copied (0 = load at once; uploads are never delayed)");
ABSL_FLAG(int, versions_to_keep, 1, "newest versions of each model to serve");
ABSL_FLAG(int, num_load_threads, 1,
          "versions loaded in parallel: of models that unload nothing meanwhile, and of the one model swapping "
          "versions at a time");
ABSL_FLAG(std::string, device, "cpu", "cpu, cuda or cuda:N");
ABSL_FLAG(std::string, dtype, "float32", "float32; float16/bfloat16 on CUDA");
ABSL_FLAG(int64_t, cuda_graph_max_tokens, 4096,
          "CUDA: passes of at most this many tokens (batch and length rounded up to powers of two) "
          "replay CUDA graphs, one per shape, captured when the version loads; 0 = none");
ABSL_FLAG(int, cpus, 0,
          "CPUs the server sizes its threads for (batch and intra-op threads, admin jobs' workers); "
          "0 = detected: the CPUs it may run on, capped by a cgroup CPU quota. For a container with a "
          "CPU request and no limit, which sees the whole node");
ABSL_FLAG(int, num_batch_threads, 0,
          "batch threads per model version (concurrent forward passes); 0 = on CPU one per CPU up to 4 "
          "(or CPUs / --inference_threads), on CUDA 1");
ABSL_FLAG(int, inference_threads, 0,
          "intra-op threads of each forward pass (torch and OpenBLAS); 0 = CPUs / batch threads, at "
          "least 1");
ABSL_FLAG(bool, release_batch_when_idle, true,
          "send a batch at once when no forward pass is running (a lone request does not wait "
          "--max_queue_delay_micros); false = TF Serving's policy, wait for the delay or a full "
          "batch (with --fair_share_batching and several batch threads, full is the thread's "
          "share: one input at low load)");
ABSL_FLAG(int, max_batch_size, 32, "most inputs in one forward pass (1 = no batching)");
ABSL_FLAG(int64_t, max_batch_tokens, 16384,
          "most padded tokens in one forward pass (raised to the model's longest input, logged)");
ABSL_FLAG(int64_t, max_queue_delay_micros, 2000, "longest an input waits for its batch to fill");
ABSL_FLAG(int64_t, max_queue_size, 1024, "most queued inputs per model version (then RESOURCE_EXHAUSTED)");
ABSL_FLAG(bool, length_aware_batching, true, "group inputs of similar length");
ABSL_FLAG(bool, fair_share_batching, true,
          "with several batch threads, cap each batch at its thread's share of the inputs in flight "
          "(queued + being processed) and send it once it holds that share, so that the threads "
          "split the load evenly; false = each batch takes up to --max_batch_size");
ABSL_FLAG(int, max_inputs_per_request, 64, "most inputs in one request");
ABSL_FLAG(int64_t, max_text_bytes, 65536, "most bytes in one input text");
ABSL_FLAG(int, max_message_bytes, 16 << 20,
          "largest gRPC message either way; a bigger one is RESOURCE_EXHAUSTED");
ABSL_FLAG(double, max_connection_age_s, 0,
          "ask a client connection this old to go away (HTTP/2 GOAWAY; its calls and streams "
          "finish): the client reconnects, through a Kubernetes Service possibly to a pod the "
          "autoscaler added; 0 = never");
ABSL_FLAG(double, keepalive_time_s, 7200,
          "ping a connection quiet this long that has a call in flight (any connection with "
          "--keepalive_permit_without_calls), and close it when the ping is not answered within "
          "--keepalive_timeout_s; 0 = never");
ABSL_FLAG(double, keepalive_timeout_s, 20, "see --keepalive_time_s");
ABSL_FLAG(double, keepalive_min_client_ping_s, 300,
          "shortest interval between a client's keepalive pings the server accepts (0 = any); a "
          "client that pings more often gets GOAWAY too_many_pings and loses its connection: set "
          "it at or below the clients' keepalive time");
ABSL_FLAG(bool, keepalive_permit_without_calls, false,
          "accept client keepalive pings on connections with no call in flight, and ping those "
          "connections too; false = one such ping per 2 hours");
ABSL_FLAG(int, max_concurrent_streams, 256,
          "most ClassifyStream calls open at once; one more is RESOURCE_EXHAUSTED");
ABSL_FLAG(int, stream_max_pending_responses, 32,
          "per ClassifyStream: requests read but not yet answered and read by the client; at the "
          "limit the server stops reading the stream (flow control) until the client reads");
ABSL_FLAG(double, stream_idle_timeout_s, 300,
          "end a ClassifyStream (DEADLINE_EXCEEDED) after this long with no request sent and no "
          "response read (0 = never)");
ABSL_FLAG(double, upload_idle_timeout_s, 60,
          "end an Admin UploadModel stream that sends no data for this long; its staging is "
          "removed (0 = never)");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain (with --tls_key: serve TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of the certificate, unencrypted");
ABSL_FLAG(std::string, tls_client_ca, "",
          "mutual TLS: PEM certificates of the authorities whose client certificates are "
          "accepted; a client without one is refused (with --tls_cert; followed as they are)");
ABSL_FLAG(double, tls_reload_s, 60,
          "read --tls_cert/--tls_key/--tls_client_ca again this often: a renewed pair serves new "
          "connections without a restart (1-86400; rounded up to whole seconds)");
ABSL_FLAG(double, drain_timeout_s, 30,
          "on SIGTERM/SIGINT, how long in-flight calls may finish (a signal while the models load, "
          "or a second one, exits at once)");

namespace {

namespace batching = collabserve::batching;
namespace util = collabserve::util;
using collabserve::service::Server;
using collabserve::service::ServerOptions;

// SIGTERM and SIGINT. The main thread and every thread it starts block them; one thread of this
// watcher's own takes them, through a handler that writes the signal's number to a pipe. A handler,
// not only a mask: threads that libraries start before main (OpenBLAS's pool) do not block them,
// and a signal the kernel hands to one of those took its default action and ended the process on
// the spot, before anything was cleaned up (the demo's temporary repository stayed behind).
//   Before Serving(): a signal removes the startup directory (if any) and exits at once with
//     128 + the signal: nothing is served yet, and loading may take a minute.
//   After: Wait() returns the first signal (the caller drains); a second one exits at once.
class SignalWatcher {
 public:
  // Call once, before any other thread of this program starts.
  static SignalWatcher& Install() {
    static SignalWatcher* watcher = new SignalWatcher();  // never destroyed: its thread runs to exit
    return *watcher;
  }
  // Runs `make`, which creates a directory and returns its path, and has a signal before serving
  // remove that directory: a signal while it is being written waits for it, then removes it whole.
  absl::StatusOr<std::string> MakeStartupDirectory(
      const std::function<absl::StatusOr<std::string>()>& make) {
    absl::MutexLock l(&mu_);
    absl::StatusOr<std::string> dir = make();
    if (dir.ok()) cleanup_dir_ = *dir;
    return dir;
  }
  void Serving() {
    absl::MutexLock l(&mu_);
    serving_ = true;
  }
  int Wait() {
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(
        +[](int* sig) { return *sig != 0; }, &signal_));
    return signal_;
  }

 private:
  SignalWatcher() {
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGTERM);
    sigaddset(&signals, SIGINT);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // inherited by every thread started after
    int fds[2];
    PCHECK(pipe2(fds, O_CLOEXEC) == 0) << "pipe2";
    // A handler must never block, even with the reader stuck.
    PCHECK(fcntl(fds[1], F_SETFL, O_NONBLOCK) == 0) << "fcntl";
    write_fd_.store(fds[1]);
    struct sigaction action {};
    action.sa_handler = &SignalWatcher::OnSignal;
    action.sa_flags = SA_RESTART;
    sigemptyset(&action.sa_mask);
    PCHECK(sigaction(SIGTERM, &action, nullptr) == 0 && sigaction(SIGINT, &action, nullptr) == 0)
        << "sigaction";
    std::thread([this, fd = fds[0], signals] {
      pthread_sigmask(SIG_UNBLOCK, &signals, nullptr);
      for (;;) {
        unsigned char sig = 0;
        const ssize_t n = read(fd, &sig, 1);
        if (n == 1) Take(sig);
        if (n == 0 || (n < 0 && errno != EINTR)) return;
      }
    }).detach();
  }

  // Async-signal-safe: one write.
  static void OnSignal(int sig) {
    const int saved = errno;
    const unsigned char c = static_cast<unsigned char>(sig);
    if (write(write_fd_.load(std::memory_order_relaxed), &c, 1) < 0) {
      // Nothing to do in a handler; the pipe only fills after 64 Ki signals.
    }
    errno = saved;
  }

  void Take(int sig) {
    absl::MutexLock l(&mu_);
    if (serving_ && signal_ == 0) {
      signal_ = sig;
      return;
    }
    LOG(WARNING) << "signal " << sig << (serving_ ? " again: exiting now" : " while starting: exiting");
    if (!cleanup_dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(cleanup_dir_, ec);
    }
    std::fflush(nullptr);
    _exit(128 + sig);
  }

  static inline std::atomic<int> write_fd_{-1};  // lock-free: safe to read in a handler
  absl::Mutex mu_;
  std::string cleanup_dir_ ABSL_GUARDED_BY(mu_);
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  int signal_ ABSL_GUARDED_BY(mu_) = 0;
};

// Removes a directory and everything in it when it goes out of scope.
class RemovedAtExit {
 public:
  explicit RemovedAtExit(std::string dir) : dir_(std::move(dir)) {}
  ~RemovedAtExit() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    if (ec) LOG(WARNING) << "could not remove " << dir_ << ": " << ec.message();
  }
  RemovedAtExit(const RemovedAtExit&) = delete;
  RemovedAtExit& operator=(const RemovedAtExit&) = delete;

 private:
  std::string dir_;
};

// A repository holding only demo/1, in a fresh temporary directory.
absl::StatusOr<std::string> MakeDemoRepository() {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = absl::StrCat(tmp != nullptr && *tmp ? tmp : "/tmp", "/collabserve-demo-XXXXXX");
  if (mkdtemp(templ.data()) == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot create a temporary directory from ", templ));
  }
  const std::string version_dir = absl::StrCat(templ, "/demo/1");
  absl::Status s = collabserve::model::WriteDemoCheckpoint(version_dir);
  if (!s.ok()) {
    RemovedAtExit half_written(templ);
    return s;
  }
  return templ;
}

int Run(int argc, char** argv, int cpus) {
  absl::SetProgramUsageMessage("collabserve [--port=8500] [--model_repository=DIR] ...");
  absl::ParseCommandLine(argc, argv);
  // Debian's abseil is built with mutex deadlock detection on: a global lock on every mutex
  // creation and destruction (several per request). The server's lock order is fixed by design.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  const auto verbose = collabserve::tools::GetVerboseLogFlags();
  if (!verbose.ok()) {
    std::cerr << "collabserve: " << verbose.status() << "\n";
    return 1;
  }
  if (verbose->v) FLAGS_v = *verbose->v;
  if (verbose->vmodule) FLAGS_vmodule = *verbose->vmodule;

  SignalWatcher& signals = SignalWatcher::Install();

  // Batch threads x intra-op threads (batching::PlanInferenceThreads says why): on CPU, by default,
  // one single-threaded forward pass per CPU (up to 4) rather than one pass over all of them.
  // OpenBLAS's pool is process-wide and serialises concurrent multi-threaded calls, so it gets the
  // per-pass count too.
  const std::string device_flag = absl::GetFlag(FLAGS_device);
  if (const int budget = absl::GetFlag(FLAGS_cpus); budget != 0) {
    if (budget < 0 || budget > 4096) {
      std::cerr << "collabserve: --cpus=" << budget << " must be 0 (detected) or 1 to 4096\n";
      return 1;
    }
    util::SetCpuBudget(budget);
    LOG(INFO) << "--cpus=" << budget << ": threads sized for " << util::UsableCpus()
              << " CPU(s) (detected: " << cpus << ")";
    cpus = util::UsableCpus();
    util::LimitMallocArenas(cpus);  // main() set it for the detected count
  }
  if (absl::Status s = batching::ValidateThreadFlags(absl::GetFlag(FLAGS_num_batch_threads),
                                                     absl::GetFlag(FLAGS_inference_threads));
      !s.ok()) {
    std::cerr << "collabserve: " << s << "\n";
    return 1;
  }
  const batching::ThreadPlan threads = batching::PlanInferenceThreads(
      /*accelerator=*/!absl::StartsWith(device_flag, "cpu"), cpus,
      absl::GetFlag(FLAGS_num_batch_threads), absl::GetFlag(FLAGS_inference_threads));
  at::set_num_threads(threads.intra_op_threads);
  const bool blas_pinned = util::SetBlasThreads(threads.intra_op_threads);
  LOG(INFO) << "allocator: " << util::AllocatorName();
  LOG(INFO) << "inference threads: " << threads.batch_threads << " batch thread(s) per model version x "
            << threads.intra_op_threads << " intra-op thread(s) (" << threads.reason << ")"
            << (blas_pinned ? "; OpenBLAS pinned to the same" : "");

  // The flags of seconds as durations; a value that is not a finite number is refused here, a
  // negative one by the server's options (ValidateServerOptions).
  std::string bad_seconds;
  auto seconds = [&bad_seconds](const char* flag, double value) {
    if (std::isfinite(value)) return absl::Seconds(value);
    if (bad_seconds.empty()) bad_seconds = absl::StrCat("--", flag, "=", value, " is not a number of seconds");
    return absl::ZeroDuration();
  };
  ServerOptions o;
  o.host = absl::GetFlag(FLAGS_host);
  o.port = absl::GetFlag(FLAGS_port);
  o.metrics_host = o.host;
  o.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  o.model_repository = absl::GetFlag(FLAGS_model_repository);
  // The demo's temporary repository goes when the server does (on every return below; after the
  // server, which is declared later), uploads to it included.
  std::optional<RemovedAtExit> demo_repository;
  if (o.model_repository.empty()) {
    auto demo = signals.MakeStartupDirectory(MakeDemoRepository);
    if (!demo.ok()) {
      std::cerr << "collabserve: cannot build the demo model: " << demo.status() << "\n";
      return 1;
    }
    demo_repository.emplace(*demo);
    o.model_repository = *demo;
    LOG(INFO) << "no --model_repository: serving the built-in demo model from " << *demo
              << " (removed at exit, with any version uploaded to it)";
  }
  o.poll_interval = seconds("poll_interval_s", absl::GetFlag(FLAGS_poll_interval_s));
  // The demo's repository is written whole before the server starts: nothing to wait for.
  o.version_settle =
      demo_repository ? absl::ZeroDuration() : seconds("version_settle_s", absl::GetFlag(FLAGS_version_settle_s));
  o.versions_to_keep = absl::GetFlag(FLAGS_versions_to_keep);
  o.num_load_threads = absl::GetFlag(FLAGS_num_load_threads);
  o.servable.engine.device = absl::GetFlag(FLAGS_device);
  o.servable.engine.dtype = absl::GetFlag(FLAGS_dtype);
  o.servable.engine.cuda_graph_max_tokens = absl::GetFlag(FLAGS_cuda_graph_max_tokens);
  auto& b = o.servable.batching;
  b.max_batch_size = absl::GetFlag(FLAGS_max_batch_size);
  b.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  b.max_queue_delay_micros = absl::GetFlag(FLAGS_max_queue_delay_micros);
  b.max_queue_size = absl::GetFlag(FLAGS_max_queue_size);
  b.num_batch_threads = threads.batch_threads;
  b.length_aware = absl::GetFlag(FLAGS_length_aware_batching);
  b.fair_share = absl::GetFlag(FLAGS_fair_share_batching);
  o.servable.release_batch_when_idle = absl::GetFlag(FLAGS_release_batch_when_idle);
  o.inference.max_inputs_per_request = absl::GetFlag(FLAGS_max_inputs_per_request);
  o.inference.max_text_bytes = absl::GetFlag(FLAGS_max_text_bytes);
  o.inference.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  o.inference.stream_max_pending_responses = absl::GetFlag(FLAGS_stream_max_pending_responses);
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  o.stream_idle_timeout = seconds("stream_idle_timeout_s", absl::GetFlag(FLAGS_stream_idle_timeout_s));
  o.upload_idle_timeout = seconds("upload_idle_timeout_s", absl::GetFlag(FLAGS_upload_idle_timeout_s));
  o.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  o.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  o.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  o.tls.reload_interval = seconds("tls_reload_s", absl::GetFlag(FLAGS_tls_reload_s));
  o.drain_timeout = seconds("drain_timeout_s", absl::GetFlag(FLAGS_drain_timeout_s));
  o.max_connection_age = seconds("max_connection_age_s", absl::GetFlag(FLAGS_max_connection_age_s));
  o.keepalive.time = seconds("keepalive_time_s", absl::GetFlag(FLAGS_keepalive_time_s));
  o.keepalive.timeout = seconds("keepalive_timeout_s", absl::GetFlag(FLAGS_keepalive_timeout_s));
  o.keepalive.min_client_ping_interval =
      seconds("keepalive_min_client_ping_s", absl::GetFlag(FLAGS_keepalive_min_client_ping_s));
  o.keepalive.permit_without_calls = absl::GetFlag(FLAGS_keepalive_permit_without_calls);
  if (!bad_seconds.empty()) {
    std::cerr << "collabserve: INVALID_ARGUMENT: " << bad_seconds << "\n";
    return 1;
  }
  o.build_version = "0.1.0";
  o.torch_version = TORCH_VERSION;

  // The Admin service (--admin_token_file): registered on this port or bound to --admin_port.
  auto admin = collabserve::service::CreateAdminFromFlags(&o);
  if (!admin.ok()) {
    std::cerr << "collabserve: " << admin.status() << "\n";
    return 1;
  }
  // The Open Inference Protocol (KServe v2) on this port; declared before the Server so that it
  // outlives it, attached once the models are loaded (until then it answers not ready).
  collabserve::service::KServeServiceOptions kserve_options;
  kserve_options.server_version = o.build_version;
  collabserve::service::KServeService kserve(kserve_options);
  o.extra_services.push_back(&kserve);
  // The REST form of the same protocol and text-embeddings-inference's API (--http_port), over
  // the server's in-process channel.
  collabserve::service::HttpServerOptions http_options;
  http_options.host = o.host;
  http_options.port = absl::GetFlag(FLAGS_http_port);
  http_options.max_connections = absl::GetFlag(FLAGS_http_max_connections);
  http_options.idle_timeout = seconds("http_idle_timeout_s", absl::GetFlag(FLAGS_http_idle_timeout_s));
  http_options.max_body_bytes = o.max_message_bytes;
  http_options.tls = o.tls;
  if (!bad_seconds.empty()) {
    std::cerr << "collabserve: INVALID_ARGUMENT: " << bad_seconds << "\n";
    return 1;
  }
  {
    // Every flag is checked, whether it is used or not (--http_port=-1 turns the endpoint off).
    collabserve::service::HttpServerOptions check = http_options;
    if (check.port == -1) check.port = 0;
    if (absl::Status s = collabserve::service::CheckHttpServerOptions(check); !s.ok()) {
      std::cerr << "collabserve: " << s << "\n";
      return 1;
    }
  }
  Server server(o);
  absl::Status s = server.StartServing();
  if (s.ok() && *admin != nullptr) s = (*admin)->Start(&server);
  // Declared after the Server: destroyed first, once the Server has shut down (its calls in
  // flight then fail UNAVAILABLE, 503).
  std::unique_ptr<collabserve::service::HttpServer> http;
  if (s.ok() && http_options.port >= 0) {
    collabserve::service::TeiHttpOptions tei;
    tei.default_model = absl::GetFlag(FLAGS_http_default_model);
    tei.version = o.build_version;
    tei.max_concurrent_requests = http_options.max_connections;
    tei.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
    tei.max_batch_requests = absl::GetFlag(FLAGS_max_batch_size);
    tei.max_client_batch_size = o.inference.max_inputs_per_request;
    tei.tokenization_workers = util::UsableCpus();
    auto started = collabserve::service::HttpServer::Start(
        http_options, collabserve::service::NewHttpApiHandler(server.InProcessChannel(), tei));
    if (started.ok()) {
      http = *std::move(started);
      server.metrics().AddCollectable(http->NewCollectable());
    } else {
      s = started.status();
    }
  }
  if (!s.ok()) {
    std::cerr << "collabserve: " << s << "\n";
    return 1;
  }
  if (*admin != nullptr) {
    std::printf("admin on 127.0.0.1:%d\n", (*admin)->port() >= 0 ? (*admin)->port() : server.port());
  }
  // Tests and scripts read these lines to find the ports.
  std::printf("listening on 127.0.0.1:%d\n", server.port());
  if (server.metrics_port() >= 0) std::printf("metrics on 127.0.0.1:%d\n", server.metrics_port());
  if (http != nullptr) std::printf("http on 127.0.0.1:%d\n", http->port());
  std::fflush(stdout);
  s = server.LoadModels();
  if (!s.ok()) {
    std::cerr << "collabserve: " << s << "\n";
    server.Shutdown();
    return 1;
  }
  kserve.Attach(&server.inference_service(), server.repository(), &server.metrics());
  signals.Serving();  // before the line that tells scripts and tests they may signal a drain
  std::printf("serving\n");
  std::fflush(stdout);

  const int sig = signals.Wait();
  LOG(INFO) << "signal " << sig << ": draining (up to " << absl::GetFlag(FLAGS_drain_timeout_s)
            << " s)";
  // The pod leaves its Service at once and the drain's clock starts; then the admin jobs stop
  // (before the repository they use), while the calls in flight finish.
  server.BeginDrain();
  if (http != nullptr) http->BeginDrain();  // keep-alive clients reconnect elsewhere
  if (*admin != nullptr) (*admin)->Shutdown();  // cancels jobs so the drain does not wait on them
  server.Shutdown();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  collabserve::util::EnsurePassiveOpenMpWaiting(argv);
  // One malloc arena per usable CPU instead of glibc's 8 per core: fewer arenas to fragment as
  // versions and jobs come and go (util::LimitMallocArenas says what the soak measured).
  const int cpus = collabserve::util::UsableCpus();
  collabserve::util::LimitMallocArenas(cpus);
  return Run(argc, argv, cpus);
}

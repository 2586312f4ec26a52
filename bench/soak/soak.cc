// collabserve-soak: a bounded soak of the real server (issue 7). Starts build/bin/collabserve on a
// fresh repository, measures saturation (closed loop), then runs --minutes at --load_fraction of it
// (open loop, several clients with deadlines) while a new version of the served model is dropped
// into the repository every --swap_interval_s and compression jobs run through the Admin API.
// Prints requests served, failures by code, p50/p99 per interval, and the server's resident memory,
// file descriptors and threads at start and end. Exit status 1 when the soak fails: any code other
// than OK and RESOURCE_EXHAUSTED (deliberate shedding), a failed compression job or swap, RSS growth
// above --max_rss_growth (the lowest RSS sampled in the last interval against the lowest in the
// second: see below), or more fds / threads at the end than at the start (+ --leak_slack).
//
//   collabserve-soak [--minutes=10] [--preset=mini] [--clients=8] [--deadline_ms=10000]
//                    [--swap_interval_s=60] [--report_interval_s=60] [--markdown=FILE]
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collabserve/v1/admin.grpc.pb.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "server/model/checkpoint_maker.h"
#include "server/util/files.h"
#include "server/util/process_memory.h"
#include "tests/testing/server_process.h"

ABSL_FLAG(double, minutes, 10, "length of the soak (after the saturation measurement)");
ABSL_FLAG(std::string, preset, "mini", "served model shape: tiny, mini or base (random weights)");
ABSL_FLAG(int, clients, 8, "client threads, each with its own channel (connection)");
ABSL_FLAG(double, saturation_s, 10, "seconds of closed-loop load to measure saturation");
ABSL_FLAG(int, saturation_concurrency, 16, "calls in flight while measuring saturation");
ABSL_FLAG(double, load_fraction, 0.8, "offered load as a fraction of the measured saturation");
ABSL_FLAG(int64_t, deadline_ms, 10000, "deadline of every Classify");
ABSL_FLAG(double, swap_interval_s, 60, "a new version is dropped into the repository this often");
ABSL_FLAG(double, report_interval_s, 60, "one table row per interval");
ABSL_FLAG(double, compress_every_s, 15, "a compression job starts this long after the last ended");
ABSL_FLAG(bool, compression_jobs, true, "run compression jobs during the soak (off: to isolate)");
ABSL_FLAG(double, max_rss_growth, 0.05,
          "fail when the lowest RSS sampled in the last interval exceeds the lowest in the second "
          "by this much (with fewer than 3 intervals: RSS at the end against the start)");
ABSL_FLAG(double, rss_sample_s, 0.25, "the server's RSS is sampled this often");
ABSL_FLAG(int, leak_slack, 2, "fds / threads the end may exceed the start by (gRPC's own pools)");
ABSL_FLAG(std::string, markdown, "", "also write the tables as Markdown to this file");
ABSL_FLAG(std::string, work_dir, "", "repository and logs here (default: a fresh /tmp dir)");

namespace collabserve::soak {
namespace {

namespace fs = std::filesystem;
constexpr char kToken[] = "soak-token";
constexpr char kServed[] = "soak";     // the model under load, swapped every interval
constexpr char kCompressed[] = "side";  // the model the compression jobs work on (tiny)

const char* const kTexts[] = {
    "what a wonderful surprise, the film was better than the book",
    "the worst service i have had in years; never again",
    "an ordinary afternoon with nothing much to report",
    "is it raining in paris?",
    "the quarterly figures beat every estimate by a wide margin and the shares rose sharply",
    "ok",
};

struct ProcStats {
  double rss_mib = -1;
  int threads = -1;
  int fds = -1;
};

// Entries of a /proc directory (a process's fds or threads); -1 if it cannot be read.
int CountEntries(const std::string& dir) {
  std::error_code ec;
  int n = 0;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) ++n;
  return ec ? -1 : n;
}

// The process's resident memory in MiB; -1 if it cannot be read.
double RssMiB(pid_t pid) {
  absl::StatusOr<util::ProcessMemory> m = util::ReadProcessMemory(pid);
  return m.ok() ? m->rss_bytes / (1024.0 * 1024.0) : -1;
}

ProcStats Sample(pid_t pid) {
  ProcStats s;
  s.rss_mib = RssMiB(pid);
  s.threads = CountEntries(absl::StrCat("/proc/", pid, "/task"));
  s.fds = CountEntries(absl::StrCat("/proc/", pid, "/fd"));
  return s;
}

// The lowest and highest of a series of RSS samples (MiB).
struct RssRange {
  double lowest = 0, highest = 0;
  int n = 0;
  void Add(double mib) {  // a failed read (< 0) is left out
    if (mib < 0) return;
    lowest = n == 0 ? mib : std::min(lowest, mib);
    highest = n == 0 ? mib : std::max(highest, mib);
    ++n;
  }
};

// Latencies and codes of one reporting interval.
struct Interval {
  std::vector<double> latencies_ms;  // OK calls
  std::map<std::string, int64_t> codes;
  std::vector<int64_t> versions_seen;
};

class Recorder {
 public:
  explicit Recorder(absl::Time start, absl::Duration interval) : start_(start), interval_(interval) {}
  void Record(absl::Time sent, absl::Duration latency, grpc::StatusCode code, int64_t version) {
    const int64_t i = std::max<int64_t>(0, (sent - start_) / interval_);
    std::lock_guard<std::mutex> l(mu_);
    if (static_cast<int64_t>(intervals_.size()) <= i) intervals_.resize(i + 1);
    Interval& in = intervals_[i];
    in.codes[CodeName(code)]++;
    if (code == grpc::StatusCode::OK) {
      in.latencies_ms.push_back(absl::ToDoubleMilliseconds(latency));
      if (std::find(in.versions_seen.begin(), in.versions_seen.end(), version) ==
          in.versions_seen.end()) {
        in.versions_seen.push_back(version);
      }
    }
  }
  std::vector<Interval> Take() {
    std::lock_guard<std::mutex> l(mu_);
    return std::move(intervals_);
  }
  static std::string CodeName(grpc::StatusCode code) {
    static const std::map<int, std::string> names = {
        {0, "OK"}, {1, "CANCELLED"}, {2, "UNKNOWN"}, {3, "INVALID_ARGUMENT"},
        {4, "DEADLINE_EXCEEDED"}, {5, "NOT_FOUND"}, {6, "ALREADY_EXISTS"},
        {7, "PERMISSION_DENIED"}, {8, "RESOURCE_EXHAUSTED"}, {9, "FAILED_PRECONDITION"},
        {10, "ABORTED"}, {11, "OUT_OF_RANGE"}, {12, "UNIMPLEMENTED"}, {13, "INTERNAL"},
        {14, "UNAVAILABLE"}, {15, "DATA_LOSS"}, {16, "UNAUTHENTICATED"}};
    auto it = names.find(static_cast<int>(code));
    return it == names.end() ? absl::StrCat("CODE_", static_cast<int>(code)) : it->second;
  }

 private:
  const absl::Time start_;
  const absl::Duration interval_;
  std::mutex mu_;
  std::vector<Interval> intervals_;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

// One Classify of one text with the configured deadline; its code and served version.
grpc::StatusCode Classify(v1::Inference::Stub* stub, int n, int64_t* version) {
  v1::ClassifyRequest req;
  req.set_model_name(kServed);
  req.add_inputs()->set_text(kTexts[n % (sizeof(kTexts) / sizeof(kTexts[0]))]);
  v1::ClassifyResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms))));
  const grpc::Status s = stub->Classify(&ctx, req, &resp);
  *version = resp.model_version();
  return s.error_code();
}

std::shared_ptr<grpc::Channel> NewChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt("grpc.use_local_subchannel_pool", 1);  // a connection per client
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

// Closed loop: every client sends back to back for `seconds`; completed OK calls per second.
double MeasureSaturation(const std::string& address, int clients, double seconds) {
  std::atomic<int64_t> ok{0};
  const absl::Time end = absl::Now() + absl::Seconds(seconds);
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      auto stub = v1::Inference::NewStub(NewChannel(address));
      int64_t version;
      for (int n = c; absl::Now() < end; n += clients) {
        if (Classify(stub.get(), n, &version) == grpc::StatusCode::OK) ++ok;
      }
    });
  }
  for (auto& t : threads) t.join();
  return ok.load() / seconds;
}

std::unique_ptr<grpc::ClientContext> AdminContext() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(10)));
  return ctx;
}

int Run() {
  const double minutes = absl::GetFlag(FLAGS_minutes);
  const int clients = std::max(1, absl::GetFlag(FLAGS_clients));
  const std::string preset = absl::GetFlag(FLAGS_preset);
  std::string work = absl::GetFlag(FLAGS_work_dir);
  if (work.empty()) {
    std::string tmpl = "/tmp/collabserve-soak-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) {
      std::perror("mkdtemp");
      return 2;
    }
    work = tmpl;
  }
  const std::string root = work + "/repo";
  fs::create_directories(root);
  // The driver sits next to collabserve in build/bin; ServerProcess finds it through this.
  if (std::getenv("COLLABSERVE_BINARY_DIR") == nullptr) {
    const std::string self = fs::read_symlink("/proc/self/exe").string();
    ::setenv("COLLABSERVE_BINARY_DIR", fs::path(self).parent_path().parent_path().c_str(), 1);
  }
  std::printf("soak: %g min, preset %s, %d clients, work dir %s\n", minutes, preset.c_str(), clients,
              work.c_str());
  model::MakeOptions mo;
  mo.preset = preset;
  mo.seed = 1;
  const std::string source = work + "/source";
  if (absl::Status s = model::MakeCheckpoint(source, mo); !s.ok()) {
    std::fprintf(stderr, "cannot make the %s checkpoint: %s\n", preset.c_str(), s.ToString().c_str());
    return 2;
  }
  model::MakeOptions tiny;
  tiny.preset = "tiny";
  tiny.seed = 2;
  if (absl::Status s = model::MakeCheckpoint(root + "/" + kCompressed + "/1", tiny); !s.ok()) {
    std::fprintf(stderr, "cannot make the tiny checkpoint: %s\n", s.ToString().c_str());
    return 2;
  }
  // Versions are dropped by hand the way an operator would: copy, then one rename.
  auto drop = [&](int64_t version) {
    const std::string scratch = absl::StrCat(work, "/drop-", version);
    fs::create_directories(scratch);
    for (const auto& e : fs::directory_iterator(source)) {
      fs::copy_file(e.path(), fs::path(scratch) / e.path().filename());
    }
    fs::create_directories(absl::StrCat(root, "/", kServed));
    fs::rename(scratch, absl::StrCat(root, "/", kServed, "/", version));
  };
  drop(1);
  if (!util::WriteFileAtomic(work + "/token", std::string(kToken) + "\n").ok()) return 2;

  testing::ServerProcess server(
      {"--host=127.0.0.1", "--port=0", "--metrics_port=-1", "--poll_interval_s=1",
       "--versions_to_keep=1", "--model_repository=" + root, "--admin_token_file=" + work + "/token"},
      work + "/server.log", [] { ::prctl(PR_SET_PDEATHSIG, SIGKILL); });  // dies with the driver
  if (!server.serving()) {
    std::fprintf(stderr, "collabserve did not start; see %s/server.log\n", work.c_str());
    return 2;
  }
  const std::string address = server.address();

  // 1. Saturation, then the offered rate.
  const int saturation_concurrency = absl::GetFlag(FLAGS_saturation_concurrency);
  MeasureSaturation(address, saturation_concurrency, 1.0);  // warm-up
  const double saturation = MeasureSaturation(address, saturation_concurrency,
                                              absl::GetFlag(FLAGS_saturation_s));
  const double rate = saturation * absl::GetFlag(FLAGS_load_fraction);
  std::printf("saturation %.1f req/s (closed loop, %d in flight); offering %.1f req/s\n",
              saturation, saturation_concurrency, rate);
  if (saturation <= 0) {
    std::fprintf(stderr, "no call succeeded while measuring saturation; see %s/server.log\n",
                 work.c_str());
    return 1;
  }
  // Drops the next version of the served model, waits until it answers (the poller runs every
  // second), then removes the previous one from disk. False if it is not served within 60 s.
  int64_t version = 1;
  std::mutex admin_mu;  // swap() and compress() each run on one thread at a time
  auto swap = [&] {
    auto stub = v1::Inference::NewStub(NewChannel(address));
    drop(++version);
    bool served = false;
    for (absl::Time give_up = absl::Now() + absl::Seconds(60); !served && absl::Now() < give_up;) {
      int64_t v = 0;
      served = Classify(stub.get(), 0, &v) == grpc::StatusCode::OK && v == version;
      if (!served) absl::SleepFor(absl::Milliseconds(100));
    }
    if (!served) {
      std::fprintf(stderr, "version %lld was not served within 60 s\n",
                   static_cast<long long>(version));
      return false;
    }
    std::error_code ec;
    fs::remove_all(absl::StrCat(root, "/", kServed, "/", version - 1), ec);
    return true;
  };
  // One compression job of the side model through the Admin API, watched to its end; on success
  // the previous compressed version is deleted (through the API too) to keep the disk bounded.
  int64_t previous_compressed = 0;
  auto compress = [&] {
    std::lock_guard<std::mutex> l(admin_mu);
    auto admin = v1::Admin::NewStub(NewChannel(address));
    v1::CompressModelRequest req;
    req.set_model_name(kCompressed);
    req.set_source_version(1);
    req.mutable_compression()->set_rank(16);
    req.set_activate(true);
    v1::CompressModelResponse resp;
    grpc::Status s = admin->CompressModel(AdminContext().get(), req, &resp);
    if (!s.ok()) {
      std::fprintf(stderr, "CompressModel: %s\n", s.error_message().c_str());
      return false;
    }
    v1::WatchJobRequest wreq;
    wreq.set_job_id(resp.job_id());
    auto wctx = AdminContext();
    auto reader = admin->WatchJob(wctx.get(), wreq);
    v1::WatchJobResponse r;
    while (reader->Read(&r)) {
    }
    reader->Finish();
    v1::GetJobRequest greq;
    greq.set_job_id(resp.job_id());
    v1::GetJobResponse job;
    s = admin->GetJob(AdminContext().get(), greq, &job);
    if (!s.ok() || job.job().state() != v1::Job::SUCCEEDED) {
      std::fprintf(stderr, "compression job %s: %s\n", resp.job_id().c_str(),
                   s.ok() ? job.job().error().c_str() : s.error_message().c_str());
      return false;
    }
    if (previous_compressed > 0) {
      v1::DeleteVersionRequest dreq;
      dreq.set_model_name(kCompressed);
      dreq.set_version(previous_compressed);
      v1::DeleteVersionResponse dresp;
      s = admin->DeleteVersion(AdminContext().get(), dreq, &dresp);
      if (!s.ok()) {
        std::fprintf(stderr, "DeleteVersion: %s\n", s.error_message().c_str());
        return false;
      }
    }
    previous_compressed = job.job().version();
    return true;
  };

  // The baseline is taken in steady state: after one swap and one compression job, so that what
  // the first of each allocates for good (allocator arenas, gRPC and torch pools) is not counted
  // as growth.
  const ProcStats before_warmup = Sample(server.pid());
  if (!swap() || !compress()) {
    std::fprintf(stderr, "the warm-up swap or compression job failed; see %s/server.log\n",
                 work.c_str());
    return 1;
  }
  absl::SleepFor(absl::Seconds(1));
  const ProcStats at_start = Sample(server.pid());

  // 2. The soak: open-loop clients, the swapper, the compression jobs.
  const absl::Time start = absl::Now();
  const absl::Duration length = absl::Seconds(minutes * 60);
  const absl::Time end = start + length;
  const absl::Duration interval = absl::Seconds(absl::GetFlag(FLAGS_report_interval_s));
  Recorder recorder(start, interval);  // the table's rows and the RSS samples share its intervals
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  // Open loop: each client sends its calls at fixed times without waiting for earlier ones
  // (gRPC's callback API), so a slow server shows as latency and shedding, never as a lower
  // offered rate. Latency counts from when a call was due.
  std::atomic<int64_t> in_flight{0};
  // The stubs (and their channels) outlive every call: they are dropped after in_flight is 0.
  std::vector<std::unique_ptr<v1::Inference::Stub>> stubs;
  for (int c = 0; c < clients; ++c) stubs.push_back(v1::Inference::NewStub(NewChannel(address)));
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      v1::Inference::Stub* stub = stubs[c].get();
      const absl::Duration gap = absl::Seconds(clients / rate);
      absl::Time due = start + gap * c / clients;
      for (int n = c; due < end; n += clients, due += gap) {
        const absl::Time now = absl::Now();
        if (due > now) absl::SleepFor(due - now);
        struct Call {
          grpc::ClientContext ctx;
          v1::ClassifyRequest req;
          v1::ClassifyResponse resp;
          absl::Time due;
        };
        auto* call = new Call;
        call->due = due;
        call->req.set_model_name(kServed);
        call->req.add_inputs()->set_text(kTexts[n % (sizeof(kTexts) / sizeof(kTexts[0]))]);
        call->ctx.set_deadline(absl::ToChronoTime(
            absl::Now() + absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms))));
        ++in_flight;
        stub->async()->Classify(&call->ctx, &call->req, &call->resp,
                                [&recorder, &in_flight, call](grpc::Status s) {
                                  recorder.Record(call->due, absl::Now() - call->due,
                                                  s.error_code(), call->resp.model_version());
                                  delete call;
                                  --in_flight;
                                });
      }
    });
  }
  // The server's resident memory, sampled every --rss_sample_s: its lowest and highest in each
  // interval. Between its lowest and highest lie whole model copies (a compression job holds its
  // source and its result, a swap two served versions while the old one drains), so a single sample
  // moves by several percent with the moment it lands on; the lowest is the memory held for good,
  // and a leak raises it from interval to interval.
  const absl::Duration sample_every = absl::Seconds(absl::GetFlag(FLAGS_rss_sample_s));
  std::vector<RssRange> rss;  // one per interval
  std::thread sampler([&] {
    for (absl::Time now = absl::Now(); !stop && now < end; now = absl::Now()) {
      const size_t i = static_cast<size_t>((now - start) / interval);
      if (rss.size() <= i) rss.resize(i + 1);
      rss[i].Add(RssMiB(server.pid()));
      absl::SleepFor(sample_every);
    }
  });
  std::atomic<int> swaps{0}, swap_failures{0};
  std::thread swapper([&] {
    for (absl::Time next = start + absl::Seconds(absl::GetFlag(FLAGS_swap_interval_s));
         next < end - absl::Seconds(5); next += absl::Seconds(absl::GetFlag(FLAGS_swap_interval_s))) {
      while (!stop && absl::Now() < next) absl::SleepFor(absl::Milliseconds(50));
      if (stop) break;
      ++(swap() ? swaps : swap_failures);
    }
  });
  std::atomic<int> jobs_ok{0}, jobs_failed{0};
  std::thread compressor([&] {
    while (absl::GetFlag(FLAGS_compression_jobs) && !stop && absl::Now() < end - absl::Seconds(10)) {
      if (compress()) {
        ++jobs_ok;
      } else {
        ++jobs_failed;
        break;
      }
      for (absl::Time next = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_compress_every_s));
           !stop && absl::Now() < next;) {
        absl::SleepFor(absl::Milliseconds(50));
      }
    }
  });
  for (auto& t : threads) t.join();
  while (in_flight > 0) absl::SleepFor(absl::Milliseconds(10));  // bounded by the deadline
  stubs.clear();  // their connections close before the end is sampled
  stop = true;
  sampler.join();
  swapper.join();
  compressor.join();
  absl::SleepFor(absl::Seconds(3));  // unloaded versions drain; gRPC threads settle
  const ProcStats at_end = Sample(server.pid());
  const int exit_code = server.Terminate();

  // 3. Report.
  std::vector<Interval> intervals = recorder.Take();
  std::map<std::string, int64_t> codes;
  int64_t served = 0;
  std::string table =
      "| interval | requests | OK | shed (RESOURCE_EXHAUSTED) | other failures | p50 ms | p99 ms | versions served | server RSS MiB (lowest-highest) |\n"
      "|---|---|---|---|---|---|---|---|---|\n";
  const double iv = absl::ToDoubleSeconds(interval);
  for (size_t i = 0; i < intervals.size(); ++i) {
    const Interval& in = intervals[i];
    int64_t total = 0, shed = 0, other = 0;
    for (const auto& [code, n] : in.codes) {
      codes[code] += n;
      total += n;
      if (code == "RESOURCE_EXHAUSTED") shed += n;
      else if (code != "OK") other += n;
    }
    served += static_cast<int64_t>(in.latencies_ms.size());
    absl::StrAppendFormat(&table, "| %g-%g s | %d | %d | %d | %d | %.1f | %.1f | %s | %s |\n",
                          i * iv, std::min((i + 1) * iv, minutes * 60), total,
                          in.latencies_ms.size(), shed, other, Percentile(in.latencies_ms, 0.5),
                          Percentile(in.latencies_ms, 0.99), absl::StrJoin(in.versions_seen, ","),
                          i < rss.size() && rss[i].n > 0
                              ? absl::StrFormat("%.1f-%.1f", rss[i].lowest, rss[i].highest)
                              : "-");
  }
  // Growth is measured after the first interval: the warm-up swap and job ran without client
  // load, and the first interval under load still grows what load grows for good (gRPC's per-thread
  // caches, allocator arenas of the threads that first serve concurrent calls). Lowest against
  // lowest: the last interval's against the second's. A leak raises every sample, the lowest
  // included; a job or swap in flight raises only some, which a comparison of single samples read
  // as growth (+7.8% in a 1-minute run whose lowest samples did not rise). An interval must be
  // long enough to hold a moment with no job and no swap in flight (and the allocator's 10 s of
  // decay after them).
  const bool floors = rss.size() >= 3 && rss[1].n > 0 && rss.back().n > 0;
  const double baseline_mib = floors ? rss[1].lowest : at_start.rss_mib;
  const double end_mib = floors ? rss.back().lowest : at_end.rss_mib;
  const double rss_growth = baseline_mib > 0 ? (end_mib - baseline_mib) / baseline_mib : 1;
  double highest_mib = 0;
  for (const RssRange& r : rss) highest_mib = std::max(highest_mib, r.highest);
  const int slack = absl::GetFlag(FLAGS_leak_slack);
  std::vector<std::string> failures;
  for (const auto& [code, n] : codes) {
    if (code != "OK" && code != "RESOURCE_EXHAUSTED") failures.push_back(absl::StrCat(n, " x ", code));
  }
  if (rss_growth > absl::GetFlag(FLAGS_max_rss_growth)) {
    failures.push_back(absl::StrFormat("RSS grew %.1f%%", 100 * rss_growth));
  }
  if (at_end.fds > at_start.fds + slack) {
    failures.push_back(absl::StrCat("fds ", at_start.fds, " -> ", at_end.fds));
  }
  if (at_end.threads > at_start.threads + slack) {
    failures.push_back(absl::StrCat("threads ", at_start.threads, " -> ", at_end.threads));
  }
  if (swap_failures > 0) failures.push_back(absl::StrCat(swap_failures.load(), " swaps not served"));
  if (jobs_failed > 0) failures.push_back(absl::StrCat(jobs_failed.load(), " compression jobs failed"));
  if (exit_code != 0) failures.push_back(absl::StrCat("collabserve exited with ", exit_code, " on SIGTERM"));

  std::string summary = absl::StrFormat(
      "| figure | value |\n|---|---|\n"
      "| model | %s (random weights), versions_to_keep 1, poll 1 s |\n"
      "| saturation (closed loop, %d calls in flight) | %.1f req/s |\n"
      "| offered load | %.1f req/s (%.0f%%), %d clients, deadline %d ms |\n"
      "| length | %g min |\n"
      "| requests served (OK) | %d |\n"
      "| failures by code | %s |\n"
      "| version swaps during the soak (dropped, then served) | %d (%d failed) |\n"
      "| compression jobs during the soak (tiny, rank 16) | %d succeeded, %d failed |\n"
      "| resident memory before warm-up | %.1f MiB |\n"
      "| resident memory after warm-up, before load | %.1f MiB |\n"
      "| resident memory, lowest in the second interval under load -> in the last | "
      "%.1f -> %.1f MiB (%+.2f%%; limit %+.0f%%) |\n"
      "| resident memory, highest under load; at the end | %.1f MiB; %.1f MiB |\n"
      "| file descriptors start -> end | %d -> %d |\n"
      "| threads start -> end | %d -> %d |\n"
      "| verdict | %s |\n",
      preset, saturation_concurrency, saturation, rate, 100 * absl::GetFlag(FLAGS_load_fraction), clients,
      absl::GetFlag(FLAGS_deadline_ms), minutes, served,
      codes.size() <= 1 && codes.count("OK") ? "none"
                                             : absl::StrJoin(codes, ", ", absl::PairFormatter(": ")),
      swaps.load(), swap_failures.load(), jobs_ok.load(), jobs_failed.load(),
      before_warmup.rss_mib, at_start.rss_mib, baseline_mib, end_mib,
      100 * rss_growth, 100 * absl::GetFlag(FLAGS_max_rss_growth), highest_mib,
      at_end.rss_mib, at_start.fds,
      at_end.fds, at_start.threads, at_end.threads,
      failures.empty() ? "PASS" : absl::StrCat("FAIL: ", absl::StrJoin(failures, "; ")));
  std::printf("\n%s\n%s", summary.c_str(), table.c_str());
  if (!absl::GetFlag(FLAGS_markdown).empty()) {
    absl::Status s = util::WriteFileAtomic(absl::GetFlag(FLAGS_markdown), summary + "\n" + table);
    if (!s.ok()) std::fprintf(stderr, "%s\n", s.ToString().c_str());
  }
  if (absl::GetFlag(FLAGS_work_dir).empty() && failures.empty()) {
    std::error_code ec;
    fs::remove_all(work, ec);
  }
  return failures.empty() ? 0 : 1;
}

}  // namespace
}  // namespace collabserve::soak

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines appear as they happen under ctest
  return collabserve::soak::Run();
}

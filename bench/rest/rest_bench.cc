// rest_bench: what the REST endpoint (--http_port) costs next to the gRPC port, on the same server
// and model in the same run. Starts bin/collabserve on a fresh checkpoint and runs, for each way,
// closed loops of `--concurrency` clients (1 = one call at a time), each client on its own
// connection, every call one input:
//   grpc       inference.GRPCInferenceService/ModelInfer (typed contents), a stub per client
//   rest-json  POST /v2/models/bench/infer with a JSON body, keep-alive, the response parsed
//   rest-bin   the same with Triton's binary tensor extension both ways
// and prints one Markdown table: calls/s, p50 and p99 latency, the server's CPU per call (from
// /proc/<pid>/stat), and each way's ratio to grpc at the same concurrency. The ways take turns in
// short rounds, so that the shared machine's drift falls on all of them; the table gives medians
// of the rounds.
//
//   rest_bench [--collabserve=build/bin/collabserve] [--preset=tiny] [--input_tokens=16]
//              [--phase_s=5] [--rounds=5] [--concurrency=1,8]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "kserve/grpc_predict_v2.grpc.pb.h"
#include "server/model/checkpoint_maker.h"
#include "tests/testing/server_process.h"

ABSL_FLAG(std::string, collabserve, "", "the server binary (default: bin/collabserve next to this)");
ABSL_FLAG(std::string, preset, "tiny", "checkpoint preset: tiny, mini or base");
ABSL_FLAG(int, input_tokens, 16, "words per input text (about as many tokens)");
ABSL_FLAG(double, phase_s, 5, "seconds each way runs at each concurrency, split into --rounds");
ABSL_FLAG(int, rounds, 5, "rounds per concurrency; the ways take turns in each");
ABSL_FLAG(std::string, concurrency, "1,8", "closed-loop clients, comma-separated");

namespace {

using collabserve::testing::ServerProcess;

// utime + stime of a process, in seconds.
double CpuSeconds(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::vector<std::string> fields = absl::StrSplit(stat.substr(close + 2), ' ');
  // After the command: state is field 3, utime 14 and stime 15 (1-based in proc(5)).
  double utime = 0, stime = 0;
  if (fields.size() < 13 || !absl::SimpleAtod(fields[11], &utime) ||
      !absl::SimpleAtod(fields[12], &stime)) {
    return 0;
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// A keep-alive HTTP/1.1 client on one connection.
class HttpClient {
 public:
  explicit HttpClient(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ok_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~HttpClient() { ::close(fd_); }

  // POSTs `body` with `headers`; the response's status, headers block and body.
  bool Post(const std::string& path, const std::string& body, const std::string& headers,
            int* code, std::string* head, std::string* out) {
    const std::string req = absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: localhost\r\n", headers,
                                         "Content-Length: ", body.size(), "\r\n\r\n", body);
    if (!ok_ || ::send(fd_, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
      return false;
    }
    size_t end;
    while ((end = buf_.find("\r\n\r\n")) == std::string::npos) {
      if (!Fill()) return false;
    }
    *head = buf_.substr(0, end);
    buf_.erase(0, end + 4);
    *code = std::atoi(head->c_str() + 9);
    size_t length = 0;
    const size_t cl = head->find("\r\nContent-Length: ");  // not Inference-Header-Content-Length
    if (cl == std::string::npos) return false;
    length = std::strtoul(head->c_str() + cl + 18, nullptr, 10);
    while (buf_.size() < length) {
      if (!Fill()) return false;
    }
    out->assign(buf_, 0, length);
    buf_.erase(0, length);
    return true;
  }

 private:
  bool Fill() {
    char chunk[65536];
    const ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
    if (n <= 0) return false;
    buf_.append(chunk, static_cast<size_t>(n));
    return true;
  }
  int fd_ = -1;
  bool ok_ = false;
  std::string buf_;
};

std::string RawBytes(const std::string& s) {
  std::string raw;
  const uint32_t n = static_cast<uint32_t>(s.size());
  for (int k = 0; k < 4; ++k) raw.push_back(static_cast<char>((n >> (8 * k)) & 0xff));
  return raw + s;
}

struct Result {
  double calls_per_s = 0, p50_ms = 0, p99_ms = 0, cpu_ms_per_call = 0;
  int64_t failed = 0;
  std::vector<double> latencies_ms;
};

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

// Runs `clients` closed loops of `call` (which returns false on a failed call) for `phase`.
template <typename MakeCall>
Result RunLoops(pid_t server, int clients, absl::Duration phase, MakeCall make_call) {
  absl::Mutex mu;
  std::vector<double> latencies;
  std::atomic<int64_t> failed{0};
  std::vector<std::thread> threads;
  // Connections are made before the clock starts.
  std::vector<decltype(make_call())> calls;
  for (int c = 0; c < clients; ++c) calls.push_back(make_call());
  const double cpu0 = CpuSeconds(server);
  const absl::Time start = absl::Now(), stop = start + phase;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      auto& call = calls[c];
      std::vector<double> mine;
      while (absl::Now() < stop) {
        const absl::Time t = absl::Now();
        if (!call()) {
          failed.fetch_add(1);
          continue;
        }
        mine.push_back(absl::ToDoubleMilliseconds(absl::Now() - t));
      }
      absl::MutexLock lock(&mu);
      latencies.insert(latencies.end(), mine.begin(), mine.end());
    });
  }
  for (auto& t : threads) t.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const double cpu = CpuSeconds(server) - cpu0;
  Result r;
  r.calls_per_s = static_cast<double>(latencies.size()) / seconds;
  r.cpu_ms_per_call = latencies.empty() ? 0 : 1000 * cpu / static_cast<double>(latencies.size());
  r.failed = failed.load();
  r.latencies_ms = std::move(latencies);
  return r;
}

double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

int Run() {
  std::string binary = absl::GetFlag(FLAGS_collabserve);
  if (binary.empty()) binary = collabserve::testing::SiblingBinary("collabserve");
  char tmpl[] = "/tmp/collabserve-rest-bench-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    std::fprintf(stderr, "cannot create a temporary directory\n");
    return 1;
  }
  const std::string repo = tmpl;
  struct Cleanup {
    std::string dir;
    ~Cleanup() { std::filesystem::remove_all(dir); }
  } cleanup{repo};
  collabserve::model::MakeOptions mo;
  mo.preset = absl::GetFlag(FLAGS_preset);
  mo.label_names = {"negative", "positive"};
  if (absl::Status s = collabserve::model::MakeCheckpoint(repo + "/bench/1", mo); !s.ok()) {
    std::fprintf(stderr, "cannot make the checkpoint: %s\n", s.ToString().c_str());
    return 1;
  }
  ServerProcess server({"--port=0", "--metrics_port=-1", "--http_port=0", "--host=127.0.0.1",
                        absl::StrCat("--model_repository=", repo), "--poll_interval_s=0"},
                       /*stderr_log=*/"", /*in_child=*/nullptr, binary);
  if (!server.serving() || server.http_port() <= 0) {
    std::fprintf(stderr, "%s did not start with an HTTP port\n", binary.c_str());
    return 1;
  }

  std::string text;
  const char* words[] = {"the", "movie", "was", "good", "and", "long", "but", "fine"};
  for (int i = 0; i < absl::GetFlag(FLAGS_input_tokens) - 2; ++i) {
    absl::StrAppend(&text, i ? " " : "", words[i % 8]);
  }
  inference::ModelInferRequest grpc_req;
  grpc_req.set_model_name("bench");
  auto* in = grpc_req.add_inputs();
  in->set_name("text");
  in->set_datatype("BYTES");
  in->add_shape(1);
  in->mutable_contents()->add_bytes_contents(text);
  const std::string json_body = nlohmann::json{
      {"inputs", {{{"name", "text"}, {"shape", {1}}, {"datatype", "BYTES"}, {"data", {text}}}}}}.dump();
  const std::string raw = RawBytes(text);
  const std::string bin_header =
      nlohmann::json{{"inputs",
                      {{{"name", "text"}, {"shape", {1}}, {"datatype", "BYTES"},
                        {"parameters", {{"binary_data_size", raw.size()}}}}}},
                     {"parameters", {{"binary_data_output", true}}}}
          .dump();
  const std::string bin_body = bin_header + raw;
  const std::string grpc_address = absl::StrCat("127.0.0.1:", server.port());
  const int http_port = server.http_port();

  auto grpc_way = [&] {
    grpc::ChannelArguments args;
    args.SetInt("grpc.use_local_subchannel_pool", 1);  // a connection per client
    auto stub = inference::GRPCInferenceService::NewStub(
        grpc::CreateCustomChannel(grpc_address, grpc::InsecureChannelCredentials(), args));
    return [stub = std::shared_ptr<inference::GRPCInferenceService::Stub>(std::move(stub)), &grpc_req] {
      grpc::ClientContext ctx;
      inference::ModelInferResponse resp;
      return stub->ModelInfer(&ctx, grpc_req, &resp).ok() && resp.outputs_size() == 3;
    };
  };
  auto json_way = [&] {
    auto client = std::make_shared<HttpClient>(http_port);
    return [client, &json_body] {
      int code = 0;
      std::string head, body;
      if (!client->Post("/v2/models/bench/infer", json_body, "", &code, &head, &body) || code != 200) {
        return false;
      }
      const nlohmann::json answer = nlohmann::json::parse(body, nullptr, false);
      return answer.contains("outputs") && answer["outputs"].size() == 3;
    };
  };
  auto bin_way = [&] {
    auto client = std::make_shared<HttpClient>(http_port);
    const std::string headers =
        absl::StrCat("Inference-Header-Content-Length: ", bin_header.size(), "\r\n");
    return [client, headers, &bin_body] {
      int code = 0;
      std::string head, body;
      if (!client->Post("/v2/models/bench/infer", bin_body, headers, &code, &head, &body) ||
          code != 200) {
        return false;
      }
      const size_t at = head.find("Inference-Header-Content-Length: ");
      if (at == std::string::npos) return false;
      const size_t json_size = std::strtoul(head.c_str() + at + 33, nullptr, 10);
      const nlohmann::json answer = nlohmann::json::parse(body.substr(0, json_size), nullptr, false);
      return answer.contains("outputs") && answer["outputs"].size() == 3;
    };
  };

  const absl::Duration phase = absl::Seconds(absl::GetFlag(FLAGS_phase_s));
  const int rounds = absl::GetFlag(FLAGS_rounds);
  RunLoops(server.pid(), 1, absl::Seconds(1), grpc_way);  // warm up both ports
  RunLoops(server.pid(), 1, absl::Seconds(1), json_way);
  std::printf("REST endpoint against gRPC: preset %s, one input of ~%d tokens per call, %d rounds of "
              "%.1f s per way (interleaved); calls/s, CPU and the ratio are medians of the rounds, "
              "latencies over all calls\n\n",
              absl::GetFlag(FLAGS_preset).c_str(), absl::GetFlag(FLAGS_input_tokens), rounds,
              absl::ToDoubleSeconds(phase) / rounds);
  std::printf("| clients | way | calls/s | vs grpc | p50 ms | p99 ms | server CPU ms/call | failed |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_concurrency), ',')) {
    int clients = 0;
    if (!absl::SimpleAtoi(c, &clients) || clients < 1) {
      std::fprintf(stderr, "--concurrency: '%s' is not a count\n", std::string(c).c_str());
      return 1;
    }
    struct Way {
      explicit Way(const char* n) : name(n) {}
      const char* name;
      std::vector<double> rate, cpu, ratio, latencies;
      int64_t failed = 0;
    };
    Way ways[3] = {Way("grpc"), Way("rest-json"), Way("rest-bin")};
    for (int round = 0; round < rounds; ++round) {
      Result r[3] = {RunLoops(server.pid(), clients, phase / rounds, grpc_way),
                     RunLoops(server.pid(), clients, phase / rounds, json_way),
                     RunLoops(server.pid(), clients, phase / rounds, bin_way)};
      for (int w = 0; w < 3; ++w) {
        ways[w].rate.push_back(r[w].calls_per_s);
        ways[w].cpu.push_back(r[w].cpu_ms_per_call);
        ways[w].ratio.push_back(r[0].calls_per_s > 0 ? r[w].calls_per_s / r[0].calls_per_s : 0);
        ways[w].latencies.insert(ways[w].latencies.end(), r[w].latencies_ms.begin(),
                                 r[w].latencies_ms.end());
        ways[w].failed += r[w].failed;
      }
    }
    for (const Way& w : ways) {
      std::printf("| %d | %s | %.0f | %.2f | %.3f | %.3f | %.3f | %lld |\n", clients, w.name,
                  Median(w.rate), Median(w.ratio), Percentile(w.latencies, 0.5),
                  Percentile(w.latencies, 0.99), Median(w.cpu), static_cast<long long>(w.failed));
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return Run();
}

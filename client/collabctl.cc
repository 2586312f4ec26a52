// collabctl: command-line client for a collabserve server.
//   collabctl [--address=HOST:PORT] classify [--model=NAME] TEXT...
//   collabctl models | model NAME | health [--service=NAME] | tokenize [--model=NAME] TEXT...
//   collabctl bench [--model=NAME] [--concurrency=N] [--duration_s=S] [--input_tokens=N | --lengths=a,b]
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "client/collabctl_admin.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/bench.h"
#include "client/client.h"
#include "server/util/files.h"
#include "google/protobuf/util/json_util.h"

ABSL_FLAG(std::string, address, "127.0.0.1:8500", "server address host:port");
ABSL_FLAG(std::string, model, "demo", "model name");
ABSL_FLAG(int64_t, version, 0, "classify: model version (0 = newest)");
ABSL_FLAG(int, deadline_ms, 10000,
          "per-call deadline of the inference commands, in milliseconds (admin calls: 10 min; "
          "upload 1 h, --wait 24 h)");
ABSL_FLAG(bool, tls, false, "use TLS (inference and admin commands)");
ABSL_FLAG(std::string, tls_ca_file, "",
          "with --tls: PEM file of the root certificates that verify the server (default: the "
          "system's roots)");
ABSL_FLAG(std::string, tls_client_cert, "",
          "with --tls, for a server with --tls_client_ca (mutual TLS): PEM file of this client's "
          "certificate chain (with --tls_client_key)");
ABSL_FLAG(std::string, tls_client_key, "", "with --tls_client_cert: PEM file of its private key");
ABSL_FLAG(std::string, service, "", "health: service name to check (\"\" = server)");
ABSL_FLAG(int, top_k, 0, "classify: labels to return per input");
ABSL_FLAG(bool, raw_scores, false, "classify: logits instead of probabilities");
ABSL_FLAG(bool, json, false, "classify, models: print the responses as JSON (tokenize and model always do)");
ABSL_FLAG(int, concurrency, 4, "bench: concurrent closed-loop clients");
ABSL_FLAG(double, duration_s, 10, "bench: seconds to run");
ABSL_FLAG(int64_t, max_requests, 0, "bench: stop after this many requests (0 = duration only)");
ABSL_FLAG(int, input_tokens, 32, "bench: tokens per input (with [CLS]/[SEP])");
ABSL_FLAG(std::string, lengths, "", "bench: comma-separated token counts used round-robin (overrides --input_tokens)");
ABSL_FLAG(int, inputs_per_request, 1, "bench: inputs per Classify call");
ABSL_FLAG(std::string, bench_api, "callback",
          "bench: callback (gRPC callback API, no thread per worker: cheap on a shared machine), "
          "threads (one blocking thread per worker) or stream (the requests as messages of a few "
          "long-lived ClassifyStream calls: no per-call gRPC work)");
ABSL_FLAG(int, bench_streams, 0,
          "bench --bench_api=stream: ClassifyStream calls the workers share (0 = one per 16 workers)");

namespace {

using collabserve::client::Client;
namespace v1 = collabserve::v1;

int Fail(const absl::Status& s) {
  std::cerr << "collabctl: " << s << "\n";
  return 1;
}

template <typename M>
void PrintJson(const M& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = false;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  std::cout << out << "\n";
}

int Classify(const Client& client, const std::vector<std::string>& texts) {
  if (texts.empty()) return Fail(absl::InvalidArgumentError("classify: give at least one TEXT"));
  v1::ClassifyRequest req;
  req.set_model_name(absl::GetFlag(FLAGS_model));
  // 0 = newest; any other value is sent, and the server refuses one that is not a version.
  if (absl::GetFlag(FLAGS_version) != 0) req.set_model_version(absl::GetFlag(FLAGS_version));
  for (const auto& t : texts) req.add_inputs()->set_text(t);
  req.mutable_options()->set_top_k(absl::GetFlag(FLAGS_top_k));
  req.mutable_options()->set_raw_scores(absl::GetFlag(FLAGS_raw_scores));
  auto r = client.Classify(req);
  if (!r.ok()) return Fail(r.status());
  if (absl::GetFlag(FLAGS_json)) {
    PrintJson(*r);
    return 0;
  }
  for (int i = 0; i < r->results_size(); ++i) {
    const auto& res = r->results(i);
    std::printf("%s\t%.6f\t%s\n", res.label().c_str(), res.score(), texts[i].c_str());
  }
  std::printf("# model %s version %lld, %lld tokens, tokenization %lld us, queue %lld us, "
              "inference %lld us, total %lld us\n",
              r->model_name().c_str(), static_cast<long long>(r->model_version()),
              static_cast<long long>(r->num_tokens()),
              static_cast<long long>(r->timings().tokenization_us()),
              static_cast<long long>(r->timings().queue_us()),
              static_cast<long long>(r->timings().inference_us()),
              static_cast<long long>(r->timings().total_us()));
  return 0;
}

int Tokenize(const Client& client, const std::vector<std::string>& texts) {
  v1::TokenizeRequest req;
  req.set_model_name(absl::GetFlag(FLAGS_model));
  for (const auto& t : texts) req.add_inputs()->set_text(t);
  auto r = client.Tokenize(req);
  if (!r.ok()) return Fail(r.status());
  PrintJson(*r);
  return 0;
}

int Models(const Client& client) {
  auto r = client.ListModels();
  if (!r.ok()) return Fail(r.status());
  if (absl::GetFlag(FLAGS_json)) {
    PrintJson(*r);
    return 0;
  }
  // One line per model with its served versions, then one indented line per version on disk that
  // is not served (loading, settling, failed with its error, unloaded), as Triton's index lists them,
  // and per version an admin pinned or unloaded.
  for (const auto& m : r->models()) {
    std::vector<std::string> v;
    for (auto x : m.versions()) v.push_back(std::to_string(x));
    std::printf("%s\tversions %s\n", m.name().c_str(), absl::StrJoin(v, ",").c_str());
    for (const auto& status : m.version_status()) {
      if (status.state() == "available" && !status.pinned()) continue;
      const char* admin = status.pinned()              ? " (pinned by LoadModel)"
                          : status.unloaded_by_admin() ? " (by UnloadModel: LoadModel serves it again)"
                                                       : "";
      std::printf("\tversion %lld %s%s%s%s\n", static_cast<long long>(status.version()),
                  status.state().c_str(), admin, status.error().empty() ? "" : ": ",
                  status.error().c_str());
    }
  }
  return 0;
}

int Model(const Client& client, const std::vector<std::string>& args) {
  auto r = client.GetModel(args.empty() ? absl::GetFlag(FLAGS_model) : args[0]);
  if (!r.ok()) return Fail(r.status());
  PrintJson(*r);
  return 0;
}

int Health(const Client& client) {
  auto r = client.IsServing(absl::GetFlag(FLAGS_service));
  if (!r.ok()) return Fail(r.status());
  std::printf("%s\n", *r ? "SERVING" : "NOT_SERVING");
  return *r ? 0 : 1;
}

int Bench(const Client& client) {
  collabserve::client::BenchOptions o;
  o.model = absl::GetFlag(FLAGS_model);
  o.concurrency = absl::GetFlag(FLAGS_concurrency);
  o.duration_s = absl::GetFlag(FLAGS_duration_s);
  o.max_requests = absl::GetFlag(FLAGS_max_requests);
  o.inputs_per_request = absl::GetFlag(FLAGS_inputs_per_request);
  o.lengths = {absl::GetFlag(FLAGS_input_tokens)};
  const std::string api = absl::GetFlag(FLAGS_bench_api);
  if (api == "threads") {
    o.api = collabserve::client::BenchApi::kThreads;
  } else if (api == "stream") {
    o.api = collabserve::client::BenchApi::kStream;
  } else if (api != "callback") {
    return Fail(absl::InvalidArgumentError("--bench_api must be callback, threads or stream, not '" + api + "'"));
  }
  o.streams = absl::GetFlag(FLAGS_bench_streams);
  if (o.streams < 0) return Fail(absl::InvalidArgumentError("--bench_streams must be >= 0"));
  if (!absl::GetFlag(FLAGS_lengths).empty()) {
    o.lengths.clear();
    for (auto p : absl::StrSplit(absl::GetFlag(FLAGS_lengths), ',')) {
      int n = 0;
      if (!absl::SimpleAtoi(p, &n)) {
        return Fail(absl::InvalidArgumentError("--lengths: not an integer: " + std::string(p)));
      }
      o.lengths.push_back(n);
    }
  }
  auto r = collabserve::client::RunBench(client, o);
  if (!r.ok()) return Fail(r.status());
  std::printf("concurrency=%d requests=%lld errors=%lld elapsed_s=%.3f rps=%.2f inputs_per_s=%.2f "
              "p50_ms=%.3f p90_ms=%.3f p99_ms=%.3f client_cpu_s=%.3f\n",
              o.concurrency, static_cast<long long>(r->requests), static_cast<long long>(r->errors),
              r->elapsed_s, r->requests_per_s, r->inputs_per_s, r->p50_ms, r->p90_ms, r->p99_ms,
              r->client_cpu_s);
  if (r->errors > 0) std::fprintf(stderr, "first error: %s\n", r->first_error.c_str());
  return r->errors > 0 ? 1 : 0;
}

// --tls, --tls_ca_file, --tls_client_cert, --tls_client_key; the files read. Errors name the flag.
absl::StatusOr<collabserve::client::ClientTls> TlsFromFlags() {
  collabserve::client::ClientTls tls;
  tls.enabled = absl::GetFlag(FLAGS_tls);
  struct File {
    const char* flag;
    std::string path;
    std::string* pem;
  };
  const std::string cert = absl::GetFlag(FLAGS_tls_client_cert);
  const std::string key = absl::GetFlag(FLAGS_tls_client_key);
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError("--tls_client_cert and --tls_client_key go together");
  }
  for (const File& f : {File{"tls_ca_file", absl::GetFlag(FLAGS_tls_ca_file), &tls.root_certs_pem},
                        File{"tls_client_cert", cert, &tls.cert_chain_pem},
                        File{"tls_client_key", key, &tls.private_key_pem}}) {
    if (f.path.empty()) continue;
    if (!tls.enabled) return absl::InvalidArgumentError(absl::StrCat("--", f.flag, " needs --tls"));
    absl::StatusOr<std::string> pem = collabserve::util::ReadFile(f.path, size_t{1} << 20);
    if (!pem.ok()) {
      return absl::Status(pem.status().code(), absl::StrCat("--", f.flag, ": ", pem.status().message()));
    }
    *f.pem = *std::move(pem);
  }
  return tls;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "collabctl [--address=HOST:PORT] [--tls [--tls_ca_file=F]\n"
      "          [--tls_client_cert=F --tls_client_key=F]] COMMAND  (every flag: --help)\n"
      "  classify TEXT... [--model=M] [--version=V] [--top_k=K] [--raw_scores] [--json]\n"
      "  tokenize TEXT... | models [--json] | model [NAME] | health [--service=S] | bench\n"
      "admin commands (--token_file=F, else $COLLABSERVE_TOKEN):\n"
      "  upload --dir=D --name=N [COMPRESSION] [--calibration=FILE] [--min_agreement=A] [--noactivate] "
      "[--wait]\n"
      "  compress NAME [SOURCE_VERSION] COMPRESSION [--calibration=FILE] [--min_agreement=A] "
      "[--noactivate] [--wait]\n"
      "  jobs [ID] | watch ID | cancel ID | load|unload|delete NAME VERSION\n"
      "COMPRESSION: --rank=R | --ranks=R1,R2,... | --ratio=X | --max_error=E | --target_agreement=A | "
      "--max_kl=K");
  // --help lists the flags of both of collabctl's files (absl's default: only the one named like
  // the program).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "client/collabctl");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() < 2) {
    std::cerr << absl::ProgramUsageMessage() << "\n";
    return 2;
  }
  const std::string command = rest[1];
  absl::StatusOr<collabserve::client::ClientTls> tls = TlsFromFlags();
  if (!tls.ok()) {
    std::cerr << "collabctl: " << tls.status().message() << "\n";
    return 2;
  }
  if (collabserve::client::IsAdminCommand(command)) {
    std::vector<char*> a(rest.begin() + 2, rest.end());
    collabserve::client::AdminTarget target;
    target.address = absl::GetFlag(FLAGS_address);
    target.tls = *tls;
    return collabserve::client::RunAdminCommand(command, static_cast<int>(a.size()), a.data(),
                                                target);
  }
  std::vector<std::string> args(rest.begin() + 2, rest.end());
  if (absl::GetFlag(FLAGS_deadline_ms) <= 0) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--deadline_ms=", absl::GetFlag(FLAGS_deadline_ms), " must be > 0")));
  }
  collabserve::client::ClientOptions options;
  options.address = absl::GetFlag(FLAGS_address);
  options.default_deadline = std::chrono::milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  options.tls = *tls;
  // A load generator measures what the server does: an overloaded server's RESOURCE_EXHAUSTED
  // is a result to count, not something to retry.
  if (command == "bench") options.retry.max_attempts = 1;
  auto client = Client::Create(options);
  if (!client.ok()) return Fail(client.status());
  if (command == "classify") return Classify(**client, args);
  if (command == "tokenize") return Tokenize(**client, args);
  if (command == "models") return Models(**client);
  if (command == "model") return Model(**client, args);
  if (command == "health") return Health(**client);
  if (command == "bench") return Bench(**client);
  std::cerr << "collabctl: unknown command '" << command << "'\n" << absl::ProgramUsageMessage() << "\n";
  return 2;
}

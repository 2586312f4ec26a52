#include "client/collabctl_admin.h"

#include <openssl/evp.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collabserve/v1/admin.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

ABSL_FLAG(std::string, dir, "", "upload: the Hugging Face BERT directory to upload");
ABSL_FLAG(std::string, name, "", "upload: the model name to publish under");
// The compression flags are optional: one given is sent as given, whatever its value, and the
// server refuses a bad one naming it (a 0 or a negative number is not taken for "not given").
ABSL_FLAG(std::optional<int>, rank, std::nullopt, "upload/compress: shared key/query rank for every layer");
ABSL_FLAG(std::vector<std::string>, ranks, {},
          "upload/compress: a rank per layer, comma-separated (0 keeps that layer standard)");
ABSL_FLAG(std::optional<double>, ratio, std::nullopt,
          "upload/compress: compress the key/query dimension by this factor");
ABSL_FLAG(std::optional<double>, max_error, std::nullopt,
          "upload/compress: per-layer rank with relative error <= this");
ABSL_FLAG(std::optional<double>, target_agreement, std::nullopt,
          "upload/compress: the cheapest per-layer ranks found that keep this top-1 agreement on held-out text");
ABSL_FLAG(std::optional<double>, max_kl, std::nullopt,
          "upload/compress: the cheapest per-layer ranks found that keep mean KL <= this");
ABSL_FLAG(std::string, calibration, "",
          "upload/compress: calibration text, one text per line (activation-aware CP; sent as calibration.txt)");
ABSL_FLAG(std::optional<double>, min_agreement, std::nullopt,
          "upload/compress: fail (publish nothing) below this top-1 agreement (default: no gate)");
ABSL_FLAG(bool, wait, false, "upload/compress: follow the job to its end and print the report");
ABSL_FLAG(bool, activate, true, "upload/compress: load the new version once published");
ABSL_FLAG(std::string, token_file, "",
          "admin commands: file with the bearer token (default: $COLLABSERVE_TOKEN)");
ABSL_FLAG(int, chunk_bytes, 1 << 20, "upload: bytes per chunk");

namespace collabserve::client {
namespace {

namespace v1 = collabserve::v1;

constexpr const char* kUploadable[] = {"config.json",         "vocab.txt",
                                       "tokenizer_config.json", "special_tokens_map.json",
                                       "model.safetensors",   "pytorch_model.bin"};

int Error(const std::string& what) {
  std::cerr << "collabctl: " << what << "\n";
  return 1;
}

int RpcError(const std::string& what, const grpc::Status& s) {
  static const char* kNames[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                                 "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                 "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                 "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  const int c = static_cast<int>(s.error_code());
  return Error(absl::StrCat(what, ": ", c >= 0 && c <= 16 ? kNames[c] : "?", ": ",
                            s.error_message()));
}

bool ReadToken(std::string* token) {
  const std::string file = absl::GetFlag(FLAGS_token_file);
  if (!file.empty()) {
    std::ifstream in(file);
    if (!in) {
      Error(absl::StrCat("cannot read --token_file ", file));
      return false;
    }
    std::string t((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    *token = std::string(absl::StripAsciiWhitespace(t));
  } else if (const char* env = std::getenv("COLLABSERVE_TOKEN"); env != nullptr) {
    *token = std::string(absl::StripAsciiWhitespace(env));
  }
  if (token->empty()) {
    Error("admin commands need a token: --token_file=F or COLLABSERVE_TOKEN");
    return false;
  }
  return true;
}

class Admin {
 public:
  Admin(const AdminTarget& target, std::string token)
      : stub_(v1::Admin::NewStub(
            grpc::CreateChannel(target.address, ChannelCredentials(target.tls)))),
        token_(std::move(token)) {}

  std::unique_ptr<grpc::ClientContext> Context(absl::Duration deadline = absl::Minutes(10)) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata("authorization", absl::StrCat("Bearer ", token_));
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    return ctx;
  }
  v1::Admin::Stub* stub() { return stub_.get(); }

 private:
  std::unique_ptr<v1::Admin::Stub> stub_;
  std::string token_;
};

// Reads the compression flags into `spec` (`any`: one was given); false (after printing why) if
// more than one is given or --ranks holds something other than integers.
bool CompressionFromFlags(v1::CompressionSpec* spec, bool* any) {
  int n = 0;
  if (const std::optional<int> rank = absl::GetFlag(FLAGS_rank)) {
    spec->set_rank(*rank);
    ++n;
  }
  if (const std::vector<std::string> ranks = absl::GetFlag(FLAGS_ranks); !ranks.empty()) {
    for (const std::string& r : ranks) {
      int32_t v = 0;
      if (!absl::SimpleAtoi(r, &v)) {
        Error(absl::StrCat("--ranks: '", r, "' is not an integer (one rank per layer, comma-separated)"));
        return false;
      }
      spec->mutable_ranks()->add_ranks(v);
    }
    ++n;
  }
  if (const std::optional<double> ratio = absl::GetFlag(FLAGS_ratio)) {
    spec->set_ratio(*ratio);
    ++n;
  }
  if (const std::optional<double> max_error = absl::GetFlag(FLAGS_max_error)) {
    spec->set_max_error(*max_error);
    ++n;
  }
  if (const std::optional<double> target = absl::GetFlag(FLAGS_target_agreement)) {
    spec->set_target_agreement(*target);
    ++n;
  }
  if (const std::optional<double> max_kl = absl::GetFlag(FLAGS_max_kl)) {
    spec->set_max_kl(*max_kl);
    ++n;
  }
  if (n > 1) {
    Error("give at most one of --rank, --ranks, --ratio, --max_error, --target_agreement, --max_kl");
    return false;
  }
  *any = n == 1;
  return true;
}

void ProgressBar(int64_t done, int64_t total) {
  const int width = 40;
  const double f = total > 0 ? static_cast<double>(done) / total : 1.0;
  const int filled = static_cast<int>(f * width);
  std::fprintf(stderr, "\r[%s%s] %5.1f%% %.1f/%.1f MB", std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), 100 * f, done / 1e6, total / 1e6);
  std::fflush(stderr);
}

void PrintJobLine(const v1::Job& j) {
  std::printf("%-16s %-8s %-9s %s:%lld%s%s\n", j.id().c_str(),
              v1::Job::Kind_Name(j.kind()).c_str(), v1::Job::State_Name(j.state()).c_str(),
              j.model_name().c_str(), static_cast<long long>(j.version()),
              j.error().empty() ? "" : "  ", j.error().c_str());
}

// Follows `job_id` to its end, printing each event; then the report. Exit code.
int WaitForJob(Admin& admin, const std::string& job_id) {
  auto ctx = admin.Context(absl::Hours(24));
  v1::WatchJobRequest req;
  req.set_job_id(job_id);
  auto reader = admin.stub()->WatchJob(ctx.get(), req);
  v1::WatchJobResponse r;
  v1::Job::State last = v1::Job::STATE_UNSPECIFIED;
  while (reader->Read(&r)) {
    if (r.event().kind() != v1::JobEvent::BYTES_RECEIVED) {
      std::fprintf(stderr, "  %s\n", r.event().message().c_str());
    }
    last = r.state();
  }
  grpc::Status s = reader->Finish();
  if (!s.ok()) return RpcError("watch", s);
  auto gctx = admin.Context();
  v1::GetJobRequest g;
  g.set_job_id(job_id);
  v1::GetJobResponse job;
  s = admin.stub()->GetJob(gctx.get(), g, &job);
  if (!s.ok()) return RpcError("get job", s);
  if (!job.job().report().json().empty()) std::printf("%s\n", job.job().report().json().c_str());
  PrintJobLine(job.job());
  (void)last;
  return job.job().state() == v1::Job::SUCCEEDED ? 0 : 1;
}

int Upload(Admin& admin) {
  const std::string dir = absl::GetFlag(FLAGS_dir);
  const std::string name = absl::GetFlag(FLAGS_name);
  if (dir.empty() || name.empty()) {
    std::cerr << "collabctl: upload needs --dir=D and --name=N\n";
    return 2;
  }
  v1::UploadHeader header;
  header.set_model_name(name);
  bool compress = false;
  if (!CompressionFromFlags(header.mutable_compression(), &compress)) return 2;
  if (const auto gate = absl::GetFlag(FLAGS_min_agreement)) header.set_min_agreement(*gate);
  header.set_activate(absl::GetFlag(FLAGS_activate));
  // Hash every known file first (the header promises sizes and digests).
  std::vector<std::pair<std::string, std::string>> files;  // name in the upload, local path
  for (const char* f : kUploadable) files.emplace_back(f, absl::StrCat(dir, "/", f));
  const std::string calibration = absl::GetFlag(FLAGS_calibration);
  if (!calibration.empty()) {
    if (!std::ifstream(calibration)) return Error(absl::StrCat("cannot read --calibration ", calibration));
    files.emplace_back("calibration.txt", calibration);
  }
  std::vector<std::pair<std::string, std::string>> names;
  int64_t total = 0;
  for (const auto& [f, path] : files) {
    std::ifstream in(path, std::ios::binary);
    if (!in) continue;
    EVP_MD_CTX* md = EVP_MD_CTX_new();
    EVP_DigestInit_ex(md, EVP_sha256(), nullptr);
    std::vector<char> buf(1 << 20);
    int64_t size = 0;
    while (in) {
      in.read(buf.data(), buf.size());
      const std::streamsize n = in.gcount();
      if (n <= 0) break;
      EVP_DigestUpdate(md, buf.data(), static_cast<size_t>(n));
      size += n;
    }
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_DigestFinal_ex(md, d, &len);
    EVP_MD_CTX_free(md);
    v1::UploadFile* uf = header.add_files();
    uf->set_name(f);
    uf->set_size(size);
    uf->set_sha256(absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(d), len)));
    names.emplace_back(f, path);
    total += size;
  }
  if (names.empty()) return Error(absl::StrCat(dir, " holds none of the checkpoint files"));

  auto ctx = admin.Context(absl::Hours(1));
  v1::UploadModelResponse resp;
  auto writer = admin.stub()->UploadModel(ctx.get(), &resp);
  v1::UploadModelRequest req;
  *req.mutable_header() = header;
  bool ok = writer->Write(req);
  int64_t sent = 0;
  const size_t chunk = static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_chunk_bytes)));
  for (const auto& [f, path] : names) {
    std::ifstream in(path, std::ios::binary);
    std::string buf(chunk, '\0');
    int64_t offset = 0;
    while (ok && in) {
      in.read(buf.data(), buf.size());
      const std::streamsize n = in.gcount();
      if (n <= 0) break;
      v1::UploadModelRequest c;
      c.mutable_chunk()->set_file_name(f);
      c.mutable_chunk()->set_offset(offset);
      c.mutable_chunk()->set_data(buf.data(), static_cast<size_t>(n));
      ok = writer->Write(c);
      offset += n;
      sent += n;
      ProgressBar(sent, total);
    }
  }
  std::fprintf(stderr, "\n");
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (!s.ok()) return RpcError("upload", s);
  std::printf("job %s: %s:%lld (%s)\n", resp.job_id().c_str(), resp.model_name().c_str(),
              static_cast<long long>(resp.version()),
              compress ? "compressing" : "publishing as uploaded");
  std::fflush(stdout);
  return absl::GetFlag(FLAGS_wait) ? WaitForJob(admin, resp.job_id()) : 0;
}

int Compress(Admin& admin, const std::vector<std::string>& args) {
  if (args.empty() || args.size() > 2) {
    std::cerr << "collabctl: compress NAME [SOURCE_VERSION] --rank=R|--ranks=R1,R2,..|--ratio=X|--max_error=E|"
                 "--target_agreement=A|--max_kl=K [--calibration=FILE]\n";
    return 2;
  }
  v1::CompressModelRequest req;
  req.set_model_name(args[0]);
  if (args.size() == 2) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(args[1], &v)) return Error(absl::StrCat("bad version '", args[1], "'"));
    req.set_source_version(v);
  }
  bool compress = false;
  if (!CompressionFromFlags(req.mutable_compression(), &compress)) return 2;
  if (const auto gate = absl::GetFlag(FLAGS_min_agreement)) req.set_min_agreement(*gate);
  req.set_activate(absl::GetFlag(FLAGS_activate));
  if (const std::string file = absl::GetFlag(FLAGS_calibration); !file.empty()) {
    std::ifstream in(file);
    if (!in) return Error(absl::StrCat("cannot read --calibration ", file));
    for (std::string line; std::getline(in, line);) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") != std::string::npos) req.add_calibration(line);
    }
  }
  auto ctx = admin.Context();
  v1::CompressModelResponse resp;
  grpc::Status s = admin.stub()->CompressModel(ctx.get(), req, &resp);
  if (!s.ok()) return RpcError("compress", s);
  std::printf("job %s: %s:%lld\n", resp.job_id().c_str(), resp.model_name().c_str(),
              static_cast<long long>(resp.version()));
  std::fflush(stdout);
  return absl::GetFlag(FLAGS_wait) ? WaitForJob(admin, resp.job_id()) : 0;
}

int Jobs(Admin& admin, const std::vector<std::string>& args) {
  if (args.size() == 1) {
    auto ctx = admin.Context();
    v1::GetJobRequest req;
    req.set_job_id(args[0]);
    v1::GetJobResponse resp;
    grpc::Status s = admin.stub()->GetJob(ctx.get(), req, &resp);
    if (!s.ok()) return RpcError("job", s);
    PrintJobLine(resp.job());
    for (const auto& e : resp.job().events()) std::printf("  %s\n", e.message().c_str());
    if (!resp.job().report().json().empty()) std::printf("%s\n", resp.job().report().json().c_str());
    return 0;
  }
  auto ctx = admin.Context();
  v1::ListJobsResponse resp;
  grpc::Status s = admin.stub()->ListJobs(ctx.get(), v1::ListJobsRequest(), &resp);
  if (!s.ok()) return RpcError("jobs", s);
  for (const auto& j : resp.jobs()) PrintJobLine(j);
  return 0;
}

int Cancel(Admin& admin, const std::vector<std::string>& args) {
  if (args.size() != 1) {
    std::cerr << "collabctl: cancel JOB_ID\n";
    return 2;
  }
  auto ctx = admin.Context();
  v1::CancelJobRequest req;
  req.set_job_id(args[0]);
  v1::CancelJobResponse resp;
  grpc::Status s = admin.stub()->CancelJob(ctx.get(), req, &resp);
  if (!s.ok()) return RpcError("cancel", s);
  PrintJobLine(resp.job());
  return 0;
}

// load / unload / delete NAME VERSION
int Version(Admin& admin, const std::string& cmd, const std::vector<std::string>& args) {
  int64_t v = 0;
  if (args.size() != 2 || !absl::SimpleAtoi(args[1], &v)) {
    std::cerr << "collabctl: " << cmd << " NAME VERSION\n";
    return 2;
  }
  auto ctx = admin.Context();
  grpc::Status s;
  if (cmd == "load") {
    v1::LoadModelRequest r;
    r.set_model_name(args[0]);
    r.set_version(v);
    v1::LoadModelResponse out;
    s = admin.stub()->LoadModel(ctx.get(), r, &out);
  } else if (cmd == "unload") {
    v1::UnloadModelRequest r;
    r.set_model_name(args[0]);
    r.set_version(v);
    v1::UnloadModelResponse out;
    s = admin.stub()->UnloadModel(ctx.get(), r, &out);
  } else {
    v1::DeleteVersionRequest r;
    r.set_model_name(args[0]);
    r.set_version(v);
    v1::DeleteVersionResponse out;
    s = admin.stub()->DeleteVersion(ctx.get(), r, &out);
  }
  if (!s.ok()) return RpcError(cmd, s);
  std::printf("%s %s:%lld: done\n", cmd.c_str(), args[0].c_str(), static_cast<long long>(v));
  return 0;
}

}  // namespace

bool IsAdminCommand(const std::string& cmd) {
  for (const char* c : {"upload", "jobs", "cancel", "watch", "compress", "load", "unload", "delete"}) {
    if (cmd == c) return true;
  }
  return false;
}

int RunAdminCommand(const std::string& cmd, int argc, char** argv, const std::string& address) {
  AdminTarget target;
  target.address = address;
  return RunAdminCommand(cmd, argc, argv, target);
}

int RunAdminCommand(const std::string& cmd, int argc, char** argv, const AdminTarget& target) {
  std::vector<std::string> args(argv, argv + argc);
  std::string token;
  if (!ReadToken(&token)) return 2;
  Admin admin(target, token);
  if (cmd == "upload") return Upload(admin);
  if (cmd == "compress") return Compress(admin, args);
  if (cmd == "jobs") return Jobs(admin, args);
  if (cmd == "cancel") return Cancel(admin, args);
  if (cmd == "watch") {
    if (args.size() != 1) {
      std::cerr << "collabctl: watch JOB_ID\n";
      return 2;
    }
    return WaitForJob(admin, args[0]);
  }
  if (cmd == "load" || cmd == "unload" || cmd == "delete") return Version(admin, cmd, args);
  std::cerr << "collabctl: unknown admin command '" << cmd << "'\n";
  return 2;
}

}  // namespace collabserve::client

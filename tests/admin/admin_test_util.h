// Helpers shared by the admin tests: checkpoint files as an upload, SHA-256, and driving
// UploadModel / WatchJob through the generated stubs.
#ifndef COLLABSERVE_TESTS_ADMIN_ADMIN_TEST_UTIL_H_
#define COLLABSERVE_TESTS_ADMIN_ADMIN_TEST_UTIL_H_

#include <openssl/sha.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collabserve/v1/admin.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "server/util/files.h"

namespace collabserve::testing {

inline std::string Sha256Hex(const std::string& data) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), d);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(d), sizeof(d)));
}

// name -> content of every regular file in `dir`.
inline std::map<std::string, std::string> ReadDir(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    auto content = util::ReadFile(e.path().string());
    EXPECT_TRUE(content.ok()) << content.status();
    files[e.path().filename().string()] = content.ok() ? *content : "";
  }
  return files;
}

// A header listing `files` with their true sizes and digests.
inline v1::UploadHeader HeaderFor(const std::string& model,
                                  const std::map<std::string, std::string>& files) {
  v1::UploadHeader h;
  h.set_model_name(model);
  for (const auto& [name, content] : files) {
    v1::UploadFile* f = h.add_files();
    f->set_name(name);
    f->set_size(static_cast<int64_t>(content.size()));
    f->set_sha256(Sha256Hex(content));
  }
  return h;
}

inline void Authorize(grpc::ClientContext* ctx, const std::string& token) {
  if (!token.empty()) ctx->AddMetadata("authorization", absl::StrCat("Bearer ", token));
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
}

// Sends the header and every file in `chunk` sized pieces, within `deadline`.
inline grpc::Status Upload(v1::Admin::Stub* stub, const std::string& token,
                           const v1::UploadHeader& header,
                           const std::map<std::string, std::string>& files,
                           v1::UploadModelResponse* response, size_t chunk = 1 << 20,
                           absl::Duration deadline = absl::Seconds(60)) {
  grpc::ClientContext ctx;
  Authorize(&ctx, token);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  auto writer = stub->UploadModel(&ctx, response);
  v1::UploadModelRequest req;
  *req.mutable_header() = header;
  bool ok = writer->Write(req);
  for (const auto& [name, content] : files) {
    for (size_t off = 0; ok && off < content.size(); off += chunk) {
      v1::UploadModelRequest c;
      c.mutable_chunk()->set_file_name(name);
      c.mutable_chunk()->set_offset(static_cast<int64_t>(off));
      c.mutable_chunk()->set_data(content.substr(off, chunk));
      ok = writer->Write(c);
    }
  }
  writer->WritesDone();
  return writer->Finish();
}

// Every WatchJob event until the stream ends.
inline std::vector<v1::WatchJobResponse> Watch(v1::Admin::Stub* stub, const std::string& token,
                                               const std::string& job_id,
                                               grpc::Status* status = nullptr) {
  grpc::ClientContext ctx;
  Authorize(&ctx, token);
  // A watch lasts as long as its job: Authorize's 60 s guard against a hang would end it first
  // when a job runs long (a sanitizer tree on busy cores ran one for 72 s at idle priority).
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(15)));
  v1::WatchJobRequest req;
  req.set_job_id(job_id);
  auto reader = stub->WatchJob(&ctx, req);
  std::vector<v1::WatchJobResponse> events;
  v1::WatchJobResponse r;
  while (reader->Read(&r)) events.push_back(r);
  grpc::Status s = reader->Finish();
  if (status != nullptr) *status = s;
  return events;
}

}  // namespace collabserve::testing

#endif  // COLLABSERVE_TESTS_ADMIN_ADMIN_TEST_UTIL_H_

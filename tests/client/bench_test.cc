#include "client/bench.h"

#include <cstdlib>
#include <memory>

#include "gtest/gtest.h"
#include "server/text/bert_tokenizer.h"
#include "server/util/files.h"

namespace collabserve::client {
namespace {

TEST(BenchTest, MakeTextHasExactlyTheAskedTokenCount) {
  const char* src = std::getenv("COLLABSERVE_SOURCE_DIR");
  ASSERT_NE(src, nullptr);
  auto vocab = util::ReadFile(std::string(src) + "/tests/data/bert-base-uncased-vocab.txt");
  ASSERT_TRUE(vocab.ok());
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < vocab->size()) {
    size_t end = vocab->find('\n', start);
    if (end == std::string::npos) end = vocab->size();
    lines.push_back(vocab->substr(start, end - start));
    start = end + 1;
  }
  auto tok = text::BertTokenizer::Create(lines, text::TokenizerOptions());
  ASSERT_TRUE(tok.ok()) << tok.status();
  for (int n : {3, 8, 32, 128, 512}) {
    auto enc = (*tok)->Encode(MakeText(n, n), std::nullopt, 512);
    ASSERT_TRUE(enc.ok());
    EXPECT_EQ(static_cast<int>(enc->input_ids.size()), n);
    EXPECT_FALSE(enc->truncated);
  }
  EXPECT_NE(MakeText(16, 1), MakeText(16, 2));
}

TEST(BenchTest, RejectsBadOptionsBeforeSendingAnything) {
  ClientOptions co;
  co.address = "127.0.0.1:1";
  auto client = Client::Create(co);
  ASSERT_TRUE(client.ok());
  BenchOptions o;
  o.concurrency = 0;
  EXPECT_EQ(RunBench(**client, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.concurrency = 1;
  o.lengths = {2};
  EXPECT_EQ(RunBench(**client, o).status().code(), absl::StatusCode::kInvalidArgument);
}

// A client of an address where nothing listens, one attempt a call.
absl::StatusOr<std::unique_ptr<Client>> UnreachableClient() {
  ClientOptions co;
  co.address = "127.0.0.1:1";
  co.retry.max_attempts = 1;
  return Client::Create(co);
}

// A run of `max_requests` calls (each fails at once against UnreachableClient).
BenchOptions FailingRun(BenchApi api, int concurrency, int64_t max_requests) {
  BenchOptions o;
  o.api = api;
  o.concurrency = concurrency;
  o.duration_s = 60;
  o.max_requests = max_requests;
  o.deadline = std::chrono::milliseconds(5000);
  return o;
}

TEST(BenchTest, AnUnreachableServerCountsEveryRequestAsAnError) {
  auto client = UnreachableClient();
  ASSERT_TRUE(client.ok());
  for (BenchApi api : {BenchApi::kCallback, BenchApi::kThreads}) {
    auto r = RunBench(**client, FailingRun(api, 3, 30));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->requests, 0);
    EXPECT_EQ(r->errors, 30);
    EXPECT_NE(r->first_error.find("UNAVAILABLE"), std::string::npos) << r->first_error;
  }
}

// Every call's state (its ClientContext holds the channel) is gone when RunBench returns. A
// context left to a gRPC callback thread could drop the channel's last reference there, after the
// caller destroyed the Client: ~Channel then releases gRPC's callback completion queue from one of
// that queue's own threads, which cannot join itself (a later abort in grpc_cq_internal_unref, 3 of
// 100 runs of this binary on a loaded machine).
TEST(BenchTest, NoCallOutlivesTheRun) {
  auto client = UnreachableClient();
  ASSERT_TRUE(client.ok());
  const long held = (*client)->channel().use_count();
  for (int round = 0; round < 20; ++round) {
    for (BenchApi api : {BenchApi::kCallback, BenchApi::kStream, BenchApi::kThreads}) {
      ASSERT_TRUE(RunBench(**client, FailingRun(api, 4, 8)).ok());
      ASSERT_EQ((*client)->channel().use_count(), held) << "round " << round << ", api " << static_cast<int>(api);
    }
  }
}

TEST(ClientTest, UnreachableServerIsUnavailable) {
  ClientOptions co;
  co.address = "127.0.0.1:1";
  co.default_deadline = std::chrono::milliseconds(500);
  auto client = Client::Create(co);
  ASSERT_TRUE(client.ok());
  auto r = (*client)->ListModels();
  EXPECT_FALSE(r.ok());
  auto h = (*client)->IsServing();
  EXPECT_FALSE(h.ok());
  co.wait_for_connection = true;
  EXPECT_EQ(Client::Create(co).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace collabserve::client

// The overload flags of the real collabserve binary (built-in demo model): bad values are refused
// at start naming the flag; --max_concurrent_streams, --stream_idle_timeout_s and
// --max_message_bytes take effect.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "server/util/files.h"
#include "tests/testing/server_process.h"
#include "tests/testing/test_util.h"

namespace collabserve {
namespace {

using ::collabserve::testing::ServerProcess;
using ::collabserve::testing::TempDir;
using ::testing::HasSubstr;
using Stream = grpc::ClientReaderWriter<v1::StreamClassifyRequest, v1::StreamClassifyResponse>;

v1::StreamClassifyRequest DemoRequest(const std::string& text) {
  v1::StreamClassifyRequest r;
  r.set_id(text);
  r.mutable_request()->set_model_name("demo");
  r.mutable_request()->add_inputs()->set_text(text);
  return r;
}

TEST(OverloadBinaryTest, BadLimitsAreRefusedAtStartNamingTheFlag) {
  TempDir tmp;
  for (const std::string flag : {"--max_concurrent_streams=0", "--stream_max_pending_responses=0",
                                 "--stream_idle_timeout_s=-1"}) {
    const std::string log = tmp / "stderr.log";
    {
      // An empty repository: the flags are checked before any model would be loaded.
      ServerProcess server({"--port=0", "--metrics_port=-1", "--host=127.0.0.1",
                            absl::StrCat("--model_repository=", tmp.path()), flag},
                           log);
      EXPECT_FALSE(server.serving()) << flag;
    }
    auto err = util::ReadFile(log);
    ASSERT_TRUE(err.ok()) << err.status();
    EXPECT_THAT(*err, HasSubstr(flag.substr(0, flag.find('=')))) << *err;
  }
}

TEST(OverloadBinaryTest, StreamLimitAndMessageSizeTakeEffect) {
  ServerProcess server({"--port=0", "--metrics_port=-1", "--host=127.0.0.1",
                        "--max_concurrent_streams=1", "--max_message_bytes=65536"});
  ASSERT_TRUE(server.serving());
  auto stub = v1::Inference::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));

  // One stream is open and answered.
  grpc::ClientContext a_ctx;
  a_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  std::unique_ptr<Stream> a = stub->ClassifyStream(&a_ctx);
  ASSERT_TRUE(a->Write(DemoRequest("first stream")));
  v1::StreamClassifyResponse resp;
  ASSERT_TRUE(a->Read(&resp));
  EXPECT_TRUE(resp.has_response()) << resp.error().message();

  // A second one is refused.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    std::unique_ptr<Stream> b = stub->ClassifyStream(&ctx);
    b->Write(DemoRequest("second stream"));
    b->WritesDone();
    while (b->Read(&resp)) {
    }
    grpc::Status st = b->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr("--max_concurrent_streams=1"));
  }

  // An oversized unary call is refused, naming the limit; a normal one is served.
  {
    v1::ClassifyRequest big;
    big.set_model_name("demo");
    for (int i = 0; i < 8; ++i) big.add_inputs()->set_text(std::string(10000, 'x'));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::ClassifyResponse r;
    grpc::Status st = stub->Classify(&ctx, big, &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr("65536"));
  }

  // The first stream is still served, and closes normally.
  ASSERT_TRUE(a->Write(DemoRequest("first stream again")));
  ASSERT_TRUE(a->Read(&resp));
  EXPECT_TRUE(resp.has_response()) << resp.error().message();
  a->WritesDone();
  EXPECT_FALSE(a->Read(&resp));
  grpc::Status st = a->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(server.Terminate(), 0);
}

TEST(OverloadBinaryTest, IdleStreamIsEndedAndItsSlotFreed) {
  ServerProcess server({"--port=0", "--metrics_port=-1", "--host=127.0.0.1",
                        "--max_concurrent_streams=1", "--stream_idle_timeout_s=1"});
  ASSERT_TRUE(server.serving());
  auto stub = v1::Inference::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext a_ctx;
  a_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  std::unique_ptr<Stream> a = stub->ClassifyStream(&a_ctx);
  ASSERT_TRUE(a->Write(DemoRequest("then silence")));
  v1::StreamClassifyResponse resp;
  ASSERT_TRUE(a->Read(&resp));
  EXPECT_TRUE(resp.has_response()) << resp.error().message();
  // The client sends nothing more and does not half-close: the server ends the stream.
  while (a->Read(&resp)) {
  }
  grpc::Status st = a->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("--stream_idle_timeout_s"));

  // The slot frees once the server has cleaned the stream up; retry until it has (bounded).
  bool admitted = false;
  for (int attempt = 0; attempt < 100 && !admitted; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    std::unique_ptr<Stream> c = stub->ClassifyStream(&ctx);
    c->Write(DemoRequest("next stream"));
    c->WritesDone();
    int answered = 0;
    while (c->Read(&resp)) answered += resp.has_response() ? 1 : 0;
    grpc::Status cs = c->Finish();
    if (cs.ok()) {
      EXPECT_EQ(answered, 1);
      admitted = true;
    } else {
      ASSERT_EQ(cs.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << cs.error_message();
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
  EXPECT_TRUE(admitted);
  EXPECT_EQ(server.Terminate(), 0);
}

}  // namespace
}  // namespace collabserve

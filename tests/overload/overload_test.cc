// Overload and slow clients against an in-process Server on 127.0.0.1:0 (issue 7): a burst far
// beyond what the queue admits, a ClassifyStream client that sends without reading, oversized
// messages and too many streams. The batch thread can be held at a gate, so every assertion is on
// behaviour (codes, counts, bounds), never on timing; latencies are printed, not asserted.
#include <atomic>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/channel_arguments.h"
#include "gtest/gtest.h"
#include "server/service/model_servable.h"
#include "server/service/server.h"
#include "tests/overload/overload_test_util.h"
#include "tests/service/test_util.h"

namespace collabserve::service {
namespace {

using ::collabserve::testing::ClassifyRequestFor;
using ::collabserve::testing::Eventually;
using ::collabserve::testing::OverloadServer;
using ::collabserve::testing::PercentileMs;
using ::collabserve::testing::ResidentBytes;
using ::testing::HasSubstr;

std::shared_ptr<ModelServable> Servable(Server& server) {
  auto s = server.repository()->Get("tiny");
  EXPECT_TRUE(s.ok()) << s.status();
  return std::static_pointer_cast<ModelServable>(*s);
}

// ------------------------------------------------------------------------------ burst overload

struct BurstCall {
  grpc::ClientContext ctx;
  v1::ClassifyRequest req;
  v1::ClassifyResponse resp;
  grpc::Status status;
  absl::Time sent;
  absl::Duration latency;
  absl::Notification done;
};

TEST(OverloadTest, BurstBeyondTheQueueIsShedAtOnceAndTheAcceptedCallsAreCorrect) {
  OverloadServer s;
  ServerOptions o = s.Options();
  constexpr int kQueue = 16, kBatch = 4;
  o.servable.batching.max_queue_size = kQueue;
  o.servable.batching.max_batch_size = kBatch;
  o.servable.batching.num_batch_threads = 1;
  s.Start(o);
  std::shared_ptr<ModelServable> servable = Servable(s.server());

  // What each text classifies as on an idle server.
  constexpr int kTexts = 8;
  std::vector<std::string> texts;
  std::vector<v1::Result> expected;
  for (int i = 0; i < kTexts; ++i) {
    texts.push_back(absl::StrCat("overload text number ", i, " with some words"));
    v1::ClassifyResponse r;
    ASSERT_TRUE(s.Classify(ClassifyRequestFor("tiny", {texts.back()}), &r).ok());
    expected.push_back(r.results(0));
  }
  const int64_t rss_before = ResidentBytes();
  const batching::SchedulerStats before = servable->scheduler_stats();

  // The batch thread is held at the gate: the queue admits kQueue inputs (plus the one batch the
  // thread took, at most kBatch), so a burst of 4x that must be mostly shed, at once.
  constexpr int kAdmitted = kQueue + kBatch, kBurst = 4 * kAdmitted;
  s.gate().Close();
  std::vector<std::unique_ptr<BurstCall>> calls;
  for (int i = 0; i < kBurst; ++i) {
    auto c = std::make_unique<BurstCall>();
    c->req = ClassifyRequestFor("tiny", {texts[i % kTexts]});
    c->ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    BurstCall* raw = c.get();
    raw->sent = absl::Now();
    s.stub().async()->Classify(&raw->ctx, &raw->req, &raw->resp, [raw](grpc::Status st) {
      raw->latency = absl::Now() - raw->sent;
      raw->status = std::move(st);
      raw->done.Notify();
    });
    calls.push_back(std::move(c));
  }
  // Every call reached the scheduler, and every refused one has its answer, all while the gate
  // is still closed: shedding never waits for the model.
  ASSERT_TRUE(Eventually([&] {
    const batching::SchedulerStats now = servable->scheduler_stats();
    return now.tasks_scheduled - before.tasks_scheduled + now.tasks_rejected_queue_full -
               before.tasks_rejected_queue_full ==
           kBurst;
  }));
  const int64_t rejected =
      servable->scheduler_stats().tasks_rejected_queue_full - before.tasks_rejected_queue_full;
  ASSERT_TRUE(Eventually([&] {
    int done = 0;
    for (auto& c : calls) done += c->done.HasBeenNotified() ? 1 : 0;
    return done == rejected;
  }));
  std::vector<absl::Duration> shed_latency;
  for (auto& c : calls) {
    if (!c->done.HasBeenNotified()) continue;
    EXPECT_EQ(c->status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << c->status.error_message();
    EXPECT_THAT(c->status.error_message(), HasSubstr("queue full"));
    EXPECT_THAT(c->status.error_message(), HasSubstr("retry with backoff"));
    shed_latency.push_back(c->latency);
  }
  const int shed = static_cast<int>(shed_latency.size());
  EXPECT_GE(shed, kBurst - kAdmitted);
  EXPECT_LE(kBurst - shed, kAdmitted);
  EXPECT_GE(kBurst - shed, kQueue);

  s.gate().Open();
  std::vector<absl::Duration> accepted_latency;
  for (int i = 0; i < kBurst; ++i) {
    BurstCall& c = *calls[i];
    ASSERT_TRUE(c.done.WaitForNotificationWithTimeout(absl::Seconds(60)));
    if (c.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) continue;
    ASSERT_TRUE(c.status.ok()) << c.status.error_message();
    accepted_latency.push_back(c.latency);
    ASSERT_EQ(c.resp.results_size(), 1);
    const v1::Result& got = c.resp.results(0);
    const v1::Result& want = expected[i % kTexts];
    EXPECT_EQ(got.label(), want.label()) << "call " << i;
    ASSERT_EQ(got.logits_size(), want.logits_size());
    for (int k = 0; k < got.logits_size(); ++k) {
      EXPECT_NEAR(got.logits(k), want.logits(k), 1e-3) << "call " << i << " logit " << k;
    }
  }
  EXPECT_EQ(static_cast<int>(accepted_latency.size()), kBurst - shed);

  // The load is gone: the next call is served, and nothing was left queued.
  v1::ClassifyResponse after;
  grpc::Status st = s.Classify(ClassifyRequestFor("tiny", {texts[0]}), &after);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(after.results(0).label(), expected[0].label());
  const int64_t rss_after = ResidentBytes();
  // Generous: the burst holds at most kAdmitted tiny inputs; RSS must not grow with kBurst.
  EXPECT_LT(rss_after - rss_before, int64_t{128} << 20);
  std::printf(
      "burst of %d with queue %d + batch %d held: shed %d (RESOURCE_EXHAUSTED after p50 %.2f ms, "
      "p99 %.2f ms), accepted %d (p50 %.1f ms, p99 %.1f ms incl. the held gate); RSS %+.1f MiB\n",
      kBurst, kQueue, kBatch, shed, PercentileMs(shed_latency, 0.5),
      PercentileMs(shed_latency, 0.99), kBurst - shed, PercentileMs(accepted_latency, 0.5),
      PercentileMs(accepted_latency, 0.99), (rss_after - rss_before) / 1048576.0);
}

// ----------------------------------------------------------------------- ClassifyStream readers

using Stream = grpc::ClientReaderWriter<v1::StreamClassifyRequest, v1::StreamClassifyResponse>;

v1::StreamClassifyRequest StreamRequest(int i) {
  v1::StreamClassifyRequest r;
  r.set_id(absl::StrCat("r", i));
  std::vector<std::string> texts;
  for (int k = 0; k < 8; ++k) texts.push_back(absl::StrCat("stream request ", i, " input ", k));
  *r.mutable_request() = ClassifyRequestFor("tiny", texts);
  r.mutable_request()->mutable_options()->set_top_k(2);
  return r;
}

// A client with a small receive window (no BDP growth), so that not reading backs up quickly.
grpc::ChannelArguments SmallWindow() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 10);
  return args;
}

// Writes requests until told to stop or a write fails, then half-closes.
class Writer {
 public:
  explicit Writer(Stream* stream)
      : thread_([this, stream] {
          for (int i = 0; !stop_.load(); ++i) {
            if (!stream->Write(StreamRequest(i))) break;
            written_.fetch_add(1);
          }
          stream->WritesDone();
        }) {}
  ~Writer() { Join(); }
  void Stop() { stop_.store(true); }
  void Join() {
    if (thread_.joinable()) thread_.join();
  }
  int written() const { return written_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> written_{0};
  std::thread thread_;
};

// Another client, on its own connection, is served while `s` has a stalled stream.
void ExpectOthersServed(OverloadServer& s) {
  auto other = s.NewStub();
  v1::ClassifyResponse r;
  grpc::Status st = s.Classify(ClassifyRequestFor("tiny", {"another client"}), &r, other.get());
  EXPECT_TRUE(st.ok()) << st.error_message();
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  std::unique_ptr<Stream> stream = other->ClassifyStream(&ctx);
  // The request and the half-close go together: a test that sets a short --stream_idle_timeout_s
  // must not see this stream ended because a starved client (a sanitizer run) took longer than
  // that to half-close after its answer (the idle clock stops at the half-close).
  ASSERT_TRUE(stream->Write(StreamRequest(0), grpc::WriteOptions().set_last_message()));
  v1::StreamClassifyResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.id(), "r0");
  EXPECT_TRUE(resp.has_response()) << resp.error().message();
  EXPECT_FALSE(stream->Read(&resp));
  st = stream->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
}

TEST(OverloadTest, StreamThatIsNotReadStopsBeingReadAndResumesWhenTheClientReads) {
  OverloadServer s;
  ServerOptions o = s.Options();
  o.inference.stream_max_pending_responses = 4;
  o.stream_idle_timeout = absl::ZeroDuration();
  s.Start(o);
  InferenceService& svc = s.server().inference_service();

  auto stub = s.NewStub(SmallWindow());
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  std::unique_ptr<Stream> stream = stub->ClassifyStream(&ctx);
  Writer writer(stream.get());
  // The client reads nothing: once its window is full the server's writes stall, 4 requests are
  // pending, and the server stops reading that stream.
  ASSERT_TRUE(Eventually([&] { return svc.stream_read_pauses() >= 1; }));
  EXPECT_LE(svc.stream_pending_high_water(), 4);
  // Stop writing now (the stream stays stalled: nothing is read): what must be read back below
  // then does not grow with the time ExpectOthersServed takes (minutes' worth under TSan).
  writer.Stop();
  ExpectOthersServed(s);

  // The client starts reading: the stream resumes and every request is answered, in full.
  std::set<std::string> ids;
  v1::StreamClassifyResponse resp;
  while (stream->Read(&resp)) {
    EXPECT_TRUE(resp.has_response()) << resp.id() << ": " << resp.error().message();
    EXPECT_TRUE(ids.insert(resp.id()).second) << "twice: " << resp.id();
  }
  writer.Join();
  grpc::Status st = stream->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(static_cast<int>(ids.size()), writer.written());
  EXPECT_LE(svc.stream_pending_high_water(), 4);
  std::printf("slow reader: %d requests written, %lld pause(s), at most %lld pending\n",
              writer.written(), static_cast<long long>(svc.stream_read_pauses()),
              static_cast<long long>(svc.stream_pending_high_water()));
  EXPECT_TRUE(Eventually([&] { return svc.open_streams() == 0; }));
}

TEST(OverloadTest, StreamThatIsNeverReadIsEndedByTheIdleTimeout) {
  OverloadServer s;
  ServerOptions o = s.Options();
  o.inference.stream_max_pending_responses = 4;
  o.stream_idle_timeout = absl::Seconds(1);
  s.Start(o);
  InferenceService& svc = s.server().inference_service();

  auto stub = s.NewStub(SmallWindow());
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  std::unique_ptr<Stream> stream = stub->ClassifyStream(&ctx);
  Writer writer(stream.get());
  ASSERT_TRUE(Eventually([&] { return svc.stream_read_pauses() >= 1; }));
  EXPECT_LE(svc.stream_pending_high_water(), 4);
  // Stalled: no request read, no response written. The watchdog ends it; the blocked write fails.
  ASSERT_TRUE(Eventually([&] { return s.server().idle_watchdog().calls_ended() >= 1; }));
  writer.Join();
  v1::StreamClassifyResponse resp;
  while (stream->Read(&resp)) {
  }
  grpc::Status st = stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("--stream_idle_timeout_s"));
  EXPECT_TRUE(Eventually([&] { return svc.open_streams() == 0; }));
  EXPECT_LE(svc.stream_pending_high_water(), 4);
  ExpectOthersServed(s);
}

// ------------------------------------------------------------------------ oversized messages

TEST(OverloadTest, OversizedMessageIsRefusedNamingTheLimit) {
  OverloadServer s;
  ServerOptions o = s.Options();
  o.max_message_bytes = 64 << 10;
  s.Start(o);
  std::vector<std::string> texts(8, std::string(10000, 'a'));
  v1::ClassifyRequest big = ClassifyRequestFor("tiny", texts);
  ASSERT_GT(big.ByteSizeLong(), size_t{64 << 10});

  v1::ClassifyResponse r;
  grpc::Status st = s.Classify(big, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr(std::to_string(64 << 10)));

  // On a stream the same message ends the stream the same way.
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  std::unique_ptr<Stream> stream = s.stub().ClassifyStream(&ctx);
  v1::StreamClassifyRequest sr;
  sr.set_id("big");
  *sr.mutable_request() = big;
  stream->Write(sr);
  stream->WritesDone();
  v1::StreamClassifyResponse resp;
  while (stream->Read(&resp)) {
  }
  st = stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr(std::to_string(64 << 10)));

  st = s.Classify(ClassifyRequestFor("tiny", {"a normal request"}), &r);
  EXPECT_TRUE(st.ok()) << st.error_message();
}

// ----------------------------------------------------------------------- too many streams

TEST(OverloadTest, StreamsBeyondTheLimitAreRefusedAndTheServerKeepsServing) {
  OverloadServer s;
  ServerOptions o = s.Options();
  o.inference.max_concurrent_streams = 2;
  s.Start(o);
  InferenceService& svc = s.server().inference_service();

  struct Open {
    grpc::ClientContext ctx;
    std::unique_ptr<Stream> stream;
  };
  auto open = [&]() {
    auto x = std::make_unique<Open>();
    x->ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    x->stream = s.stub().ClassifyStream(&x->ctx);
    return x;
  };
  auto round_trip = [](Open& x) {
    if (!x.stream->Write(StreamRequest(1))) return false;
    v1::StreamClassifyResponse resp;
    return x.stream->Read(&resp) && resp.has_response();
  };
  auto close = [](Open& x) {
    x.stream->WritesDone();
    v1::StreamClassifyResponse resp;
    while (x.stream->Read(&resp)) {
    }
    return x.stream->Finish();
  };

  std::unique_ptr<Open> a = open(), b = open();
  ASSERT_TRUE(round_trip(*a));
  ASSERT_TRUE(round_trip(*b));
  EXPECT_EQ(svc.open_streams(), 2);

  std::unique_ptr<Open> c = open();
  EXPECT_FALSE(round_trip(*c));
  grpc::Status st = close(*c);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("--max_concurrent_streams=2"));
  EXPECT_EQ(svc.streams_refused(), 1);

  // Unary calls and the open streams go on.
  v1::ClassifyResponse r;
  st = s.Classify(ClassifyRequestFor("tiny", {"still serving"}), &r);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_TRUE(round_trip(*a));

  // One stream closes: a new one is admitted.
  st = close(*a);
  EXPECT_TRUE(st.ok()) << st.error_message();
  ASSERT_TRUE(Eventually([&] { return svc.open_streams() == 1; }));
  std::unique_ptr<Open> d = open();
  EXPECT_TRUE(round_trip(*d));
  EXPECT_TRUE(close(*d).ok());
  EXPECT_TRUE(close(*b).ok());
}

}  // namespace
}  // namespace collabserve::service

// The shipped binaries end to end: build/bin/collabserve as a subprocess, driven by
// build/bin/collabctl and the generated stubs, checked against `collabserve-model predict`.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <filesystem>
#include <iterator>
#include <map>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "tests/testing/server_process.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/util/files.h"
#include "tests/service/test_util.h"

namespace collabserve {
namespace {

using ::collabserve::testing::MakeTinyModel;
using ::collabserve::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::Not;

std::string Bin(const std::string& name) { return testing::BinaryPath(name); }

// Runs a shell command; returns its exit status and stdout.
int RunCommand(const std::string& cmd, std::string* out) {
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  out->clear();
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

using ::collabserve::testing::ServerProcess;

TEST(CollabserveBinaryTest, ServesCollabctlAndMatchesTheOfflineTool) {
  TempDir repo;
  const std::string model_dir = repo.path() + "/tiny/1";
  MakeTinyModel(model_dir, 3);
  ServerProcess server({"--port=0", "--metrics_port=0", "--host=127.0.0.1",
                        "--model_repository=" + repo.path(), "--poll_interval_s=0"});
  ASSERT_TRUE(server.serving());
  ASSERT_GT(server.port(), 0);
  ASSERT_GT(server.metrics_port(), 0);
  const std::string ctl = Bin("collabctl") + " --address=" + server.address();

  std::string out;
  EXPECT_EQ(RunCommand(ctl + " health", &out), 0);
  EXPECT_THAT(out, HasSubstr("SERVING"));
  EXPECT_EQ(RunCommand(ctl + " models", &out), 0);
  EXPECT_THAT(out, HasSubstr("tiny"));
  EXPECT_EQ(RunCommand(ctl + " classify --model=tiny 'a fine film' 'a dreadful film'", &out), 0);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 3) << out;  // two results + summary
  EXPECT_NE(RunCommand(ctl + " classify --model=missing 'x' 2>&1", &out), 0);
  EXPECT_THAT(out, HasSubstr("NOT_FOUND"));
  // A flag's value is what is asked: a negative version is not "the newest".
  EXPECT_EQ(RunCommand(ctl + " classify --model=tiny --version=-3 'x' 2>&1", &out), 1);
  EXPECT_THAT(out, HasSubstr("model_version -3 is not a version"));
  EXPECT_EQ(RunCommand(ctl + " classify --model=tiny --deadline_ms=0 'x' 2>&1", &out), 1);
  EXPECT_THAT(out, HasSubstr("--deadline_ms=0 must be > 0"));
  // The TLS files are checked, and named, before any call.
  EXPECT_EQ(RunCommand(ctl + " --tls_client_cert=/etc/hostname health 2>&1", &out), 2);
  EXPECT_THAT(out, HasSubstr("--tls_client_cert and --tls_client_key go together"));
  EXPECT_EQ(RunCommand(ctl + " --tls_client_cert=/a --tls_client_key=/b health 2>&1", &out), 2);
  EXPECT_THAT(out, HasSubstr("--tls_client_cert needs --tls"));
  EXPECT_EQ(RunCommand(ctl + " --tls --tls_client_cert=/none.crt --tls_client_key=/b health 2>&1", &out), 2);
  EXPECT_THAT(out, HasSubstr("--tls_client_cert: /none.crt: no such file"));
  // No command: the usage, naming the admin token and every command; --help: the flags of both
  // of collabctl's files (absl's default lists only collabctl.cc's).
  EXPECT_EQ(RunCommand(Bin("collabctl") + " 2>&1", &out), 2);
  for (const char* says : {"classify TEXT...", "--token_file=F, else $COLLABSERVE_TOKEN",
                           "compress NAME [SOURCE_VERSION] COMPRESSION", "--noactivate", "--max_kl=K"}) {
    EXPECT_THAT(out, HasSubstr(says));
  }
  RunCommand(Bin("collabctl") + " --help 2>&1", &out);
  for (const char* flag : {"--address", "--deadline_ms", "--token_file", "--min_agreement", "--activate"}) {
    EXPECT_THAT(out, HasSubstr(absl::StrCat(flag, " ("))) << flag;
  }
  EXPECT_EQ(RunCommand(ctl + " bench --model=tiny --concurrency=2 --duration_s=1 --input_tokens=16", &out), 0)
      << out;
  EXPECT_THAT(out, HasSubstr("p99_ms="));

  // Served logits == collabserve-model predict's.
  const std::vector<std::string> texts = {"the best movie of the year", "not good at all",
                                          "an utterly forgettable afternoon"};
  TempDir work;
  {
    std::ofstream in(work.path() + "/in.jsonl");
    for (const auto& t : texts) in << nlohmann::json{{"text", t}}.dump() << "\n";
  }
  ASSERT_EQ(RunCommand(Bin("collabserve-model") + " predict --model " + model_dir + " < " +
                           work.path() + "/in.jsonl",
                       &out),
            0)
      << out;
  std::vector<std::string> lines = absl::StrSplit(out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), texts.size()) << out;

  auto stub = v1::Inference::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  v1::ClassifyRequest req;
  req.set_model_name("tiny");
  for (const auto& t : texts) req.add_inputs()->set_text(t);
  v1::ClassifyResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::Status s = stub->Classify(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  for (size_t i = 0; i < texts.size(); ++i) {
    auto ref = nlohmann::json::parse(lines[i]);
    ASSERT_EQ(ref["logits"].size(), static_cast<size_t>(resp.results(i).logits_size()));
    for (size_t j = 0; j < ref["logits"].size(); ++j) {
      EXPECT_NEAR(resp.results(i).logits(j), ref["logits"][j].get<double>(), 1e-5);
    }
    EXPECT_EQ(resp.results(i).label(), ref["label"].get<std::string>());
  }

  // The REST endpoint's own metrics reach /metrics.
  ASSERT_GT(server.http_port(), 0);
  ASSERT_EQ(RunCommand(absl::StrCat("curl -s --max-time 30 http://127.0.0.1:", server.http_port(),
                                    "/v2/health/ready"), &out), 0);
  EXPECT_EQ(out, R"({"ready":true})");
  absl::StatusOr<std::string> scraped = testing::ScrapeMetrics(server.metrics_port());
  ASSERT_TRUE(scraped.ok()) << scraped.status();
  EXPECT_EQ(testing::ParseMetrics(*scraped)["collabserve_http_responses_total{code=\"200\"}"], 1)
      << *scraped;

  EXPECT_EQ(server.Terminate(), 0);
}

// The demo's checkpoint in $TMPDIR/collabserve-demo-*, or "" (none, or more than one).
std::string DemoRepositoryIn(const TempDir& tmp) {
  std::string out;
  int found = 0;
  for (const auto& e : std::filesystem::directory_iterator(tmp.path())) {
    if (absl::StartsWith(e.path().filename().string(), "collabserve-demo-")) {
      out = e.path().string();
      ++found;
    }
  }
  return found == 1 ? out : "";
}

TEST(CollabserveBinaryTest, ServesTheDemoModelWithoutARepository) {
  TempDir tmp;
  ServerProcess server({"--port=0", "--metrics_port=-1", "--host=127.0.0.1"}, "", nullptr, "",
                       {"TMPDIR=" + tmp.path()});
  ASSERT_TRUE(server.serving());
  // Its checkpoint sits in a temporary repository of its own while it serves...
  const std::string repository = DemoRepositoryIn(tmp);
  ASSERT_NE(repository, "");
  EXPECT_TRUE(std::filesystem::exists(repository + "/demo/1/model.safetensors")) << repository;
  EXPECT_EQ(server.metrics_port(), -1);
  std::string out;
  const std::string ctl = Bin("collabctl") + " --address=" + server.address();
  // The trained Debian-sections classifier compiled into the binary (server/model/demo/).
  EXPECT_EQ(RunCommand(ctl + " classify --model=demo 'a 3D racing game with split-screen multiplayer'", &out), 0);
  EXPECT_TRUE(absl::StartsWith(out, "games")) << out;
  EXPECT_EQ(RunCommand(ctl + " health --service=demo", &out), 0);
  // The README's curl over the REST endpoint, as written there but for the port.
  ASSERT_GT(server.http_port(), 0);
  const char* source = std::getenv("COLLABSERVE_SOURCE_DIR");
  ASSERT_NE(source, nullptr);
  const absl::StatusOr<std::string> readme = util::ReadFile(std::string(source) + "/README.md");
  ASSERT_TRUE(readme.ok()) << readme.status();
  const size_t at = readme->find("\ncurl -s localhost:8000/v2/models/demo/infer ");
  ASSERT_NE(at, std::string::npos) << "README.md lost its REST example";
  std::string curl = readme->substr(at + 1, readme->find('\n', at + 1) - at - 1);
  curl.replace(curl.find("localhost:8000"), 14, absl::StrCat("127.0.0.1:", server.http_port()));
  ASSERT_EQ(RunCommand(curl + " --max-time 30", &out), 0) << curl;
  const nlohmann::json answer = nlohmann::json::parse(out, nullptr, false);
  ASSERT_TRUE(answer.contains("outputs")) << out;
  EXPECT_EQ(answer["outputs"][2]["name"], "label") << out;
  EXPECT_EQ(answer["outputs"][2]["data"][0], "mail") << out;
  // And its curl of text-embeddings-inference's /predict: every label, best first.
  const size_t tei_at = readme->find("\ncurl -s localhost:8000/predict ");
  ASSERT_NE(tei_at, std::string::npos) << "README.md lost its text-embeddings-inference example";
  curl = readme->substr(tei_at + 1, readme->find('\n', tei_at + 1) - tei_at - 1);
  curl = curl.substr(0, curl.find("  #"));
  curl.replace(curl.find("localhost:8000"), 14, absl::StrCat("127.0.0.1:", server.http_port()));
  ASSERT_EQ(RunCommand(curl + " --max-time 30", &out), 0) << curl;
  const nlohmann::json predictions = nlohmann::json::parse(out, nullptr, false);
  ASSERT_TRUE(predictions.is_array() && predictions.size() > 1) << out;
  EXPECT_EQ(predictions[0]["label"], "mail") << out;
  EXPECT_EQ(server.Terminate(), 0);
  // ... which goes with it.
  EXPECT_FALSE(std::filesystem::exists(repository)) << repository << " was left behind";
}

// A signal while the server is still loading (here the demo, right after its port opened) ends it
// at once without leaving its temporary repository behind. It used to take the signal's default
// action in a thread that a library started before main (OpenBLAS's pool), which killed the
// process on the spot.
TEST(CollabserveBinaryTest, ASignalWhileLoadingExitsAndRemovesTheDemoRepository) {
  TempDir tmp;
  ServerProcess server({"--port=0", "--metrics_port=-1", "--host=127.0.0.1"}, "", nullptr, "",
                       {"TMPDIR=" + tmp.path()}, "listening on");
  ASSERT_TRUE(server.reached());
  EXPECT_FALSE(server.serving());
  const std::string repository = DemoRepositoryIn(tmp);
  ASSERT_NE(repository, "");
  // 128 + SIGTERM while loading; 0 if the load had already finished (a normal drain).
  EXPECT_THAT(server.Terminate(), ::testing::AnyOf(128 + SIGTERM, 0));
  EXPECT_FALSE(std::filesystem::exists(repository)) << repository << " was left behind";
}

TEST(CollabserveBinaryTest, ReportsABadRepository) {
  std::string out;
  const int rc = RunCommand(Bin("collabserve") +
                                " --port=0 --metrics_port=-1 --http_port=-1 --model_repository=/nonexistent/repo 2>&1",
                            &out);
  EXPECT_EQ(rc, 1);
  EXPECT_THAT(out, HasSubstr("/nonexistent/repo"));
  // The allocator it was built with is the one it runs on (a linker that drops unreferenced
  // libraries once left it on glibc's malloc with jemalloc on its link line).
  EXPECT_THAT(out, HasSubstr("allocator: " COLLABSERVE_SERVER_ALLOCATOR));

  // An empty repository serves (uploads fill it), and says what a model's files look like.
  TempDir empty, work;
  ServerProcess server({"--port=0", "--metrics_port=-1", "--host=127.0.0.1",
                        "--model_repository=" + empty.path(), "--poll_interval_s=0"},
                       work.path() + "/stderr.log");
  ASSERT_TRUE(server.serving());
  std::ifstream in(work.path() + "/stderr.log");
  const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(log, HasSubstr("serving 0 of 0 model(s) from " + empty.path() +
                             ": it holds no model yet (a model is MODEL/VERSION/, e.g. " +
                             empty.path() + "/mymodel/1/config.json); --poll_interval_s=0: it is "
                             "not scanned again"));
}

// A version that cannot load is logged once, with its path and where its file is wrong; the start-up
// summary names it; `collabctl models` lists it with its error; a call for it says why, once.
// A checkpoint put straight into its model directory gets one message that says where it belongs.
TEST(CollabserveBinaryTest, ABrokenVersionIsLoggedOnceAndListedWithItsError) {
  TempDir repo;
  MakeTinyModel(repo.path() + "/good/1", 1);
  MakeTinyModel(repo.path() + "/bad/1", 2);
  MakeTinyModel(repo.path() + "/flat", 3);
  {
    std::ofstream config(repo.path() + "/bad/1/config.json", std::ios::trunc);
    config << "{\n  \"hidden_size\": 3";
  }
  TempDir work;
  const std::string log = work.path() + "/stderr.log";
  ServerProcess server({"--port=0", "--metrics_port=0", "--host=127.0.0.1",
                        "--model_repository=" + repo.path(), "--poll_interval_s=0"},
                       log);
  ASSERT_TRUE(server.serving());
  // /metrics: what an alert on a model with no version serving reads.
  absl::StatusOr<std::string> scraped = testing::ScrapeMetrics(server.metrics_port());
  ASSERT_TRUE(scraped.ok()) << scraped.status();
  std::map<std::string, double> metrics = testing::ParseMetrics(*scraped);
  EXPECT_EQ(metrics["collabserve_model_versions{model=\"bad\",state=\"failed\"}"], 1);
  EXPECT_EQ(metrics["collabserve_model_versions{model=\"bad\",state=\"available\"}"], 0);
  EXPECT_EQ(metrics.count("collabserve_model_versions{model=\"bad\",state=\"available\"}"), 1u);
  EXPECT_EQ(metrics["collabserve_model_versions{model=\"good\",state=\"available\"}"], 1);
  EXPECT_EQ(metrics["collabserve_model_versions{model=\"good\",state=\"failed\"}"], 0);
  const std::string why = "config.json: not valid JSON: parse error at line 2, column 1";
  std::string text;
  {
    std::ifstream in(log);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  size_t logged = 0;
  for (size_t at = text.find(why); at != std::string::npos; at = text.find(why, at + 1)) ++logged;
  EXPECT_EQ(logged, 1u) << text;
  EXPECT_THAT(text, HasSubstr("cannot load bad:1 from " + repo.path() + "/bad/1"));
  EXPECT_THAT(text, HasSubstr("serving 1 of 2 model(s) from " + repo.path() +
                              "; failed to load: bad:1"));
  EXPECT_THAT(text, HasSubstr("ignoring " + repo.path() + "/flat: it holds a checkpoint's files "
                              "(config.json), but each version is a directory named by its "
                              "number: move them into " + repo.path() + "/flat/1/"));
  EXPECT_THAT(text, Not(HasSubstr("/flat/config.json"))) << "one message for the directory";

  const std::string ctl = Bin("collabctl") + " --address=" + server.address();
  std::string out;
  EXPECT_EQ(RunCommand(ctl + " models", &out), 0);
  EXPECT_THAT(out, HasSubstr("bad\tversions \n\tversion 1 failed: INVALID_ARGUMENT: loading bad:1"));
  EXPECT_THAT(out, HasSubstr(why));
  EXPECT_THAT(out, HasSubstr("good\tversions 1\n"));

  EXPECT_EQ(RunCommand(ctl + " classify --model=bad 'x' 2>&1", &out), 1);
  EXPECT_THAT(out, HasSubstr("NOT_FOUND: model \"bad\" has no available version (version 1 failed "
                             "to load: loading bad:1 from " + repo.path() + "/bad/1: "));
  EXPECT_THAT(out, HasSubstr(why));
  EXPECT_THAT(out, Not(HasSubstr("no version is available"))) << "said twice";
  EXPECT_EQ(out.find("bad:1"), out.rfind("bad:1")) << "named twice: " << out;
}

// glog's verbose log from the command line: --v and --vmodule (the Helm chart's extraArgs example
// passes --v=1), over GLOG_v when given, GLOG_v's level when not.
TEST(CollabserveBinaryTest, VerboseLogFlagsReachGlog) {
  TempDir repo;
  MakeTinyModel(repo.path() + "/tiny/1", 1);
  TempDir work;
  struct Case {
    std::vector<std::string> flags;
    std::vector<std::string> env;
    bool logged;  // VLOG(1) in model_repository.cc
  };
  const Case cases[] = {
      {{}, {}, false},
      {{"--v=1"}, {}, true},
      {{"--vmodule=model_repo*=1"}, {}, true},
      {{"--vmodule=batch_scheduler=1,model_repository=1"}, {}, true},
      {{"--v=1", "--vmodule=model_repository=0,model_*=1"}, {}, false},  // the first match wins
      {{}, {"GLOG_v=1"}, true},
      {{"--v=0"}, {"GLOG_v=1"}, false},
  };
  int i = 0;
  for (const Case& c : cases) {
    const std::string log = absl::StrCat(work.path(), "/stderr", i++, ".log");
    std::vector<std::string> args = {"--port=0", "--metrics_port=-1", "--host=127.0.0.1",
                                     "--model_repository=" + repo.path()};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    const std::string what = absl::StrCat(absl::StrJoin(c.env, " "), " ", absl::StrJoin(c.flags, " "));
    ServerProcess server(args, log, nullptr, "", c.env);
    ASSERT_TRUE(server.serving()) << what;
    EXPECT_EQ(server.Terminate(), 0) << what;
    std::ifstream in(log);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(absl::StrContains(text, "model repository: loaded tiny:1 from"), c.logged)
        << what << ":\n" << text;
  }
}

// --cpus sizes the threads for the CPUs given (a container with a request and no limit sees the
// whole node): one CPU plans one batch thread of one intra-op thread.
TEST(CollabserveBinaryTest, CpusSizesTheThreads) {
  TempDir repo;
  MakeTinyModel(repo.path() + "/tiny/1", 1);
  TempDir work;
  const std::string log = work.path() + "/stderr.log";
  ServerProcess server({"--port=0", "--metrics_port=-1", "--host=127.0.0.1",
                        "--model_repository=" + repo.path(), "--cpus=1"},
                       log);
  ASSERT_TRUE(server.serving());
  EXPECT_EQ(server.Terminate(), 0);
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("--cpus=1: threads sized for 1 CPU(s)"));
  EXPECT_THAT(text, HasSubstr("inference threads: 1 batch thread(s) per model version x 1 intra-op thread(s)"));
}

// collabserve-model's JSON-lines commands answer each bad line with an error that names the line and
// where its JSON is wrong, in place of its result, and go on; the exit status says lines failed.
TEST(CollabserveBinaryTest, TheOfflineToolNamesABadInputLine) {
  TempDir work;
  const std::string m = work.path() + "/m";
  MakeTinyModel(m, 1);
  // Writes `contents` to work/NAME and returns its path.
  auto file = [&](const std::string& name, const std::string& contents) {
    std::ofstream(work.path() + "/" + name) << contents;
    return work.path() + "/" + name;
  };
  const std::string tool = Bin("collabserve-model");
  std::string out;
  std::vector<std::string> lines;
  auto predict = [&](const std::string& input) {
    const int rc = RunCommand(tool + " predict --model " + m + " < " + input + " 2>/dev/null", &out);
    lines = absl::StrSplit(out, '\n', absl::SkipEmpty());
    return rc;
  };
  auto evaluate = [&](const std::string& data) {
    return RunCommand(tool + " evaluate --model " + m + " --data " + data + " 2>&1", &out);
  };

  EXPECT_EQ(predict(file("in.jsonl", "{\"text\": \"fine\"}\n{\"text\": 3}\n{\"text\": \"a\",}\n[1]\n\n{\"text\": \"ok\"}\n")), 1);
  ASSERT_EQ(lines.size(), 5u) << out;
  EXPECT_THAT(lines[0], HasSubstr("\"logits\""));
  EXPECT_THAT(lines[1], HasSubstr("{\"error\":\"line 2: "));
  EXPECT_THAT(lines[2], HasSubstr("{\"error\":\"line 3: not valid JSON: parse error at column 14"));
  EXPECT_THAT(lines[3], HasSubstr("{\"error\":\"line 4: not a JSON object"));
  EXPECT_THAT(lines[4], HasSubstr("\"logits\""));

  EXPECT_EQ(evaluate(file("data.jsonl", "{\"text\": \"fine\", \"label\": \"positive\"}\n"
                                        "{\"text\": \"bad\", \"label\": \"negative\"\n")),
            1);
  EXPECT_THAT(out, HasSubstr(work.path() + "/data.jsonl:2: not valid JSON: parse error at column"));

  // Inputs the engine refuses are refused line by line: the good lines of the same batch are
  // answered (they used to fail with the batch, naming no line), and an id past 32 bits is refused
  // rather than wrapped.
  EXPECT_EQ(predict(file("ids.jsonl", "{\"text\": \"a\"}\n{\"input_ids\": [101, 99999999, 102]}\n"
                                      "{\"text\": \"b\"}\n{\"input_ids\": [5000000000]}\n"
                                      "{\"input_ids\": [101, 102], \"token_type_ids\": [0, 9]}\n")),
            1);
  ASSERT_EQ(lines.size(), 5u) << out;
  EXPECT_THAT(lines[0], HasSubstr("\"logits\""));
  EXPECT_THAT(lines[1], HasSubstr("line 2: token id 99999999 is outside the vocabulary"));
  EXPECT_THAT(lines[2], HasSubstr("\"logits\""));
  EXPECT_THAT(lines[3], HasSubstr("line 4: \\\"input_ids\\\": 5000000000 is out of range"));
  EXPECT_THAT(lines[4], HasSubstr("line 5: token type 9 is outside [0, 2)"));
  // evaluate: FILE:LINE for a label the model lacks, blank lines counted.
  EXPECT_EQ(evaluate(file("labels.jsonl", "{\"text\": \"fine\", \"label\": \"positive\"}\n\n"
                                          "{\"text\": \"x\", \"label\": \"neutral\"}\n")),
            1);
  EXPECT_THAT(out, HasSubstr("labels.jsonl:3: label 'neutral' is not one of the model's"));
}

// evaluate --reference compares two models as the reference serves its outputs, as the compression
// measures fidelity: a multi-label model's texts agree when every label's decision (logit > 0)
// does and its KL is the sum of Bernoulli KLs (it was argmax and sum p·log(p/q) over sigmoids,
// which is no KL); a regression model has no agreement or KL (null), only max |Δ logit|.
TEST(CollabserveBinaryTest, EvaluateComparesAsTheReferenceServesItsOutputs) {
  TempDir work;
  const std::string tool = Bin("collabserve-model");
  const std::string data = work.path() + "/data.jsonl";
  {
    std::ofstream in(data);
    for (const char* t : {"a fine film", "dreadful", "the plot, the cast and the score", "meh", "x y z",
                          "an utterly forgettable afternoon", "best of the year"}) {
      in << nlohmann::json{{"text", t}}.dump() << "\n";
    }
  }
  std::string out;
  auto make = [&](const std::string& dir, const std::string& problem, int labels, int seed) {
    ASSERT_EQ(RunCommand(absl::StrCat(tool, " make --out ", dir, " --preset tiny --problem_type ", problem,
                                      " --labels ", labels, " --seed ", seed, " 2>&1"),
                         &out),
              0)
        << out;
  };
  auto logits = [&](const std::string& dir) {
    std::vector<std::vector<double>> rows;
    EXPECT_EQ(RunCommand(tool + " predict --model " + dir + " < " + data + " 2>/dev/null", &out), 0) << out;
    for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
      rows.push_back(nlohmann::json::parse(line)["logits"].get<std::vector<double>>());
    }
    return rows;
  };
  auto evaluate = [&](const std::string& m, const std::string& ref) {
    EXPECT_EQ(RunCommand(tool + " evaluate --model " + m + " --reference " + ref + " --data " + data + " 2>/dev/null",
                         &out),
              0)
        << out;
    return nlohmann::json::parse(out);
  };

  // b is single-label (softmax) with a's labels: compared as the reference a serves (sigmoid).
  const std::string a = work.path() + "/a", b = work.path() + "/b";
  make(a, "multi_label_classification", 4, 1);
  make(b, "single_label_classification", 4, 2);
  const auto la = logits(a), lb = logits(b);
  ASSERT_EQ(la.size(), 7u);
  ASSERT_EQ(lb.size(), 7u);
  double agree = 0, kl = 0, diff = 0;
  for (size_t i = 0; i < la.size(); ++i) {
    bool all = true;
    for (size_t c = 0; c < la[i].size(); ++c) {
      all = all && ((la[i][c] > 0) == (lb[i][c] > 0));
      const double p = 1 / (1 + std::exp(-la[i][c])), q = 1 / (1 + std::exp(-lb[i][c]));
      kl += p * std::log(p / q) + (1 - p) * std::log((1 - p) / (1 - q));
      diff = std::max(diff, std::abs(la[i][c] - lb[i][c]));
    }
    agree += all;
  }
  nlohmann::json r = evaluate(b, a);
  EXPECT_DOUBLE_EQ(r["top1_agreement"].get<double>(), agree / 7) << r;
  EXPECT_NEAR(r["mean_kl"].get<double>(), kl / 7, 1e-5) << r;
  EXPECT_NEAR(r["max_abs_logit_diff"].get<double>(), diff, 1e-5) << r;
  EXPECT_LE(r["top1_agreement_lower95"].get<double>(), agree / 7) << r;
  r = evaluate(a, a);
  EXPECT_DOUBLE_EQ(r["top1_agreement"].get<double>(), 1.0) << r;
  EXPECT_DOUBLE_EQ(r["mean_kl"].get<double>(), 0.0) << r;

  const std::string ra = work.path() + "/ra", rb = work.path() + "/rb";
  make(ra, "regression", 1, 1);
  make(rb, "regression", 1, 2);
  r = evaluate(rb, ra);
  EXPECT_TRUE(r["top1_agreement"].is_null()) << r;
  EXPECT_TRUE(r["mean_kl"].is_null()) << r;
  EXPECT_GT(r["max_abs_logit_diff"].get<double>(), 0) << r;
}

// collabserve-model's flags: a flag without its value, a value past 32 bits, a bad label list or
// noise, an unknown command are refused by name; make never writes into an existing directory and
// leaves nothing behind when it fails.
TEST(CollabserveBinaryTest, TheOfflineToolRefusesBadFlagsAndKeepsAnExistingCheckpoint) {
  TempDir work;
  const std::string tool = Bin("collabserve-model");
  const std::string m = work.path() + "/m";
  const std::pair<std::string, std::string> cases[] = {
      {"make --out --preset tiny", "--out needs a value"},
      {"make --out=", "--out needs a value"},
      {"make --out " + m + " --labels 4294967298", "--labels = 4294967298 is out of range"},
      {"make --out " + m + " --planted_rank 8 --planted_noise nan", "--planted_noise must be a finite number"},
      {"make --out " + m + " --label_names a,,b", "a name is empty"},
      {"make --out " + m + " --label_names a,b,a", "'a' comes twice"},
      {"make --out " + m + " --labels 3 --label_names a,b", "--labels 3 but --label_names has 2 names"},
      {"make --out " + m + " --planted_rank 1000", "--planted_rank must be in [0, 64]"},
      {"predict --model", "--model needs a value"},
      {"bogus", "unknown command 'bogus'"},
  };
  std::string out;
  for (const auto& [args, message] : cases) {
    EXPECT_NE(RunCommand("cd " + work.path() + " && " + tool + " " + args + " 2>&1", &out), 0) << args;
    EXPECT_THAT(out, HasSubstr(message)) << args;
  }
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(work.path())) left.push_back(e.path().filename());
  EXPECT_THAT(left, ::testing::IsEmpty()) << "a refused or failed make left files behind";

  ASSERT_EQ(RunCommand(tool + " make --out " + m + " --seed 1", &out), 0) << out;
  EXPECT_EQ(RunCommand(tool + " make --out " + m + "/ --seed 5 --format bin 2>&1", &out), 1);
  EXPECT_THAT(out, HasSubstr("already exists; choose a new output directory"));
  EXPECT_FALSE(std::filesystem::exists(m + "/pytorch_model.bin")) << "written into the existing one";
  // make takes predict's dtype names too.
  EXPECT_EQ(RunCommand(tool + " make --out " + m + "-half --dtype float16", &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("\"dtype\":\"f16\""));
  EXPECT_EQ(RunCommand(tool + " inspect --model " + m, &out), 0);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << "one JSON line: " << out;
}

// A flag that every model's load, or the serving itself, would refuse stops the server at start-up,
// naming the flag, before it listens: not a server that reports SERVING with no model loaded, or
// listens on another port than asked.
// Mutual TLS end to end: collabctl with a certificate the client CA issued reaches the inference
// port and the admin port (its own, --admin_port); without one it is refused on both.
TEST(CollabserveBinaryTest, MutualTlsOnBothPortsWithCollabctl) {
  TempDir repo, certs;
  MakeTinyModel(repo.path() + "/tiny/1", 1);
  const std::string d = certs.path() + "/";
  const std::string make =
      "cd " + d + " && openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
      "-addext subjectAltName=DNS:localhost -keyout server.key -out server.crt && "
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=clients-ca -keyout ca.key -out ca.crt && "
      "openssl req -new -newkey rsa:2048 -nodes -subj /CN=client -keyout client.key -out client.csr && "
      "openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -out client.crt";
  std::string out;
  ASSERT_EQ(RunCommand("(" + make + ") >/dev/null 2>&1", &out), 0) << "openssl could not make the certificates";
  ASSERT_TRUE(util::WriteFileAtomic(d + "token", "mtls-token\n").ok());
  // A free port for the admin service (0 would put it on the inference port).
  int admin_port = 0;
  {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
    admin_port = ntohs(a.sin_port);
    close(fd);
  }
  ServerProcess server({"--port=0", "--metrics_port=-1", "--host=127.0.0.1", "--poll_interval_s=0",
                        "--model_repository=" + repo.path(), "--tls_cert=" + d + "server.crt",
                        "--tls_key=" + d + "server.key", "--tls_client_ca=" + d + "ca.crt",
                        "--admin_token_file=" + d + "token", absl::StrCat("--admin_port=", admin_port)});
  ASSERT_TRUE(server.serving());
  const std::string tls = " --tls --tls_ca_file=" + d + "server.crt --deadline_ms=5000";
  const std::string mine = " --tls_client_cert=" + d + "client.crt --tls_client_key=" + d + "client.key";
  const std::string inference = Bin("collabctl") + absl::StrCat(" --address=localhost:", server.port()) + tls;
  const std::string admin = Bin("collabctl") + absl::StrCat(" --address=localhost:", admin_port) + tls +
                            " --token_file=" + d + "token";
  EXPECT_EQ(RunCommand(inference + mine + " classify --model=tiny 'hello' 2>&1", &out), 0) << out;
  EXPECT_EQ(RunCommand(admin + mine + " jobs 2>&1", &out), 0) << out;
  EXPECT_NE(RunCommand(inference + " health 2>&1", &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("UNAVAILABLE"));
  EXPECT_NE(RunCommand(admin + " jobs 2>&1", &out), 0) << out;
  // The client's key and certificate swapped: refused as well, before any call.
  EXPECT_NE(RunCommand(inference + " --tls_client_cert=" + d + "client.key --tls_client_key=" + d +
                           "client.crt health 2>&1", &out), 0);
}

TEST(CollabserveBinaryTest, RefusesABadFlagBeforeListening) {
  TempDir repo;
  MakeTinyModel(repo.path() + "/tiny/1", 1);
  const std::pair<std::string, std::string> cases[] = {
      {"--port=70000", "--port=70000 is not a port number"},
      {"--metrics_port=-2", "--metrics_port=-2 is not a port number"},
      {"--max_batch_size=0", "--max_batch_size = 0; it must be >= 1"},
      {"--max_queue_delay_micros=-1", "--max_queue_delay_micros = -1"},
      {"--cpus=-1", "--cpus=-1 must be 0 (detected) or 1 to 4096"},
      {"--device=tpu", "device 'tpu' is not cpu, cuda or cuda:N"},
      {"--dtype=int8", "dtype 'int8' is not float32"},
      {"--cuda_graph_max_tokens=-1", "cuda_graph_max_tokens is -1"},
      {"--num_batch_threads=-1", "--num_batch_threads=-1 must be 0 (automatic) or 1 to 1024"},
      {"--inference_threads=100000", "--inference_threads=100000 must be"},
      {"--drain_timeout_s=nan", "--drain_timeout_s=nan is not a number of seconds"},
      {"--drain_timeout_s=-1", "--drain_timeout_s must not be negative"},
      {"--vmodule=model_repository", "'model_repository' is not PATTERN=N"},
      {"--vmodule=a=1,=2", "--vmodule=a=1,=2: '=2' is not PATTERN=N"},
      {"--admin_port=70000 --admin_token_file=" + repo.path() + "/tiny/1/vocab.txt",
       "--admin_port=70000 is not a port number"},
      {"--tls_client_ca=/etc/hostname", "--tls_client_ca needs --tls_cert and --tls_key"},
      {"--tls_cert=/none.crt --tls_key=/none.key", "--tls_cert: /none.crt: no such file"},
      {"--tls_reload_s=0.5", "--tls_reload_s=0.5 is not within 1-86400"},
      {"--keepalive_timeout_s=0", "--keepalive_timeout_s=0 is not within 0.001 to 2147483 seconds"},
      {"--keepalive_min_client_ping_s=2592000", "--keepalive_min_client_ping_s=2592000 is not within 0 to"},
      {"--http_port=70000", "--http_port=70000 must be 0 (pick) to 65535, or -1 for none"},
      {"--http_max_connections=0", "--http_max_connections=0 must be 1 to 65536"},
      {"--http_idle_timeout_s=0", "--http_idle_timeout_s=0 must be 0.001 to 86400"},
  };
  for (const auto& [flag, message] : cases) {
    std::string out;
    const int rc = RunCommand("timeout 60 " + Bin("collabserve") + " --port=0 --metrics_port=-1 --http_port=-1 " +
                                  "--model_repository=" + repo.path() + " " + flag + " 2>&1",
                              &out);
    EXPECT_EQ(rc, 1) << flag << ":\n" << out;
    EXPECT_THAT(out, HasSubstr(message)) << flag;
    EXPECT_THAT(out, ::testing::Not(HasSubstr("listening on"))) << flag;
  }
}

}  // namespace
}  // namespace collabserve

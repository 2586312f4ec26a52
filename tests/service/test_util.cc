#include "tests/service/test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/model/checkpoint_maker.h"

namespace collabserve::testing {

void MakeTinyModel(const std::string& dir, uint64_t seed) {
  model::MakeOptions o;
  o.preset = "tiny";
  o.labels = 2;
  o.label_names = {"negative", "positive"};
  o.seed = seed;
  absl::Status s = model::MakeCheckpoint(dir, o);
  ASSERT_TRUE(s.ok()) << s;
}

void Gate::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}
void Gate::Open() {
  absl::MutexLock lock(&mu_);
  closed_ = false;
}
void Gate::Pass() {
  absl::MutexLock lock(&mu_);
  ++arrivals_;
  mu_.Await(absl::Condition(
      +[](bool* closed) { return !*closed; }, &closed_));
}
bool Gate::WaitForArrivals(int n) {
  absl::MutexLock lock(&mu_);
  auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return arrivals_ >= n; };
  return mu_.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(30));
}

absl::StatusOr<HttpAnswer> HttpGet(int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::UnavailableError("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to metrics port ", port));
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  ::send(fd, request.data(), request.size(), 0);
  std::string response;
  char buf[65536];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) response.append(buf, n);
  ::close(fd);
  const size_t body = response.find("\r\n\r\n");
  HttpAnswer answer;
  if (response.rfind("HTTP/1.", 0) != 0 || body == std::string::npos || response.size() < 12 ||
      !absl::SimpleAtoi(response.substr(9, 3), &answer.code)) {
    return absl::InternalError("not an HTTP response: " + response.substr(0, 200));
  }
  answer.body = response.substr(body + 4);
  return answer;
}

absl::StatusOr<std::string> ScrapeMetrics(int port) {
  absl::StatusOr<HttpAnswer> answer = HttpGet(port, "/metrics");
  if (!answer.ok()) return answer.status();
  if (answer->code != 200) return absl::InternalError(absl::StrCat("HTTP error: ", answer->code));
  return answer->body;
}

std::map<std::string, double> ParseMetrics(const std::string& text) {
  std::map<std::string, double> samples;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) {
      ADD_FAILURE() << "metrics line without a value: " << line;
      continue;
    }
    double value = 0;
    const std::string v = line.substr(space + 1);
    if (v == "+Inf") {
      value = HUGE_VAL;
    } else if (!absl::SimpleAtod(v, &value)) {
      ADD_FAILURE() << "metrics line with a bad value: " << line;
      continue;
    }
    samples[line.substr(0, space)] = value;
  }
  return samples;
}

}  // namespace collabserve::testing

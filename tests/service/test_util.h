// Helpers for the service and integration tests: temporary model repositories with tiny
// checkpoints, a gate to hold the batch thread, and a /metrics scraper.
#ifndef COLLABSERVE_TESTS_SERVICE_TEST_UTIL_H_
#define COLLABSERVE_TESTS_SERVICE_TEST_UTIL_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "tests/testing/test_util.h"

// TempDir comes from the shared test helpers (one definition for every test).
namespace collabserve::testing {

// Writes a tiny random-weight checkpoint (labels negative/positive) to `dir`.
void MakeTinyModel(const std::string& dir, uint64_t seed);

// Holds the batch thread inside ServableOptions::before_batch_hook while closed.
class Gate {
 public:
  void Close();
  void Open();
  // The hook: counts the arrival and waits while the gate is closed.
  void Pass();
  // Waits until `n` batches have arrived at the gate in total (false after 30 s).
  bool WaitForArrivals(int n);

 private:
  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  int arrivals_ ABSL_GUARDED_BY(mu_) = 0;
};

struct HttpAnswer {
  int code = 0;
  std::string body;
};
// GET `path` on 127.0.0.1:`port` (the metrics port): the status code and body.
absl::StatusOr<HttpAnswer> HttpGet(int port, const std::string& path);
// GET http://127.0.0.1:port/metrics; the body (an error for a code other than 200).
absl::StatusOr<std::string> ScrapeMetrics(int port);

// Sample lines of the Prometheus text format: "name{labels}" -> value. Fails the test on a line
// that does not parse.
std::map<std::string, double> ParseMetrics(const std::string& text);

// Polls `condition` every 2 ms for up to 30 s.
template <typename F>
bool Eventually(F condition) {
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (absl::Now() < give_up) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return condition();
}

}  // namespace collabserve::testing

#endif  // COLLABSERVE_TESTS_SERVICE_TEST_UTIL_H_

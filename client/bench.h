// Closed-loop load generator: `concurrency` workers, each sending one Classify at a time and the
// next as soon as the previous answers, for a bounded time and count. By default the workers are
// gRPC callback-API loops (no thread per worker), so that the generator costs the machine it
// shares with the server little CPU; BenchApi::kThreads keeps one blocking thread per worker;
// BenchApi::kStream sends the same requests as messages of ClassifyStream calls (the workers
// spread over a few long-lived streams), which spares the per-call gRPC work of a unary call.
#ifndef COLLABSERVE_CLIENT_BENCH_H_
#define COLLABSERVE_CLIENT_BENCH_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"

namespace collabserve::client {

enum class BenchApi {
  kCallback,  // each worker starts its next call from the previous call's completion callback
  kThreads,   // a thread per worker, blocking in Client::Classify
  kStream,    // workers share `streams` ClassifyStream calls; each keeps one request in flight
};

struct BenchOptions {
  std::string model = "demo";
  int concurrency = 4;
  double duration_s = 10;
  // Stop after this many requests in total (0 = only the duration bounds the run).
  int64_t max_requests = 0;
  // Token counts of the generated inputs (including [CLS]/[SEP]), used round-robin.
  std::vector<int> lengths = {32};
  int inputs_per_request = 1;
  std::chrono::milliseconds deadline{30000};
  BenchApi api = BenchApi::kCallback;
  // kStream only: how many ClassifyStream calls carry the workers (spread evenly); 0 = one per 16
  // workers (the server reads at most --stream_max_pending_responses, 32 by default, ahead on a
  // stream). Each stream's deadline is the run's duration plus `deadline`.
  int streams = 0;
};

struct BenchResult {
  int64_t requests = 0;  // completed OK
  int64_t errors = 0;
  std::string first_error;
  double elapsed_s = 0;
  double requests_per_s = 0;
  double inputs_per_s = 0;
  double p50_ms = 0, p90_ms = 0, p99_ms = 0;
  // CPU time (user + system) this process spent while the load ran: the load generator's own cost,
  // which on a machine shared with the server is taken from the server.
  double client_cpu_s = 0;
};

// Text that the bert-base-uncased vocabulary splits into exactly `num_tokens - 2` word pieces (one
// per word), so that with [CLS]/[SEP] the model sees `num_tokens` tokens. `seed` varies the words.
std::string MakeText(int num_tokens, uint64_t seed);

// Runs the load. INVALID_ARGUMENT for bad options; call errors are counted, not returned.
absl::StatusOr<BenchResult> RunBench(const Client& client, const BenchOptions& options);

}  // namespace collabserve::client

#endif  // COLLABSERVE_CLIENT_BENCH_H_

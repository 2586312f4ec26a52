// C++ client for collabserve: a channel with the server's options and thin, deadline-bounded
// wrappers over the Inference and Health stubs. Errors come back as absl::Status with the server's
// code and message.
#ifndef COLLABSERVE_CLIENT_CLIENT_H_
#define COLLABSERVE_CLIENT_CLIENT_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "client/tls.h"
#include "grpcpp/channel.h"

namespace collabserve::client {

// Retries of calls that fail with UNAVAILABLE (server unreachable, restarting or draining) or
// RESOURCE_EXHAUSTED (its queue is full). Every Client call is safe to repeat: none changes the
// server's state. Attempts are spaced by exponential backoff with jitter (each wait is drawn
// uniformly from [backoff / 2, backoff]) and stay inside the call's one deadline: a wait that would
// end past the deadline is not started and the last error is returned.
struct RetryOptions {
  // Attempts in all, the first included; 1 disables retries.
  int max_attempts = 5;
  std::chrono::milliseconds initial_backoff{50};
  std::chrono::milliseconds max_backoff{2000};
  double backoff_multiplier = 2.0;
  // Called before each wait with the error of the attempt that just failed and its number (1, 2,
  // ...). For logging and tests; may be empty.
  std::function<void(const absl::Status& error, int attempt)> on_retry;
};

struct ClientOptions {
  // "host:port".
  std::string address = "127.0.0.1:8500";
  // Deadline applied to each call unless the call gives its own.
  std::chrono::milliseconds default_deadline{10000};
  // Largest message sent or received (bytes).
  int max_message_bytes = 64 << 20;
  // TLS (off by default), mutual TLS with a client certificate.
  ClientTls tls;
  // Wait for the channel to connect in Create (up to default_deadline); UNAVAILABLE otherwise.
  bool wait_for_connection = false;
  RetryOptions retry;
};

// Thread-safe: one Client may be used from many threads (gRPC channels and stubs are).
class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Create(const ClientOptions& options);

  // Each call uses `deadline` if non-zero, else options.default_deadline; the deadline covers all
  // of its attempts (see RetryOptions).
  absl::StatusOr<v1::ClassifyResponse> Classify(const v1::ClassifyRequest& request,
                                                std::chrono::milliseconds deadline = {}) const;
  absl::StatusOr<v1::TokenizeResponse> Tokenize(const v1::TokenizeRequest& request,
                                                std::chrono::milliseconds deadline = {}) const;
  absl::StatusOr<v1::ListModelsResponse> ListModels(std::chrono::milliseconds deadline = {}) const;
  absl::StatusOr<v1::ModelMetadata> GetModel(const std::string& model,
                                             std::chrono::milliseconds deadline = {}) const;
  // grpc.health.v1 Check for `service` ("" = the whole server). Returns true iff SERVING; an RPC
  // error (e.g. NOT_FOUND for an unknown service, UNAVAILABLE when unreachable) is returned as is.
  absl::StatusOr<bool> IsServing(const std::string& service = "",
                                 std::chrono::milliseconds deadline = {}) const;

  v1::Inference::Stub* stub() const { return stub_.get(); }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  const ClientOptions& options() const { return options_; }

 private:
  Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel);
  // Runs `attempt` (one RPC on the context it is given) until it succeeds, fails with a code that
  // is not retried, runs out of attempts, or the next wait would pass the deadline.
  absl::Status CallWithRetries(std::chrono::milliseconds deadline,
                               const std::function<grpc::Status(grpc::ClientContext*)>& attempt) const;

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Inference::Stub> stub_;
};

}  // namespace collabserve::client

#endif  // COLLABSERVE_CLIENT_CLIENT_H_

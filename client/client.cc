#include "client/client.h"

#include <algorithm>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace collabserve::client {
namespace {

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

bool Retryable(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::RESOURCE_EXHAUSTED;
}

// Uniform in [backoff / 2, backoff]: spreads clients that failed together without ever waiting
// much less than asked.
std::chrono::milliseconds Jittered(std::chrono::milliseconds backoff) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  const int64_t hi = std::max<int64_t>(backoff.count(), 1);
  std::uniform_int_distribution<int64_t> dist(hi / 2, hi);
  return std::chrono::milliseconds(dist(rng));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Create(const ClientOptions& options) {
  if (options.address.empty()) return absl::InvalidArgumentError("client address is empty");
  const RetryOptions& r = options.retry;
  if (r.max_attempts < 1 || r.initial_backoff.count() < 0 || r.max_backoff < r.initial_backoff ||
      r.backoff_multiplier < 1) {
    return absl::InvalidArgumentError(
        "retry options: need max_attempts >= 1, 0 <= initial_backoff <= max_backoff and "
        "backoff_multiplier >= 1");
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  auto channel = grpc::CreateCustomChannel(options.address, ChannelCredentials(options.tls), args);
  if (options.wait_for_connection &&
      !channel->WaitForConnected(std::chrono::system_clock::now() + options.default_deadline)) {
    return absl::UnavailableError(absl::StrCat("cannot connect to ", options.address, " within ",
                                               options.default_deadline.count(), " ms"));
  }
  return std::unique_ptr<Client>(new Client(options, std::move(channel)));
}

Client::Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::Inference::NewStub(channel_)) {}

absl::Status Client::CallWithRetries(
    std::chrono::milliseconds deadline,
    const std::function<grpc::Status(grpc::ClientContext*)>& attempt) const {
  if (deadline.count() <= 0) deadline = options_.default_deadline;
  const auto give_up = std::chrono::system_clock::now() + deadline;
  const RetryOptions& retry = options_.retry;
  std::chrono::milliseconds backoff = retry.initial_backoff;
  for (int n = 1;; ++n) {
    grpc::ClientContext context;
    context.set_deadline(give_up);
    const grpc::Status s = attempt(&context);
    if (s.ok() || !Retryable(s.error_code()) || n >= retry.max_attempts) return FromGrpc(s);
    const std::chrono::milliseconds wait = Jittered(backoff);
    if (std::chrono::system_clock::now() + wait >= give_up) return FromGrpc(s);
    if (retry.on_retry) retry.on_retry(FromGrpc(s), n);
    std::this_thread::sleep_for(wait);
    backoff = std::min(retry.max_backoff,
                       std::chrono::milliseconds(static_cast<int64_t>(
                           static_cast<double>(backoff.count()) * retry.backoff_multiplier)));
  }
}

absl::StatusOr<v1::ClassifyResponse> Client::Classify(const v1::ClassifyRequest& request,
                                                      std::chrono::milliseconds deadline) const {
  v1::ClassifyResponse response;
  absl::Status s = CallWithRetries(deadline, [&](grpc::ClientContext* context) {
    response.Clear();
    return stub_->Classify(context, request, &response);
  });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::TokenizeResponse> Client::Tokenize(const v1::TokenizeRequest& request,
                                                      std::chrono::milliseconds deadline) const {
  v1::TokenizeResponse response;
  absl::Status s = CallWithRetries(deadline, [&](grpc::ClientContext* context) {
    response.Clear();
    return stub_->Tokenize(context, request, &response);
  });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::ListModelsResponse> Client::ListModels(std::chrono::milliseconds deadline) const {
  v1::ListModelsResponse response;
  absl::Status s = CallWithRetries(deadline, [&](grpc::ClientContext* context) {
    response.Clear();
    return stub_->ListModels(context, v1::ListModelsRequest(), &response);
  });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::ModelMetadata> Client::GetModel(const std::string& model,
                                                   std::chrono::milliseconds deadline) const {
  v1::GetModelRequest request;
  request.set_model_name(model);
  v1::ModelMetadata response;
  absl::Status s = CallWithRetries(deadline, [&](grpc::ClientContext* context) {
    response.Clear();
    return stub_->GetModel(context, request, &response);
  });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<bool> Client::IsServing(const std::string& service,
                                       std::chrono::milliseconds deadline) const {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  absl::Status s = CallWithRetries(deadline, [&](grpc::ClientContext* context) {
    response.Clear();
    return health->Check(context, request, &response);
  });
  if (!s.ok()) return s;
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

}  // namespace collabserve::client

#include "client/client.h"

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

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Create(const ClientOptions& options) {
  if (options.address.empty()) return absl::InvalidArgumentError("client address is empty");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (options.use_tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.root_certs_pem;
    creds = grpc::SslCredentials(ssl);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  auto channel = grpc::CreateCustomChannel(options.address, creds, args);
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

void Client::SetDeadline(grpc::ClientContext* context, std::chrono::milliseconds deadline) const {
  if (deadline.count() <= 0) deadline = options_.default_deadline;
  context->set_deadline(std::chrono::system_clock::now() + deadline);
}

absl::StatusOr<v1::ClassifyResponse> Client::Classify(const v1::ClassifyRequest& request,
                                                      std::chrono::milliseconds deadline) const {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::ClassifyResponse response;
  grpc::Status s = stub_->Classify(&context, request, &response);
  if (!s.ok()) return FromGrpc(s);
  return response;
}

absl::StatusOr<v1::TokenizeResponse> Client::Tokenize(const v1::TokenizeRequest& request,
                                                      std::chrono::milliseconds deadline) const {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::TokenizeResponse response;
  grpc::Status s = stub_->Tokenize(&context, request, &response);
  if (!s.ok()) return FromGrpc(s);
  return response;
}

absl::StatusOr<v1::ListModelsResponse> Client::ListModels(std::chrono::milliseconds deadline) const {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::ListModelsResponse response;
  grpc::Status s = stub_->ListModels(&context, v1::ListModelsRequest(), &response);
  if (!s.ok()) return FromGrpc(s);
  return response;
}

absl::StatusOr<v1::ModelMetadata> Client::GetModel(const std::string& model,
                                                   std::chrono::milliseconds deadline) const {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::GetModelRequest request;
  request.set_model_name(model);
  v1::ModelMetadata response;
  grpc::Status s = stub_->GetModel(&context, request, &response);
  if (!s.ok()) return FromGrpc(s);
  return response;
}

absl::StatusOr<bool> Client::IsServing(const std::string& service,
                                       std::chrono::milliseconds deadline) const {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status s = health->Check(&context, request, &response);
  if (!s.ok()) return FromGrpc(s);
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

}  // namespace collabserve::client

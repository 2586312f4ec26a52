// The Open Inference Protocol (KServe v2 / Triton, `inference.GRPCInferenceService`) on the same
// port as collabserve.v1.Inference. ModelInfer is a front end to InferenceService::StartClassify:
// the same validation, tokenizer, batcher, metrics and error codes as Classify.
//
// Tensors of every model:
//   input  `text`          BYTES [N] or [N, 1]   UTF-8 text, one element per input (required)
//   input  `text_pair`     BYTES, same N         second segment for sentence-pair tasks (optional)
//   output `logits`        FP32  [N, C]          C = number of labels, in label id order
//   output `probabilities` FP32  [N, C]          softmax; sigmoid for multi-label models or C == 1;
//                                                the logits for regression (Classify's rule)
//   output `label`         BYTES [N]             the best label's name
// Inputs may come as `contents.bytes_contents` or as `raw_input_contents` (each element a 4-byte
// little-endian length followed by its bytes), not both in one request. The response uses the form
// the request used: raw inputs get `raw_output_contents` (what Triton clients read), typed inputs
// get `contents` (KServe's Python client reads either). `outputs` may ask for a subset, in any
// order; empty means all three in the order above.
//
// Triton's classification extension (listed in ServerMetadata's extensions): an output parameter
// `classification` = K (int64_param or uint64_param, K >= 1) on `logits` or `probabilities`
// answers that output as BYTES [N, min(K, C)] instead: each input's K highest values, best first
// (ties in label order), each "value:index:label" with the value printed as std::to_string does
// ("0.912345:1:positive"), as Triton does.
//
// Request parameters: `truncate` (bool_param, default true) is Classify's options.truncate;
// `timeout` (int64_param or uint64_param, microseconds, 0 = none) is a deadline counted from the
// call's arrival, and the earlier of it and the gRPC deadline applies (DEADLINE_EXCEEDED, as
// Classify's deadline); `priority` and other parameters are ignored (one queue per model).
//
// Errors: INVALID_ARGUMENT naming the input, output or parameter (unknown name, wrong datatype,
// bad shape, more elements than --max_inputs_per_request (checked before decoding), element count
// not matching the shape, malformed raw bytes, missing `text`, empty text, a parameter of the
// wrong type or value) or a malformed model_version (digits only: "1", not " 1"); NOT_FOUND for
// an unknown model or version (model_version "" = newest); UNAVAILABLE while the models load or
// the server drains; the rest as Classify.
//
// ModelMetadata reports platform "collabserve", the served versions, and the tensors above with -1
// for variable dimensions (`text` as [-1]). ModelConfig (Triton's model_configuration extension,
// listed in ServerMetadata) describes the resolved version in Triton's terms: max_batch_size is
// --max_inputs_per_request (the most inputs one request carries), the tensors without their batch
// dimension (`text`, `text_pair` and `label` TYPE_STRING dims [1] reshaped to [], one per input;
// `text_pair` optional), dynamic_batching the batcher's batch size, delay and queue size, one
// instance group of the version's batch threads on its device (KIND_CPU, or KIND_GPU with the GPU's
// index), and the parameters problem_type, max_length, dtype, device and, for a collaborative model,
// collaborative_ranks (comma-separated). Errors as ModelMetadata.
//
// ModelStatistics (Triton's statistics extension, also listed) answers, for every served version
// of the named model (empty name: of every model; a version: that one), what it has done since it
// loaded (servable_statistics.h): calls that succeeded or failed after naming it, per call its
// queue wait, tokenization (compute_input), forward pass (compute_infer) and response building
// (compute_output), inputs answered (inference_count), forward passes run (execution_count), and
// those passes by batch size (compute_infer only), ordered by model and version. A call counts as
// a success once its results are in, before ModelInfer builds its tensors (which fails only on an
// internal error). Answered while the server drains and after its GPU failed; UNAVAILABLE only
// until the models have loaded. NOT_FOUND for an unknown model or a version not served;
// INVALID_ARGUMENT for a malformed version or a version without a model.
//
// RepositoryIndex (Triton's model_repository extension, also listed) lists every version the
// repository knows, ordered by model and version, with Triton's states: READY (served), LOADING,
// or UNAVAILABLE with the reason (the load error, files still being written, unloaded by an admin,
// or not among the newest versions served); `ready` keeps the READY ones only. A non-empty
// repository_name is INVALID_ARGUMENT (one repository); answered while draining, as statistics.
// RepositoryModelLoad and RepositoryModelUnload are refused with FAILED_PRECONDITION and
// Triton's "explicit model load / unload is not allowed" (the repository is polled): loading and
// unloading are the admin's, with the admin token (collabserve.v1.Admin). Triton answers
// UNAVAILABLE there, which a client's retry policy would retry.
//
// ServerLive is true until the server's GPU fails for good
// (then a restart is the cure, as with grpc.health.v1); ServerReady is true once the
// service is attached (models loaded) until the server starts draining; ModelReady is true when the
// model (version) is served and the server is ready; an unknown model is not ready (OK status).
#ifndef COLLABSERVE_SERVER_SERVICE_KSERVE_SERVICE_H_
#define COLLABSERVE_SERVER_SERVICE_KSERVE_SERVICE_H_

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kserve/grpc_predict_v2.grpc.pb.h"
#include "server/metrics/metrics.h"
#include "server/repository/model_repository.h"
#include "server/service/inference_service.h"

namespace collabserve::service {

struct KServeServiceOptions {
  // ServerMetadata's name and version.
  std::string server_name = "collabserve";
  std::string server_version = "0.1.0";
};

// Thread-safe. Register it in ServerOptions::extra_services before the Server starts, then
// Attach() once Server::LoadModels() has succeeded; until then ModelInfer and ModelMetadata answer
// UNAVAILABLE and the readiness calls answer false. Must outlive the Server.
// ModelConfig's instance kind for a version served on `device` (the engine's device string:
// "cpu", "cuda" or "cuda:N"): KIND_GPU with the GPU's index in `gpus` (0 for "cuda"), else KIND_CPU.
void DescribeDevice(const std::string& device, inference::ModelInstanceGroup* group);
// RepositoryIndex's entry for one version (all but the name): its state in Triton's terms and why.
void DescribeVersion(const repository::ModelRepository::VersionStatus& status,
                     inference::RepositoryIndexResponse::ModelIndex* index);

class KServeService final : public inference::GRPCInferenceService::CallbackService {
 public:
  explicit KServeService(KServeServiceOptions options = {});

  // `inference`, `repository` and `metrics` are not owned and must stay alive until the gRPC
  // server has shut down (Server::inference_service(), repository(), metrics() do). Call once.
  void Attach(InferenceService* inference, repository::ModelRepository* repository,
              metrics::Metrics* metrics);

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const inference::ServerLiveRequest* request,
                                       inference::ServerLiveResponse* response) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const inference::ServerReadyRequest* request,
                                        inference::ServerReadyResponse* response) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest* request,
                                           inference::ServerMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const inference::ModelInferRequest* request,
                                       inference::ModelInferResponse* response) override;
  grpc::ServerUnaryReactor* ModelConfig(grpc::CallbackServerContext* context,
                                        const inference::ModelConfigRequest* request,
                                        inference::ModelConfigResponse* response) override;
  grpc::ServerUnaryReactor* ModelStatistics(grpc::CallbackServerContext* context,
                                            const inference::ModelStatisticsRequest* request,
                                            inference::ModelStatisticsResponse* response) override;
  grpc::ServerUnaryReactor* RepositoryIndex(grpc::CallbackServerContext* context,
                                            const inference::RepositoryIndexRequest* request,
                                            inference::RepositoryIndexResponse* response) override;
  grpc::ServerUnaryReactor* RepositoryModelLoad(
      grpc::CallbackServerContext* context, const inference::RepositoryModelLoadRequest* request,
      inference::RepositoryModelLoadResponse* response) override;
  grpc::ServerUnaryReactor* RepositoryModelUnload(
      grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest* request,
      inference::RepositoryModelUnloadResponse* response) override;

 private:
  class InferReactor;
  struct Attached {
    InferenceService* inference = nullptr;
    repository::ModelRepository* repository = nullptr;
    metrics::Metrics* metrics = nullptr;
  };

  Attached attached() const;
  // OK when attached and not draining; UNAVAILABLE (with Classify's wording) otherwise.
  static grpc::Status CheckServing(const Attached& a);

  const KServeServiceOptions options_;
  mutable absl::Mutex mu_;
  Attached attached_ ABSL_GUARDED_BY(mu_);
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_KSERVE_SERVICE_H_

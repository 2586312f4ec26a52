// collabserve.v1.Inference on gRPC's callback API: handlers validate, tokenize inline and queue
// the inputs on the model version's batch scheduler, then return; the batch thread that completes
// a call's last input finishes its reactor. No handler thread ever waits for the model.
#ifndef COLLABSERVE_SERVER_SERVICE_INFERENCE_SERVICE_H_
#define COLLABSERVE_SERVER_SERVICE_INFERENCE_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "grpcpp/support/status.h"
#include "server/metrics/metrics.h"
#include "server/repository/model_repository.h"

namespace collabserve::service {

class ModelServable;

struct InferenceServiceOptions {
  // Most inputs in one ClassifyRequest / TokenizeRequest.
  int max_inputs_per_request = 64;
  // Most bytes in one text (or text_pair).
  int64_t max_text_bytes = 64 * 1024;
  // Most ClassifyStream calls open at once; one more is refused with RESOURCE_EXHAUSTED. >= 1.
  int max_concurrent_streams = 256;
  // Flow control of one ClassifyStream: requests read but not yet answered (running, or answered
  // and waiting for the client to read the response). At the limit the server stops reading that
  // stream until the client reads a response, so HTTP/2 flow control pushes back on a client that
  // sends without reading, and the stream's memory stays bounded. >= 1.
  int stream_max_pending_responses = 32;
};

// Thread-safe. The repository is attached once the models are loaded (until then calls get
// UNAVAILABLE); it must stay alive until the gRPC server has shut down.
class InferenceService final : public v1::Inference::CallbackService {
 public:
  InferenceService(InferenceServiceOptions options, metrics::Metrics* metrics);

  const InferenceServiceOptions& options() const { return options_; }

  void AttachRepository(repository::ModelRepository* repository) {
    repository_.store(repository, std::memory_order_release);
  }
  // New calls (and new requests on open streams) get UNAVAILABLE from now on.
  void StartDraining() { draining_.store(true, std::memory_order_release); }
  bool draining() const { return draining_.load(std::memory_order_acquire); }
  // The model device failed for good (Server::OnDeviceFailure): new calls and requests get
  // UNAVAILABLE naming `failure` from now on. The first call's failure is the one kept.
  void StopForDeviceFailure(const absl::Status& failure);
  bool device_failed() const { return device_failed_.load(std::memory_order_acquire); }
  // UNAVAILABLE, saying why, while draining or after a device failure; OK otherwise (loading is
  // the caller's to check).
  grpc::Status Refusal() const;
  // The `model` label of a call refused before its model version was resolved: the requested
  // model's name when the repository knows it (so per-model error rates and alerts see a model's
  // refusals: after a GPU failure, while draining, an unserved version), else "" (a name a client
  // made up must not become a label).
  std::string ModelLabel(const std::string& requested) const;
  // Unary calls and stream requests being processed.
  int64_t inflight() const { return inflight_.load(std::memory_order_acquire); }
  // This service's calls (Classify or ClassifyStream; not KServe's ModelInfer) whose client
  // cancelled or whose deadline passed, as seen by OnCancel.
  int64_t cancellations() const { return cancellations_.load(std::memory_order_acquire); }
  // ClassifyStream calls open now (reactors not yet done).
  int64_t open_streams() const { return open_streams_.load(std::memory_order_acquire); }
  // ClassifyStream calls refused because max_concurrent_streams were open.
  int64_t streams_refused() const { return streams_refused_.load(std::memory_order_acquire); }
  // The most requests any one stream has had pending (read, not yet written) at once; never above
  // stream_max_pending_responses.
  int64_t stream_pending_high_water() const {
    return stream_pending_high_water_.load(std::memory_order_acquire);
  }
  // Times a stream stopped reading because stream_max_pending_responses were pending.
  int64_t stream_read_pauses() const { return stream_read_pauses_.load(std::memory_order_acquire); }

  // Used by the unary and the streaming handler: validates `request`, tokenizes it and queues its
  // inputs; `finish` is called exactly once, possibly before this returns, possibly on a batch
  // thread, with the outcome. `cancelled` turns true when the client gives up. `resolved`, when
  // not null, is the version the caller already looked up for this request (KServe): used as it
  // is, since a second lookup could miss a version that a swap retired in between.
  using FinishCallback = std::function<void(const grpc::Status&, v1::ClassifyResponse*)>;
  void StartClassify(const v1::ClassifyRequest& request, absl::Time deadline,
                     std::shared_ptr<std::atomic<bool>> cancelled, FinishCallback finish,
                     std::shared_ptr<ModelServable> resolved = nullptr);

  grpc::ServerUnaryReactor* Classify(grpc::CallbackServerContext* context,
                                     const v1::ClassifyRequest* request,
                                     v1::ClassifyResponse* response) override;
  grpc::ServerBidiReactor<v1::StreamClassifyRequest, v1::StreamClassifyResponse>* ClassifyStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const v1::TokenizeRequest* request,
                                     v1::TokenizeResponse* response) override;
  grpc::ServerUnaryReactor* Decode(grpc::CallbackServerContext* context,
                                   const v1::DecodeRequest* request,
                                   v1::DecodeResponse* response) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const v1::GetModelRequest* request,
                                     v1::ModelMetadata* response) override;

 private:
  class ClassifyReactor;
  class StreamReactor;

  // OK, or UNAVAILABLE while loading / draining.
  grpc::Status CheckServing() const;
  // Metrics of a finished call.
  void EndCall(const std::string& model, const std::string& version, const grpc::Status& status,
               absl::Time arrival);
  // After the call's finish callback: it no longer counts as in flight.
  void LeaveInflight();

  const InferenceServiceOptions options_;
  metrics::Metrics* const metrics_;
  std::atomic<repository::ModelRepository*> repository_{nullptr};
  std::atomic<bool> draining_{false};
  mutable absl::Mutex failure_mu_;
  std::string device_failure_ ABSL_GUARDED_BY(failure_mu_);  // its message, once failed
  std::atomic<bool> device_failed_{false};
  std::atomic<int64_t> inflight_{0};
  std::atomic<int64_t> cancellations_{0};
  std::atomic<int64_t> open_streams_{0};
  std::atomic<int64_t> streams_refused_{0};
  std::atomic<int64_t> stream_pending_high_water_{0};
  std::atomic<int64_t> stream_read_pauses_{0};
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_INFERENCE_SERVICE_H_

#include "server/service/inference_service.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include <glog/logging.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "server/batching/request_tracker.h"
#include "server/service/inference_task.h"
#include "server/service/model_servable.h"
#include "server/service/status_mapping.h"
#include "server/text/bert_tokenizer.h"
#include "server/util/status_macros.h"

namespace collabserve::service {
namespace {

absl::Time ToAbslTime(std::chrono::system_clock::time_point tp) {
  if (tp == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(tp);
}

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

std::optional<int64_t> OptionalVersion(bool has, int64_t version) {
  if (!has) return std::nullopt;
  return version;
}

// Checks the parts of a request that do not need the model.
absl::Status ValidateInputs(const google::protobuf::RepeatedPtrField<v1::Input>& inputs,
                            const InferenceServiceOptions& options) {
  if (inputs.empty()) {
    return absl::InvalidArgumentError("the request has no inputs; send 1 to " +
                                      std::to_string(options.max_inputs_per_request));
  }
  if (inputs.size() > options.max_inputs_per_request) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request has ", inputs.size(), " inputs, more than the limit of ",
        options.max_inputs_per_request, " (--max_inputs_per_request); split it into several"));
  }
  for (int i = 0; i < inputs.size(); ++i) {
    const v1::Input& in = inputs[i];
    if (in.text().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("inputs[", i, "].text is empty"));
    }
    if (static_cast<int64_t>(in.text().size()) > options.max_text_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "inputs[", i, "].text is ", in.text().size(), " bytes, more than the limit of ",
          options.max_text_bytes, " (--max_text_bytes)"));
    }
    if (in.has_text_pair() && static_cast<int64_t>(in.text_pair().size()) > options.max_text_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "inputs[", i, "].text_pair is ", in.text_pair().size(), " bytes, more than the limit of ",
          options.max_text_bytes, " (--max_text_bytes)"));
    }
  }
  return absl::OkStatus();
}

struct Encoded {
  model::TokenizedInput input;
  bool truncated = false;
  int num_tokens_before_truncation = 0;
  // With EncodeOptions::offsets (Tokenize): text::Encoding's.
  std::vector<std::pair<int32_t, int32_t>> offsets;
  std::vector<uint8_t> special_tokens_mask;
};

// Tokenizes input `index` for `servable`'s model, up to its max length (options.max_length is
// set here); with !options.truncate an over-long input is an error.
absl::StatusOr<Encoded> EncodeInput(const ModelServable& servable, const v1::Input& in, int index,
                                    text::EncodeOptions options) {
  const int max_length = servable.info().max_length;
  if (in.has_text_pair() && servable.info().type_vocab_size < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs[", index, "].text_pair is given, but model ", servable.id().DebugString(),
        " has one token type (type_vocab_size ", servable.info().type_vocab_size,
        ") and takes no text pairs; send the text alone"));
  }
  std::optional<std::string_view> pair;
  if (in.has_text_pair()) pair = in.text_pair();
  options.max_length = max_length;
  auto enc = servable.engine().tokenizer().Encode(in.text(), pair, options);
  if (!enc.ok()) {
    return util::Prefixed(enc.status(), absl::StrCat("inputs[", index, "]: "));
  }
  Encoded out;
  out.input.input_ids.assign(enc->input_ids.begin(), enc->input_ids.end());
  out.input.token_type_ids.assign(enc->token_type_ids.begin(), enc->token_type_ids.end());
  out.truncated = enc->truncated;
  out.num_tokens_before_truncation = enc->num_tokens_before_truncation;
  out.offsets = std::move(enc->offsets);
  out.special_tokens_mask = std::move(enc->special_tokens_mask);
  if (static_cast<int>(out.input.input_ids.size()) > max_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs[", index, "] has ", out.input.input_ids.size(), " tokens, more than model ",
        servable.id().DebugString(), "'s max length of ", max_length,
        "; shorten it or leave options.truncate unset (true)"));
  }
  // What the forward pass would refuse is refused here, for this request alone: in a batch it
  // would fail every caller's inputs. Word pieces without the special tokens (Tokenize's
  // add_special_tokens=false) are no model input: none of them, for one, is a valid answer.
  if (!options.add_special_tokens) return out;
  if (absl::Status s = servable.engine().CheckInput(out.input); !s.ok()) {
    return util::Prefixed(s, absl::StrCat("inputs[", index, "]: model ",
                                          servable.id().DebugString(), " cannot take it: "));
  }
  return out;
}

void FillResult(const model::ModelInfo& info, const model::Prediction& p,
                const v1::ClassifyOptions& options, v1::Result* r) {
  const std::vector<float>& scores = options.raw_scores() ? p.logits : p.probabilities;
  const int best = std::clamp(p.label, 0, static_cast<int>(scores.size()) - 1);
  auto label_of = [&info](int i) {
    return i < static_cast<int>(info.labels.size()) ? info.labels[i] : absl::StrCat("LABEL_", i);
  };
  r->set_label(label_of(best));
  if (!scores.empty()) r->set_score(scores[best]);
  if (options.top_k() > 0) {
    std::vector<int> order(scores.size());
    std::iota(order.begin(), order.end(), 0);
    const int k = std::min<int>(options.top_k(), static_cast<int>(order.size()));
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&scores](int a, int b) { return scores[a] > scores[b]; });
    for (int i = 0; i < k; ++i) {
      v1::LabelScore* ls = r->add_top_k();
      ls->set_label(label_of(order[i]));
      ls->set_score(scores[order[i]]);
    }
  }
  for (float l : p.logits) r->add_logits(l);
}

absl::StatusOr<std::shared_ptr<ModelServable>> Resolve(repository::ModelRepository* repository,
                                                       const std::string& model,
                                                       std::optional<int64_t> version) {
  if (model.empty()) {
    return absl::InvalidArgumentError("model_name is empty; ListModels lists the served models");
  }
  if (version.has_value() && *version <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model_version ", *version, " is not a version; versions are >= 1 (or leave "
                     "it unset for the newest)"));
  }
  auto s = repository->Get(model, version);
  if (!s.ok()) return s.status();
  return std::static_pointer_cast<ModelServable>(std::move(s).value());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Reactors.

class InferenceService::ClassifyReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit ClassifyReactor(std::atomic<int64_t>* cancellations)
      : cancellations_(cancellations), cancelled_(std::make_shared<std::atomic<bool>>(false)) {}
  void OnCancel() override {
    cancelled_->store(true, std::memory_order_relaxed);
    cancellations_->fetch_add(1, std::memory_order_acq_rel);
  }
  void OnDone() override { delete this; }
  const std::shared_ptr<std::atomic<bool>>& cancelled() const { return cancelled_; }

 private:
  std::atomic<int64_t>* const cancellations_;
  const std::shared_ptr<std::atomic<bool>> cancelled_;
};

// Reads requests as they come, starts each one at once, and writes the responses in completion
// order (one write in flight at a time, the rest queued). Flow control: while
// options.stream_max_pending_responses requests are outstanding (running, queued for writing or
// being written) no read is outstanding, so a client that sends without reading is held back by
// HTTP/2 flow control instead of growing the queue; the read resumes when a write completes.
// Finishes when the client has half-closed and every started request has been answered, or once
// the call is cancelled and nothing is pending any more.
class InferenceService::StreamReactor final
    : public grpc::ServerBidiReactor<v1::StreamClassifyRequest, v1::StreamClassifyResponse> {
 public:
  // `service->open_streams_` already counts this stream; OnDone uncounts it.
  StreamReactor(InferenceService* service, grpc::CallbackServerContext* context)
      : service_(service),
        max_pending_(std::max(1, service->options_.stream_max_pending_responses)),
        deadline_(ToAbslTime(context->deadline())),
        cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    absl::MutexLock lock(&mu_);
    reading_ = true;
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      std::optional<grpc::Status> done;
      {
        absl::MutexLock lock(&mu_);
        reading_ = false;
        reads_done_ = true;
        done = FinishStatusLocked();
      }
      if (done) Finish(*done);
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      ++pending_;  // reading_ stays true: request_ is in use until the next read is started
      NotePendingLocked();
    }
    const std::string id = request_.id();
    service_->StartClassify(
        request_.request(), deadline_, cancelled_,
        [this, id](const grpc::Status& status, v1::ClassifyResponse* response) {
          v1::StreamClassifyResponse out;
          out.set_id(id);
          if (status.ok()) {
            out.mutable_response()->Swap(response);
          } else {
            out.mutable_error()->set_code(static_cast<int>(status.error_code()));
            out.mutable_error()->set_message(status.error_message());
          }
          std::optional<grpc::Status> done;
          {
            absl::MutexLock lock(&mu_);
            --pending_;
            if (!write_failed_) queue_.push_back(std::move(out));
            MaybeWriteLocked();
            done = FinishStatusLocked();
          }
          // Last use of `this`: OnDone (which deletes it) may run as soon as Finish is called.
          if (done) Finish(*done);
        });
    // No request of this stream can have finished the call: reads_done_ is still false, and a
    // cancellation cannot finish it while this reaction runs (gRPC holds the reactor until it
    // returns). StartRead is called under mu_, as StartWrite is: gRPC never runs a reaction inline.
    request_.Clear();
    absl::MutexLock lock(&mu_);
    reading_ = false;
    MaybeReadLocked();
  }

  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> done;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {
        write_failed_ = true;
        queue_.clear();
      }
      MaybeWriteLocked();
      done = FinishStatusLocked();
      if (!done) MaybeReadLocked();
    }
    if (done) Finish(*done);
  }

  void OnCancel() override {
    cancelled_->store(true, std::memory_order_relaxed);
    service_->cancellations_.fetch_add(1, std::memory_order_acq_rel);
    std::optional<grpc::Status> done;
    {
      absl::MutexLock lock(&mu_);
      call_cancelled_ = true;
      done = FinishStatusLocked();
    }
    if (done) Finish(*done);
  }

  void OnDone() override {
    service_->open_streams_.fetch_sub(1, std::memory_order_acq_rel);
    delete this;
  }

 private:
  int Outstanding() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return pending_ + static_cast<int>(queue_.size()) + (writing_ ? 1 : 0);
  }

  void NotePendingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t n = Outstanding();
    int64_t seen = service_->stream_pending_high_water_.load(std::memory_order_relaxed);
    while (n > seen && !service_->stream_pending_high_water_.compare_exchange_weak(
                           seen, n, std::memory_order_acq_rel)) {
    }
  }

  // Starts the next read unless one is outstanding, the stream is ending, or it is at its limit
  // of pending requests (then the next completed write calls this again).
  void MaybeReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (reading_ || reads_done_ || finished_ || call_cancelled_ || write_failed_) return;
    if (Outstanding() >= max_pending_) {
      if (!paused_) {
        paused_ = true;
        service_->stream_read_pauses_.fetch_add(1, std::memory_order_acq_rel);
        VLOG(1) << "ClassifyStream: " << Outstanding()
                << " responses pending (--stream_max_pending_responses); reading paused";
      }
      return;
    }
    paused_ = false;
    reading_ = true;
    StartRead(&request_);
  }

  void MaybeWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || queue_.empty() || finished_) return;
    current_ = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    StartWrite(&current_);
  }

  // The status to Finish with, once (then finished_ is set), or nullopt if the stream goes on.
  // The caller calls Finish after releasing mu_: OnDone may delete the reactor right away.
  std::optional<grpc::Status> FinishStatusLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || pending_ > 0 || writing_) return std::nullopt;
    if (call_cancelled_ || write_failed_) {
      finished_ = true;
      return grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled");
    }
    if (reads_done_ && queue_.empty()) {
      finished_ = true;
      return grpc::Status::OK;
    }
    return std::nullopt;
  }

  InferenceService* const service_;
  const int max_pending_;
  const absl::Time deadline_;
  const std::shared_ptr<std::atomic<bool>> cancelled_;
  v1::StreamClassifyRequest request_;  // owned by the one outstanding read

  absl::Mutex mu_;
  int pending_ ABSL_GUARDED_BY(mu_) = 0;  // started, not yet answered
  // A read is outstanding, or its request is being started (request_ is in use either way).
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;   // not reading: at the pending limit
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool call_cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<v1::StreamClassifyResponse> queue_ ABSL_GUARDED_BY(mu_);
  v1::StreamClassifyResponse current_ ABSL_GUARDED_BY(mu_);
};

namespace {

// A ClassifyStream refused before it started (too many streams open).
class RefusedStream final
    : public grpc::ServerBidiReactor<v1::StreamClassifyRequest, v1::StreamClassifyResponse> {
 public:
  explicit RefusedStream(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

// ---------------------------------------------------------------------------------------------

InferenceService::InferenceService(InferenceServiceOptions options, metrics::Metrics* metrics)
    : options_(std::move(options)), metrics_(metrics) {}

void InferenceService::StopForDeviceFailure(const absl::Status& failure) {
  absl::MutexLock lock(&failure_mu_);
  if (device_failed_.load(std::memory_order_relaxed)) return;
  device_failure_ = std::string(failure.message());
  device_failed_.store(true, std::memory_order_release);
}

grpc::Status InferenceService::Refusal() const {
  if (draining()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "collabserve is shutting down and takes no new requests; retry on another "
                        "replica");
  }
  if (device_failed()) {
    absl::MutexLock lock(&failure_mu_);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat("collabserve's GPU failed and it takes no new requests until it "
                                     "restarts; retry on another replica (", device_failure_, ")"));
  }
  return grpc::Status::OK;
}

grpc::Status InferenceService::CheckServing() const {
  if (grpc::Status refusal = Refusal(); !refusal.ok()) return refusal;
  if (repository_.load(std::memory_order_acquire) == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "collabserve is still loading its models; retry once grpc.health.v1 "
                        "reports SERVING");
  }
  return grpc::Status::OK;
}

void InferenceService::EndCall(const std::string& model, const std::string& version,
                               const grpc::Status& status, absl::Time arrival) {
  metrics_->CountRequest(model, version, CodeName(status.error_code()));
  if (!model.empty()) {
    metrics_->ForModel(model).request_duration->Observe(absl::ToDoubleSeconds(absl::Now() - arrival));
  }
}

void InferenceService::LeaveInflight() {
  metrics_->inflight_requests()->Decrement();
  inflight_.fetch_sub(1, std::memory_order_acq_rel);
}

std::string InferenceService::ModelLabel(const std::string& requested) const {
  repository::ModelRepository* repository = repository_.load(std::memory_order_acquire);
  return repository != nullptr && repository->Knows(requested) ? requested : std::string();
}

void InferenceService::StartClassify(const v1::ClassifyRequest& request, absl::Time deadline,
                                     std::shared_ptr<std::atomic<bool>> cancelled,
                                     FinishCallback finish,
                                     std::shared_ptr<ModelServable> servable) {
  const absl::Time arrival = absl::Now();
  inflight_.fetch_add(1, std::memory_order_acq_rel);
  metrics_->inflight_requests()->Increment();
  auto reject = [&](const absl::Status& status, const std::string& model,
                    const std::string& version) {
    const grpc::Status g = ToGrpcStatus(status);
    VLOG(1) << "Classify(" << request.model_name() << ") rejected: " << status;
    if (servable != nullptr) servable->statistics().RecordFailure(absl::Now() - arrival);
    EndCall(model, version, g, arrival);
    finish(g, nullptr);
    LeaveInflight();
  };

  grpc::Status serving = CheckServing();
  if (!serving.ok()) return reject(FromGrpcStatus(serving), ModelLabel(request.model_name()), "");
  absl::Status valid = ValidateInputs(request.inputs(), options_);
  if (valid.ok() && request.options().top_k() < 0) {
    valid = absl::InvalidArgumentError(
        absl::StrCat("options.top_k is ", request.options().top_k(), "; it must be >= 0"));
  }
  // Resolved before a bad input is refused, so that the refusal counts as a failure of the version
  // it names (its statistics), as ModelInfer's does; the input's error still comes first.
  absl::Status resolved = absl::OkStatus();
  if (servable == nullptr) {
    auto named = Resolve(repository_.load(std::memory_order_acquire), request.model_name(),
                         OptionalVersion(request.has_model_version(), request.model_version()));
    if (named.ok()) {
      servable = std::move(named).value();
    } else {
      resolved = named.status();
    }
  }
  if (!valid.ok()) return reject(valid, ModelLabel(request.model_name()), "");
  if (!resolved.ok()) return reject(resolved, ModelLabel(request.model_name()), "");
  const std::string& model = servable->id().model;
  const std::string version = std::to_string(servable->id().version);

  // Tokenization runs inline: WordPiece over a few hundred bytes takes microseconds, less than a
  // hop to another thread would (see the collabserve_tokenization_duration_seconds histogram).
  const bool truncate = !request.options().has_truncate() || request.options().truncate();
  const absl::Time tok_start = absl::Now();
  const int n = request.inputs_size();
  std::vector<Encoded> encoded;
  encoded.reserve(n);
  int64_t total_tokens = 0;
  for (int i = 0; i < n; ++i) {
    text::EncodeOptions eo;
    eo.truncate = truncate;
    auto e = EncodeInput(*servable, request.inputs(i), i, eo);
    if (!e.ok()) return reject(e.status(), model, version);
    total_tokens += static_cast<int64_t>(e->input.input_ids.size());
    encoded.push_back(std::move(e).value());
  }
  const absl::Duration tokenization = absl::Now() - tok_start;
  servable->model_metrics().tokenization_duration->Observe(absl::ToDoubleSeconds(tokenization));

  std::vector<int> num_tokens(n);
  std::vector<bool> truncated(n);
  for (int i = 0; i < n; ++i) {
    num_tokens[i] = static_cast<int>(encoded[i].input.input_ids.size());
    truncated[i] = encoded[i].truncated;
  }
  auto state = std::make_shared<CallState>();
  state->deadline = deadline;
  state->cancelled = std::move(cancelled);
  // Runs on the thread that reports the last input: a batch thread, or this one if scheduling
  // failed. It owns the servable reference until the response is built.
  state->tracker = batching::RequestTracker<InputResult>::Create(
      n, [this, servable, arrival, tokenization, total_tokens, num_tokens = std::move(num_tokens),
          truncated = std::move(truncated), options = request.options(),
          finish = std::move(finish)](absl::StatusOr<std::vector<InputResult>> results) {
        const std::string& model = servable->id().model;
        const std::string version = std::to_string(servable->id().version);
        if (!results.ok()) {
          const grpc::Status g = ToGrpcStatus(results.status());
          servable->statistics().RecordFailure(absl::Now() - arrival);
          EndCall(model, version, g, arrival);
          finish(g, nullptr);
          LeaveInflight();
          return;
        }
        v1::ClassifyResponse response;
        absl::Duration queue = absl::ZeroDuration(), inference = absl::ZeroDuration();
        const absl::Time output_start = absl::Now();
        for (size_t i = 0; i < results->size(); ++i) {
          const InputResult& r = (*results)[i];
          v1::Result* out = response.add_results();
          FillResult(servable->info(), r.prediction, options, out);
          out->set_num_tokens(num_tokens[i]);
          out->set_truncated(truncated[i]);
          queue = std::max(queue, r.queue_wait);
          inference = std::max(inference, r.inference);
        }
        response.set_model_name(model);
        response.set_model_version(servable->id().version);
        response.set_num_tokens(total_tokens);
        v1::Timings* t = response.mutable_timings();
        t->set_queue_us(Micros(queue));
        t->set_tokenization_us(Micros(tokenization));
        t->set_inference_us(Micros(inference));
        const absl::Time end = absl::Now();
        t->set_total_us(Micros(end - arrival));
        servable->statistics().RecordSuccess({static_cast<int64_t>(results->size()), end - arrival, queue,
                                              tokenization, inference, end - output_start},
                                             end);
        EndCall(model, version, grpc::Status::OK, arrival);
        finish(grpc::Status::OK, &response);
        // Only now: the drain (Server::Shutdown) waits for this count, and the response must have
        // been handed to gRPC before it stops the server.
        LeaveInflight();
      });

  std::vector<std::unique_ptr<InferenceTask>> tasks;
  tasks.reserve(n);
  std::shared_ptr<const CallState> shared_state = state;
  for (int i = 0; i < n; ++i) {
    tasks.push_back(std::make_unique<InferenceTask>(shared_state, i, std::move(encoded[i].input)));
  }
  absl::Status scheduled = servable->Schedule(&tasks);
  if (!scheduled.ok()) {
    // Nothing was taken: report every input failed, which fires the tracker once with the error.
    if (scheduled.code() == absl::StatusCode::kResourceExhausted) {
      scheduled = absl::ResourceExhaustedError(
          absl::StrCat(scheduled.message(),
                       "; the server is overloaded, retry with backoff (the queue's size is "
                       "--max_queue_size)"));
    } else if (scheduled.code() == absl::StatusCode::kInvalidArgument) {
      // More inputs than the whole queue holds (--max_inputs_per_request above --max_queue_size).
      scheduled = absl::InvalidArgumentError(absl::StrCat(
          scheduled.message(), " (--max_queue_size); split the request into smaller ones"));
    }
    for (auto& t : tasks) t->Fail(scheduled);
  }
}

grpc::ServerUnaryReactor* InferenceService::Classify(grpc::CallbackServerContext* context,
                                                     const v1::ClassifyRequest* request,
                                                     v1::ClassifyResponse* response) {
  auto* reactor = new ClassifyReactor(&cancellations_);
  StartClassify(*request, ToAbslTime(context->deadline()), reactor->cancelled(),
                [reactor, response](const grpc::Status& status, v1::ClassifyResponse* result) {
                  if (status.ok() && result != nullptr) response->Swap(result);
                  reactor->Finish(status);
                });
  return reactor;
}

grpc::ServerBidiReactor<v1::StreamClassifyRequest, v1::StreamClassifyResponse>*
InferenceService::ClassifyStream(grpc::CallbackServerContext* context) {
  const int64_t open = open_streams_.fetch_add(1, std::memory_order_acq_rel);
  if (open >= options_.max_concurrent_streams) {
    open_streams_.fetch_sub(1, std::memory_order_acq_rel);
    streams_refused_.fetch_add(1, std::memory_order_acq_rel);
    metrics_->CountRequest("", "", CodeName(grpc::StatusCode::RESOURCE_EXHAUSTED));
    return new RefusedStream(grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat(open, " ClassifyStream calls are open, the limit of this server "
                           "(--max_concurrent_streams=",
                     options_.max_concurrent_streams,
                     "); retry with backoff, or send several requests on one stream")));
  }
  return new StreamReactor(this, context);
}

grpc::ServerUnaryReactor* InferenceService::Tokenize(grpc::CallbackServerContext* context,
                                                     const v1::TokenizeRequest* request,
                                                     v1::TokenizeResponse* response) {
  return FinishUnary(context, [&]() -> grpc::Status {
    if (grpc::Status serving = CheckServing(); !serving.ok()) return serving;
    if (absl::Status valid = ValidateInputs(request->inputs(), options_); !valid.ok()) {
      return ToGrpcStatus(valid);
    }
    auto servable = Resolve(repository_.load(std::memory_order_acquire), request->model_name(),
                            OptionalVersion(request->has_model_version(), request->model_version()));
    if (!servable.ok()) return ToGrpcStatus(servable.status());
    text::EncodeOptions eo;
    eo.truncate = !request->has_truncate() || request->truncate();
    eo.add_special_tokens = !request->has_add_special_tokens() || request->add_special_tokens();
    eo.offsets = true;
    const auto& tokenizer = (*servable)->engine().tokenizer();
    for (int i = 0; i < request->inputs_size(); ++i) {
      auto e = EncodeInput(**servable, request->inputs(i), i, eo);
      if (!e.ok()) return ToGrpcStatus(e.status());
      v1::Tokens* t = response->add_results();
      for (int32_t id : e->input.input_ids) {
        t->add_input_ids(id);
        t->add_tokens(std::string(tokenizer.IdToToken(id)));
      }
      for (int32_t id : e->input.token_type_ids) t->add_token_type_ids(id);
      for (const auto& [start, end] : e->offsets) {
        v1::TokenOffset* o = t->add_offsets();
        o->set_start(start);
        o->set_end(end);
      }
      for (uint8_t special : e->special_tokens_mask) t->add_special_tokens_mask(special != 0);
      t->set_truncated(e->truncated);
      t->set_num_tokens_before_truncation(e->num_tokens_before_truncation);
    }
    response->set_model_version((*servable)->id().version);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* InferenceService::Decode(grpc::CallbackServerContext* context,
                                                   const v1::DecodeRequest* request,
                                                   v1::DecodeResponse* response) {
  return FinishUnary(context, [&]() -> grpc::Status {
    if (grpc::Status serving = CheckServing(); !serving.ok()) return serving;
    if (request->sequences().empty() ||
        request->sequences_size() > options_.max_inputs_per_request) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("the request has ", request->sequences_size(),
                                       " sequences; send 1 to ", options_.max_inputs_per_request,
                                       " (--max_inputs_per_request)"));
    }
    auto servable = Resolve(repository_.load(std::memory_order_acquire), request->model_name(),
                            OptionalVersion(request->has_model_version(), request->model_version()));
    if (!servable.ok()) return ToGrpcStatus(servable.status());
    const bool skip = !request->has_skip_special_tokens() || request->skip_special_tokens();
    const auto& tokenizer = (*servable)->engine().tokenizer();
    for (int i = 0; i < request->sequences_size(); ++i) {
      const auto& ids = request->sequences(i).ids();
      // A text decoded may be as long as a text sent (--max_text_bytes), and it has at most one
      // token a byte.
      if (ids.size() > options_.max_text_bytes) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("sequences[", i, "] has ", ids.size(),
                                         " ids, more than the limit of ", options_.max_text_bytes,
                                         " (--max_text_bytes)"));
      }
      auto text = tokenizer.Decode(std::vector<int32_t>(ids.begin(), ids.end()), skip,
                                   static_cast<size_t>(options_.max_text_bytes));
      if (!text.ok()) {
        return ToGrpcStatus(util::Prefixed(text.status(), absl::StrCat("sequences[", i, "].")));
      }
      response->add_texts(*std::move(text));
    }
    response->set_model_version((*servable)->id().version);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* InferenceService::ListModels(grpc::CallbackServerContext* context,
                                                       const v1::ListModelsRequest* request,
                                                       v1::ListModelsResponse* response) {
  return FinishUnary(context, [&]() -> grpc::Status {
    repository::ModelRepository* repository = repository_.load(std::memory_order_acquire);
    if (grpc::Status serving = CheckServing(); !serving.ok()) return serving;
    for (const auto& [name, versions] : repository->List()) {
      v1::ModelSummary* m = response->add_models();
      m->set_name(name);
      for (const auto& v : versions) {
        if (v.state == repository::ModelRepository::VersionStatus::State::kAvailable) {
          m->add_versions(v.version);
        }
        v1::ModelVersionStatus* s = m->add_version_status();
        s->set_version(v.version);
        s->set_state(repository::ModelRepository::StateName(v));
        if (!v.error.ok()) s->set_error(v.error.ToString());
        s->set_pinned(v.pinned);
        s->set_unloaded_by_admin(v.disabled);
      }
    }
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* InferenceService::GetModel(grpc::CallbackServerContext* context,
                                                     const v1::GetModelRequest* request,
                                                     v1::ModelMetadata* response) {
  return FinishUnary(context, [&]() -> grpc::Status {
    if (grpc::Status serving = CheckServing(); !serving.ok()) return serving;
    auto servable = Resolve(repository_.load(std::memory_order_acquire), request->model_name(),
                            OptionalVersion(request->has_model_version(), request->model_version()));
    if (!servable.ok()) return ToGrpcStatus(servable.status());
    const ModelServable& s = **servable;
    const model::ModelInfo& info = s.info();
    response->set_name(s.id().model);
    response->set_version(s.id().version);
    for (const auto& l : info.labels) response->add_labels(l);
    response->set_problem_type(info.problem_type);
    response->set_max_length(info.max_length);
    response->set_num_layers(info.num_layers);
    response->set_num_heads(info.num_heads);
    response->set_head_size(info.head_size);
    response->set_hidden_size(info.hidden_size);
    response->set_intermediate_size(info.intermediate_size);
    for (int r : info.collaborative_ranks) response->add_collaborative_ranks(r);
    response->set_collaborative(!info.collaborative_ranks.empty());
    v1::ParameterCounts* p = response->mutable_parameters();
    p->set_total(info.params.total);
    p->set_embeddings(info.params.embeddings);
    p->set_attention_qk(info.params.attention_qk);
    p->set_attention_vo(info.params.attention_vo);
    p->set_ffn(info.params.ffn);
    p->set_layer_norm(info.params.layer_norm);
    p->set_head(info.params.head);
    response->set_compression_ratio(s.compression_ratio());
    response->set_device(info.device);
    response->set_dtype(info.dtype);
    response->set_vocab_size(s.engine().tokenizer().vocab_size());
    response->set_load_seconds(s.load_seconds());
    return grpc::Status::OK;
  });
}

}  // namespace collabserve::service

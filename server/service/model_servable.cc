#include "server/service/model_servable.h"

#include <algorithm>
#include <utility>

#include <glog/logging.h>

#include "absl/strings/str_cat.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "server/model/device.h"
#include "server/text/bert_tokenizer.h"
#include "server/util/status_macros.h"

namespace collabserve::service {
namespace {

// [CLS] w w ... [SEP] in the model's own vocabulary (w: the unknown-word token, which every
// vocabulary has).
model::TokenizedInput WarmUpInput(const text::BertTokenizer& tokenizer, int length) {
  model::TokenizedInput in;
  in.input_ids.assign(length, tokenizer.unk_id());
  in.input_ids.front() = tokenizer.cls_id();
  in.input_ids.back() = tokenizer.sep_id();
  in.token_type_ids.assign(length, 0);
  return in;
}

}  // namespace

ModelServable::ModelServable(repository::ServableId id, const ServableOptions& options,
                             metrics::Metrics* metrics)
    : id_(std::move(id)),
      options_(options),
      clock_(options.clock != nullptr ? options.clock : batching::RealClock::Get()),
      metrics_(metrics) {}

absl::StatusOr<std::unique_ptr<ModelServable>> ModelServable::Load(
    const repository::ServableId& id, const std::string& path, const ServableOptions& options,
    metrics::Metrics* metrics) {
  const absl::Time start = absl::Now();
  std::unique_ptr<ModelServable> s(new ModelServable(id, options, metrics));
  auto engine = model::Engine::Load(path, options.engine);
  // The repository's error names the version and its path: the statuses here say only what failed.
  if (!engine.ok()) return s->Failed(engine.status(), "");
  s->engine_ = std::move(engine).value();
  const absl::Time engine_loaded = absl::Now();
  const model::ModelInfo& info = s->engine_->info();
  if (info.labels.empty()) {
    return absl::FailedPreconditionError("the model has no labels (id2label in config.json)");
  }

  batching::SchedulerOptions so = options.batching;
  so.name = id.DebugString();
  so.clock = s->clock_;
  so.release_when_idle = options.release_batch_when_idle;
  // The model cannot take more than max_length tokens per input; a batch must fit one such input.
  if (so.max_batch_tokens < info.max_length) {
    LOG(WARNING) << id.DebugString() << ": --max_batch_tokens=" << so.max_batch_tokens
                 << " is below the model's longest input (" << info.max_length
                 << " tokens); its batches may hold up to " << info.max_length << " tokens";
    so.max_batch_tokens = info.max_length;
  }
  ModelServable* raw = s.get();
  // The gauge follows every change of the queue, sweeps of expired inputs included (which form no
  // batch): set only on Schedule and on batches, it kept its last value on an idle server.
  so.on_queue_size = [raw](int64_t queued) {
    if (prometheus::Gauge* g = raw->queue_depth_.load(std::memory_order_acquire)) {
      g->Set(static_cast<double>(queued));
    }
  };
  // Every input that leaves the queue, those failed there at their deadline included: the HPA's
  // queue-time p90 read low under overload when only the inputs that reached a batch counted.
  // (model_metrics_ is set below, before any task can be scheduled.)
  so.on_dequeue = [raw](absl::Duration waited) {
    raw->model_metrics_.queue_duration->Observe(absl::ToDoubleSeconds(waited));
  };
  absl::Status created = batching::BatchScheduler<InferenceTask>::Create(
      so,
      [raw](std::unique_ptr<batching::Batch<InferenceTask>> batch) {
        raw->ProcessBatch(std::move(batch));
      },
      &s->scheduler_);
  if (!created.ok()) {
    return created;
  }
  const absl::Time warm_up_start = absl::Now();
  RETURN_IF_ERROR(s->WarmUp());
  const absl::Duration warm_up = absl::Now() - warm_up_start;

  // Q/K parameters of a standard layer: W_Q and W_K (hidden x hidden) with their biases.
  const int64_t standard_qk =
      int64_t{2} * info.num_layers * (int64_t{info.hidden_size} * info.hidden_size + info.hidden_size);
  s->compression_ratio_ =
      (info.collaborative_ranks.empty() || info.params.attention_qk == 0)
          ? 1.0
          : static_cast<double>(standard_qk) / static_cast<double>(info.params.attention_qk);
  s->load_seconds_ = absl::ToDoubleSeconds(absl::Now() - start);

  metrics::ModelVersionFacts facts;
  const auto& p = info.params;
  facts.parameters = {{"total", p.total},           {"embeddings", p.embeddings},
                      {"attention_qk", p.attention_qk}, {"attention_vo", p.attention_vo},
                      {"ffn", p.ffn},               {"layer_norm", p.layer_norm},
                      {"head", p.head}};
  if (info.collaborative_ranks.empty()) {
    facts.layer_ranks.assign(info.num_layers, info.num_heads * info.head_size);
  } else {
    facts.layer_ranks = info.collaborative_ranks;
  }
  facts.compression_ratio = s->compression_ratio_;
  facts.load_seconds = s->load_seconds_;
  for (size_t i = 0; i < info.collaborative_ranks.size() && i < info.collaborative_errors.size(); ++i) {
    if (info.collaborative_ranks[i] > 0 && info.collaborative_errors[i] >= 0) {
      facts.layer_errors.emplace_back(static_cast<int>(i), info.collaborative_errors[i]);
    }
  }
  facts.fidelity_agreement = info.fidelity_top1_agreement;
  metrics->SetVersionFacts(id.model, id.version, facts);
  s->facts_published_ = true;
  s->model_metrics_ = metrics->ForModel(id.model);
  s->queue_depth_.store(metrics->QueueDepth(id.model, id.version), std::memory_order_release);
  LOG(INFO) << "loaded " << id.DebugString() << " from " << path << " in " << s->load_seconds_
            << " s (engine " << absl::ToDoubleSeconds(engine_loaded - start) << " s, warm-up "
            << absl::ToDoubleSeconds(warm_up) << " s; " << info.num_layers << " layers, " << p.total << " parameters, "
            << (info.collaborative_ranks.empty() ? "standard" : "collaborative") << ")";
  return s;
}

ModelServable::~ModelServable() {
  // Drain first: queued tasks still run on the engine and report to their calls.
  if (scheduler_ != nullptr) scheduler_->Shutdown(batching::ShutdownMode::kDrain);
  scheduler_.reset();
  if (facts_published_) metrics_->RemoveVersion(id_.model, id_.version);
  VLOG(1) << "unloaded " << id_.DebugString();
}

absl::Status ModelServable::WarmUp() {
  // One short input, then one full batch of medium inputs: the first passes allocate and pick
  // kernels, so that the first client requests do not pay for it.
  const int max_len = engine_->info().max_length;
  const text::BertTokenizer& tokenizer = engine_->tokenizer();
  std::vector<model::TokenizedInput> inputs = {WarmUpInput(tokenizer, std::min(8, max_len))};
  auto r = engine_->Run(inputs);
  if (!r.ok()) return Failed(r.status(), "warm-up failed: ");
  const int n = static_cast<int>(std::min<int64_t>(options_.batching.max_batch_size, 8));
  inputs.assign(n, WarmUpInput(tokenizer, std::min(64, max_len)));
  r = engine_->Run(inputs);
  if (!r.ok()) return Failed(r.status(), "warm-up failed: ");
  // On CUDA: a pass in every graph bucket a batch can fall in, so that no client request waits for
  // a capture.
  const absl::Time graphs_start = absl::Now();
  const absl::Status graphs = engine_->WarmUpGraphs(options_.batching.max_batch_size);
  if (!graphs.ok()) {
    return Failed(graphs, "warm-up of the CUDA graphs failed: ");
  }
  if (engine_->cuda_graphs() > 0) {
    LOG(INFO) << id_.DebugString() << ": " << engine_->cuda_graphs() << " CUDA graphs captured in "
              << absl::ToDoubleSeconds(absl::Now() - graphs_start) << " s";
  }
  return absl::OkStatus();
}

absl::Status ModelServable::Failed(const absl::Status& status, absl::string_view prefix) const {
  if (model::IsDeviceFailure(status) && options_.on_device_failure) options_.on_device_failure(status);
  return util::Prefixed(status, prefix);
}

absl::Status ModelServable::Schedule(std::vector<std::unique_ptr<InferenceTask>>* tasks) {
  return scheduler_->ScheduleAll(tasks);
}

void ModelServable::ProcessBatch(std::unique_ptr<batching::Batch<InferenceTask>> batch) {
  if (options_.before_batch_hook) options_.before_batch_hook();

  // Queue waits are known only while the tasks are in the batch.
  std::vector<absl::Duration> waits(batch->num_tasks());
  for (int64_t i = 0; i < batch->num_tasks(); ++i) waits[i] = batch->queue_wait(i);
  std::vector<std::unique_ptr<InferenceTask>> tasks = batch->RemoveAllTasks();

  // The scheduler already dropped dead tasks; this catches those that died while the batch waited
  // for this thread (e.g. behind the hook), so that they still never reach the model.
  const absl::Time now = clock_->Now();
  std::vector<std::unique_ptr<InferenceTask>> live;
  std::vector<absl::Duration> live_waits;
  live.reserve(tasks.size());
  int64_t tokens = 0, longest = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    if (tasks[i]->cancelled()) {
      tasks[i]->Fail(absl::CancelledError("the client cancelled the call before inference"));
    } else if (tasks[i]->deadline() <= now) {
      tasks[i]->Fail(absl::DeadlineExceededError(
          "the call's deadline passed while its input waited for the model"));
    } else {
      tokens += tasks[i]->size();
      longest = std::max(longest, tasks[i]->size());
      live.push_back(std::move(tasks[i]));
      live_waits.push_back(waits[i]);
    }
  }
  if (live.empty()) return;

  std::vector<const model::TokenizedInput*> inputs;
  inputs.reserve(live.size());
  for (const auto& t : live) inputs.push_back(&t->input());
  const absl::Time t0 = absl::Now();
  const absl::Status fault = options_.batch_fault_hook ? options_.batch_fault_hook() : absl::OkStatus();
  absl::StatusOr<std::vector<model::Prediction>> predictions =
      fault.ok() ? engine_->Run(absl::MakeConstSpan(inputs))
                 : absl::StatusOr<std::vector<model::Prediction>>(fault);
  const absl::Duration inference = absl::Now() - t0;

  const auto& m = model_metrics_;
  const int64_t padded = static_cast<int64_t>(live.size()) * longest;
  m.inference_duration->Observe(absl::ToDoubleSeconds(inference));
  m.batch_size->Observe(static_cast<double>(live.size()));
  m.batch_tokens->Observe(static_cast<double>(tokens));
  m.batch_padding_ratio->Observe(padded == 0 ? 0.0 : static_cast<double>(padded - tokens) / padded);
  statistics_.RecordExecution(static_cast<int64_t>(live.size()), inference);

  if (!predictions.ok() || predictions->size() != live.size()) {
    // Failed tells the Server of a device failure before the calls end: a client that sees this
    // error finds the server NOT_SERVING already.
    const absl::Status error =
        predictions.ok()
            ? absl::InternalError(absl::StrCat("model ", id_.DebugString(), " returned ",
                                               predictions->size(), " predictions for ",
                                               live.size(), " inputs"))
            : Failed(predictions.status(), absl::StrCat("model ", id_.DebugString(), ": "));
    LOG(ERROR) << error;
    for (auto& t : live) t->Fail(error);
    return;
  }
  for (size_t i = 0; i < live.size(); ++i) {
    live[i]->Complete(std::move((*predictions)[i]), live_waits[i], inference);
  }
}

}  // namespace collabserve::service

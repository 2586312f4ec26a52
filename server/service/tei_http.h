// Hugging Face text-embeddings-inference's HTTP API (TEI 1.9, router/src/http) for classifiers and
// re-rankers, on --http_port beside the KServe routes: what TEI's users send (curl scripts,
// huggingface_hub's InferenceClient, LangChain and LlamaIndex's TEI classes). Every request
// becomes a collabserve.v1.Inference call over the server's in-process channel, so the limits,
// batching, metrics and messages are the gRPC port's.
//
// TEI serves one model. The routes at the root serve TeiHttpOptions::default_model
// (--http_default_model), or, when that is "", the one model the server knows, served or not (with
// several, they answer 400 naming them and the flag: set it wherever a second model may come); the
// same routes under /models/M serve model M (a base URL http://host:8000/models/M). Its newest
// served version answers.
//
//   GET  /health, /ping, /      200 with an empty body when the model has a version served and
//                               the server is ready (KServe's ModelReady: not while it starts,
//                               drains or after its GPU failed), else 503 {"error":"unhealthy",
//                               "error_type":"Unhealthy"} (HEAD too)
//   GET  /info                  {"model_id","model_sha":null,"model_dtype","served_model_name",
//                                "model_type":{"classifier"|"reranker":{"id2label","label2id"}},
//                                "max_concurrent_requests","max_input_length","max_batch_tokens",
//                                "max_batch_requests","max_client_batch_size","auto_truncate":true,
//                                "tokenization_workers","version","sha":null,"docker_label":null};
//                               "reranker" for a one-label model
//   POST /predict               {"inputs": "a" | ["a", "pair"] | [["a"], ["b", "pair"], ...],
//                                "truncate"?: bool, "truncation_direction"?: "right",
//                                "raw_scores"?: bool}
//                               -> [{"score","label"}, ...]: every label, best first; a batch (an
//                               array of arrays) gets one such list per input
//   POST /rerank                {"query","texts":[...],"truncate"?,"truncation_direction"?,
//                                "raw_scores"?,"return_text"?} (one-label models)
//                               -> [{"index","score","text"?}, ...] best first
//   POST /tokenize              {"inputs": "a" | ["a", "b", ...], "add_special_tokens"?: bool
//                                (default true), "prompt_name"?: null}
//                               -> one list per text (a single one too) of {"id","text",
//                               "special","start","stop"}: the [CLS]/[SEP] added are special, with
//                               their token as text and null start/stop; any other token has the
//                               bytes [start, stop) of its text it came from (Hugging Face's
//                               offsets) and those bytes as text. Nothing is cut: a text longer
//                               than the model's max length is refused (422), where TEI tokenizes
//                               it whole
//   POST /decode                {"ids": [101, 2054, ...] | [[...], ...], "skip_special_tokens"?:
//                               bool (default true)} -> ["text", ...], one per sequence (Decode:
//                               Hugging Face's decode; an id outside the vocabulary is refused)
//   POST /, /invocations        /rerank for a one-label model, else /predict
//
// As in TEI: an array whose first element is a string is one pair, so a batch of single texts is
// [["a"], ["b"]]; a missing or null "truncate" is true (TEI's --auto-truncate); unknown keys are
// ignored (huggingface_hub sends "parameters"). Unlike TEI, the scores are the model's own
// probabilities, as Classify gives them: softmax over the labels, but per-label sigmoid for a
// multi_label_classification model, sigmoid for one label, the value for a regression model;
// "raw_scores": true gives the logits. Inputs are cut from the right ("truncation_direction":
// "left" is refused), and a pair's first text must not be empty (Classify refuses it: 422). Each
// answer of /predict and /rerank carries TEI's headers x-compute-characters, x-compute-tokens,
// x-total-time, x-tokenization-time, x-queue-time and x-inference-time (milliseconds).
//
// Errors are TEI's {"error": "...", "error_type": "..."}: "Empty" 400 for an empty text (or no
// texts to rerank), "Validation" 422 for a malformed request and what Classify refuses as
// INVALID_ARGUMENT (too many inputs, too long without truncation, ...), 404 for a model the server
// does not know, 400 for a body that is not JSON or a model the root routes cannot choose;
// "Overloaded" 429 (RESOURCE_EXHAUSTED: the queue is full); "Unhealthy" 503 for a known model with
// no version served (loading; also one whose files stay broken: its load error is the message),
// and UNAVAILABLE (starting, draining, a failed GPU); "Backend" 424 for a
// classifier asked to rerank, and grpc-gateway's code otherwise (kserve_http.h). A request whose
// client goes away is cancelled (499), as on the KServe routes.
#ifndef COLLABSERVE_SERVER_SERVICE_TEI_HTTP_H_
#define COLLABSERVE_SERVER_SERVICE_TEI_HTTP_H_

#include <cstdint>
#include <memory>
#include <string>

#include "server/service/http_server.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace collabserve::service {

// What /info reports besides the model's own metadata, and which model the root routes serve.
struct TeiHttpOptions {
  std::string default_model;             // --http_default_model ("": the only model served)
  std::string version = "0.1.0";         // the server's
  int max_concurrent_requests = 256;     // --http_max_connections
  int64_t max_batch_tokens = 16384;      // --max_batch_tokens
  int max_batch_requests = 32;           // --max_batch_size
  int max_client_batch_size = 64;        // --max_inputs_per_request
  // Inputs tokenized at once: tokenization runs on each request's own thread (main: the usable
  // CPUs).
  int tokenization_workers = 1;
};

// The handler that answers the routes above through `channel` (Server::InProcessChannel(), or any
// channel to a server with collabserve.v1.Inference and KServe's GRPCInferenceService, which
// /health asks). Thread-safe.
HttpHandler NewTeiHttpHandler(std::shared_ptr<grpc::Channel> channel, TeiHttpOptions options);

// The handler of --http_port: the KServe routes (kserve_http.h) for /v2 and the paths under it,
// TEI's for every other path.
HttpHandler NewHttpApiHandler(std::shared_ptr<grpc::Channel> channel, TeiHttpOptions options);

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_TEI_HTTP_H_

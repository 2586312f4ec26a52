// The Open Inference Protocol's HTTP/REST form (KServe v2, as Triton serves it) on --http_port.
// Every request becomes the gRPC call of kserve_service.h over the server's in-process channel, so
// the limits, validation, batching, metrics and errors are the gRPC port's; a gRPC status becomes
// the HTTP code grpc-gateway gives it (INVALID_ARGUMENT 400, NOT_FOUND 404, RESOURCE_EXHAUSTED 429,
// DEADLINE_EXCEEDED 504, UNAVAILABLE 503, FAILED_PRECONDITION 400, ...; but CANCELLED 503: only
// the server, shutting down, cancels) with the body {"error": "<the status message>"}. An
// inference whose client closes the connection (or half-closes it: HttpRequest::client_gone) is
// cancelled, its input leaves the queue, and the answer nobody reads is a 499.
//
//   GET  /v2/health/live                      200 {"live":true}, else 400 {"live":false}
//   GET  /v2/health/ready                     200 {"ready":true}, else 400 {"ready":false}
//   GET  /v2                                  {"name","version","extensions"}
//   GET  /v2/models/M[/versions/V]            {"name","versions","platform","inputs","outputs"}
//   GET  /v2/models/M[/versions/V]/ready      as /v2/health/ready, for that model (version)
//   GET  /v2/models/M[/versions/V]/config     Triton's model configuration (ModelConfig)
//   GET  /v2/models[/M[/versions/V]]/stats    {"model_stats":[...]} (Triton's statistics)
//   POST /v2/models/M[/versions/V]/infer      inference (below)
//   POST /v2/repository/index                 [{"name","version","state","reason"}]; body {"ready":true}
//                                             keeps the READY ones
//   POST /v2/repository/models/M/load|unload  refused as on gRPC (FAILED_PRECONDITION: 400)
// HEAD is answered as GET without the body; another method on a known path is 405. M and V are
// percent-decoded. Proto messages are written with their field names, 64-bit integers as JSON
// numbers, enums by name, maps as objects, and a parameter as its value.
//
// Inference: {"id"?, "parameters"?, "inputs": [{"name","shape","datatype","data"}], "outputs"?:
// [{"name","parameters"?}]}. A BYTES input's data are strings, flat or nested as the shape (at
// most 32 deep); another datatype is refused (every input is BYTES);
// parameters are bool, integer, number or string values ("truncate", "timeout" and an output's
// "classification" as on gRPC). The answer: {"model_name","model_version","id","outputs": [{"name",
// "datatype","shape","data"}]}, FP32 data as numbers, BYTES as strings (invalid UTF-8 replaced).
// Triton's binary tensor extension: with the header Inference-Header-Content-Length: N the body is
// N bytes of JSON then the inputs whose parameter "binary_data_size" gives their length, in input
// order, each laid out as raw_input_contents; an output with the parameter "binary_data": true (or
// every output, with the request parameter "binary_data_output": true) is sent the same way after
// the JSON, with "binary_data_size" in its parameters, the same header, and the type
// application/octet-stream. Errors name the field ("inputs[1].data[2]: not a string"). Inference
// answers alone are compressible (http_server.h): gzipped for a client that asks, as Triton does;
// the binary extension's header then still counts the uncompressed JSON.
#ifndef COLLABSERVE_SERVER_SERVICE_KSERVE_HTTP_H_
#define COLLABSERVE_SERVER_SERVICE_KSERVE_HTTP_H_

#include <functional>
#include <memory>

#include "grpcpp/support/status.h"
#include "server/service/http_server.h"

namespace grpc {
class Channel;
class ClientContext;
}  // namespace grpc

namespace collabserve::service {

// The HTTP code for a gRPC status code (grpc-gateway's table).
int HttpCodeForGrpc(int grpc_code);

// The double whose shortest decimal form is the float's, for a JSON writer (which prints a double's
// shortest form): 0.1f is written 0.1, not the 0.10000000149011612 it widens to.
double ShortestDouble(float f);

// Waits for the asynchronous call on `ctx` that `start` begins (handing it the function to call
// with the call's status), polling http.client_gone() every 50 ms meanwhile: once the client has
// gone the call is cancelled and *client_gone set. Returns the call's status.
grpc::Status AwaitUnlessClientGone(const HttpRequest& http, grpc::ClientContext* ctx,
                                   const std::function<void(std::function<void(grpc::Status)>)>& start,
                                   bool* client_gone);

// The handler that answers the routes above through `channel` (Server::InProcessChannel(), or any
// channel to a server with the KServe service). Thread-safe; the channel must stay usable while
// the handler is called (calls on a server that shut down fail UNAVAILABLE: 503).
HttpHandler NewKServeHttpHandler(std::shared_ptr<grpc::Channel> channel);

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_KSERVE_HTTP_H_

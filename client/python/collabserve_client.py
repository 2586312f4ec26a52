#!/usr/bin/python3
"""A Python client for collabserve, using Debian's python3-grpcio and python3-protobuf.

The stubs are generated at run time from the repository's .proto files with `protoc --python_out`
and `grpc_python_plugin` (Debian package protobuf-compiler-grpc) into a temporary directory, so no
generated code is kept anywhere. Every command prints JSON (one object per line) on stdout, and
exits non-zero with the gRPC status code and message on stderr when a call fails.

  collabserve_client.py --address 127.0.0.1:8500 [--tls [--tls-ca-file F]] health [--service MODEL]
      (mutual TLS: --tls-client-cert F --tls-client-key F)
  collabserve_client.py classify --model tiny [--version 2] [--pair TEXT ...] TEXT ...
  collabserve_client.py infer --model tiny [--version 2] [--raw] [--top K] [--pair TEXT ...] TEXT ...
  collabserve_client.py kserve-status [--model tiny]
  collabserve_client.py models
  collabserve_client.py upload --token-file F --model NAME --dir CHECKPOINT_DIR
                               [--rank R | --ranks R1,R2,... | --ratio X] [--activate] [--watch]
  collabserve_client.py watch --token-file F JOB_ID

`classify` calls collabserve.v1.Inference/Classify; `infer` calls the Open Inference Protocol's
inference.GRPCInferenceService/ModelInfer (KServe v2, same port); `health` calls grpc.health.v1;
`upload` streams a Hugging Face BERT checkpoint to collabserve.v1.Admin/UploadModel and `watch`
follows the job with WatchJob until it ends (exit status 0 only if it SUCCEEDED).
"""

import argparse
import atexit
import hashlib
import importlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time

try:
    import grpc
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("collabserve_client: python3-grpcio is not installed "
             "(apt-get install python3-grpcio, or scripts/install-deps.sh)")

DEFAULT_PROTO_DIR = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto"))
UPLOAD_CHUNK_BYTES = 1 << 20


class Stubs:
    """Modules generated from the .proto files: inference, admin (None if admin.proto is absent),
    kserve and health, each with its _pb2 and _pb2_grpc."""

    def __init__(self, proto_dir, out_dir=None):
        protoc = shutil.which("protoc")
        plugin = shutil.which("grpc_python_plugin")
        if protoc is None or plugin is None:
            raise RuntimeError("protoc and grpc_python_plugin are needed to generate the stubs "
                               "(apt-get install protobuf-compiler protobuf-compiler-grpc)")
        if out_dir is None:
            out_dir = tempfile.mkdtemp(prefix="collabserve-pystubs-")
            atexit.register(shutil.rmtree, out_dir, True)
        # health.proto is compiled from its own directory: as grpc/health/v1/health_pb2 it would
        # be shadowed by the grpc package itself. The wire names (grpc.health.v1.Health) stay.
        jobs = [(proto_dir, "collabserve/v1/inference.proto"),
                (proto_dir, "kserve/grpc_predict_v2.proto"),
                (os.path.join(proto_dir, "grpc", "health", "v1"), "health.proto")]
        has_admin = os.path.exists(os.path.join(proto_dir, "collabserve", "v1", "admin.proto"))
        if has_admin:
            jobs.append((proto_dir, "collabserve/v1/admin.proto"))
        for include, proto in jobs:
            cmd = [protoc, "--proto_path=" + include, "--python_out=" + out_dir,
                   "--grpc_python_out=" + out_dir, "--plugin=protoc-gen-grpc_python=" + plugin,
                   os.path.join(include, proto)]
            run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if run.returncode != 0:
                raise RuntimeError("protoc failed on %s:\n%s" % (proto, run.stdout))
        sys.path.insert(0, out_dir)
        load = importlib.import_module
        self.inference_pb2 = load("collabserve.v1.inference_pb2")
        self.inference_grpc = load("collabserve.v1.inference_pb2_grpc")
        self.kserve_pb2 = load("kserve.grpc_predict_v2_pb2")
        self.kserve_grpc = load("kserve.grpc_predict_v2_pb2_grpc")
        self.health_pb2 = load("health_pb2")
        self.health_grpc = load("health_pb2_grpc")
        self.admin_pb2 = load("collabserve.v1.admin_pb2") if has_admin else None
        self.admin_grpc = load("collabserve.v1.admin_pb2_grpc") if has_admin else None


def raw_bytes(elements):
    """BYTES tensor elements in the Open Inference Protocol's raw layout."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def parse_raw_bytes(raw):
    out, pos = [], 0
    while pos < len(raw):
        (n,) = struct.unpack_from("<I", raw, pos)
        out.append(raw[pos + 4:pos + 4 + n])
        pos += 4 + n
    return out


def parse_raw_fp32(raw):
    return list(struct.unpack("<%df" % (len(raw) // 4), raw))


class Client:
    # Unary calls that fail with UNAVAILABLE (server unreachable, loading, restarting, draining) or
    # RESOURCE_EXHAUSTED (a full queue) are tried again, as collabctl does: up to MAX_ATTEMPTS in
    # all, waits drawn from [backoff / 2, backoff] with backoff 50 ms doubling up to 2 s, all inside
    # the call's one deadline. None of these calls changes the server's state; UploadModel and
    # WatchJob are not retried.
    MAX_ATTEMPTS = 5
    RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)

    def __init__(self, address, stubs, timeout_s=30.0, token=None, tls=False, root_certs=None,
                 on_retry=None, client_cert=None, client_key=None):
        """tls: talk TLS, as the server's --tls_cert / --tls_key offer it; root_certs (PEM bytes)
        verify the server, None = the system's roots; client_cert and client_key (PEM bytes):
        this client's certificate, for a server with --tls_client_ca (mutual TLS).
        on_retry(error, attempt) is called before each wait (for logging)."""
        self.stubs = stubs
        self.timeout = timeout_s
        self.on_retry = on_retry
        if tls:
            self.channel = grpc.secure_channel(
                address, grpc.ssl_channel_credentials(root_certificates=root_certs,
                                                      private_key=client_key,
                                                      certificate_chain=client_cert))
        else:
            self.channel = grpc.insecure_channel(address)
        self.inference = stubs.inference_grpc.InferenceStub(self.channel)
        self.kserve = stubs.kserve_grpc.GRPCInferenceServiceStub(self.channel)
        self.health = stubs.health_grpc.HealthStub(self.channel)
        self.metadata = [("authorization", "Bearer " + token)] if token else None
        self.admin = stubs.admin_grpc.AdminStub(self.channel) if stubs.admin_grpc else None

    def _call(self, method, request):
        """method(request) with the retries above, inside one deadline of self.timeout."""
        give_up = time.monotonic() + self.timeout
        backoff = 0.05
        for attempt in range(1, self.MAX_ATTEMPTS + 1):
            try:
                return method(request, timeout=max(give_up - time.monotonic(), 0.001))
            except grpc.RpcError as e:
                if e.code() not in self.RETRYABLE or attempt == self.MAX_ATTEMPTS:
                    raise
                wait = random.uniform(backoff / 2, backoff)
                if time.monotonic() + wait >= give_up:
                    raise
                if self.on_retry:
                    self.on_retry(e, attempt)
                time.sleep(wait)
                backoff = min(backoff * 2, 2.0)

    def check_health(self, service=""):
        pb = self.stubs.health_pb2
        resp = self._call(self.health.Check, pb.HealthCheckRequest(service=service))
        return pb.HealthCheckResponse.ServingStatus.Name(resp.status)

    def classify(self, model, texts, pairs=None, version=None):
        pb = self.stubs.inference_pb2
        req = pb.ClassifyRequest(model_name=model)
        if version is not None:
            req.model_version = version
        for i, text in enumerate(texts):
            item = req.inputs.add(text=text)
            if pairs:
                item.text_pair = pairs[i]
        resp = self._call(self.inference.Classify, req)
        return [{"label": r.label, "score": r.score, "logits": list(r.logits),
                 "model_version": resp.model_version} for r in resp.results]

    def list_models(self):
        """ListModels: one dict per model, with its served versions and the state of every version
        on disk (with the load error of a failed one)."""
        resp = self._call(self.inference.ListModels, self.stubs.inference_pb2.ListModelsRequest())
        out = []
        for m in resp.models:
            status = []
            for v in m.version_status:
                row = {"version": v.version, "state": v.state}
                if v.error:
                    row["error"] = v.error
                if v.pinned:
                    row["pinned"] = True  # by an admin's LoadModel
                if v.unloaded_by_admin:
                    row["unloaded_by_admin"] = True
                status.append(row)
            out.append({"name": m.name, "versions": list(m.versions), "version_status": status})
        return out

    def infer(self, model, texts, pairs=None, version="", raw=False, top=0):
        """KServe v2 ModelInfer; one dict per input with logits, probabilities and label. With
        top > 0 the probabilities come as Triton's classification extension answers them: "top",
        the `top` best classes, each {"probability", "index", "label"}, best first."""
        pb = self.stubs.kserve_pb2
        req = pb.ModelInferRequest(model_name=model, model_version=version, id="python-client")
        if top > 0:
            req.outputs.add(name="logits")
            probs = req.outputs.add(name="probabilities")
            probs.parameters["classification"].int64_param = top
            req.outputs.add(name="label")
        tensors = [("text", texts)] + ([("text_pair", pairs)] if pairs else [])
        for name, values in tensors:
            encoded = [v.encode("utf-8") for v in values]
            tensor = req.inputs.add(name=name, datatype="BYTES", shape=[len(values)])
            if raw:
                req.raw_input_contents.append(raw_bytes(encoded))
            else:
                tensor.contents.bytes_contents.extend(encoded)
        resp = self._call(self.kserve.ModelInfer, req)
        if resp.id != req.id:
            raise RuntimeError("ModelInfer echoed id %r, sent %r" % (resp.id, req.id))
        outputs = {}
        for i, out in enumerate(resp.outputs):
            if resp.raw_output_contents:
                data = resp.raw_output_contents[i]
                values = parse_raw_bytes(data) if out.datatype == "BYTES" else parse_raw_fp32(data)
            else:
                values = (list(out.contents.bytes_contents) if out.datatype == "BYTES"
                          else list(out.contents.fp32_contents))
            outputs[out.name] = (list(out.shape), values)
        n = len(texts)
        c = outputs["logits"][0][1]
        probs_shape, probs = outputs["probabilities"]
        rows = []
        for i in range(n):
            row = {"label": outputs["label"][1][i].decode("utf-8"),
                   "logits": outputs["logits"][1][i * c:(i + 1) * c],
                   "model_version": resp.model_version,
                   "raw": bool(resp.raw_output_contents)}
            if top > 0:
                k = probs_shape[1]
                row["top"] = []
                for entry in probs[i * k:(i + 1) * k]:
                    # "value:index:label"; the label itself may hold colons.
                    value, index, label = entry.decode("utf-8").split(":", 2)
                    row["top"].append({"probability": float(value), "index": int(index),
                                       "label": label})
            else:
                row["probabilities"] = probs[i * c:(i + 1) * c]
            rows.append(row)
        return rows

    def kserve_status(self, model=None):
        pb = self.stubs.kserve_pb2
        out = {
            "live": self._call(self.kserve.ServerLive, pb.ServerLiveRequest()).live,
            "ready": self._call(self.kserve.ServerReady, pb.ServerReadyRequest()).ready,
        }
        meta = self._call(self.kserve.ServerMetadata, pb.ServerMetadataRequest())
        out["server"] = {"name": meta.name, "version": meta.version, "extensions": list(meta.extensions)}
        # Triton's model_repository extension: every version on disk and whether it serves (None
        # while the server loads its models, or from a server without the extension).
        out["repository"] = None
        if "model_repository" in meta.extensions:
            try:
                index = self.kserve.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=self.timeout)
                out["repository"] = [
                    {"model": m.name, "version": m.version, "state": m.state,
                     **({"reason": m.reason} if m.reason else {})}
                    for m in index.models if not model or m.name == model]
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
        if model:
            out["model_ready"] = self._call(self.kserve.ModelReady,
                                            pb.ModelReadyRequest(name=model)).ready
            m = self._call(self.kserve.ModelMetadata, pb.ModelMetadataRequest(name=model))
            out["model"] = {
                "name": m.name, "platform": m.platform, "versions": list(m.versions),
                "inputs": [[t.name, t.datatype, list(t.shape)] for t in m.inputs],
                "outputs": [[t.name, t.datatype, list(t.shape)] for t in m.outputs]}
            # Triton's model_configuration extension: how the newest version is served.
            c = self._call(self.kserve.ModelConfig, pb.ModelConfigRequest(name=model)).config
            out["model"]["config"] = {
                "max_batch_size": c.max_batch_size,
                "preferred_batch_size": list(c.dynamic_batching.preferred_batch_size),
                "max_queue_delay_us": c.dynamic_batching.max_queue_delay_microseconds,
                "instances": [[pb.ModelInstanceGroup.Kind.Name(g.kind), g.count] for g in c.instance_group],
                "parameters": {k: v.string_value for k, v in sorted(c.parameters.items())}}
        return out

    def _need_admin(self):
        if self.admin is None:
            raise RuntimeError("proto/collabserve/v1/admin.proto is missing: no Admin stubs")
        if self.metadata is None:
            raise RuntimeError("the Admin service needs a token (--token-file)")

    def upload(self, model, checkpoint_dir, rank=None, ratio=None, activate=True, ranks=None,
               min_agreement=None):
        """Streams every known file of `checkpoint_dir` (calibration.txt too: activation-aware
        compression); returns the UploadModelResponse. At most one of rank, ranks (one per layer;
        0 keeps a layer standard) and ratio; none uploads the checkpoint as it is. min_agreement:
        the fidelity gate. OSError when the directory or a file cannot be read."""
        self._need_admin()
        pb = self.stubs.admin_pb2
        if not os.path.isfile(os.path.join(checkpoint_dir, "config.json")):
            raise OSError("%s: no config.json (a Hugging Face BERT checkpoint directory)"
                          % checkpoint_dir)
        known = ["config.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json",
                 "model.safetensors", "pytorch_model.bin", "calibration.txt"]
        names = [n for n in known if os.path.isfile(os.path.join(checkpoint_dir, n))]
        header = pb.UploadHeader(model_name=model, activate=activate)
        if min_agreement is not None:
            header.min_agreement = min_agreement
        if rank is not None:
            header.compression.rank = rank
        elif ranks is not None:
            header.compression.ranks.ranks.extend(ranks)
        elif ratio is not None:
            header.compression.ratio = ratio
        for name in names:
            path = os.path.join(checkpoint_dir, name)
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(UPLOAD_CHUNK_BYTES), b""):
                    digest.update(block)
            header.files.add(name=name, size=os.path.getsize(path), sha256=digest.hexdigest())

        def requests():
            yield pb.UploadModelRequest(header=header)
            for name in names:
                offset = 0
                with open(os.path.join(checkpoint_dir, name), "rb") as f:
                    for block in iter(lambda: f.read(UPLOAD_CHUNK_BYTES), b""):
                        yield pb.UploadModelRequest(
                            chunk=pb.UploadChunk(file_name=name, offset=offset, data=block))
                        offset += len(block)

        # The call answers once the upload is validated, after the jobs queued before it: a client
        # that gives up first cancels the job, so the deadline is collabctl's hour.
        return self.admin.UploadModel(requests(), timeout=max(self.timeout, 3600),
                                      metadata=self.metadata)

    def watch(self, job_id):
        """Yields (event kind, job state, event) until the job ends."""
        self._need_admin()
        pb = self.stubs.admin_pb2
        for resp in self.admin.WatchJob(pb.WatchJobRequest(job_id=job_id),
                                        timeout=max(self.timeout, 3600), metadata=self.metadata):
            yield (pb.JobEvent.Kind.Name(resp.event.kind), pb.Job.State.Name(resp.state),
                   resp.event)


def print_json(obj):
    print(json.dumps(obj, sort_keys=True), flush=True)


def watch_and_print(client, job_id):
    """Prints each event; returns the job's final state name."""
    state = "STATE_UNSPECIFIED"
    for kind, state, event in client.watch(job_id):
        print_json({"job_id": job_id, "event": kind, "state": state, "message": event.message,
                    "version": event.version})
    return state


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="127.0.0.1:8500", help="host:port of collabserve")
    parser.add_argument("--proto-dir", default=DEFAULT_PROTO_DIR,
                        help="directory holding collabserve/, kserve/ and grpc/ .proto files")
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline per call (s)")
    parser.add_argument("--token-file", help="file with the Admin bearer token")
    parser.add_argument("--tls", action="store_true",
                        help="use TLS (the server's --tls_cert / --tls_key)")
    parser.add_argument("--tls-ca-file",
                        help="with --tls: PEM root certificates that verify the server (default: "
                             "the system's)")
    parser.add_argument("--tls-client-cert",
                        help="with --tls, for a server with --tls_client_ca (mutual TLS): PEM "
                             "certificate chain of this client (with --tls-client-key)")
    parser.add_argument("--tls-client-key", help="with --tls-client-cert: PEM file of its key")
    sub = parser.add_subparsers(dest="command", required=True)
    # The Admin commands take --token-file after their name too (SUPPRESS: not given there, the
    # one before the command stands).
    admin = argparse.ArgumentParser(add_help=False)
    admin.add_argument("--token-file", default=argparse.SUPPRESS,
                       help="file with the Admin bearer token")
    p = sub.add_parser("health")
    p.add_argument("--service", default="", help="model name, or empty for the whole server")
    for name in ("classify", "infer"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--version", default=None)
        p.add_argument("--pair", action="append", help="text_pair, once per text")
        p.add_argument("texts", nargs="+")
        if name == "infer":
            p.add_argument("--raw", action="store_true", help="send raw_input_contents")
            p.add_argument("--top", type=int, default=0, metavar="K",
                           help="answer the K best classes (Triton's classification parameter)")
    p = sub.add_parser("kserve-status")
    p.add_argument("--model")
    sub.add_parser("models")
    p = sub.add_parser("upload", parents=[admin])
    p.add_argument("--model", required=True)
    p.add_argument("--dir", required=True, help="Hugging Face BERT checkpoint directory")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--rank", type=int)
    group.add_argument("--ranks", help="one rank per layer, comma-separated (0 keeps a layer standard)")
    group.add_argument("--ratio", type=float)
    p.add_argument("--min-agreement", type=float,
                   help="fidelity gate: publish nothing below this top-1 agreement")
    p.add_argument("--activate", action=argparse.BooleanOptionalAction, default=True,
                   help="load the new version once published (as collabctl; --no-activate: leave "
                        "it to the repository's next scan)")
    p.add_argument("--watch", action="store_true", help="follow the job until it ends")
    p = sub.add_parser("watch", parents=[admin])
    p.add_argument("job_id")
    args = parser.parse_args(argv)

    for flag in ("tls_ca_file", "tls_client_cert", "tls_client_key"):
        if getattr(args, flag) and not args.tls:
            parser.error("--%s needs --tls" % flag.replace("_", "-"))
    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        parser.error("--tls-client-cert and --tls-client-key go together")
    if args.command in ("classify", "infer") and args.pair and len(args.pair) != len(args.texts):
        parser.error("give --pair once per text (%d texts, %d pairs)"
                     % (len(args.texts), len(args.pair)))
    version = None
    if args.command == "classify" and args.version is not None:
        try:
            version = int(args.version) or None  # 0: the newest, as in collabctl
        except ValueError:
            parser.error("--version %r: a version is an integer (1, 2, ...)" % args.version)
    ranks = None
    if getattr(args, "ranks", None) is not None:
        try:
            ranks = [int(r) for r in args.ranks.split(",")]
        except ValueError:
            parser.error("--ranks %r: one integer rank per layer, comma-separated" % args.ranks)
    token = None
    try:
        if args.token_file and args.command in ("upload", "watch"):
            try:
                with open(args.token_file) as f:
                    token = f.read().strip()
            except OSError as e:
                raise OSError("--token-file: %s" % e) from e
        pems = {}
        for flag in ("tls_ca_file", "tls_client_cert", "tls_client_key"):
            pems[flag] = None
            if getattr(args, flag):
                try:
                    with open(getattr(args, flag), "rb") as f:
                        pems[flag] = f.read()
                except OSError as e:
                    raise OSError("--%s: %s" % (flag.replace("_", "-"), e)) from e
        def on_retry(error, attempt):
            print("collabserve_client: %s: attempt %d: %s: %s; trying again"
                  % (args.command, attempt, error.code().name, error.details()), file=sys.stderr)

        client = Client(args.address, Stubs(args.proto_dir), args.timeout, token, args.tls,
                        pems["tls_ca_file"], on_retry, pems["tls_client_cert"],
                        pems["tls_client_key"])
        if args.command == "health":
            status = client.check_health(args.service)
            print_json({"service": args.service, "status": status})
            return 0 if status == "SERVING" else 1
        if args.command == "classify":
            for row in client.classify(args.model, args.texts, args.pair, version):
                print_json(row)
        elif args.command == "infer":
            for row in client.infer(args.model, args.texts, args.pair, args.version or "",
                                    args.raw, args.top):
                print_json(row)
        elif args.command == "kserve-status":
            print_json(client.kserve_status(args.model))
        elif args.command == "models":
            for row in client.list_models():
                print_json(row)
        elif args.command == "upload":
            resp = client.upload(args.model, args.dir, args.rank, args.ratio, args.activate, ranks,
                                 args.min_agreement)
            print_json({"job_id": resp.job_id, "model_name": resp.model_name,
                        "version": resp.version})
            if args.watch:
                return 0 if watch_and_print(client, resp.job_id) == "SUCCEEDED" else 1
        elif args.command == "watch":
            return 0 if watch_and_print(client, args.job_id) == "SUCCEEDED" else 1
    except grpc.RpcError as e:
        print("collabserve_client: %s: %s: %s" % (args.command, e.code().name, e.details() or ""),
              file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:
        print("collabserve_client: %s: %s" % (args.command, e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("collabserve_client: %s: interrupted" % args.command, file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

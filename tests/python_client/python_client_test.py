#!/usr/bin/python3
"""Interoperability test: client/python/collabserve_client.py (Debian's python3-grpcio, stubs
generated at run time) against the real build/bin/collabserve started on 127.0.0.1:0.

  python_client_test.py --server BIN/collabserve --model-tool BIN/collabserve-model \
      --client client/python/collabserve_client.py --proto-dir proto [--admin]

Fails (never skips) when python3-grpcio, protoc or grpc_python_plugin is missing. With --admin the
server gets an admin token and the test uploads a checkpoint and watches its compression job.
"""

import argparse
import http.client
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import unittest

ARGS = None


def run(cmd, check=True, timeout=300):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError("%s exited %d\nstdout:\n%s\nstderr:\n%s"
                             % (" ".join(cmd), proc.returncode, proc.stdout, proc.stderr))
    return proc


def start_server(repo, flags):
    """Starts collabserve on 127.0.0.1:0 over `repo`; returns the process and its address once it
    serves."""
    cmd = [ARGS.server, "--host=127.0.0.1", "--port=0", "--metrics_port=-1", "--http_port=0",
           "--model_repository=" + repo, "--poll_interval_s=0"] + flags
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    address = None
    serving = False
    server.http_port = None
    for line in server.stdout:
        if line.startswith("listening on 127.0.0.1:"):
            address = line.split("listening on ", 1)[1].strip()
        elif line.startswith("http on 127.0.0.1:"):
            server.http_port = int(line.rsplit(":", 1)[1])
        elif line.startswith("serving"):
            serving = True
            break
    if not serving or address is None:
        server.kill()
        server.wait()
        raise AssertionError("collabserve did not start (exit %s); see its stderr above"
                             % server.returncode)
    return server, address


class PythonClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="collabserve-pyclient-")
        cls.repo = os.path.join(cls.tmp, "repo")
        run([ARGS.model_tool, "make", "--out", os.path.join(cls.repo, "tiny", "1"),
             "--seed", "3"])
        flags = []
        cls.token_file = None
        if ARGS.admin:
            cls.token_file = os.path.join(cls.tmp, "token")
            with open(cls.token_file, "w") as f:
                f.write("python-client-test-token\n")
            flags.append("--admin_token_file=" + cls.token_file)
        cls.server, cls.address = start_server(cls.repo, flags)

    @classmethod
    def tearDownClass(cls):
        if cls.server.poll() is None:
            cls.server.kill()
            cls.server.wait()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def client(self, *args, check=True, token=True):
        cmd = ["/usr/bin/python3", ARGS.client, "--address", self.address,
               "--proto-dir", ARGS.proto_dir, "--timeout", "60"]
        if self.token_file and token:
            cmd += ["--token-file", self.token_file]
        return run(cmd + list(args), check=check, timeout=900)

    def rows(self, *args):
        return [json.loads(line) for line in self.client(*args).stdout.splitlines()]

    def test_0_dependencies_are_installed(self):
        proc = run(["/usr/bin/python3", "-c", "import grpc, google.protobuf"], check=False)
        self.assertEqual(proc.returncode, 0,
                         "python3-grpcio / python3-protobuf missing (scripts/install-deps.sh):\n"
                         + proc.stderr)
        for tool in ("protoc", "grpc_python_plugin"):
            self.assertIsNotNone(shutil.which(tool),
                                 tool + " missing (protobuf-compiler, protobuf-compiler-grpc)")

    def test_health(self):
        self.assertEqual(self.rows("health"), [{"service": "", "status": "SERVING"}])
        self.assertEqual(self.rows("health", "--service", "tiny")[0]["status"], "SERVING")
        proc = self.client("health", "--service", "nope", check=False)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("NOT_FOUND", proc.stderr)

    def test_classify_and_kserve_infer_agree(self):
        texts = ["the best movie of the year", "not good at all"]
        classified = self.rows("classify", "--model", "tiny", *texts)
        self.assertEqual(len(classified), 2)
        for raw in (False, True):
            inferred = self.rows("infer", "--model", "tiny", *(["--raw"] if raw else []), *texts)
            self.assertEqual(len(inferred), 2)
            for c, k in zip(classified, inferred):
                self.assertEqual(k["raw"], raw)
                self.assertEqual(k["label"], c["label"])
                self.assertEqual(k["model_version"], "1")
                self.assertEqual(len(k["logits"]), len(c["logits"]))
                for a, b in zip(k["logits"], c["logits"]):
                    self.assertAlmostEqual(a, b, places=5)
                self.assertAlmostEqual(sum(k["probabilities"]), 1.0, places=5)
                self.assertAlmostEqual(max(k["probabilities"]), c["score"], places=5)

    def test_rest_agrees_with_classify(self):
        # The REST endpoint through Python's own HTTP client: one keep-alive connection, a
        # Content-Length body, a chunked one, and an error.
        texts = ["the best movie of the year", "not good at all"]
        classified = self.rows("classify", "--model", "tiny", *texts)
        body = json.dumps({"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES",
                                       "data": texts}]})
        conn = http.client.HTTPConnection("127.0.0.1", self.server.http_port, timeout=60)
        try:
            for chunked in (False, True):
                payload = iter([body[:7].encode(), body[7:].encode()]) if chunked else body
                conn.request("POST", "/v2/models/tiny/infer", body=payload,
                             headers={"Content-Type": "application/json"},
                             encode_chunked=chunked)
                resp = conn.getresponse()
                answer = json.loads(resp.read())
                self.assertEqual(resp.status, 200, answer)
                outputs = {o["name"]: o for o in answer["outputs"]}
                self.assertEqual(outputs["label"]["data"], [c["label"] for c in classified])
                logits = outputs["logits"]["data"]
                width = len(classified[0]["logits"])
                self.assertEqual(outputs["logits"]["shape"], [2, width])
                for i, c in enumerate(classified):
                    for a, b in zip(logits[i * width:(i + 1) * width], c["logits"]):
                        self.assertAlmostEqual(a, b, places=5)
            conn.request("GET", "/v2/models/nope")
            resp = conn.getresponse()
            self.assertEqual(resp.status, 404)
            self.assertIn("nope", json.loads(resp.read())["error"])
        finally:
            conn.close()

    def test_kserve_classification_extension(self):
        texts = ["the best movie of the year", "not good at all"]
        plain = self.rows("infer", "--model", "tiny", *texts)
        for raw in (False, True):
            top = self.rows("infer", "--model", "tiny", "--top", "5",
                            *(["--raw"] if raw else []), *texts)
            for p, t in zip(plain, top):
                # Both labels (5 is capped at the model's 2), best first, the best one the label.
                self.assertEqual(len(t["top"]), 2)
                self.assertEqual(t["top"][0]["label"], p["label"])
                self.assertNotIn("probabilities", t)
                self.assertEqual(t["logits"], p["logits"])
                for entry in t["top"]:
                    self.assertAlmostEqual(entry["probability"],
                                           p["probabilities"][entry["index"]], places=5)
                self.assertGreaterEqual(t["top"][0]["probability"], t["top"][1]["probability"])

    def test_text_pair(self):
        args = ["--model", "tiny", "--pair", "someone makes music", "a man plays guitar"]
        classified = self.rows("classify", *args)
        inferred = self.rows("infer", *args)
        for a, b in zip(inferred[0]["logits"], classified[0]["logits"]):
            self.assertAlmostEqual(a, b, places=5)
        alone = self.rows("classify", "--model", "tiny", "a man plays guitar")
        self.assertNotEqual(alone[0]["logits"], classified[0]["logits"])

    def test_kserve_status_and_metadata(self):
        status = self.rows("kserve-status", "--model", "tiny")[0]
        self.assertTrue(status["live"])
        self.assertTrue(status["ready"])
        self.assertTrue(status["model_ready"])
        self.assertEqual(status["server"]["name"], "collabserve")
        self.assertEqual(status["model"]["platform"], "collabserve")
        self.assertEqual(status["model"]["versions"], ["1"])
        self.assertEqual(status["model"]["inputs"][0], ["text", "BYTES", [-1]])
        self.assertEqual(status["model"]["outputs"][0], ["logits", "FP32", [-1, 2]])
        self.assertEqual(status["server"]["extensions"],
                         ["classification", "model_configuration", "statistics", "model_repository"])
        self.assertEqual(status["repository"], [{"model": "tiny", "version": "1", "state": "READY"}])
        config = status["model"]["config"]
        self.assertGreater(config["max_batch_size"], 0)
        self.assertEqual(config["instances"][0][0], "KIND_CPU")
        self.assertEqual(config["parameters"]["device"], "cpu")
        self.assertNotIn("collaborative_ranks", config["parameters"])

    def test_models(self):
        rows = {row["name"]: row for row in self.rows("models")}
        self.assertEqual(rows["tiny"], {"name": "tiny", "versions": [1],
                                        "version_status": [{"version": 1, "state": "available"}]})

    def test_errors_come_back_as_grpc_status(self):
        proc = self.client("classify", "--model", "missing", "x", check=False)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("NOT_FOUND", proc.stderr)
        proc = self.client("infer", "--model", "tiny", "--version", "x", "hello", check=False)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("INVALID_ARGUMENT", proc.stderr)
        proc = self.client("classify", "--model", "tiny", "--version", "x", "hello", check=False)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("--version 'x': a version is an integer", proc.stderr)
        # --version 0 is the newest, as in collabctl.
        self.assertEqual(self.rows("classify", "--model", "tiny", "--version", "0", "hello")[0]
                         ["model_version"], 1)

    def test_tls(self):
        certs = os.path.join(self.tmp, "certs")
        os.makedirs(certs)
        cert, key = os.path.join(certs, "cert.pem"), os.path.join(certs, "key.pem")
        run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
             "-keyout", key, "-out", cert])
        server, address = start_server(self.repo, ["--tls_cert=" + cert, "--tls_key=" + key])
        try:
            # The certificate's name, not 127.0.0.1.
            base = ["/usr/bin/python3", ARGS.client, "--address",
                    "localhost:" + address.rsplit(":", 1)[1], "--proto-dir", ARGS.proto_dir,
                    "--timeout", "20"]
            proc = run(base + ["--tls", "--tls-ca-file", cert, "classify", "--model", "tiny",
                               "hello"])
            self.assertEqual(json.loads(proc.stdout.splitlines()[0])["model_version"], 1)
            proc = run(base + ["--tls", "--tls-ca-file", cert, "health"])
            self.assertEqual(json.loads(proc.stdout)["status"], "SERVING")
            # The REST port speaks HTTPS with the same certificate.
            conn = http.client.HTTPSConnection(
                "localhost", server.http_port, timeout=20,
                context=ssl.create_default_context(cafile=cert))
            conn.request("GET", "/v2/health/ready")
            resp = conn.getresponse()
            self.assertEqual((resp.status, json.loads(resp.read())), (200, {"ready": True}))
            conn.close()
            # Plaintext to a TLS port, and TLS with roots that do not sign the server, fail.
            proc = run(base + ["--timeout", "3", "health"], check=False)
            self.assertEqual(proc.returncode, 2, proc.stderr)
            self.assertIn("UNAVAILABLE", proc.stderr)
            proc = run(base + ["--timeout", "3", "--tls", "health"], check=False)
            self.assertEqual(proc.returncode, 2, proc.stderr)
            proc = run(base + ["--tls-ca-file", cert, "health"], check=False)
            self.assertEqual(proc.returncode, 2)
            self.assertIn("--tls-ca-file needs --tls", proc.stderr)
            proc = run(base + ["--tls", "--tls-ca-file", os.path.join(certs, "none.pem"),
                               "health"], check=False)
            self.assertEqual(proc.returncode, 2)
            self.assertIn("--tls-ca-file:", proc.stderr)
        finally:
            server.kill()
            server.wait()

    def test_mutual_tls(self):
        # --tls_client_ca: the server refuses a client without a certificate the CA signed.
        certs = os.path.join(self.tmp, "mtls")
        os.makedirs(certs)
        def make(name, subject):
            crt, key = os.path.join(certs, name + ".crt"), os.path.join(certs, name + ".key")
            run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                 "-subj", subject, "-addext", "subjectAltName=DNS:localhost",
                 "-keyout", key, "-out", crt])
            return crt, key
        cert, key = make("server", "/CN=localhost")
        ca_cert, ca_key = make("ca", "/CN=clients-ca")
        # The client's certificate is issued by the CA, as in a deployment.
        client_cert, client_key = os.path.join(certs, "client.crt"), os.path.join(certs, "client.key")
        run(["openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=client",
             "-keyout", client_key, "-out", os.path.join(certs, "client.csr")])
        run(["openssl", "x509", "-req", "-in", os.path.join(certs, "client.csr"), "-CA", ca_cert,
             "-CAkey", ca_key, "-CAcreateserial", "-days", "1", "-out", client_cert])
        stranger_cert, stranger_key = make("stranger", "/CN=stranger")
        server, address = start_server(self.repo, ["--tls_cert=" + cert, "--tls_key=" + key,
                                                   "--tls_client_ca=" + ca_cert])
        try:
            common = ["/usr/bin/python3", ARGS.client, "--address",
                      "localhost:" + address.rsplit(":", 1)[1], "--proto-dir", ARGS.proto_dir]
            tls = ["--tls", "--tls-ca-file", cert]
            mine = ["--tls-client-cert", client_cert, "--tls-client-key", client_key]
            proc = run(common + ["--timeout", "20"] + tls + mine +
                       ["classify", "--model", "tiny", "hello"])
            self.assertEqual(json.loads(proc.stdout.splitlines()[0])["model_version"], 1)
            # No certificate, and one the CA did not sign: refused at the handshake.
            for who in ([], ["--tls-client-cert", stranger_cert, "--tls-client-key", stranger_key]):
                proc = run(common + ["--timeout", "3"] + tls + who + ["health"], check=False)
                self.assertEqual(proc.returncode, 2, proc.stderr)
                self.assertIn("UNAVAILABLE", proc.stderr)
            # REST: the same refusal, the same admission.
            def rest(with_cert):
                ctx = ssl.create_default_context(cafile=cert)
                if with_cert:
                    ctx.load_cert_chain(client_cert, client_key)
                conn = http.client.HTTPSConnection("localhost", server.http_port, timeout=20,
                                                   context=ctx)
                try:
                    conn.request("GET", "/v2/health/live")
                    return conn.getresponse().status
                finally:
                    conn.close()
            self.assertEqual(rest(True), 200)
            with self.assertRaises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
                rest(False)
            proc = run(common + tls + ["--tls-client-cert", client_cert, "health"], check=False)
            self.assertEqual(proc.returncode, 2)
            self.assertIn("--tls-client-cert and --tls-client-key go together", proc.stderr)
            proc = run(common + mine + ["health"], check=False)
            self.assertEqual(proc.returncode, 2)
            self.assertIn("--tls-client-cert needs --tls", proc.stderr)
        finally:
            server.kill()
            server.wait()

    def test_retries_unavailable_within_the_deadline(self):
        # A Health service that fails its first calls with a chosen code: the client's retry
        # policy seen from the server's side.
        import concurrent.futures
        import importlib.util
        import grpc
        spec = importlib.util.spec_from_file_location("collabserve_client", ARGS.client)
        client_module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(client_module)
        stubs = client_module.Stubs(ARGS.proto_dir)

        class FlakyHealth(stubs.health_grpc.HealthServicer):
            def __init__(self):
                self.failures, self.code, self.calls = 0, None, 0

            def Check(self, request, context):
                self.calls += 1
                if self.calls <= self.failures:
                    context.abort(self.code, "not yet (call %d)" % self.calls)
                return stubs.health_pb2.HealthCheckResponse(
                    status=stubs.health_pb2.HealthCheckResponse.SERVING)

        health = FlakyHealth()
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
        stubs.health_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            base = ["/usr/bin/python3", ARGS.client, "--address", "127.0.0.1:%d" % port,
                    "--proto-dir", ARGS.proto_dir, "--timeout", "20", "health"]
            cases = [  # failures, code, exit status, calls the server sees
                (2, grpc.StatusCode.UNAVAILABLE, 0, 3),
                (1, grpc.StatusCode.RESOURCE_EXHAUSTED, 0, 2),
                (9, grpc.StatusCode.UNAVAILABLE, 2, 5),  # gives up after five attempts
                (1, grpc.StatusCode.NOT_FOUND, 2, 1),  # not retried
            ]
            for failures, code, status, calls in cases:
                with self.subTest(failures=failures, code=code.name):
                    health.failures, health.code, health.calls = failures, code, 0
                    proc = run(base, check=False)
                    self.assertEqual(proc.returncode, status, proc.stderr)
                    self.assertEqual(health.calls, calls)
                    self.assertEqual(proc.stderr.count("trying again"), calls - 1, proc.stderr)
                    if status == 0:
                        self.assertEqual(json.loads(proc.stdout)["status"], "SERVING")
                    else:
                        self.assertIn(code.name, proc.stderr)
        finally:
            server.stop(None)

    def test_upload_and_watch(self):
        if not ARGS.admin:
            self.fail("run with --admin to test upload and watch (the Admin service)")
        checkpoint = os.path.join(self.tmp, "upload")
        run([ARGS.model_tool, "make", "--out", checkpoint, "--seed", "4"])
        # The usage's form: --token-file after the command; a rank per layer (tiny: 2 layers).
        proc = self.client("upload", "--token-file", self.token_file, "--model", "uploaded",
                           "--dir", checkpoint, "--ranks", "8,0", "--activate", "--watch",
                           check=False, token=False)
        lines = [json.loads(l) for l in proc.stdout.splitlines()]
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertTrue(lines[0]["job_id"])
        events = [l["event"] for l in lines[1:]]
        self.assertIn("PUBLISHED", events)
        self.assertEqual(lines[-1]["state"], "SUCCEEDED")
        layers = [l for l in lines[1:] if l.get("event") == "LAYER_COMPRESSED"]
        messages = sorted(l["message"] for l in layers)
        self.assertEqual(len(messages), 2, lines)
        self.assertTrue(messages[0].startswith("layer 1 of 2 compressed: rank 8, error "), messages)
        self.assertEqual(messages[1], "layer 2 of 2 kept standard (rank 0)")
        bad = self.client("upload", "--model", "x", "--dir", checkpoint, "--ranks", "8,y",
                          check=False)
        self.assertEqual(bad.returncode, 2)
        self.assertIn("--ranks '8,y'", bad.stderr)
        # Files that cannot be read: one line naming them, exit 2, no traceback.
        for args, says in [(["--dir", self.tmp], "no config.json"),
                           (["--token-file", os.path.join(self.tmp, "missing"), "--dir", checkpoint],
                            "--token-file: [Errno 2]")]:
            bad = self.client("upload", "--model", "x", *args, check=False)
            self.assertEqual(bad.returncode, 2, bad.stderr)
            self.assertIn(says, bad.stderr)
            self.assertNotIn("Traceback", bad.stderr)
        # Watching an ended job replays its events and ends.
        again = self.client("watch", lines[0]["job_id"])
        self.assertIn("SUCCEEDED", again.stdout)
        rows = self.rows("classify", "--model", "uploaded", "hello there")
        self.assertEqual(rows[0]["model_version"], lines[0]["version"])
        self.assertEqual(self.rows("health", "--service", "uploaded")[0]["status"], "SERVING")

    def test_z_sigterm_drains_and_exits_cleanly(self):
        self.server.send_signal(signal.SIGTERM)
        self.assertEqual(self.server.wait(timeout=120), 0)


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--model-tool", required=True)
    parser.add_argument("--client", required=True)
    parser.add_argument("--proto-dir", required=True)
    parser.add_argument("--admin", action="store_true")
    ARGS, rest = parser.parse_known_args()
    for path in (ARGS.server, ARGS.model_tool, ARGS.client):
        if not os.path.exists(path):
            sys.exit("python_client_test: %s does not exist (build it first)" % path)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()

"""Access control on both frontends: with API keys configured, every RPC and route but health
is refused without a valid key (UNAUTHENTICATED / 401) and served with one; one key cannot
abort another's request; per-key rate and concurrency limits answer RESOURCE_EXHAUSTED / 429
and a slot frees when its request ends; TLS and mutual TLS refuse plaintext and certificate-less
clients; binding beyond loopback without a key warns; keys are compared in constant time and
key files and TLS files are checked with errors that name the flag (and never the key)."""

from __future__ import annotations

import datetime
import hmac
import ipaddress
import logging
import ssl
import time
from pathlib import Path

import grpc
import httpx2
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from megainfer import Engine, SamplingParams
from megainfer.cli import main
from megainfer.engine_config import EngineConfig
from megainfer.errors import ConfigError
from megainfer.server.access import AccessPolicy, KeyLimitExceeded, TokenBucket, bearer_key, fingerprint
from megainfer.server.api_key_file import KeyLimits, configured_keys, load_key_file
from megainfer.server.client import Client, request_message
from megainfer.server.endpoints import Endpoints
from megainfer.server.engine_backend import EngineBackend
from megainfer.server.served_model import ServedModel
from megainfer.server.tls import ClientTls, TlsFiles
from megainfer.v1 import inference_pb2 as pb
from megainfer.v1 import inference_pb2_grpc as pb_grpc

openai = pytest.importorskip("openai")
x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

MODEL = "tiny-mixtral"
KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789", "carol": "sk-carol-0123456789",
        "dave": "sk-dave-0123456789"}
KEY_FILE = f"""
keys:
  - key: {KEYS['alice']}
    name: alice
  - key: {KEYS['carol']}
    name: carol
    max_concurrency: 1
  - key: {KEYS['dave']}
    name: dave
    rate_limit: 0.5
"""
LONG = SamplingParams(max_tokens=1500, ignore_eos=True)  # seconds of decoding on the tiny model
SHORT = SamplingParams(max_tokens=2, ignore_eos=True)
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}


# ---------------------------------------------------------------- certificates


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _certificate(subject: str, key, issuer_name: x509.Name, issuer_key, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert=None, key=None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return path


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    """A CA (self-signed), a server certificate and a client certificate it signed, a key that
    belongs to neither, and the server's key encrypted."""
    out = tmp_path_factory.mktemp("certs")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("megainfer test CA", ca_key, _name("megainfer test CA"), ca_key, ca=True)
    files = {"ca": _write(out / "ca.pem", cert=ca)}
    for who in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        files[f"{who}_cert"] = _write(out / f"{who}.pem", cert=_certificate(who, key, ca.subject, ca_key, ca=False))
        files[f"{who}_key"] = _write(out / f"{who}.key", key=key)
    files["stranger_key"] = _write(out / "stranger.key", key=ec.generate_private_key(ec.SECP256R1()))
    server_key = serialization.load_pem_private_key(files["server_key"].read_bytes(), None)
    files["encrypted_key"] = out / "encrypted.key"
    files["encrypted_key"].write_bytes(server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    return files


# ---------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def backend():
    inner = EngineBackend(Engine(MODEL, EngineConfig(num_kv_blocks=512)))
    yield inner
    inner.close()


@pytest.fixture(scope="module")
def served() -> ServedModel:
    return ServedModel.load(MODEL)


@pytest.fixture(scope="module")
def keyed(backend, served, tmp_path_factory):
    """Both frontends and a metrics port behind four keys: alice and bob unlimited (bob from
    --api-key, the others from a key file), carol one request at a time, dave 0.5 requests/s."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    key_file.write_text(KEY_FILE)
    access = AccessPolicy.from_options([KEYS["bob"]], key_file, environ={})
    endpoints = Endpoints(backend, served, port=0, http_port=0, metrics_port=0, access=access).start()
    yield endpoints
    endpoints.stop(0)


def auth(who: str | None) -> tuple:
    return () if who is None else (("authorization", f"Bearer {KEYS.get(who, who)}"),)


def headers(who: str | None) -> dict[str, str]:
    return {} if who is None else {"Authorization": f"Bearer {KEYS.get(who, who)}"}


def stub(endpoints: Endpoints) -> pb_grpc.InferenceStub:
    return pb_grpc.InferenceStub(grpc.insecure_channel(endpoints.grpc.address))


def generate(endpoints: Endpoints, who: str | None, params: SamplingParams = SHORT, request_id: str = ""):
    return stub(endpoints).Generate(request_message("hello", params, request_id), metadata=auth(who), timeout=60)


def rpc_code(call) -> grpc.StatusCode | None:
    """The status a call ends with (None: OK), reading a stream to its end."""
    try:
        result = call()
        if not isinstance(result, pb.ServerInfoResponse | pb.AbortResponse):
            list(result)
    except grpc.RpcError as exc:
        return exc.code()
    return None


def complete(sdk) -> int:
    """Tokens in the OpenAI SDK's answer to a two-token completion."""
    answer = sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
    return answer.usage.completion_tokens


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# ---------------------------------------------------------------- keys on every door


@pytest.mark.parametrize("who", [None, "not-a-key"])
def test_grpc_refuses_every_rpc_but_health_without_a_valid_key(keyed, who):
    inference = stub(keyed)
    channel = grpc.insecure_channel(keyed.grpc.address)
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    calls = {
        "Generate": lambda: generate(keyed, who),
        "Abort": lambda: inference.Abort(pb.AbortRequest(request_id="x"), metadata=auth(who)),
        "ServerInfo": lambda: inference.ServerInfo(pb.ServerInfoRequest(), metadata=auth(who)),
        "reflection": lambda: reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=auth(who)),
    }
    for name, call in calls.items():
        assert rpc_code(call) is grpc.StatusCode.UNAUTHENTICATED, name
    try:
        inference.ServerInfo(pb.ServerInfoRequest(), metadata=auth(who))
    except grpc.RpcError as exc:  # the message says how to send a key, and never echoes one
        assert "Bearer" in exc.details() and "not-a-key" not in exc.details()
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), metadata=auth(who))
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_serves_every_rpc_with_a_valid_key(keyed):
    inference = stub(keyed)
    for who in ("alice", "bob"):
        assert inference.ServerInfo(pb.ServerInfoRequest(), metadata=auth(who)).model == MODEL
        responses = list(generate(keyed, who))
        assert responses[-1].finish_reason == "length"
        assert inference.Abort(pb.AbortRequest(request_id="unknown"), metadata=auth(who)).aborted is False
    reflect = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(keyed.grpc.address))
    answer = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               metadata=auth("alice")))
    assert "megainfer.v1.Inference" in [s.name for s in answer.list_services_response.service]
    client = Client(keyed.grpc.address, api_key=KEYS["alice"])  # the CLI's client sends the key itself
    assert sum(len(r.token_ids) for r in client.generate("hi", SHORT)) == 2 and client.info().model == MODEL
    client.close()


ROUTES = [("POST", "/v1/completions", COMPLETION),
          ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
          ("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None), ("GET", "/metrics", None),
          ("GET", "/version", None), ("GET", "/no/such/route", None)]


@pytest.mark.parametrize("who", [None, "not-a-key"])
def test_http_refuses_every_route_but_health_without_a_valid_key(keyed, who):
    with httpx2.Client(base_url=keyed.http_url, timeout=30) as http:
        for method, path, body in ROUTES:
            response = http.request(method, path, json=body, headers=headers(who))
            assert response.status_code == 401, (path, response.text)
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert "not-a-key" not in response.text and response.headers["www-authenticate"] == "Bearer"
        assert http.get("/health", headers=headers(who)).json() == {"status": "serving"}
        scraped = httpx2.get(keyed.metrics_url, headers=headers(who), timeout=30)  # the metrics-only port
        assert scraped.status_code == 401
    if who is not None:  # the SDK will not send a request without a key
        sdk = openai.OpenAI(base_url=keyed.http_url + "/v1", api_key=who, max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_http_serves_every_route_with_a_valid_key(keyed):
    with httpx2.Client(base_url=keyed.http_url, timeout=30, headers=headers("bob")) as http:
        for method, path, body in ROUTES[2:6]:
            assert http.request(method, path, json=body).status_code == 200, path
        assert http.get("/no/such/route").status_code == 404  # past the key, the route's own answer
    assert "megainfer:" in httpx2.get(keyed.metrics_url, headers=headers("bob"), timeout=30).text
    sdk = openai.OpenAI(base_url=keyed.http_url + "/v1", api_key=KEYS["alice"], max_retries=0, timeout=30)
    assert complete(sdk) == 2


def test_a_key_cannot_abort_another_keys_request(keyed):
    inference = stub(keyed)
    stream = generate(keyed, "alice", LONG, request_id="alices-request")
    assert next(stream).request_id == "alices-request"
    assert inference.Abort(pb.AbortRequest(request_id="alices-request"), metadata=auth("bob")).aborted is False
    later = [next(stream) for _ in range(5)]  # alice's request streams on
    assert not any(r.finish_reason for r in later)
    assert inference.Abort(pb.AbortRequest(request_id="alices-request"), metadata=auth("alice")).aborted is True
    assert list(stream)[-1].finish_reason == "abort"


# ---------------------------------------------------------------- limits


def test_concurrency_limit_refuses_a_second_request_and_frees_its_slot_when_the_first_ends(keyed):
    held = generate(keyed, "carol", LONG)
    next(held)
    assert keyed.access.live("carol") == 1
    assert rpc_code(lambda: generate(keyed, "carol")) is grpc.StatusCode.RESOURCE_EXHAUSTED
    with httpx2.Client(base_url=keyed.http_url, timeout=30, headers=headers("carol")) as http:
        refused = http.post("/v1/completions", json=COMPLETION)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
        assert "max_concurrency" in refused.json()["error"]["message"]
        assert rpc_code(lambda: generate(keyed, "alice")) is None  # other keys are not held up
        held.cancel()  # the client goes away: its slot frees
        wait_until(lambda: keyed.access.live("carol") == 0)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as streaming:  # now an HTTP stream holds it
            assert streaming.status_code == 200
            lines = streaming.iter_lines()  # kept: a line iterator dropped closes the connection
            next(lines)
            assert keyed.access.live("carol") == 1
            assert rpc_code(lambda: generate(keyed, "carol")) is grpc.StatusCode.RESOURCE_EXHAUSTED
        wait_until(lambda: keyed.access.live("carol") == 0)  # the stream's client left
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200
    assert rpc_code(lambda: generate(keyed, "carol")) is None  # a request that finished frees its slot too
    assert keyed.access.live("carol") == 0


def test_rate_limit_refuses_requests_over_the_rate_on_both_frontends(keyed):
    assert rpc_code(lambda: generate(keyed, "dave")) is None  # the bucket's one request
    assert rpc_code(lambda: generate(keyed, "dave")) is grpc.StatusCode.RESOURCE_EXHAUSTED
    refused = httpx2.post(keyed.http_url + "/v1/completions", headers=headers("dave"), timeout=30,
                          json=COMPLETION)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert httpx2.get(keyed.http_url + "/v1/models", headers=headers("dave"), timeout=30).status_code == 200


# ---------------------------------------------------------------- TLS


def _client_context(certs, with_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs["ca"]))
    if with_cert:
        context.load_cert_chain(str(certs["client_cert"]), str(certs["client_key"]))
    return context


def _plaintext_refused(endpoints: Endpoints) -> None:
    plain = grpc.insecure_channel(endpoints.grpc.address)
    with pytest.raises(grpc.RpcError) as refused:
        pb_grpc.InferenceStub(plain).ServerInfo(pb.ServerInfoRequest(), timeout=5)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    with pytest.raises(httpx2.HTTPError):
        httpx2.get(endpoints.http_url.replace("https://", "http://") + "/health", timeout=5)


def test_tls_serves_tls_clients_and_refuses_plaintext(backend, served, certs):
    tls = TlsFiles.from_options(certs["server_cert"], certs["server_key"])
    endpoints = Endpoints(backend, served, port=0, http_port=0, tls=tls).start()
    try:
        assert endpoints.http_url.startswith("https://") and "(TLS)" in endpoints.describe()[0]
        client = Client(endpoints.grpc.address, tls=ClientTls(ca_certs=certs["ca"]))
        assert client.info().model == MODEL
        client.close()
        http = httpx2.Client(verify=_client_context(certs, with_cert=False), timeout=30)
        sdk = openai.OpenAI(base_url=endpoints.http_url + "/v1", api_key="x", http_client=http, max_retries=0)
        assert complete(sdk) == 2
        http.close()
        _plaintext_refused(endpoints)
    finally:
        endpoints.stop(0)


def test_mutual_tls_requires_a_client_certificate(backend, served, certs):
    tls = TlsFiles.from_options(certs["server_cert"], certs["server_key"], certs["ca"])
    endpoints = Endpoints(backend, served, port=0, http_port=0, tls=tls).start()
    try:
        assert "(mutual TLS)" in endpoints.describe()[0]
        with_cert = ClientTls(ca_certs=certs["ca"], certfile=certs["client_cert"], keyfile=certs["client_key"])
        client = Client(endpoints.grpc.address, tls=with_cert)
        assert client.info().model == MODEL
        client.close()
        anonymous = grpc.secure_channel(endpoints.grpc.address, ClientTls(ca_certs=certs["ca"]).grpc_credentials())
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.InferenceStub(anonymous).ServerInfo(pb.ServerInfoRequest(), timeout=5)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        url = endpoints.http_url + "/health"
        assert httpx2.get(url, verify=_client_context(certs, with_cert=True), timeout=30).status_code == 200
        with pytest.raises(httpx2.HTTPError):
            httpx2.get(url, verify=_client_context(certs, with_cert=False), timeout=5)
        _plaintext_refused(endpoints)
    finally:
        endpoints.stop(0)


def test_tls_files_are_checked_and_errors_name_the_flag(certs, tmp_path):
    with pytest.raises(ConfigError, match="--ssl-certfile .*missing.pem: cannot read"):
        TlsFiles.from_options(tmp_path / "missing.pem", certs["server_key"])
    with pytest.raises(ConfigError, match="--ssl-keyfile .*stranger.key: is not the private key"):
        TlsFiles.from_options(certs["server_cert"], certs["stranger_key"])
    with pytest.raises(ConfigError, match="--ssl-keyfile .*encrypted.key: cannot be loaded .*unencrypted"):
        TlsFiles.from_options(certs["server_cert"], certs["encrypted_key"])  # and no pass phrase prompt
    with pytest.raises(ConfigError, match="--ssl-certfile needs --ssl-keyfile"):
        TlsFiles.from_options(certs["server_cert"], None)
    with pytest.raises(ConfigError, match="--ssl-ca-certs .*needs TLS|client certificates need TLS"):
        TlsFiles.from_options(None, None, certs["ca"])
    with pytest.raises(ConfigError, match="--ssl-ca-certs .*server.key"):
        TlsFiles.from_options(certs["server_cert"], certs["server_key"], certs["server_key"])
    assert TlsFiles.from_options(None, None) is None


# ---------------------------------------------------------------- warnings


def test_binding_beyond_loopback_without_a_key_warns(backend, served, caplog):
    caplog.set_level(logging.WARNING, logger="megainfer.server.endpoints")
    exposed = Endpoints(backend, served, host="0.0.0.0", port=0, http_port=0)
    exposed.stop(0)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "--api-key" in warnings[0], warnings
    assert "gRPC on 0.0.0.0:" in warnings[0] and "HTTP API on 0.0.0.0:" in warnings[0]
    caplog.clear()
    keyed_plaintext = Endpoints(backend, served, host="0.0.0.0", port=0, http_port=None,
                                access=AccessPolicy.from_keys(["k"]))
    keyed_plaintext.stop(0)
    assert any("without TLS" in r.getMessage() for r in caplog.records)
    caplog.clear()
    Endpoints(backend, served, host="127.0.0.1", port=0, http_port=0).stop(0)
    assert not caplog.records


# ---------------------------------------------------------------- the policy itself


def test_keys_are_compared_in_constant_time(monkeypatch):
    policy = AccessPolicy.from_keys(["first-key", "second-key", "third-key"])
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    for presented in ("first-key", "third-key", "no-such-key"):
        compared.clear()
        found = policy.authenticate(presented)
        assert len(compared) == 3  # every key, even after the first matched
        assert all(len(a) == len(b) == 32 for a, b in compared)  # digests, never the keys themselves
        assert found == (None if presented == "no-such-key" else fingerprint(presented))
    assert policy.authenticate(None) is None and policy.authenticate("") is None


def test_bearer_header_parsing():
    assert bearer_key("Bearer abc") == "abc" and bearer_key("bearer  abc ") == "abc"
    assert bearer_key("Basic abc") is None and bearer_key("Bearer") is None and bearer_key(None) is None


def test_token_bucket_and_concurrency_limits():
    now = [0.0]
    bucket = TokenBucket(2.0, 2.0, lambda: now[0])
    assert bucket.take() == 0 and bucket.take() == 0
    assert bucket.take() == pytest.approx(0.5)  # one token per half second
    now[0] = 0.5
    assert bucket.take() == 0
    policy = AccessPolicy.from_keys(["k"], max_concurrency=2)
    who = fingerprint("k")
    first, second = policy.admit(who), policy.admit(who)
    with pytest.raises(KeyLimitExceeded) as over:
        policy.admit(who)
    assert over.value.retry_after_s is None
    first.release()
    first.release()  # twice is once
    assert policy.live(who) == 1
    with policy.admit(who):
        assert policy.live(who) == 2
    second.release()
    assert policy.live(who) == 0


def test_key_file_formats_and_defaults(tmp_path):
    defaults = KeyLimits(rate_limit=10.0, max_concurrency=4)
    yaml_file = tmp_path / "keys.yml"
    yaml_file.write_text("keys:\n  - plain-key\n  - {key: named-key, name: team, rate_limit: null, "
                         "max_concurrency: 1}\n")
    plain, named = load_key_file(yaml_file, defaults)
    assert plain.name is None and plain.limits == defaults
    assert named.name == "team" and named.limits == KeyLimits(None, 1)
    lines = tmp_path / "keys.txt"
    lines.write_text("# ops keys\n\nline-key-1\n  line-key-2  \n")
    assert [e.key for e in load_key_file(lines, defaults)] == ["line-key-1", "line-key-2"]
    policy = AccessPolicy.from_options(["flag-key"], yaml_file, environ={"MEGAINFER_API_KEY": "env-key"})
    assert policy.principals == [fingerprint("flag-key"), fingerprint("plain-key"), "team"]
    assert AccessPolicy.from_options(None, None, environ={"MEGAINFER_API_KEY": "env-key"}).authenticate("env-key")
    assert AccessPolicy.from_options(None, None, environ={}) is None


@pytest.mark.parametrize("text, error", [
    ("keys:\n  - {key: secret-one, colour: red}", r"keys\[0\]: unknown field\(s\) colour"),
    ("keys:\n  - {name: team}", r"keys\[0\] \(name 'team'\): the `key` field is missing"),
    ("keys:\n  - {key: secret-one, rate_limit: -1}", r"keys\[0\] rate_limit: must be a number .* > 0, got -1"),
    ("keys:\n  - {key: secret-one, max_concurrency: 0.5}", r"max_concurrency: must be a whole number"),
    ("keys:\n  - secret-one\n  - secret-one", r"keys\[1\]: the same key as .*keys\[0\]"),
    ("keys:\n  - {key: secret-one, name: a}\n  - {key: secret-two, name: a}", r"the name 'a' is taken by"),
    ("keys:\n  - 'secret one'", r"keys\[0\]: a key cannot contain spaces"),
    ("- secret-one", r"expected a mapping with one field, `keys:`"),
    ("keys: [secret-one", r"not valid YAML at line"),
    ("keys: []", r"no keys in it"),
])
def test_key_file_errors_name_the_file_and_entry_and_never_the_key(tmp_path, text, error):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error) as raised:
        load_key_file(path, KeyLimits())
    assert str(path) in str(raised.value) and "--api-key-file" in str(raised.value)
    assert "secret-one" not in str(raised.value) and "secret-two" not in str(raised.value)


def test_flag_errors_name_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--api-key-file .*missing.yaml: cannot read"):
        configured_keys([], tmp_path / "missing.yaml", KeyLimits(), environ={})
    with pytest.raises(ConfigError, match="--api-key #2: a key must be a non-empty string"):
        configured_keys(["a-key", ""], None, KeyLimits(), environ={})
    with pytest.raises(ConfigError, match="--api-key-rate-limit: must be a number"):
        AccessPolicy.from_options(["a-key"], None, rate_limit=0, environ={})
    with pytest.raises(ConfigError, match="no key is configured"):
        AccessPolicy.from_options(None, None, max_concurrency=2, environ={})


def test_cli_reports_a_bad_key_file_without_a_traceback(tmp_path, capsys):
    assert main(["serve", "--model", MODEL, "--api-key-file", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err
    assert "--api-key-file" in err and "none.yaml" in err and "Traceback" not in err


def test_generate_cli_sends_the_key(keyed, capsys, monkeypatch):
    args = ["generate", "--server", keyed.grpc.address, "--prompt", "hi", "--max-tokens", "2"]
    assert main(args + ["--api-key", KEYS["bob"]]) == 0
    monkeypatch.setenv("MEGAINFER_API_KEY", KEYS["alice"])
    assert main(args) == 0
    monkeypatch.delenv("MEGAINFER_API_KEY")
    capsys.readouterr()
    assert main(args) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err

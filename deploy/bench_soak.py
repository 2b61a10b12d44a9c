"""`megainfer bench soak PLAN.yaml --duration 10m --concurrency N [--chaos]`: a plan brought up as
`megainfer deploy` brings it up, served on loopback over gRPC and HTTP (any free ports, with an
API key every request carries), under `soak_traffic`'s mixed load for the duration, with
`deploy.chaos`'s faults where asked.

While it runs, every rank's resources (`NodeResources`: RSS, KV blocks, M2N slots) are sampled
every `SAMPLE_EVERY_S`. After the duration: no new requests, the in-flight ones end (or turn
unended after the request timeout), then the deployment must report every node serving and
idle within `IDLE_BOUND_S`; what the nodes still hold then is leaked. The soak fails (exit
status 1) on an unended request, a leaked block or slot, a deployment that never settles, or a
fault not recovered within its bound; `soak_report` defines every figure."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from deploy.cli import max_model_len, start_backend
from megainfer.tools.bench import soak_report
from megainfer.tools.bench.soak_report import Fault, ResourceSample, SoakRun
from megainfer.tools.bench.soak_traffic import SoakTraffic, TrafficSpec
from megainfer.errors import ConfigError
from megainfer.plan import Plan
from megainfer.server.access import AccessPolicy
from megainfer.server.endpoints import Endpoints
from megainfer.server.served_model import ServedModel

logger = logging.getLogger(__name__)

SAMPLE_EVERY_S = 5.0  # resource samples while the soak runs
IDLE_BOUND_S = 60.0  # after the drain, how long the deployment has to report serving and idle
IDLE_POLL_S = 0.5


@dataclass
class SoakSpec:
    duration_s: float  # how long traffic is sent
    concurrency: int = 8  # clients, each with one request in flight
    chaos: bool = False
    seed: int = 0  # the traffic mix and the faults
    request_timeout_s: float = 120.0  # a request without an end by then is unended

    def __post_init__(self) -> None:
        if not 0 < self.duration_s < float("inf"):
            raise ConfigError(f"--duration must be a positive time, got {self.duration_s:g} s")
        if self.concurrency < 1:
            raise ConfigError(f"--concurrency must be at least 1, got {self.concurrency}")
        if not 0 < self.request_timeout_s < float("inf"):
            raise ConfigError(f"--request-timeout must be a positive time, got {self.request_timeout_s:g} s")


class ResourceSampler:
    """Every rank's resources every `every_s` on the soak's clock, from a thread of its own."""

    def __init__(self, backend, t0: float, every_s: float = SAMPLE_EVERY_S) -> None:
        self.backend = backend
        self.t0 = t0
        self.every_s = every_s
        self.samples: list[ResourceSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-resources", daemon=True)

    def start(self) -> "ResourceSampler":
        self._thread.start()
        return self

    def read(self) -> ResourceSample:
        nodes = self.backend.resources()  # ranks that do not answer (dead, stopped) are left out
        return ResourceSample(time.monotonic() - self.t0, nodes)

    def _run(self) -> None:
        while True:
            try:
                self.samples.append(self.read())
            except Exception as exc:  # a node being replaced: the next sample will see it
                logger.warning("soak: resource sample failed: %s", exc)
            if self._stop.wait(self.every_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def settle(backend, sampler: ResourceSampler, bound_s: float = IDLE_BOUND_S) -> tuple[ResourceSample, float | None]:
    """Wait until every rank serves and holds nothing (no request, block or slot); the last
    reading, and how long that took (None: not within `bound_s`, the reading then shows what is held)."""
    start = time.monotonic()
    reading = ResourceSample(0.0, [])
    while True:
        try:
            health = backend.health()
            reading = sampler.read()
            # Every rank answered (a rank that cannot is left out of the reading) and holds nothing.
            if all(h.serving for h in health) and len(reading.nodes) == len(health) \
                    and all(n.idle for n in reading.nodes):
                return reading, time.monotonic() - start
        except Exception as exc:  # noqa: BLE001 - a node that cannot answer yet is not idle yet
            logger.info("soak: not settled yet: %s", exc)
        if time.monotonic() - start > bound_s:
            return reading, None
        time.sleep(IDLE_POLL_S)


def _faults(chaos, offset_s: float) -> list[Fault]:
    """The injector's records on the soak's clock (its at_s counts from its own start)."""
    return [Fault(kind=str(r.kind), target=r.target, at_s=offset_s + r.at_s, recovery_s=r.recovery_s,
                  bound_s=r.bound_s, detail=r.detail, noticed_s=r.noticed_s, during_recovery=r.during_recovery)
            for r in chaos.records]


def _wait(traffic: SoakTraffic, duration_s: float, show_progress: bool) -> None:
    with tqdm(total=int(duration_s), desc="soak", unit="s", disable=not show_progress) as bar:
        while (elapsed := traffic.now()) < duration_s:
            time.sleep(min(1.0, duration_s - elapsed))
            bar.update(int(min(traffic.now(), duration_s)) - bar.n)
            bar.set_postfix_str(f"{len(traffic.records)} requests")


def measure(backend, endpoints: Endpoints, served: ServedModel, api_key: str, plan_path: str, spec: SoakSpec,
            show_progress: bool) -> SoakRun:
    """The soak against a started deployment and its endpoints (which take `api_key`): traffic,
    samples, faults, drain, settle."""
    vocab = backend.model.vocab_size  # token-id prompts stay inside both the model's and the tokenizer's
    if served.tokenizer is not None:
        vocab = min(vocab, served.tokenizer.vocab_size)
    traffic = SoakTraffic(TrafficSpec(
        grpc_target=endpoints.grpc.address, http_url=endpoints.http_url, model=served.name,
        max_model_len=served.max_model_len, vocab_size=vocab, concurrency=spec.concurrency, seed=spec.seed,
        request_timeout_s=spec.request_timeout_s, api_key=api_key), served.tokenizer).start()
    sampler = ResourceSampler(backend, traffic.t0).start()
    chaos, chaos_offset = None, 0.0
    try:
        if spec.chaos:
            from deploy.chaos import Chaos

            chaos_offset = traffic.now()
            chaos = Chaos(backend, restart_clients=traffic.restart_clients, seed=spec.seed,
                          duration_s=spec.duration_s).start()
        _wait(traffic, spec.duration_s, show_progress)
    finally:
        if chaos is not None:
            chaos.stop()
        traffic.stop()
        sampler.stop()
    print(f"drained {len(traffic.records)} requests; waiting for the deployment to settle ...", flush=True)
    final, idle_after = settle(backend, sampler)
    return SoakRun(plan=plan_path, duration_s=spec.duration_s, concurrency=spec.concurrency, seed=spec.seed,
                   chaos=spec.chaos, records=traffic.records, samples=sampler.samples, final=final,
                   faults=_faults(chaos, chaos_offset) if chaos is not None else [], idle_after_s=idle_after,
                   idle_bound_s=IDLE_BOUND_S, client_restarts=traffic.restarts)


def run(plan_path: str, spec: SoakSpec, json_path: str | None = None, plot_path: str | None = None,
        show_progress: bool = True) -> int:
    plan = Plan.load(plan_path)
    if plot_path is None and json_path is not None:
        plot_path = str(Path(json_path).with_suffix(".png"))
    print(f"soak of {plan_path}: {plan.attention.nodes} attention x {plan.experts.nodes} expert node(s), "
          f"{spec.duration_s:g} s, {spec.concurrency} clients{', with chaos' if spec.chaos else ''}", flush=True)
    backend = start_backend(plan, show_progress=show_progress)
    endpoints = None
    try:
        served = ServedModel.load(plan.model, max_model_len=max_model_len(backend))
        # Served as it would be in production, with an API key every request must carry.
        api_key = secrets.token_urlsafe(24)
        endpoints = Endpoints(backend, served, "127.0.0.1", 0, http_port=0,
                              access=AccessPolicy.from_keys([api_key])).start()
        result = measure(backend, endpoints, served, api_key, plan_path, spec, show_progress)
    finally:
        if endpoints is not None:
            endpoints.stop(0)
        backend.close()
    summary = soak_report.summarize(result)
    print(soak_report.format_report(summary), flush=True)
    if json_path:
        soak_report.save_json(summary, json_path)
        print(f"json: {json_path}")
    if plot_path:
        soak_report.plot(summary, plot_path)
        print(f"plot: {plot_path}")
    return 1 if summary.failures else 0

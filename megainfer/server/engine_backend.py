"""One colocated engine behind the gRPC service (`megainfer serve`): a step loop thread."""

from __future__ import annotations

import dataclasses
import threading

from megainfer.engine import Engine
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import RequestStream, StreamRegistry


class EngineBackend:
    def __init__(self, engine: Engine, max_open: int | None = None) -> None:
        self.engine = engine
        self.registry = StreamRegistry(max_open or 2 * engine.config.max_num_seqs)
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="engine-steps", daemon=True)
        self.thread.start()

    def submit(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        stream = self.registry.open(request_id)
        try:
            with self.lock:
                stream.prompt_tokens = self.engine.add_request(request_id, prompt, params).num_prompt_tokens
                self.work.notify()
        except BaseException:
            self.registry.close(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> bool:
        with self.lock:
            aborted = self.engine.abort(request_id)
        self.registry.close(request_id)
        return aborted

    def info(self) -> dict:
        s = self.engine.stats()
        return {"model": self.engine.model_config.name, "plan_yaml": "",
                "nodes": [{"name": "engine", "role": "engine", "state": "serving",
                           "detail": f"running {s.num_running}, waiting {s.num_waiting}, KV {s.kv_cache_usage:.0%}"}]}

    def metrics_snapshot(self) -> dict:
        with self.lock:
            s = self.engine.stats()
        return {"running": s.num_running, "waiting": s.num_waiting, "kv_cache_usage": s.kv_cache_usage,
                "expert_bytes_read": s.expert_bytes_read}

    def close(self) -> None:
        with self.lock:
            self.stopping = True
            self.work.notify()
        self.thread.join(5)

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.stopping and not self.engine.has_unfinished_requests():
                    self.work.wait()
                if self.stopping:
                    return
                deltas = self.engine.step()
            for d in deltas:
                self.registry.deliver(dataclasses.asdict(d))

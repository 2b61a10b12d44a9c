"""A whole deployment across two "hosts": a Ray head in one network namespace (an "H20"
host) and a Ray worker in another (an "L40S" host), joined by a veth pair (tests/netns.py).
The heterogeneous plan puts the attention node on the first and the expert node on the
second, so every micro-batch crosses the veth over M2N; the answers must equal the
colocated engine's. Slow (two Ray nodes, a deployment): `python -m pytest -m slow`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import yaml

from megainfer import Engine, SamplingParams
from megainfer.engine_config import EngineConfig
from tests.helpers import ROOT, generate_all
from tests.netns import netns_pair

pytestmark = pytest.mark.slow

RAY_PORT = 6380  # free: the namespaces are new
START_TIMEOUT_S = 90
DEPLOY_TIMEOUT_S = 300
HOST_RAY_ADDRESS_FILE = "/tmp/ray/ray_current_cluster"  # where `ray start --head` says "join me" by default
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def ray_tmpdir():
    """Ray's temporary directory for this cluster only: `ray start --head` writes the cluster's
    address to <tmp>/ray/ray_current_cluster, and a later `ray.init()` anywhere on the machine
    would join that (dead) cluster. Short, because Ray puts UNIX sockets under it."""
    path = tempfile.mkdtemp(prefix="mr", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ray_env(host, tmpdir: str) -> dict[str, str]:
    # Token auth is Ray's default for `ray start`; every process must ask for it. NIXL's UCX
    # is held to TCP on the veth, so its bytes really cross the link (not shared memory).
    return {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": tmpdir, "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": host.device, "PYTHONPATH": str(ROOT)}


def ray_start(net, host, gpu: str, head: bool, tmpdir: str) -> subprocess.Popen:
    where = ["--head", f"--port={RAY_PORT}"] if head else [f"--address={net.a.address}:{RAY_PORT}"]
    argv = ["ray", "start", "--block", *where, f"--node-ip-address={host.address}", "--num-cpus=2",
            "--num-gpus=1", f"--resources={json.dumps({f'accelerator_type:{gpu}': 1})}",
            "--object-store-memory=100000000", "--disable-usage-stats"]
    if head:
        argv.append("--include-dashboard=false")
    return net.run(host, argv, env=ray_env(host, tmpdir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for_nodes(net, count: int, tmpdir: str) -> None:
    probe = ("import ray; ray.init(address='%s:%d', log_to_driver=False); "
             "print(sum(n['Alive'] for n in ray.nodes()))" % (net.a.address, RAY_PORT))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        out = subprocess.run(["ip", "netns", "exec", net.a.netns, sys.executable, "-c", probe], capture_output=True,
                             text=True, timeout=60, env={**os.environ, **ray_env(net.a, tmpdir)})
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(1)
    raise AssertionError(f"the two Ray nodes did not come up within {START_TIMEOUT_S} s: {out.stderr[-2000:]}")


def test_deployment_across_two_namespaces_serves_colocated_answers(mixtral_ref, tmp_path, ray_tmpdir):
    had_address_file = os.path.exists(HOST_RAY_ADDRESS_FILE)
    expected = generate_all(Engine(str(mixtral_ref.path), EngineConfig(max_num_batched_tokens=64)),
                            mixtral_ref.prompts, GREEDY)
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({
        "model": str(mixtral_ref.path), "dtype": "float32",
        "attention": {"gpu": "H20", "tp": 1, "nodes": 1}, "experts": {"gpu": "L40S", "tp": 1, "nodes": 1},
        "pipeline": {"micro_batches": 2, "global_batch": 8},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64},
        "transport": {"backend": "auto"}}))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(mixtral_ref.prompts))
    with netns_pair() as net:
        ray_start(net, net.a, "H20", head=True, tmpdir=ray_tmpdir)
        wait_for_nodes(net, 1, ray_tmpdir)
        ray_start(net, net.b, "L40S", head=False, tmpdir=ray_tmpdir)
        wait_for_nodes(net, 2, ray_tmpdir)
        sent_before = net.bytes_sent(net.a)
        driver = net.run(net.a, [sys.executable, "-m", "tests.deploy.netns_driver", str(plan), f"{net.a.address}:"
                                 f"{RAY_PORT}", str(prompts)], env=ray_env(net.a, ray_tmpdir), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            out, err = driver.communicate(timeout=DEPLOY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            driver.kill()
            out, err = driver.communicate()
            raise AssertionError(f"the deployment did not finish within {DEPLOY_TIMEOUT_S} s: {err[-3000:]}")
        assert driver.returncode == 0, err[-3000:]
        result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
        sent = net.bytes_sent(net.a) - sent_before
    hosts = {r["name"]: (r["host"], r["gpu"]) for r in result["placements"]}
    assert hosts == {"attention0": (net.a.address, "H20"), "expert0": (net.b.address, "L40S")}, hosts
    links = {r["name"]: r["links"] for r in result["placements"]}
    assert links["attention0"] == {"expert0": links["attention0"]["expert0"]}
    assert links["attention0"]["expert0"] in ("nixl", "tcp")  # never shm across namespaces
    assert links["expert0"] == {"attention0": links["attention0"]["expert0"]}
    assert result["answers"] == expected
    assert sent > 0
    assert os.path.exists(HOST_RAY_ADDRESS_FILE) == had_address_file, "the test's Ray cluster leaked its address"

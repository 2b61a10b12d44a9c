"""deploy/k8s/raycluster.yaml holds together: its plan parses and fits the worker groups' GPUs
(by megainfer's own placement arithmetic), the head's command is a `megainfer deploy` that
megainfer's parser accepts, the probes and the Service point at the ports the head declares,
and the volumes are where the command and the plan look. Schema validation where
kubernetes-validate is installed."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.placement import gpu_type_shortfalls, resources_needed
from megainfer.cli import build_parser
from megainfer.plan import Plan
from tests.helpers import ROOT

MANIFEST = ROOT / "deploy" / "k8s" / "raycluster.yaml"
SOURCE_PLAN = ROOT / "deploy" / "plans" / "mixtral-8x22b-h20-l40s.yaml"


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    by_kind: dict[str, dict] = {}
    for doc in yaml.safe_load_all(MANIFEST.read_text()):
        if doc is None:
            continue
        assert doc["kind"] not in by_kind, f"two {doc['kind']} documents"
        by_kind[doc["kind"]] = doc
    assert set(by_kind) == {"ConfigMap", "PersistentVolumeClaim", "RayCluster", "Service"}
    return by_kind


@pytest.fixture(scope="module")
def plan(docs) -> Plan:
    return Plan.from_dict(yaml.safe_load(docs["ConfigMap"]["data"]["plan.yaml"]), source="ConfigMap plan.yaml")


def head_container(docs) -> dict:
    (container,) = docs["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    return container


def pod_templates(docs) -> list[dict]:
    spec = docs["RayCluster"]["spec"]
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


def ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def deploy_command(docs) -> list[str]:
    """The `megainfer ...` line of the head's script, as argv after the program name."""
    script = head_container(docs)["args"][0].replace("\\\n", " ")  # continued lines joined
    (line,) = [line for line in script.splitlines() if line.strip().startswith("exec megainfer ")]
    return shlex.split(line)[2:]


def group_resources(group: dict) -> dict[str, float]:
    """A worker group's rayStartParams resources, read as KubeRay reads them (quotes trimmed, JSON)."""
    return json.loads(group["rayStartParams"].get("resources", "{}").strip("'\"` "))


def test_plan_is_the_checked_in_plan_with_its_checkpoint_on_the_volume(plan):
    assert plan.model.startswith("/models/")
    assert plan.serve.host == "0.0.0.0"  # reachable from outside the pod
    source = Plan.load(SOURCE_PLAN).to_dict()
    ours = plan.to_dict()
    for data in (source, ours):
        del data["model"]
        data["serve"].pop("host")
    assert ours == source  # the ConfigMap follows deploy/plans/mixtral-8x22b-h20-l40s.yaml


def test_head_runs_megainfer_deploy_with_flags_megainfer_accepts(docs):
    args = build_parser().parse_args(deploy_command(docs))
    assert args.command == "deploy" and args.address == "auto" and args.host == "0.0.0.0"
    named = ports(head_container(docs))
    assert args.port == named["grpc"]
    assert args.http_port == named["http"] and args.http_host == "0.0.0.0"
    assert args.metrics_port == named["metrics"]
    # The plan comes from the ConfigMap, mounted where the command reads it.
    mounts = {m["name"]: m for m in head_container(docs)["volumeMounts"]}
    volumes = {v["name"]: v for v in docs["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]}
    plan_path = Path(args.plan)
    (name,) = [n for n, m in mounts.items() if Path(m["mountPath"]) == plan_path.parent]
    assert volumes[name]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert plan_path.name in docs["ConfigMap"]["data"]


def _run_script(command: list[str], script: str, tmp_path: Path, generated: str) -> dict[str, list[str]]:
    """Run a container's script with `ray` and `megainfer` replaced by recorders of their argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for program in ("ray", "megainfer"):
        tool = bin_dir / program
        tool.write_text(f"#!{sys.executable}\nimport json, sys\n"
                        f"open({str(tmp_path / program)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
        tool.chmod(0o755)
    assert command[1] == "-lc"
    shell = [command[0], "-c", *command[2:]]  # not a login shell here: /etc/profile would reset PATH
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "KUBERAY_GEN_RAY_START_CMD": generated}
    out = subprocess.run([*shell, script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return {p: json.loads((tmp_path / p).read_text()) for p in ("ray", "megainfer") if (tmp_path / p).exists()}


def test_head_script_starts_ray_without_blocking_then_deploys(docs, tmp_path):
    container = head_container(docs)
    assert container["command"] == ["/bin/bash", "-lc", "--"]
    generated = ("ray start --head  --block  --dashboard-host=0.0.0.0  --num-cpus=0 "
                 " --resources='{\"accelerator_type:H20\": 1}' ")  # KubeRay's shape, --block included
    argv = _run_script(container["command"], container["args"][0], tmp_path, generated)
    assert argv["ray"] == ["start", "--head", "--dashboard-host=0.0.0.0", "--num-cpus=0",
                           '--resources={"accelerator_type:H20": 1}']
    assert argv["megainfer"] == ["deploy", *deploy_command(docs)[1:]]


def test_workers_run_kubrays_ray_start(docs, tmp_path):
    annotations = docs["RayCluster"]["metadata"]["annotations"]
    assert annotations["ray.io/overwrite-container-cmd"] == "true"  # so every container needs its command
    for group in docs["RayCluster"]["spec"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        argv = _run_script(container["command"], container["args"][0], tmp_path,
                           "ray start  --address=megainfer-head-svc:6379  --block  --num-gpus=8 ")
        assert argv["ray"] == ["start", "--address=megainfer-head-svc:6379", "--block", "--num-gpus=8"]


def test_probes_and_service_point_at_the_declared_ports(docs):
    container = head_container(docs)
    named = ports(container)
    assert container["readinessProbe"]["grpc"]["port"] == named["grpc"]
    from megainfer.server.service import SERVICE

    assert container["readinessProbe"]["grpc"]["service"] == SERVICE
    for probe in ("startupProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and named.get(get["port"], get["port"]) == named["http"]
    service = docs["Service"]["spec"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["ports"]} == {
        "grpc": (named["grpc"], "grpc"), "http": (named["http"], "http"), "metrics": (named["metrics"], "metrics")}
    assert service["selector"] == {"ray.io/cluster": docs["RayCluster"]["metadata"]["name"],
                                   "ray.io/node-type": "head"}
    scrape = docs["RayCluster"]["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"]
    assert int(scrape["prometheus.io/port"]) == named["metrics"] and scrape["prometheus.io/path"] == "/metrics"


def test_every_pod_mounts_the_models_claim_read_only(docs, plan):
    claim = docs["PersistentVolumeClaim"]["metadata"]["name"]
    model_root = Path(plan.model).parent
    images = set()
    for template in pod_templates(docs):
        spec = template["spec"]
        (container,) = spec["containers"]
        images.add(container["image"])
        (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == model_root]
        assert mount["readOnly"] is True
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
        assert spec["securityContext"]["runAsNonRoot"] is True
    assert len(images) == 1  # one image: head and workers run the same megainfer


def test_worker_groups_hold_the_plans_gpus_by_type(docs, plan):
    hosts, cpus = [], 0.0
    for group in docs["RayCluster"]["spec"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        gpus = int(group["rayStartParams"]["num-gpus"])
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"] == gpus
        (accelerator,) = [k for k in group_resources(group) if k.startswith("accelerator_type:")]
        gpu_type = accelerator.split(":", 1)[1]
        # On nodes of that GPU type, as NVIDIA's GPU feature discovery labels them.
        assert spec["nodeSelector"]["nvidia.com/gpu.product"] == f"NVIDIA-{gpu_type}"
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]
        hosts += [{"GPU": float(gpus), "CPU": float(limits["cpu"]), accelerator: 1.0}] * group["replicas"]
        cpus += float(limits["cpu"]) * group["replicas"]
    assert gpu_type_shortfalls(plan, hosts) == []  # what deploy's capacity check asks of the cluster
    need = resources_needed(plan)
    assert sum(h["GPU"] for h in hosts) == need["GPU"]  # no idle GPUs
    assert cpus >= need["CPU"]
    for gpu in (plan.attention.gpu, plan.experts.gpu):
        assert any(f"accelerator_type:{gpu}" in h for h in hosts), f"no worker group of {gpu} GPUs"


def test_manifest_validates_against_kubernetes_schemas(docs):
    kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                              reason="kubernetes-validate is not installed (pip install it)")
    version = "1.33.0"
    for kind in ("ConfigMap", "PersistentVolumeClaim", "Service"):
        kubernetes_validate.validate(docs[kind], version, strict=True)
    # The RayCluster is a custom resource: its pod templates are checked as the Pods KubeRay makes.
    for template in pod_templates(docs):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "megainfer", **template.get("metadata", {})},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, version, strict=True)

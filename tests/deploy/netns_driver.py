"""A deployment's driver inside a network namespace (tests/deploy/test_two_hosts_deploy.py).

    python -m tests.deploy.netns_driver PLAN RAY_ADDRESS PROMPTS_JSON

Deploys PLAN on the Ray cluster at RAY_ADDRESS with CPU tensors (a rehearsal of its GPU
types), then prints one line, `RESULT <json>`: where every rank landed (its Ray node's
address and GPU type) and the M2N backend of each of its links, and the greedy answers to
the prompts over gRPC. Other output (Ray's, NIXL's) goes before it.
"""

from __future__ import annotations

import json
import sys


def main(plan_path: str, address: str, prompts_path: str) -> None:
    import ray

    from deploy.deployment import Deployment
    from megainfer.plan import Plan
    from megainfer.sampling_params import SamplingParams
    from megainfer.server.client import Client
    from megainfer.server.service import Server

    prompts = json.loads(open(prompts_path).read())
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    deployment = Deployment(Plan.load(plan_path), address=address, show_progress=False, device="cpu").start()
    try:
        hosts = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        placed = [{"name": r.name, "host": hosts.get(r.node_id), "gpu": r.accelerator_type, "links": r.links}
                  for r in deployment.group.placements()]
        server = Server(deployment, port=0).start()
        client = Client(server.address)
        try:
            answers = [[t for r in client.generate(p, greedy) for t in r.token_ids] for p in prompts]
        finally:
            client.close()
            server.stop(0)
        print("RESULT " + json.dumps({"placements": placed, "answers": answers}), flush=True)
    finally:
        deployment.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])

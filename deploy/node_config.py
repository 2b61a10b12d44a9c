"""What every node actor shares: its weights, names, where it listens, its tensor-parallel group.
(Its runtime configuration comes from deploy/runtime_config.py.)"""

from __future__ import annotations

from deploy.link import SwitchableLink
from deploy.runtime_config import AttentionRuntime, ExpertRuntime, rank_name
from megainfer.config import ModelConfig
from megainfer.model.weights import RandomWeights, SafetensorsCheckpoint, WeightSource
from megainfer.model_resolution import resolve_model
from megainfer.plan import Plan
from megainfer import tensor_parallel
from megainfer.tensor_parallel import TensorParallelGroup

# Seconds a node waits on a peer before declaring it gone.
PEER_TIMEOUT_S = 20.0
# A follower rank waits for its leader's next step in the control group's broadcast. Long
# enough for a re-wire (every endpoint re-opened and re-connected, PEER_TIMEOUT_S each way,
# plus a restarted expert node reloading its weights); a dead rank is found by the health
# checks within seconds, and this only bounds how long its group's survivors hang.
TP_GROUP_TIMEOUT_S = 300.0


def checked_model(plan: Plan) -> ModelConfig:
    """The plan's model, checked against the plan before anything starts."""
    model, _ = weights_of(plan)
    plan.check_model(model)  # tp against heads and intermediate size, experts against nodes
    return model


def weights_of(plan: Plan) -> tuple[ModelConfig, WeightSource]:
    model, checkpoint = resolve_model(plan.model)
    return model, SafetensorsCheckpoint(checkpoint) if checkpoint else RandomWeights(0)


def bind_host(host: str) -> str:
    """Where a node's endpoint listens: the given host (127.0.0.1 on an embedded single-machine
    Ray), else this node's address in the cluster, which is what peers elsewhere can reach."""
    if host:
        return host
    import ray

    return ray.util.get_node_ip_address()


def data_link(plan: Plan, runtime: AttentionRuntime | ExpertRuntime, name: str, rank: int, secret: bytes, host: str,
              count_when_quiet: bool = False) -> SwitchableLink:
    """A rank's M2N link: its slots and peers as the runtime configuration sizes them (so rdma's
    locked-memory check at start covers what wiring registers), backend and RDMA devices as the
    plan's transport section sets them."""
    return SwitchableLink(name, rank, secret, bind_host(host), runtime.receive_slot_bytes, runtime.num_slots,
                          plan.transport.backend, PEER_TIMEOUT_S, peers=runtime.peers,
                          peer_slot_bytes=runtime.peer_slot_bytes or None,
                          rdma_devices=tuple(plan.transport.rdma_devices), count_when_quiet=count_when_quiet)


def node_names(plan: Plan) -> tuple[list[str], list[str]]:
    """(attention nodes, i.e. their leader ranks; expert nodes)."""
    return ([f"attention{i}" for i in range(plan.attention.nodes)],
            [f"expert{k}" for k in range(plan.experts.nodes)])


def attention_rank_name(node: int, rank: int) -> str:
    return rank_name(f"attention{node}", rank)


def attention_rank_names(plan: Plan) -> list[str]:
    """Every rank of every attention node: each is an M2N peer of every expert node."""
    return [attention_rank_name(i, r) for i in range(plan.attention.nodes) for r in range(plan.attention.tp)]


def tp_master_address(host: str) -> str:
    """A free TCP port on `host` (this node's address) for a tensor-parallel group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def join_tp_group(master: str, rank: int, world_size: int, device: str) -> TensorParallelGroup:
    """The node's own group (never across nodes): gloo for control, NCCL for activations on GPUs."""
    return tensor_parallel.join(master, rank, world_size, device, TP_GROUP_TIMEOUT_S)

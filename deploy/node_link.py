"""A rank's M2N link as the plan and its runtime configuration size it, where it listens, and how
long it waits on a peer."""

from __future__ import annotations

from deploy.link import SwitchableLink
from deploy.runtime_config import AttentionRuntime, ExpertRuntime
from megainfer.plan import Plan

# Seconds a node waits on a peer before declaring it gone.
PEER_TIMEOUT_S = 20.0


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

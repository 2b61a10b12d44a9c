"""How `auto` chooses a backend per peer pair, and the reason it gives (transport/selection.py)."""

from __future__ import annotations

import pytest

from transport.selection import Capabilities, NoBackend, choose


def host(name="h1", shm=True, rdma=False, nixl=False, **reasons) -> Capabilities:
    return Capabilities(host=name, shm=shm, rdma=rdma, nixl=nixl, **reasons)


def test_one_host_is_shm_whatever_else_both_have():
    choice = choose("auto", "auto", host(rdma=True, nixl=True), host(rdma=True, nixl=True), "a0", "e0")
    assert choice.backend == "shm" and choice.reason == "both ends are on one host"


def test_across_hosts_rdma_needs_both_probes_and_says_which_end_failed():
    both = choose("auto", "auto", host("h1", rdma=True, nixl=True), host("h2", rdma=True, nixl=True), "a0", "e0")
    assert both.backend == "rdma" and "passed a loopback queue-pair check" in both.reason
    assert "not shm: the two ends are on different hosts" in both.reason
    one = choose("auto", "auto", host("h1", rdma=True, nixl=True),
                 host("h2", rdma=False, nixl=True, rdma_reason="port 1 of mlx5_0 is DOWN"), "a0", "e0")
    assert one.backend == "nixl"
    assert "not rdma: e0: port 1 of mlx5_0 is DOWN" in one.reason and "a0:" not in one.reason.split("not rdma")[1]


def test_tcp_is_the_fallback_with_every_reason():
    choice = choose("auto", "auto", host("h1", rdma_reason="no RDMA device", nixl_reason="NIXL is not installed"),
                    host("h2", nixl=True), "a0", "e0")
    assert choice.backend == "tcp"
    assert "not rdma: a0: no RDMA device; e0: unavailable" in choice.reason
    assert "not nixl: a0: NIXL is not installed" in choice.reason


def test_a_named_backend_is_used_when_both_can_and_refused_with_the_reason_otherwise():
    assert choose("tcp", "auto", host(), host()).backend == "tcp"  # even on one host
    assert choose("auto", "nixl", host("h1", nixl=True), host("h2", nixl=True)).backend == "nixl"
    with pytest.raises(NoBackend, match="nixl between e0 and a0 is unavailable: e0: NIXL is not installed"):
        choose("nixl", "auto", host(nixl=True), host(nixl=False, nixl_reason="NIXL is not installed"), "a0", "e0")
    with pytest.raises(NoBackend, match="shm .* the two ends are on different hosts"):
        choose("shm", "auto", host("h1"), host("h2"), "a0", "e0")
    with pytest.raises(NoBackend, match="backend mismatch: a0 uses shm, e0 uses tcp"):
        choose("shm", "tcp", host(), host(), "a0", "e0")


def test_capabilities_survive_the_hello():
    caps = host("h9", shm=False, rdma=True, nixl=False, shm_reason="/dev/shm is not writable",
                nixl_reason="NIXL is not installed")
    assert Capabilities.from_hello(caps.hello_fields()) == caps
    assert Capabilities.from_hello({}) == Capabilities("", False, False, False)

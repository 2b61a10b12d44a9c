"""Device, port, GID and MTU choice for RDMA channels, over recorded GID tables and fake
contexts (no verbs device needed), and probe()'s reasons."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from transport import rdma
from transport import rdma_port as rp
from transport.errors import BackendUnavailable, HandshakeError

TABLES = json.loads((Path(__file__).parent / "data" / "rdma_ports.json").read_text())
TYPE_NUMBERS = {rp.IB: 0, rp.ROCE_V1: 1, rp.ROCE_V2: 2}  # enum ibv_gid_type


def entries(name: str) -> list[rp.GidEntry]:
    return [rp.GidEntry(i, gid, kind, netdev) for i, gid, kind, netdev in TABLES[name]["gids"]]


def link_layer(name: str) -> int:
    return TABLES[name]["port_attr"]["link_layer"]


def where(name: str) -> str:
    return f"port {TABLES[name]['port']} of {TABLES[name]['device']}"


def gid_entry_object(index: int, text: str, kind: str, port: int):
    """What Context.query_gid_table returns: pyverbs' own GIDEntry where pyverbs imports."""
    raw = bytes.fromhex(text.replace(":", ""))
    try:
        from pyverbs.device import GIDEntry
    except ImportError:
        return SimpleNamespace(gid_index=index, port_num=port, gid_type=TYPE_NUMBERS[kind], ndev_ifindex=0,
                               gid_str=lambda: text)
    # GIDEntry holds the GID as two 64-bit words in memory (network) order
    prefix, interface = struct.unpack("=QQ", raw)
    return GIDEntry(prefix, interface, index, port, TYPE_NUMBERS[kind], 0)


class FakeContext:
    """The pyverbs Context methods inspect_port uses, answering from a recorded table.
    per_index=True answers like an old pyverbs without query_gid_table."""

    def __init__(self, *names: str, per_index: bool = False) -> None:
        self.ports = {TABLES[n]["port"]: TABLES[n] for n in names}
        self.per_index = per_index
        self.closed = False

    def query_port(self, port: int):
        if port not in self.ports:
            raise RuntimeError(f"Failed to query port {port}. Errno: 22, Invalid argument")
        return SimpleNamespace(**self.ports[port]["port_attr"])

    def query_device(self):
        return SimpleNamespace(phys_port_cnt=max(self.ports))

    def query_gid_table(self, max_entries: int):
        if self.per_index:
            raise AttributeError("query_gid_table")
        found = [gid_entry_object(i, text, kind, port)
                 for port, table in self.ports.items() for i, text, kind, _ in table["gids"]]
        assert len(found) <= max_entries
        return found

    def query_gid(self, port: int, index: int):
        for i, text, _, _ in self.ports[port]["gids"]:
            if i == index:
                return SimpleNamespace(gid=text)
        return SimpleNamespace(gid=rp.gid_text(bytes(16)))  # unpopulated entries read as zeros

    def query_gid_type(self, port: int, index: int):
        for i, _, kind, _ in self.ports[port]["gids"]:
            if i == index:
                return 1 if kind == rp.ROCE_V2 else 0  # sysfs: "RoCE v2" or "IB/RoCE v1"
        raise RuntimeError("Failed to query gid type")

    def close(self) -> None:
        self.closed = True


# -- settings and devices --------------------------------------------------------------------
def test_settings_default_and_from_the_environment():
    assert rp.settings_from_env({}) == rp.RdmaSettings(None, 1, None)
    env = {rp.ENV_DEVICE: "mlx5_1", rp.ENV_PORT: "2", rp.ENV_GID_INDEX: "0"}
    assert rp.settings_from_env(env) == rp.RdmaSettings("mlx5_1", 2, 0)
    with pytest.raises(BackendUnavailable, match="MEGAINFER_RDMA_PORT='0' is not an integer >= 1"):
        rp.settings_from_env({rp.ENV_PORT: "0"})
    with pytest.raises(BackendUnavailable, match="MEGAINFER_RDMA_GID_INDEX='three' is not an integer >= 0"):
        rp.settings_from_env({rp.ENV_GID_INDEX: "three"})


def test_a_lossless_fabrics_traffic_class_and_service_level_reach_the_port_choice():
    env = {"MEGAINFER_RDMA_TRAFFIC_CLASS": "106", "MEGAINFER_RDMA_SERVICE_LEVEL": "3"}
    assert rp.settings_from_env(env) == rp.RdmaSettings(None, 1, None, 106, 3)
    ctx, choice = rdma.select_port(env, list_devices=fake_devices("mlx5_0"),
                                   open_ctx=lambda n: FakeContext("connectx_roce"))
    assert (choice.traffic_class, choice.service_level) == (106, 3)
    ctx.close()
    with pytest.raises(BackendUnavailable, match=r"MEGAINFER_RDMA_TRAFFIC_CLASS='256' is not an integer 0\.\.255; "
                                                 r"set it to an integer 0\.\.255, or unset it \(default: 0\)"):
        rp.settings_from_env({"MEGAINFER_RDMA_TRAFFIC_CLASS": "256"})
    with pytest.raises(BackendUnavailable, match=r"MEGAINFER_RDMA_SERVICE_LEVEL='16' is not an integer 0\.\.15"):
        rp.settings_from_env({"MEGAINFER_RDMA_SERVICE_LEVEL": "16"})


def test_device_candidates_and_rc_support():
    devices = [rp.DeviceInfo("mlx5_0"), rp.DeviceInfo("mlx5_1")]
    assert rp.candidate_devices(devices, None) == devices
    assert rp.candidate_devices(devices, "mlx5_1") == [devices[1]]
    with pytest.raises(BackendUnavailable, match=r"MEGAINFER_RDMA_DEVICE=mlx5_9 is not a verbs device here "
                                                 r"\(devices: mlx5_0, mlx5_1\)"):
        rp.candidate_devices(devices, "mlx5_9")
    with pytest.raises(BackendUnavailable, match="the verbs device list is empty"):
        rp.candidate_devices([], None)
    assert rp.rc_unsupported_reason(devices[0]) == ""
    efa = rp.DeviceInfo("rdmap0s6", node_type=7, transport_type=4)  # what EFA reports
    assert "rdmap0s6 is not an InfiniBand/RoCE adapter (transport unspecified" in rp.rc_unsupported_reason(efa)
    iwarp = rp.DeviceInfo("irdma0", node_type=4, transport_type=1)
    assert "transport iWARP" in rp.rc_unsupported_reason(iwarp)


# -- GID choice over recorded tables -----------------------------------------------------------
def test_connectx_roce_port_chooses_roce_v2_ipv4_mapped():
    gid, note = rp.choose_gid(entries("connectx_roce"), link_layer("connectx_roce"), where("connectx_roce"))
    assert (gid.index, gid.type, str(gid.address.ipv4_mapped), note) == (3, rp.ROCE_V2, "10.0.0.5", "")


def test_roce_ipv6_prefers_a_global_address_over_link_local():
    gid, note = rp.choose_gid(entries("connectx_roce_ipv6"), rp.LINK_ETHERNET, "port 1 of mlx5_0")
    assert (gid.index, gid.gid, note) == (3, "2001:0db8:0000:0001:0000:0000:0000:0005", "")


def test_link_local_only_port_takes_roce_v2_link_local_and_says_so():
    gid, note = rp.choose_gid(entries("roce_link_local_only"), rp.LINK_ETHERNET, where("roce_link_local_only"))
    assert (gid.index, gid.type, gid.is_link_local) == (1, rp.ROCE_V2, True)
    assert "same L2 segment only" in note


def test_roce_v1_only_port_is_refused_with_the_fix():
    with pytest.raises(BackendUnavailable) as err:
        rp.choose_gid(entries("roce_v1_only"), rp.LINK_ETHERNET, where("roce_v1_only"))
    message = str(err.value)
    assert message.startswith("no RoCE v2 GID on port 1 of mlx4_0 (entries: 0 (RoCE v1 fe80::202:c9ff:fe01:203 "
                              "on eth2), 1 (RoCE v1 ::ffff:10.0.0.7 on eth2))")
    assert message.endswith("; set MEGAINFER_RDMA_GID_INDEX")


def test_infiniband_port_uses_its_port_gid():
    gid, note = rp.choose_gid(entries("connectx_ib"), rp.LINK_INFINIBAND, where("connectx_ib"))
    assert (gid.index, gid.type, note) == (0, rp.IB, "")


def test_empty_table_is_a_clear_error():
    with pytest.raises(BackendUnavailable, match=r"port 1 of mlx5_3 has an empty GID table \(give its network "
                                                 r"interface an IP address; or set MEGAINFER_RDMA_GID_INDEX\)"):
        rp.choose_gid(entries("roce_empty"), rp.LINK_ETHERNET, where("roce_empty"))
    zeros = [rp.GidEntry(0, rp.gid_text(bytes(16)), rp.ROCE_V2)]
    with pytest.raises(BackendUnavailable, match="empty GID table"):
        rp.choose_gid(zeros, rp.LINK_ETHERNET, "port 1 of mlx5_3")


def test_gid_index_override_wins_but_must_exist():
    gid, note = rp.choose_gid(entries("connectx_roce"), rp.LINK_ETHERNET, "port 1 of mlx5_0", override=2)
    assert (gid.index, gid.type) == (2, rp.ROCE_V1) and "MEGAINFER_RDMA_GID_INDEX" in note
    with pytest.raises(BackendUnavailable, match=r"MEGAINFER_RDMA_GID_INDEX=9 is not a populated GID index on "
                                                 r"port 1 of mlx5_0 \(populated: 0, 1, 2, 3\)"):
        rp.choose_gid(entries("connectx_roce"), rp.LINK_ETHERNET, "port 1 of mlx5_0", override=9)


def test_gid_bytes_and_text_agree():
    gid = entries("connectx_roce")[3]
    assert gid.raw == bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 5])
    assert rp.gid_text(gid.raw) == gid.gid


# -- MTU -------------------------------------------------------------------------------------
def test_path_mtu_is_the_smaller_active_mtu():
    assert rp.path_mtu(5, 3) == 3 and rp.path_mtu(3, 5) == 3 and rp.path_mtu(4, 4) == 4
    with pytest.raises(HandshakeError, match="invalid RDMA MTU"):
        rp.path_mtu(5, 0)  # a peer that did not state it


# -- ports through a context-like object ----------------------------------------------------------
@pytest.mark.parametrize("per_index", [False, True], ids=["query_gid_table", "query_gid+query_gid_type"])
def test_inspect_active_roce_port(per_index):
    choice = rp.inspect_port(FakeContext("connectx_roce", per_index=per_index), "mlx5_0", 1)
    assert (choice.device, choice.port, choice.link_layer, choice.mtu, choice.mtu_bytes) == \
        ("mlx5_0", 1, rp.LINK_ETHERNET, 5, 4096)
    assert (choice.gid.index, choice.gid.type, choice.gid.gid) == (3, rp.ROCE_V2, "0000:0000:0000:0000:0000:ffff:0a00:0005")
    assert choice.describe() == "port 1 of mlx5_0 (Ethernet, MTU 4096, GID 3 (RoCE v2 ::ffff:10.0.0.5))"


@pytest.mark.parametrize("per_index", [False, True], ids=["query_gid_table", "query_gid+query_gid_type"])
def test_inspect_infiniband_port(per_index):
    choice = rp.inspect_port(FakeContext("connectx_ib", per_index=per_index), "mlx5_2", 1)
    assert (choice.link_layer, choice.lid, choice.gid.index, choice.gid.type) == (rp.LINK_INFINIBAND, 17, 0, rp.IB)


def test_inspect_port_reasons():
    with pytest.raises(BackendUnavailable, match=r"^port 1 of mlx5_0 is DOWN$"):
        rp.inspect_port(FakeContext("roce_down"), "mlx5_0", 1)
    with pytest.raises(BackendUnavailable, match=r"port 1 of mlx5_2 is INIT \(no subnet manager"):
        rp.inspect_port(FakeContext("ib_no_subnet_manager"), "mlx5_2", 1)
    with pytest.raises(BackendUnavailable, match=r"cannot query port 2 of mlx5_0 .*; set MEGAINFER_RDMA_PORT"):
        rp.inspect_port(FakeContext("connectx_roce"), "mlx5_0", 2)
    with pytest.raises(BackendUnavailable, match="no RoCE v2 GID on port 1 of mlx4_0"):
        rp.inspect_port(FakeContext("roce_v1_only"), "mlx4_0", 1)


# -- probe and port selection, with fake devices and contexts ------------------------------------
def fake_devices(*names, **types):
    return lambda: [rp.DeviceInfo(n, **types) for n in names]


def test_probe_reports_the_chosen_port():
    opened = {}

    def open_ctx(name):
        opened[name] = FakeContext("connectx_roce")
        return opened[name]

    result = rdma.probe({}, list_devices=fake_devices("mlx5_0"), open_ctx=open_ctx, loopback=lambda ctx, c: "")
    assert result == rdma.ProbeResult(True, "", "mlx5_0", 1, 3, rp.ROCE_V2, "Ethernet", 4096, "",
                                      "the only candidate device")
    assert opened["mlx5_0"].closed  # probe holds nothing open afterwards


def test_probe_skips_a_down_device_and_takes_the_next():
    tables = {"mlx5_0": "roce_down", "mlx5_1": "roce_link_local_only"}
    result = rdma.probe({}, list_devices=fake_devices("mlx5_0", "mlx5_1"),
                        open_ctx=lambda name: FakeContext(tables[name]), loopback=lambda ctx, c: "")
    assert (result.ok, result.device, result.gid_index, result.mtu) == (True, "mlx5_1", 1, 1024)
    assert "link-local" in result.note


def test_probe_reasons():
    down = rdma.probe({}, list_devices=fake_devices("mlx5_0"), open_ctx=lambda n: FakeContext("roce_down"),
                      loopback=lambda ctx, c: "")
    assert down == rdma.ProbeResult(False, "port 1 of mlx5_0 is DOWN")
    v1 = rdma.probe({}, list_devices=fake_devices("mlx4_0"), open_ctx=lambda n: FakeContext("roce_v1_only"))
    assert not v1.ok and "no RoCE v2 GID on port 1 of mlx4_0" in v1.reason
    named = rdma.probe({rp.ENV_DEVICE: "mlx5_7"}, list_devices=fake_devices("mlx5_0"))
    assert named.reason == "MEGAINFER_RDMA_DEVICE=mlx5_7 is not a verbs device here (devices: mlx5_0)"
    efa = rdma.probe({}, list_devices=fake_devices("rdmap0s6", node_type=7, transport_type=4))
    assert not efa.ok and "not an InfiniBand/RoCE adapter" in efa.reason


def test_probe_fails_when_the_loopback_write_does_not_complete():
    ctx = FakeContext("connectx_roce")
    seen = []

    def loopback(c, choice):
        seen.append(choice)
        return "loopback write did not complete within 1 s on port 1 of mlx5_0"

    result = rdma.probe({}, list_devices=fake_devices("mlx5_0"), open_ctx=lambda n: ctx, loopback=loopback)
    assert (result.ok, result.reason, result.device, result.gid_index) == \
        (False, "loopback write did not complete within 1 s on port 1 of mlx5_0", "mlx5_0", 3)
    assert seen[0].gid.index == 3 and ctx.closed


def test_wait_until_gives_up_at_the_deadline():
    now = [0.0]

    def clock():
        now[0] += 0.25
        return now[0]

    assert rdma.wait_until(lambda: [], 1.0, clock) is False and now[0] >= 1.0
    polls = iter([[], [], [(0, 0, 0)]])
    assert rdma.wait_until(lambda: next(polls), 1.0, clock) is True


def test_probe_and_available_on_this_machine_agree():
    ok, reason = rdma.available()
    result = rdma.probe()
    if ok:
        pytest.skip("this machine has a verbs device")
    assert result == rdma.ProbeResult(False, reason)
    assert reason.startswith("pyverbs is not installed (pip install") or reason.startswith("no RDMA device")
    with pytest.raises(BackendUnavailable, match="^" + re.escape(f"rdma: {reason}") + "$"):
        rdma.RdmaContext.open()

"""Which verbs device, port and GID an RDMA channel uses, and at what path MTU.

Pure functions over plain data (settings from the environment, recorded GID tables, port
attributes), plus `inspect_port`, which reads a port through any context-like object with
pyverbs' `Context` methods (`query_port`, `query_device`, `query_gid_table`, or the older
`query_gid` + `query_gid_type`), so that recorded tables and fake contexts test the same
code a device runs. Nothing here imports pyverbs. Every failure is a BackendUnavailable
whose message is the human-readable reason.

Device choice: MEGAINFER_RDMA_DEVICE names one (on its host, over anything else); else the
endpoint's `rdma_devices` (plan.yaml's transport.rdma_devices) narrow the verbs list, which
is ordered nearest this process's GPU first (transport/rdma_host.py); the first device whose
port is usable is taken, and `PortChoice.reason` says why it was that one.

GID choice (the source GID of every packet; the peer addresses us by it):
    MEGAINFER_RDMA_GID_INDEX set   that entry, whatever its type (it must be populated)
    InfiniBand link layer          the port GID of type IB with the lowest index (normally 0);
                                   routing is by LID, so no GRH is needed within a subnet
    Ethernet (RoCE)                RoCE v2 with an IPv4-mapped address (::ffff:a.b.c.d), else
                                   RoCE v2 with a global IPv6 address, else RoCE v2 link-local
                                   (reaches one L2 segment only: noted); RoCE v1 only is refused
                                   (needs a lossless L2 fabric; set the index to force it)
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from transport.errors import BackendUnavailable, HandshakeError
from transport.transport_settings import (RDMA_DEVICE, RDMA_GID_INDEX, RDMA_PORT, RDMA_SERVICE_LEVEL,
                                          RDMA_TRAFFIC_CLASS, SettingError)

ENV_DEVICE, ENV_PORT, ENV_GID_INDEX = RDMA_DEVICE.name, RDMA_PORT.name, RDMA_GID_INDEX.name

# libibverbs' enum values (verbs.h), restated so this module needs no pyverbs.
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
PORT_ACTIVE = 4
LINK_UNSPECIFIED, LINK_INFINIBAND, LINK_ETHERNET = 0, 1, 2
LINK_NAMES = {LINK_UNSPECIFIED: "unspecified", LINK_INFINIBAND: "InfiniBand", LINK_ETHERNET: "Ethernet"}
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}  # enum ibv_mtu
NODE_CA = 1
TRANSPORT_IB = 0  # InfiniBand and RoCE both report the IB transport
TRANSPORT_NAMES = {-1: "unknown", 0: "InfiniBand/RoCE", 1: "iWARP", 2: "usNIC", 3: "usNIC UDP", 4: "unspecified"}

IB, ROCE_V1, ROCE_V2 = "IB", "RoCE v1", "RoCE v2"
GID_TYPES = {0: IB, 1: ROCE_V1, 2: ROCE_V2}  # enum ibv_gid_type (ibv_query_gid_table's entries)


@dataclass(frozen=True)
class RdmaSettings:
    device: str | None  # None: the first device with a usable port
    port: int
    gid_index: int | None  # None: chosen from the GID table
    traffic_class: int = 0  # RoCE's GRH traffic class (DSCP x 4 + ECN)
    service_level: int = 0


def settings_from_env(environ=None) -> RdmaSettings:
    """The RDMA settings (transport_settings.py) from `environ` (None: os.environ now); a bad value
    is a BackendUnavailable naming the variable and the fix."""
    try:
        return RdmaSettings(RDMA_DEVICE.read(environ), RDMA_PORT.read(environ), RDMA_GID_INDEX.read(environ),
                            RDMA_TRAFFIC_CLASS.read(environ), RDMA_SERVICE_LEVEL.read(environ))
    except SettingError as exc:
        raise BackendUnavailable(str(exc)) from None


# -- devices -----------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceInfo:
    name: str
    node_type: int = NODE_CA
    transport_type: int = TRANSPORT_IB


def rc_unsupported_reason(dev: DeviceInfo) -> str:
    """Why `dev` cannot carry RC write-with-immediate ("" when it can, as far as its type says)."""
    if dev.transport_type == TRANSPORT_IB and dev.node_type == NODE_CA:
        return ""
    kind = TRANSPORT_NAMES.get(dev.transport_type, f"type {dev.transport_type}")
    return (f"{dev.name} is not an InfiniBand/RoCE adapter (transport {kind}, node type {dev.node_type}): "
            "RC queue pairs with write-with-immediate need one (AWS EFA, for one, reports 'unspecified')")


def candidate_devices(devices: list[DeviceInfo], wanted: str | None,
                      allowed: tuple[str, ...] = ()) -> list[DeviceInfo]:
    """The devices to try, in the verbs list's order: the one MEGAINFER_RDMA_DEVICE names (it
    overrides `allowed` on its host), else those `allowed` names (empty: all of them). A name
    in `allowed` that this host lacks is passed over: other hosts may have it."""
    if not devices:
        raise BackendUnavailable("no RDMA device (the verbs device list is empty)")
    names = ", ".join(d.name for d in devices)
    if wanted is not None:
        found = [dev for dev in devices if dev.name == wanted]
        if not found:
            raise BackendUnavailable(f"{ENV_DEVICE}={wanted} is not a verbs device here (devices: {names})")
        return found
    if not allowed:
        return list(devices)
    found = [dev for dev in devices if dev.name in allowed]
    if not found:
        raise BackendUnavailable(f"rdma_devices ({', '.join(allowed)}) names no verbs device here (devices: {names})")
    return found


# -- GID tables ----------------------------------------------------------------------------
@dataclass(frozen=True)
class GidEntry:
    index: int
    gid: str  # eight colon-separated groups of four hex digits, as verbs prints it
    type: str  # IB | ROCE_V1 | ROCE_V2
    netdev: str = ""

    @property
    def raw(self) -> bytes:
        return bytes.fromhex(self.gid.replace(":", ""))

    @property
    def address(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(self.raw)

    @property
    def is_zero(self) -> bool:
        return not any(self.raw)

    @property
    def is_ipv4_mapped(self) -> bool:
        return self.address.ipv4_mapped is not None

    @property
    def is_link_local(self) -> bool:
        return self.address.is_link_local

    @property
    def address_text(self) -> str:
        # spelled out here: Python's own text for IPv4-mapped addresses changed in 3.13
        v4 = self.address.ipv4_mapped
        return f"::ffff:{v4}" if v4 is not None else str(self.address)

    def describe(self) -> str:
        dev = f" on {self.netdev}" if self.netdev else ""
        return f"{self.index} ({self.type} {self.address_text}{dev})"


def gid_text(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def choose_gid(entries: list[GidEntry], link_layer: int, where: str,
               override: int | None = None) -> tuple[GidEntry, str]:
    """(entry, note) for the port described as `where` ("port 1 of mlx5_0"); see the module
    docstring for the order. `note` says what to know about a usable but limited choice."""
    usable = sorted((e for e in entries if not e.is_zero), key=lambda e: e.index)
    if override is not None:
        for entry in usable:
            if entry.index == override:
                return entry, f"GID index {override} set by {ENV_GID_INDEX}"
        have = ", ".join(str(e.index) for e in usable) or "none"
        raise BackendUnavailable(f"{ENV_GID_INDEX}={override} is not a populated GID index on {where} "
                                 f"(populated: {have})")
    if not usable:
        hint = "give its network interface an IP address" if link_layer == LINK_ETHERNET else \
            "is a subnet manager running?"
        raise BackendUnavailable(f"{where} has an empty GID table ({hint}; or set {ENV_GID_INDEX})")
    if link_layer != LINK_ETHERNET:
        ib = [e for e in usable if e.type == IB]
        return (ib or usable)[0], ""
    v2 = [e for e in usable if e.type == ROCE_V2]
    for preferred, note in ((lambda e: e.is_ipv4_mapped, ""),
                            (lambda e: not e.is_link_local, ""),
                            (lambda e: True, "link-local RoCE v2 GID: reaches peers on the same L2 segment only")):
        for entry in v2:
            if preferred(entry):
                return entry, note
    table = ", ".join(e.describe() for e in usable)
    raise BackendUnavailable(f"no RoCE v2 GID on {where} (entries: {table}); set {ENV_GID_INDEX}")


def read_gid_table(ctx, port: int, link_layer: int, gid_tbl_len: int) -> list[GidEntry]:
    """The populated GID entries of `port`, read through a pyverbs-like context."""
    try:
        ports = ctx.query_device().phys_port_cnt
        found = ctx.query_gid_table(max(1, gid_tbl_len) * max(1, ports))
    except Exception:  # noqa: BLE001 - an old pyverbs, or a kernel without the GID table ioctl
        return _read_gid_table_per_index(ctx, port, link_layer, gid_tbl_len)
    return [GidEntry(e.gid_index, e.gid_str(), GID_TYPES.get(e.gid_type, f"type {e.gid_type}"),
                     _netdev_name(e.ndev_ifindex))
            for e in found if e.port_num == port]


def _read_gid_table_per_index(ctx, port: int, link_layer: int, gid_tbl_len: int) -> list[GidEntry]:
    # ibv_query_gid_type reports sysfs types, where "IB/RoCE v1" is one value: the link
    # layer tells them apart (as libibverbs' own fallback does).
    v1 = ROCE_V1 if link_layer == LINK_ETHERNET else IB
    entries = []
    for index in range(gid_tbl_len):
        try:
            text = ctx.query_gid(port, index).gid
            sysfs_type = ctx.query_gid_type(port, index)
        except Exception:  # noqa: BLE001 - an unpopulated entry
            continue
        entry = GidEntry(index, text, ROCE_V2 if sysfs_type == 1 else v1)
        if not entry.is_zero:
            entries.append(entry)
    return entries


def _netdev_name(ifindex: int) -> str:
    if not ifindex:
        return ""
    try:
        return socket.if_indextoname(ifindex)
    except OSError:  # the interface is in another network namespace
        return f"ifindex {ifindex}"


# -- ports -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PortChoice:
    device: str
    port: int
    link_layer: int  # LINK_INFINIBAND | LINK_ETHERNET
    lid: int
    mtu: int  # the port's active MTU, enum ibv_mtu
    gid: GidEntry
    note: str = ""
    reason: str = ""  # why this device: where it sits against the GPU, or that it was named
    traffic_class: int = 0  # what the path's packets carry (MEGAINFER_RDMA_TRAFFIC_CLASS)
    service_level: int = 0  # (MEGAINFER_RDMA_SERVICE_LEVEL)

    @property
    def where(self) -> str:
        return f"port {self.port} of {self.device}"

    @property
    def mtu_bytes(self) -> int:
        return MTU_BYTES[self.mtu]

    @property
    def link_name(self) -> str:
        return LINK_NAMES.get(self.link_layer, str(self.link_layer))

    def describe(self) -> str:
        note = f"; {self.note}" if self.note else ""
        return (f"{self.where} ({self.link_name}, MTU {self.mtu_bytes}, GID {self.gid.describe()}"
                f"{', LID %d' % self.lid if self.link_layer == LINK_INFINIBAND else ''}{note})")


def inspect_port(ctx, device: str, port: int, gid_override: int | None = None) -> PortChoice:
    """Read `port` of the opened `device` and choose its GID; BackendUnavailable says why not."""
    where = f"port {port} of {device}"
    try:
        attr = ctx.query_port(port)
    except Exception as exc:  # noqa: BLE001 - pyverbs raises PyverbsRDMAError for a missing port
        raise BackendUnavailable(f"cannot query {where} ({exc}); set {ENV_PORT}") from None
    if attr.state != PORT_ACTIVE:
        state = PORT_STATES.get(attr.state, f"in state {attr.state}")
        hint = " (no subnet manager has configured it yet?)" if attr.state == 2 else ""
        raise BackendUnavailable(f"{where} is {state}{hint}")
    if attr.active_mtu not in MTU_BYTES:
        raise BackendUnavailable(f"{where} reports an invalid active MTU ({attr.active_mtu})")
    # libibverbs treats an unspecified link layer as InfiniBand
    link = LINK_ETHERNET if attr.link_layer == LINK_ETHERNET else LINK_INFINIBAND
    if link == LINK_INFINIBAND and attr.lid == 0:
        raise BackendUnavailable(f"{where} is ACTIVE but has LID 0 (no subnet manager?)")
    table = read_gid_table(ctx, port, link, attr.gid_tbl_len)
    gid, note = choose_gid(table, link, where, gid_override)
    return PortChoice(device, port, link, attr.lid, attr.active_mtu, gid, note)


def path_mtu(local: int, remote: int) -> int:
    """The path MTU (enum ibv_mtu) of a connection: the smaller of the two ports' active MTUs."""
    if remote not in MTU_BYTES:
        raise HandshakeError(f"the peer stated an invalid RDMA MTU ({remote}); it runs another version")
    if local not in MTU_BYTES:
        raise ValueError(f"invalid local MTU {local}")
    return min(local, remote)

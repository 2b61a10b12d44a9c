"""Which backend a peer pair uses, and why.

Each endpoint describes what it can do (`Capabilities`, sent in its hello); the accepting
side of a connection decides for the pair with `choose` and tells the connecting side the
choice and its reason, which both log. With `backend="auto"` on both ends:

    1. shm   both ends on one host (same boot id) with a doorbell each
    2. rdma  both ends have a verbs port that is ACTIVE and passed a loopback queue-pair
             write (`transport.rdma.probe`), not merely a device in the list, and room under
             RLIMIT_MEMLOCK for every region their wiring registers (the loopback's two pages
             pass under any limit; `transport.rdma_host`)
    3. nixl  both ends have NIXL with its UCX plugin (UCX picks RDMA or TCP itself)
    4. tcp   always possible

A backend named on either end is used if both ends can, and refused with the reason
otherwise; two different named backends are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "shm", "tcp", "rdma", "nixl")


@dataclass(frozen=True)
class Capabilities:
    host: str  # transport.endpoint.host_id(): equal on one machine
    shm: bool
    rdma: bool
    nixl: bool
    shm_reason: str = ""  # why not, where False
    rdma_reason: str = ""
    nixl_reason: str = ""

    def hello_fields(self) -> dict:
        return {"host": self.host, "shm": self.shm, "rdma": self.rdma, "nixl": self.nixl,
                "shm_reason": self.shm_reason, "rdma_reason": self.rdma_reason, "nixl_reason": self.nixl_reason}

    @classmethod
    def from_hello(cls, hello: dict) -> "Capabilities":
        return cls(host=str(hello.get("host", "")), shm=bool(hello.get("shm")), rdma=bool(hello.get("rdma")),
                   nixl=bool(hello.get("nixl")), shm_reason=str(hello.get("shm_reason", "")),
                   rdma_reason=str(hello.get("rdma_reason", "")), nixl_reason=str(hello.get("nixl_reason", "")))


@dataclass(frozen=True)
class Choice:
    backend: str  # shm | rdma | nixl | tcp
    reason: str


class NoBackend(Exception):
    """No backend both ends accept; the message says which end lacks what."""


def _why_not(kind: str, me: Capabilities, peer: Capabilities, me_name: str, peer_name: str) -> str | None:
    """None where both ends can use `kind`, else the reason they cannot."""
    if kind == "tcp":
        return None
    if kind == "shm":
        if me.host != peer.host:
            return "the two ends are on different hosts"
        lacking = [(n, c.shm_reason) for n, c in ((me_name, me), (peer_name, peer)) if not c.shm]
    else:
        lacking = [(n, getattr(c, f"{kind}_reason")) for n, c in ((me_name, me), (peer_name, peer))
                   if not getattr(c, kind)]
    if not lacking:
        return None
    return "; ".join(f"{name}: {reason or 'unavailable'}" for name, reason in lacking)


def choose(mine: str, theirs: str, me: Capabilities, peer: Capabilities, me_name: str = "this end",
           peer_name: str = "the peer") -> Choice:
    """The backend for the pair (me, peer), given what each end asked for."""
    if mine != "auto" and theirs != "auto" and mine != theirs:
        raise NoBackend(f"backend mismatch: {me_name} uses {mine}, {peer_name} uses {theirs}")
    wanted = mine if mine != "auto" else theirs
    if wanted != "auto":
        why = _why_not(wanted, me, peer, me_name, peer_name)
        if why is not None:
            raise NoBackend(f"{wanted} between {peer_name} and {me_name} is unavailable: {why}")
        return Choice(wanted, f"{wanted} was requested")
    passed_over = []
    for kind, because in (("shm", "both ends are on one host"),
                          ("rdma", "both ends have an ACTIVE verbs port that passed a loopback queue-pair check "
                                   "and the locked memory to register their slots"),
                          ("nixl", "both ends have NIXL with UCX"),
                          ("tcp", "the fallback every pair has")):
        why = _why_not(kind, me, peer, me_name, peer_name)
        if why is None:
            return Choice(kind, "; ".join([because] + passed_over))
        passed_over.append(f"not {kind}: {why}")
    raise AssertionError("tcp is always possible")

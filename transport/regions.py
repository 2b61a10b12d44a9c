"""The memory an endpoint's peers' adapters touch directly: send buffers registered (read by the
adapter where a payload lies in one), regions exposed for the peers' rdma writes, and the
peers' regions this endpoint's channels write into. `Endpoint.register`, `expose`, `aim`,
`settle` and `hold_stream` are these.
"""

from __future__ import annotations

from transport.core_rdma import CoreRdmaOutbound
from transport.errors import TransportError
from transport.wire import RegionGrant

__all__ = ["RegionCalls", "Regions"]


class Regions:
    """One endpoint's registered, exposed and aimed-at memory (over its BackendSet, whose rdma
    resources hold the core's domain, and its outbound channels, the channel set's own dict)."""

    def __init__(self, endpoint: str, backends, outbound: dict) -> None:
        self.endpoint, self.backends, self.outbound = endpoint, backends, outbound
        self.rdma = backends.rdma  # where memory is exposed, read in place and settled

    def register(self, buffer) -> None:
        """Declare a buffer (a contiguous torch tensor) that payloads will be sent from, for the
        life of this endpoint. Backends that write from registered memory (nixl; rdma in the
        compiled core) then send a payload lying in it without copying it to staging first,
        after `send` or a post returned: its bytes must stay as they are until the receiver has
        the message (its answer came back, or its slot was released). Host memory is a hint:
        payloads anywhere else still work, through staging. A CUDA tensor registered on an
        endpoint whose rdma channels are the core's is read by the adapter itself (GPUDirect
        RDMA, through the dma-buf CUDA exports): rounds may then post CUDA tensors lying in it,
        to rdma peers only."""
        self.backends.register(buffer)

    def reads_in_place(self, buffer) -> bool:
        """Whether this endpoint's rdma adapter reads a payload lying in `buffer` where it lies:
        the buffer was given to `register` (the very object) and the compiled core's domain
        registered it (after `connect`: the domain opens with the first rdma pair). A CUDA
        tensor that reads False cannot be posted from (`post_round` refuses it)."""
        return self.rdma.reads_in_place(buffer)

    def expose(self, buffer) -> RegionGrant | None:
        """Declare a buffer (a contiguous CPU or CUDA tensor) this endpoint's rdma peers may write
        into, for the life of this endpoint, and return the grant a peer needs to (`aim`): the
        memory is registered for remote writes on the core's rdma domain (a CUDA tensor through
        its dma-buf: the adapter writes GPU memory, GPUDirect RDMA). None where this endpoint's
        rdma channels are not the compiled core's (no rdma pair yet: call it after `connect`;
        or the pyverbs reference), so no peer can. BackendUnavailable, with the reason, where
        the memory cannot be registered. The owner decides where it reads what was written:
        a message posted into it arrives with a header that says 0 bytes, once its bytes are
        placed."""
        return self.rdma.expose(buffer)

    def aim(self, peer: str, grant: RegionGrant | list | tuple | None) -> None:
        """The region `peer` exposed to this endpoint (its `expose` grant, or the grant's plain
        fields as its owner's message carried them: checked here, ValueError if they are not
        a grant), for posts with `targets`; None: none. Only a channel of the compiled core's
        rdma writes into a peer's region: TransportError for any other. Set again after every
        `connect` or `reconnect` (new channels)."""
        if grant is not None and not isinstance(grant, RegionGrant):
            grant = RegionGrant.from_plain(list(grant))
        channel = self.outbound.get(peer)
        if channel is None:
            raise TransportError(f"endpoint {self.endpoint} has no peer {peer!r}; peers: {', '.join(self.outbound)}")
        if not isinstance(channel, CoreRdmaOutbound):
            raise TransportError(f"endpoint {self.endpoint}: peer {peer}'s channel ({channel.kind}) cannot write into "
                                 "a region it exposed: only rdma in the compiled core can")
        channel.aim(grant)

    def can_aim(self, peer: str) -> bool:
        """Whether this endpoint's channel to `peer` can write into a region the peer exposes
        (rdma in the compiled core): `aim` then takes the peer's grant."""
        return isinstance(self.outbound.get(peer), CoreRdmaOutbound)

    def settle(self) -> None:
        """After a message into an exposed GPU region arrived and before a kernel reads its
        bytes: makes the adapter's writes visible to the GPU's kernels where the platform does
        not order them itself (cuFlushGPUDirectRDMAWrites; nothing where it does, nothing for
        host memory). Costs a host call only where a flush is needed."""
        self.rdma.settle()

    def hold_stream(self, stream: int, device: int, addresses, values) -> None:
        """GPU `device`'s stream `stream` (a CUstream handle: torch's `Stream.cuda_stream`) waits,
        in the driver, until the 32-bit word at each of `addresses` holds values[i]: marks a
        peer's post wrote after its payload into a region exposed here (`post_round(...,
        mark=)`). The stream's later work then sees those payloads (the wait flushes the
        adapter's writes where the GPU needs it and can; where it cannot, the host flushes
        them first, as `settle`); the host returns at once. BackendUnavailable where this
        endpoint exposed no memory of that GPU or the driver refuses the wait; ValueError
        where the words do not lie in one region it exposed."""
        self.rdma.hold_stream(stream, device, addresses, values)


class RegionCalls:
    """An endpoint's calls on the memory its peers' adapters read and write in place, each
    `Regions`' (which says what it does): the endpoint's `regions`."""

    regions: Regions

    def register(self, buffer) -> None:
        self.regions.register(buffer)

    def reads_in_place(self, buffer) -> bool:
        return self.regions.reads_in_place(buffer)

    def expose(self, buffer) -> RegionGrant | None:
        return self.regions.expose(buffer)

    def can_aim(self, peer: str) -> bool:
        return self.regions.can_aim(peer)

    def aim(self, peer: str, grant: RegionGrant | list | tuple | None) -> None:
        self.regions.aim(peer, grant)

    def settle(self) -> None:
        self.regions.settle()

    def hold_stream(self, stream: int, device: int, addresses, values) -> None:
        self.regions.hold_stream(stream, device, addresses, values)

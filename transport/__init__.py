"""M2N transport: pre-registered slots, tagged one-sided writes, no collective set-up.

    spec = EndpointSpec(name="attn0", rank=0, secret=secret, listen="10.0.0.5:7000",
                        peers={"expert0": "10.0.0.6:7000"}, slot_bytes=1 << 20, num_slots=3)
    ep = Endpoint(spec).connect()
    ep.send("expert0", tensor, layer=3, micro_batch=1, token_count=128)
    msg = ep.recv("expert0", micro_batch=1)     # msg.header, msg.tensor(torch.bfloat16)
    msg.release()                               # the sender may now reuse that slot
    ep.slots_in_use()                           # SlotUsage(held=0, unreleased=0, queued=0) when idle
    ep.post_round(("e0", "e1"), buf, begins, ends, counts, layer=3, micro_batch=1)  # one call, every peer
    arrivals = ep.collect_round(("e0", "e1"), micro_batch=1)   # .fields, .gather_into(buf), .release()

Backends: shm (one host), tcp, rdma (pyverbs, where a verbs port works), nixl (NVIDIA NIXL
over UCX), chosen per peer pair by `backend="auto"` (transport/selection.py; docs/transport.md).
Never imports megainfer.
"""

from transport.endpoint import Endpoint, EndpointSpec, Message, SlotUsage, host_id
from transport.errors import (BackendUnavailable, HandshakeError, PayloadTooLarge, PeerClosed, PeerTimeout,
                              ProtocolViolation, RoundFailed, TransportError)
from transport.rounds import Arrivals
from transport.wire import Header

__all__ = ["Endpoint", "EndpointSpec", "Message", "SlotUsage", "Header", "Arrivals", "host_id", "TransportError",
           "RoundFailed",
           "HandshakeError", "PeerTimeout", "PeerClosed", "ProtocolViolation", "PayloadTooLarge",
           "BackendUnavailable"]

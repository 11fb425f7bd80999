"""Floor 1: collectives, comm implementations and the comm context.

Communication: the collectives (tensors in, tensors out: copy-in, one collective, copy-out),
the comm implementations a group calls (default, custom, symmetric memory) and the comm context (the
side streams and the stream protocols of the all-gathers and reduce-scatters), and the byte exchange
every room moving rows between ranks uses (aligned ``pack``/``take``, one ``exchange``) with the "raise on
every rank, or none" agreement (``raise_everywhere``). Imports ``base``.

Internal: fsdp2's public names are in ``fsdp2``; this face is for reading the architecture.
"""

from ._collectives import all_ranks_true, raise_everywhere
from ._comm_context import CommContext
from ._comms import AllGather, Comm, ForwardingComm, GroupComms, ReduceScatter
from ._exchange import ALIGN, Received, Scratch, exchange, nbytes_of, pack, padded, take

__all__ = [
    "ALIGN",
    "AllGather",
    "Comm",
    "CommContext",
    "ForwardingComm",
    "GroupComms",
    "Received",
    "ReduceScatter",
    "Scratch",
    "all_ranks_true",
    "exchange",
    "nbytes_of",
    "pack",
    "padded",
    "raise_everywhere",
    "take",
]

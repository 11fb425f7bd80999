"""Floor 1: collectives, comm implementations and the comm context.

Communication: the collectives (tensors in, tensors out: copy-in, one collective, copy-out),
the comm implementations a group calls (default, custom, symmetric memory) and the comm context (the
side streams and the stream protocols of the all-gathers and reduce-scatters). Imports ``base``.

Internal: fsdp2's public names are in ``fsdp2``; this face is for reading the architecture.
"""

from ._comm_context import CommContext
from ._comms import AllGather, Comm, ForwardingComm, GroupComms, ReduceScatter

__all__ = ["AllGather", "Comm", "CommContext", "ForwardingComm", "GroupComms", "ReduceScatter"]

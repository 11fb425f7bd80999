"""Floor 1: collectives, comm implementations and the comm context.

Communication: the collectives (tensors in, tensors out: copy-in, one collective, copy-out),
the comm implementations a group calls (default, custom, symmetric memory) and the comm context (the
side streams and the stream protocols of the all-gathers and reduce-scatters), and the byte exchange
every room moving rows between ranks uses (aligned ``pack``/``take``, one ``exchange``) with the "raise on
every rank, or none" agreement (``raise_everywhere``). Imports ``base``.

The face: ``__all__`` is what the rooms above may use, and they import nothing else of this room
(``tests/house/test_layering.py`` checks). fsdp2's public names are in ``fsdp2``.
"""

from ._collectives import (
    AllGatherResult,
    CopyIn,
    DivideFactors,
    all_gather_copy_in,
    all_ranks_true,
    all_reduce_before_tail,
    contiguous_strides,
    copy_out_2d,
    divide_factors,
    issue_all_gather,
    packed_all_gather_copy_in,
    raise_everywhere,
    reduce_scatter,
    reduce_scatter_copy_in,
    run_all_reduce_hook,
    same_order_tail,
    view_out_shards,
    wait_all_gather,
)
from ._comm_context import CommContext, serves_on_streams
from ._comms import (
    AllGather,
    Comm,
    DefaultAllGather,
    DefaultReduceScatter,
    ForwardingComm,
    GroupComms,
    ProcessGroupAllocAllGather,
    ProcessGroupAllocReduceScatter,
    ReduceScatter,
    SymmMemAllGather,
    SymmMemReduceScatter,
    check_comm,
    check_symmetric_memory,
    comm_type,
)
from ._exchange import ALIGN, Packed, Received, Scratch, exchange, nbytes_of, pack, padded, take

__all__ = [
    "ALIGN",
    "AllGather",
    "AllGatherResult",
    "Comm",
    "CommContext",
    "CopyIn",
    "DefaultAllGather",
    "DefaultReduceScatter",
    "DivideFactors",
    "ForwardingComm",
    "GroupComms",
    "Packed",
    "ProcessGroupAllocAllGather",
    "ProcessGroupAllocReduceScatter",
    "Received",
    "ReduceScatter",
    "Scratch",
    "SymmMemAllGather",
    "SymmMemReduceScatter",
    "all_gather_copy_in",
    "all_ranks_true",
    "all_reduce_before_tail",
    "check_comm",
    "check_symmetric_memory",
    "comm_type",
    "contiguous_strides",
    "copy_out_2d",
    "divide_factors",
    "exchange",
    "issue_all_gather",
    "nbytes_of",
    "pack",
    "packed_all_gather_copy_in",
    "padded",
    "raise_everywhere",
    "reduce_scatter",
    "reduce_scatter_copy_in",
    "run_all_reduce_hook",
    "same_order_tail",
    "serves_on_streams",
    "take",
    "view_out_shards",
    "wait_all_gather",
]

"""What a group reads of the root it works under, as a protocol (the root lives in ``runtime``).

Owns: ``GroupRoot``, the few fields of ``runtime``'s ``RootContext`` a group reads (the streams, the
event scope, the usage agreement) and the two questions it asks the schedule (join a bucketed
all-gather, queue a bucketed reduce-scatter). Groups are built below the runtime, so they name this
protocol instead of the class. Does not own any of those objects.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..comm._comm_context import CommContext
from ..trace._events import EventScope
from ._skip import UseAgreement


class GroupSchedule(Protocol):
    """The cross-group questions a group asks (``runtime``'s ``Schedule``)."""

    bucket_gathers: bool
    bucket_reduces: bool

    def gather(self, group: Any, state: Any) -> bool: ...
    def reduce(self, group: Any, params: list[Any], grads: list[torch.Tensor]) -> bool: ...


class GroupRoot(Protocol):
    """What a group reads of its root context (``runtime``'s ``RootContext``)."""

    comm_ctx: CommContext
    event_scope: EventScope
    use_agreement: UseAgreement

    @property
    def schedule(self) -> GroupSchedule: ...

"""The private names torch's own code reads from an FSDP state, answered by fsdp2's state.

Owns: ``TorchStateNames``, a base of ``FSDPState`` that maps the attributes torch's modules read past
the public API onto fsdp2's own fields and calls, and ``TorchGroupView``, a group as torch's code
sees it. The readers, in torch 2.13:

- ``torch.distributed.pipelining`` (``_PipelineStageBase.perform_reduce_grad``): ``fully_shard.state(m)``,
  then ``_state_ctx.all_states``, each state's ``_fsdp_param_groups`` and their ``post_backward()``,
  and the root's ``_root_post_backward_final_callback()``;
- ``torch.distributed.fsdp.register_fsdp_forward_method``: ``_get_fsdp_state()._pre_forward`` and
  ``._post_forward``;
- ``torch.distributed.fsdp.share_comm_ctx``: ``_comm_ctx`` (read and written) and each group's
  ``comm_ctx``.

Does not own: behaviour. Each name forwards to the public method or field of the same meaning, so a
torch helper given an fsdp2 module does what fsdp2's own helper does. Nothing here is part of
fsdp2's API; tests pin each name against the torch code that reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ..comm import CommContext

if TYPE_CHECKING:
    from ..group import FSDPParamGroup


class _State(Protocol):
    """What the names below use of ``FSDPState``."""

    groups: list[FSDPParamGroup]
    comm_ctx: CommContext | None

    def shared_context(self) -> Any: ...
    def shared_comm_context(self) -> CommContext: ...
    def pre_forward(self, module: Any, args: Any, kwargs: Any) -> tuple[Any, Any]: ...
    def post_forward(self, module: Any, args: Any, output: Any) -> Any: ...
    def finish_backward(self) -> None: ...


class TorchStateNames:
    """Torch's private FSDP-state names, forwarded to fsdp2's ``FSDPState`` (see the module docstring)."""

    @property
    def _fsdp_param_groups(self: _State) -> list[TorchGroupView]:
        return [TorchGroupView(group, self) for group in self.groups]

    @property
    def _fsdp_param_group(self: _State) -> TorchGroupView | None:
        return TorchGroupView(self.groups[0], self) if len(self.groups) == 1 else None

    @property
    def _state_ctx(self: _State) -> Any:
        return self.shared_context()

    @property
    def _comm_ctx(self: _State) -> CommContext:
        return self.shared_comm_context()

    @_comm_ctx.setter
    def _comm_ctx(self: _State, comm_ctx: CommContext) -> None:
        if not isinstance(comm_ctx, CommContext):
            raise TypeError(
                f"An fsdp2 module cannot share the communication context of a module sharded by torch's "
                f"fully_shard (got {type(comm_ctx).__name__}). Shard every stage with fsdp2.fully_shard."
            )
        self.shared_context().comm_ctx = comm_ctx

    def _pre_forward(self: _State, module: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return self.pre_forward(module, args, kwargs)

    def _post_forward(self: _State, module: Any, args: Any, output: Any) -> Any:
        return self.post_forward(module, args, output)

    def _root_post_backward_final_callback(self: _State) -> None:
        # A backward driven by hand (pipelining's REDUCE_GRAD action after manual post_backward calls):
        # the same end-of-backward work the autograd callback does.
        self.finish_backward()


class TorchGroupView:
    """A group as torch's own code sees it (``_fsdp_param_groups``): torch's calls on its groups.

    Attributes are the group's (read and written through). ``post_backward()`` is torch's meaning
    of the name, which also reduces the gradients: pipelining's manual reduction calls it on every
    group before the end-of-backward callback. In fsdp2 the root's context runs a post-backward and
    its schedule reduces (``RootContext.post_backward``); the group only takes the gradients.
    """

    __slots__ = ("_fsdp2_group", "_fsdp2_state")

    def __init__(self, group: FSDPParamGroup, state: _State) -> None:
        object.__setattr__(self, "_fsdp2_group", group)
        object.__setattr__(self, "_fsdp2_state", state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fsdp2_group, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._fsdp2_group, name, value)

    def post_backward(self, *args: Any, **kwargs: Any) -> None:
        self._fsdp2_state.shared_context().post_backward(self._fsdp2_group)

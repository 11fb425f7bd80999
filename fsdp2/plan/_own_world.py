"""A c10d world of its own for a simulation inside a job, and the simulation's no-op backend.

Owns: ``own_world`` (c10d's default group and group registry swapped for this thread while a
simulation runs, the job's restored after) and ``register_simulated_backend`` (torch's no-op process
group under the name ``SIM_BACKEND``). Does not own: the simulation (``_memory.simulated_world``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

SIM_BACKEND = "fsdp2_simulated"


def register_simulated_backend() -> None:
    """Register the simulation's backend (torch's no-op process group) once per process."""
    if SIM_BACKEND.upper() in dist.Backend.__dict__:
        return
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common: Any, options: Any) -> Any:
        # the no-op process group torch ships, without a public constructor
        return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)  # type: ignore[call-arg]  # noqa: SLF001

    dist.Backend.register_backend(SIM_BACKEND, create, extended_api=True, devices=["cpu", "cuda"])


@contextlib.contextmanager
def own_world() -> Iterator[None]:
    """A c10d world of its own for this thread while the simulation runs, the job's restored after.

    c10d keeps its default group and group registry in one ``_world`` object, which torch names as
    the place to override; the threaded process group of torch's tests keeps one per thread. So a
    simulation inside a running job (``plan`` on every rank) sees no process group of the job's, and
    the job's groups are untouched. Other threads of a real job must not issue collectives meanwhile.
    """
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world  # noqa: SLF001 - the documented extension point
    count = world.group_count  # group names continue the job's: c10d registers them by name
    per_thread = getattr(type(world), "_world", None)
    threaded = isinstance(per_thread, threading.local)  # torch's threaded process group
    saved = getattr(per_thread, "world", None) if threaded else world
    if threaded and saved is not None:
        del per_thread.world  # type: ignore[union-attr]
    elif not threaded:
        c10d._world = _isolated_world(c10d._World)()  # noqa: SLF001 - idem
    c10d._world.group_count = count  # noqa: SLF001 - idem
    try:
        yield
    finally:
        # Unregister only the simulation's groups: destroying its default group would unregister
        # every group of the process, the job's too.
        for group in list(c10d._world.pg_map):  # noqa: SLF001 - idem
            c10d._unregister_process_group(group.group_name)  # type: ignore[attr-defined]  # noqa: SLF001 - idem
        if threaded:
            if saved is not None:
                per_thread.world = saved  # type: ignore[union-attr]
            else:
                del per_thread.world  # type: ignore[union-attr]
        else:
            c10d._world = world  # noqa: SLF001 - idem


def _isolated_world(base: type[Any]) -> type[Any]:
    """c10d's ``_World`` with maps and a group count of its own (``_World`` keeps them in globals)."""

    class IsolatedWorld(base):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.own: dict[str, Any] = {name: {} for name in _WORLD_MAPS}
            self.own_count = 0

        def _get_count(self) -> int:
            return self.own_count

        def _set_count(self, value: int) -> None:
            self.own_count = value

        group_count = property(_get_count, _set_count)

    def mapped(name: str) -> property:
        return property(lambda self: self.own[name])

    for name in _WORLD_MAPS:
        setattr(IsolatedWorld, name, mapped(name))
    return IsolatedWorld


_WORLD_MAPS = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "tags_to_pg", "pg_to_tag")

"""Every name an ``__all__`` lists resolves (fsdp2's and every room's face), and ``import *`` works."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp2"
ROOMS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())


def test_every_room_is_covered() -> None:
    assert len(ROOMS) > 10, ROOMS
    assert "testing" in ROOMS


@pytest.mark.parametrize("package", ["fsdp2", *(f"fsdp2.{room}" for room in ROOMS)])
def test_every_listed_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == [], f"{package}.__all__ lists names the package does not define: {missing}"
    namespace: dict[str, object] = {}
    exec(f"from {package} import *", namespace)
    assert set(module.__all__) <= set(namespace)


def test_public_local_shard_is_the_weight_sync_one() -> None:
    import fsdp2
    from fsdp2.weights import LocalShard

    assert fsdp2.LocalShard is LocalShard
    assert set(LocalShard.__dataclass_fields__) == {
        "name",
        "tensor",
        "global_shape",
        "offset",
        "mesh",
        "placements",
    }

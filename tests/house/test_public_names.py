"""Every name a public ``__all__`` lists resolves, and ``from fsdp2 import *`` works."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("package", ["fsdp2", "fsdp2.testing"])
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

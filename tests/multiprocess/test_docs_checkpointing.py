"""docs/checkpointing.md's snippets, executed in order in 2 real gloo processes.

The page's code blocks share one namespace, as a reader running them one after the other would; the
test supplies what the page assumes (a ``Net`` with ``.blocks``, a saved plain state dict, batches) and
skips only the ``init_process_group`` line (the harness already made the group).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import run_multiprocess

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

DOC = Path(__file__).resolve().parents[2] / "docs" / "checkpointing.md"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.up(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # every process builds the same model
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 2)
        self.register_buffer("offset", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) + self.offset


def _run_snippets(workdir: str) -> None:
    os.chdir(workdir)
    if dist.get_rank() == 0:
        torch.save(Net().state_dict(), "plain_model.pt")
    dist.barrier()
    blocks = [part.split("```", 1)[0] for part in DOC.read_text().split("```python\n")[1:]]
    assert len(blocks) >= 6, "the page lost its snippets"
    namespace: dict[str, object] = {
        "Net": Net,
        "Block": Block,
        "batches": [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)],
        "eval_batch": torch.ones(4, 8),
    }
    for index, code in enumerate(blocks):
        code = "\n".join(line for line in code.splitlines() if "init_process_group" not in line)
        exec(compile(code, f"checkpointing.md block {index}", "exec"), namespace)
    gc.collect()


def test_checkpointing_page_runs(tmp_path: Path) -> None:
    run_multiprocess(2, _run_snippets, str(tmp_path))
    assert (tmp_path / "model.safetensors").exists()
    assert (tmp_path / "ckpt" / "step100" / ".metadata").exists()

"""examples/lora.py in thread ranks: LoRA on the example GPT, the frozen backbone kept gathered, the
weights synced to a plain bf16 inference copy that equals the trainer and generates text."""

from __future__ import annotations

import sys
from pathlib import Path

from tests._harness import run_threaded

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(argv: list[str]) -> dict:
    sys.path.insert(0, str(EXAMPLES))
    import lora  # examples/lora.py

    return lora.main(argv)


def test_lora_example_trains_keeps_the_backbone_and_syncs_the_inference_copy() -> None:
    argv = ["--steps", "12", "--dim", "32", "--layers", "2", "--heads", "2", "--batch-size", "4"]
    argv += ["--seq-len", "16", "--sync-every", "4", "--sample-chars", "20"]
    results = run_threaded(2, _run, argv)
    first, second = results
    assert first["losses"] == second["losses"]  # averaged over ranks
    assert first["losses"][-1] < first["losses"][0]  # the adapters learn
    assert first["same"]  # rank 0's inference copy equals the trainer's full weights in bf16
    assert len(first["text"]) == 20
    assert second["text"] == ""  # only rank 0 receives the weights and generates
    # every frozen Linear weight and bias of the blocks, the embeddings, norms and head are kept
    assert len(first["kept"]) == len(second["kept"]) > 0
    # the first step gathers the backbone once, the later ones the adapters only
    assert first["gathered"][-1] < first["gathered"][0] / 2
    # the first sync sends everything, the later ones only the adapters (under a third of it)
    assert all(later < first["synced"][0] / 3 for later in first["synced"][1:])

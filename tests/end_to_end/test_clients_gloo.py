"""Real clients that shard with torch's ``fully_shard`` themselves, run with fsdp2 behind torch's name.

Each client runs twice in 2 gloo processes on the same model, data and seed: once unchanged (torch's
``fully_shard``) and once after ``fsdp2.patch_torch_fsdp()``, and the runs must agree bit for bit.

- **torchtitan 0.3.0**: the llama3 debug model through torchtitan's own ``parallelize_llama``
  (``apply_fsdp_to_decoder``: every block and the root, then ``disable_fsdp_gradient_division``) with
  selective activation checkpointing, trained with the trainer's loss normalisation (summed
  cross-entropy over the global token count). Losses, gradient norms and parameters equal torch's,
  and the first gradient norm equals the unsharded model's: the division really is disabled on
  fsdp2's modules (before fsdp2's modules were torch ``FSDPModule`` instances it reached none of
  them, and every gradient came out divided by the data-parallel size).
- **transformers' Trainer with accelerate's FSDP2 plugin** (``fsdp_config={"version": 2}``) on a
  small Llama: ``train()``, ``evaluate()``, ``train()`` again (the Trainer reshards the FSDP modules
  before building its second optimizer). Logged losses and gradient norms, the evaluation loss and
  the final parameters equal torch's.

CPU adaptations, the same for both runs: torchtitan 0.3.0's model package imports its Triton
expert-parallel kernels at import time (a stand-in module takes their place; they are never called
here), its device type defaults to CUDA (set to CPU), and FlexAttention has no CPU backward (the
llama blocks use torchtitan's causal SDPA attention). torch's ``fully_shard`` with torchtitan's
divide factor 1.0 needs ``PREMUL_SUM``, which gloo lacks, so torch's run also sets
``set_force_sum_reduction_for_comms(True)`` (at factor 1 the same sums); fsdp2 needs no change.
accelerate builds FSDP only on accelerators, so its state is marked FSDP on these CPU processes.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._harness import run_multiprocess
from tests.shared.titan_cpu import stand_in_for_triton_kernels

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _save(out: str, impl: str, result: dict[str, Any]) -> None:
    with open(Path(out) / f"{impl}{dist.get_rank()}.pkl", "wb") as f:
        pickle.dump(result, f)


def _load(out: str, impl: str, rank: int) -> dict[str, Any]:
    with open(Path(out) / f"{impl}{rank}.pkl", "rb") as f:
        result: dict[str, Any] = pickle.load(f)
    return result


def _assert_runs_equal(out: str, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    ours = []
    for rank in range(2):
        theirs, mine = _load(out, "torch", rank), _load(out, "fsdp2", rank)
        for key in keys:
            assert mine[key] == theirs[key], (rank, key, mine[key], theirs[key])
        assert mine["params"].keys() == theirs["params"].keys()
        for name, value in mine["params"].items():
            torch.testing.assert_close(value, theirs["params"][name], rtol=0, atol=0, msg=name)
        ours.append(mine)
    return ours


# ---- torchtitan ------------------------------------------------------------------------------------

_TOKENS, _SEQ, _VOCAB = 2, 32, 2048


def _titan_batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(
        0, _VOCAB, (_TOKENS, _SEQ + 1), generator=torch.Generator().manual_seed(10 * step + rank)
    )


def _titan_model(torchtitan_llama3: Any) -> torch.nn.Module:
    from torchtitan.models.common.attention import ScaledDotProductAttention

    torchtitan_llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()
    spec = torchtitan_llama3.model_registry("debugmodel")
    torch.manual_seed(0)
    model: torch.nn.Module = spec.model.build()
    return model


def _titan_loss(model: torch.nn.Module, tokens: torch.Tensor, global_tokens: float) -> torch.Tensor:
    positions = torch.arange(_SEQ).repeat(tokens.shape[0], 1)
    logits = model(tokens[:, :-1], positions=positions)
    labels = tokens[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    return loss / global_tokens


def _torchtitan_run(impl: str, out: str) -> None:
    if impl == "fsdp2":
        import fsdp2

        fsdp2.patch_torch_fsdp()  # before torchtitan imports fully_shard, as a user would
    stand_in_for_triton_kernels()
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.models.llama3 as llama3
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    parallel_dims_module.device_type = "cpu"
    world = dist.get_world_size()
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    parallel_dims = parallel_dims_module.ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    model = llama3.parallelize_llama(
        _titan_model(llama3),
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=SelectiveAC.Config(),
        dump_folder=tempfile.mkdtemp(),
    )
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if impl == "torch":
        for module in fsdp_modules:
            module.set_force_sum_reduction_for_comms(True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result: dict[str, Any] = {"losses": [], "grad_norms": [], "fsdp_modules": len(fsdp_modules)}
    for step in range(2):
        tokens = _titan_batch(dist.get_rank(), step)
        global_tokens = float(_TOKENS * _SEQ * world)  # the trainer all-reduces the label count
        loss = _titan_loss(model, tokens, global_tokens)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        result["losses"].append(loss.item())
        result["grad_norms"].append(norm.full_tensor().item())
        optim.step()
        optim.zero_grad()
    result["params"] = {name: p.full_tensor() for name, p in model.named_parameters()}
    if dist.get_rank() == 0:  # the unsharded model on every rank's batch: the first step's gradient norm
        reference = _titan_model(llama3)
        for rank in range(world):
            _titan_loss(reference, _titan_batch(rank, 0), float(_TOKENS * _SEQ * world)).backward()
        result["reference_grad_norm"] = torch.nn.utils.get_total_norm(
            [p.grad for p in reference.parameters() if p.grad is not None]
        ).item()
    _save(out, impl, result)


def test_torchtitan_llama3_with_fsdp2_behind_torchs_name() -> None:
    with tempfile.TemporaryDirectory() as out:
        run_multiprocess(2, _torchtitan_run, "torch", out)
        run_multiprocess(2, _torchtitan_run, "fsdp2", out)
        ours = _assert_runs_equal(out, ("losses", "grad_norms", "fsdp_modules"))
        assert ours[0]["fsdp_modules"] > 2  # the blocks and more, as many as torch's run (checked above)
        # Summation order differs from the unsharded model's in the last bits; a gradient divided by the
        # data-parallel size would be off by a factor of 2.
        torch.testing.assert_close(
            ours[0]["grad_norms"][0], ours[0]["reference_grad_norm"], rtol=1e-4, atol=0
        )


# ---- transformers Trainer + accelerate FSDP2 ---------------------------------------------------------


def _mark_accelerate_state_fsdp() -> None:
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if kwargs.get("fsdp_plugin") is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = kwargs["fsdp_plugin"]

    AcceleratorState.__init__ = init  # type: ignore[method-assign]


def _trainer_run(impl: str, out: str) -> None:
    os.environ.update(LOCAL_WORLD_SIZE=os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if impl == "fsdp2":
        import fsdp2

        fsdp2.patch_torch_fsdp()
    _mark_accelerate_state_fsdp()
    from torch.distributed.fsdp import FSDPModule
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(16):
        ids = torch.randint(0, 64, (16,), generator=gen)
        data.append({"input_ids": ids, "labels": ids.clone()})
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_steps=3,
        learning_rate=1e-3,
        fsdp=True,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        data_seed=0,
        ddp_backend="gloo",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8])

    def logged() -> list[tuple[Any, Any]]:
        return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]

    trainer.train()
    first = logged()
    evaluation = trainer.evaluate()["eval_loss"]
    trainer.train()  # after an evaluation: the Trainer reshards, then builds a new optimizer
    _save(
        out,
        impl,
        {
            "log": [first, logged()],
            "eval_loss": evaluation,
            "fsdp_modules": sum(isinstance(m, FSDPModule) for m in trainer.model.modules()),
            "params": {name: p.full_tensor() for name, p in trainer.model.named_parameters()},
        },
    )


def test_trainer_with_accelerate_fsdp2_plugin_and_fsdp2_behind_torchs_name() -> None:
    with tempfile.TemporaryDirectory() as out:
        run_multiprocess(2, _trainer_run, "torch", out)
        run_multiprocess(2, _trainer_run, "fsdp2", out)
        ours = _assert_runs_equal(out, ("log", "eval_loss", "fsdp_modules"))
        assert ours[0]["fsdp_modules"] > 2  # the decoder layers, the root and more, as many as torch's run
        assert all(len(run) == 3 for run in ours[0]["log"])

"""Whole training steps on one GPU (NCCL, one rank): fsdp2 against torch's fully_shard, interleaved.

What it measures, per configuration (fp32, bf16 mixed precision, CPU offload with bf16):

- **bitwise parity**: three steps of each with attention's math kernels (deterministic), losses and
  parameters compared bit for bit.
- **parity**: both implementations start from the same weights and see the same batches; the
  largest difference between their losses over the first steps (world 1: the reductions are
  identities, so the two should agree exactly).
- **peak memory**: ``torch.cuda.max_memory_allocated`` over two steady-state steps, each
  implementation measured alone (the other model is not alive), with the bytes allocated before
  those steps (parameters, gradients, optimizer states).
- **step time**: forward, backward, AdamW, ``zero_grad``, timed between ``torch.cuda.synchronize``
  calls; the two models alternate round by round, and the ratio fsdp2 / torch is taken per round
  (median and range reported).

At one rank the all-gather and reduce-scatter move no data between GPUs, so this shows the cost of
each implementation's machinery on a GPU (copy-in/out, streams and events, hooks, pinned copies),
not communication overlap, which needs several GPUs.

Run:  python benchmarks/gpu_step.py [--layers 12 --dim 1024 --seq 1024 --batch 4] [--out DIR]
Prints a Markdown table and writes gpu_step.json under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp2


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (
            t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
            for t in self.qkv(self.norm1(x)).chunk(3, -1)
        )
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(attn)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


CONFIGS: dict[str, Callable[[], dict[str, Any]]] = {
    "fp32": lambda: {},
    "bf16": lambda: {"mp_policy": "bf16"},
    "offload+bf16": lambda: {"mp_policy": "bf16", "offload": True},
}


def _shard(base: nn.Module, impl: str, options: dict[str, Any]) -> nn.Module:
    from torch.distributed import fsdp as torch_fsdp

    lib: Any = fsdp2 if impl == "fsdp2" else torch_fsdp
    kwargs: dict[str, Any] = {}
    if options.get("mp_policy") == "bf16":
        kwargs["mp_policy"] = lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if options.get("offload"):
        kwargs["offload_policy"] = lib.CPUOffloadPolicy()
    model = copy.deepcopy(base).cuda() if not options.get("offload") else copy.deepcopy(base)
    for layer in model.layers:
        lib.fully_shard(layer, **kwargs)
    lib.fully_shard(model, **kwargs)
    return model


def _step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _batches(args: argparse.Namespace, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).cuda() for _ in range(n)]


def _bitwise_parity(base: nn.Module, options: dict[str, Any], batches: list[torch.Tensor]) -> bool:
    """Both implementations, three steps with attention's deterministic (math) kernels: equal bit for bit?

    The default attention kernels accumulate their backward with atomics, so torch differs from itself
    between runs (the "torch vs torch" column); with the math kernels it does not, and any difference
    left would be fsdp2's.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    finals: dict[str, tuple[list[float], list[torch.Tensor]]] = {}
    for impl in ("torch", "fsdp2"):
        model = _shard(base, impl, options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        with sdpa_kernel(SDPBackend.MATH):
            losses = [float(_step(model, opt, b)) for b in batches]
        finals[impl] = (losses, [cast(DTensor, p).full_tensor().detach().cpu() for p in model.parameters()])
        del model, opt
        gc.collect()
    (tl, tp), (fl, fp) = finals["torch"], finals["fsdp2"]
    return tl == fl and all(torch.equal(a, b) for a, b in zip(tp, fp, strict=True))


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    options = CONFIGS[name]()
    layers = args.layers if not options.get("offload") else max(2, args.layers // 3)
    torch.manual_seed(0)
    base = Model(layers, args.dim, args.heads, args.vocab)
    batches = _batches(args, args.warmup + 2)
    out: dict[str, Any] = {"layers": layers, "params_M": sum(p.numel() for p in base.parameters()) / 1e6}
    losses: dict[str, list[float]] = {}
    # Memory and parity, one model alive at a time; torch runs twice, so the losses show the GPU's
    # own run-to-run spread (kernels with atomics, such as attention's backward) beside fsdp2's.
    for run in ("torch", "fsdp2", "torch_again"):
        impl = run.removesuffix("_again")
        gc.collect()
        torch.cuda.empty_cache()
        model = _shard(base, impl, options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses[run] = [float(_step(model, opt, b)) for b in batches[: args.warmup]]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        losses[run] += [float(_step(model, opt, b)) for b in batches[args.warmup :]]
        torch.cuda.synchronize()
        if run == impl:
            out[f"{impl}_state_MiB"] = before / 2**20
            out[f"{impl}_peak_MiB"] = torch.cuda.max_memory_allocated() / 2**20
        del model, opt
        gc.collect()  # torch's FSDP state holds reference cycles: free its model before the next one
    out["losses"] = losses
    out["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses["torch"], losses["fsdp2"], strict=True))
    out["torch_vs_torch_loss_diff"] = max(
        abs(a - b) for a, b in zip(losses["torch"], losses["torch_again"], strict=True)
    )
    out["peak_ratio"] = out["fsdp2_peak_MiB"] / out["torch_peak_MiB"]
    out["math_sdpa_bit_equal"] = _bitwise_parity(base, options, batches[:3])
    torch.cuda.empty_cache()
    models = {impl: _shard(base, impl, options) for impl in ("torch", "fsdp2")}
    opts = {impl: torch.optim.AdamW(m.parameters(), lr=1e-4) for impl, m in models.items()}
    for impl in models:  # warm-up: lazy init, allocator, kernels
        for b in batches[:2]:
            _step(models[impl], opts[impl], b)
    times: dict[str, list[float]] = {"torch": [], "fsdp2": []}
    rounds = args.rounds if not options.get("offload") else max(2, args.rounds // 2)
    for _ in range(rounds):
        for impl in ("torch", "fsdp2"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for b in batches[: args.steps]:
                _step(models[impl], opts[impl], b)
            torch.cuda.synchronize()
            times[impl].append((time.perf_counter() - t0) / args.steps * 1e3)
    ratios = sorted(f / t for f, t in zip(times["fsdp2"], times["torch"], strict=True))
    out.update(
        torch_ms=statistics.median(times["torch"]),
        fsdp2_ms=statistics.median(times["fsdp2"]),
        time_ratio=statistics.median(ratios),
        time_ratio_range=(ratios[0], ratios[-1]),
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="steps per implementation per round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/gpu_step.py needs a CUDA device; the CPU figures come from benchmarks/suite.py"
        )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "args": vars(args),
    }
    try:
        for name in args.configs.split(","):
            results[name] = run_config(name, args)
            r = results[name]
            print(f"{name}: {json.dumps({k: v for k, v in r.items() if k != 'losses'})}", flush=True)
    finally:
        dist.destroy_process_group()
    print(f"\n{results['device']}, torch {results['torch']}, one rank (NCCL)\n")
    print(
        "| config | params M | torch ms | fsdp2 ms | fsdp2/torch (range) "
        "| torch peak MiB | fsdp2 peak MiB | ratio | max loss diff (torch vs torch) "
        "| bit-equal, math attention |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.configs.split(","):
        r = results[name]
        lo, hi = r["time_ratio_range"]
        print(
            f"| {name} | {r['params_M']:.1f} | {r['torch_ms']:.2f} | {r['fsdp2_ms']:.2f} "
            f"| {r['time_ratio']:.3f} ({lo:.3f}-{hi:.3f}) | {r['torch_peak_MiB']:.0f} "
            f"| {r['fsdp2_peak_MiB']:.0f} | {r['peak_ratio']:.3f} | {r['max_loss_diff']:.2e} "
            f"({r['torch_vs_torch_loss_diff']:.2e}) | {'yes' if r['math_sdpa_bit_equal'] else 'NO'} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_step.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

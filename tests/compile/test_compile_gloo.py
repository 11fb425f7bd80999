"""Whole-model torch.compile in real gloo processes: the collectives in the graph (one spawn of 2).

``torch.compile(model, fullgraph=True)`` over a model sharded bottom-up traces forward and backward
with no graph break (fullgraph would raise at one), every all-gather, reduce-scatter and all-reduce
counted in the graphs AOTAutograd hands its compilers (with inductor's min-cut partitioner). With
the ``aot_eager`` backend the losses and parameters of three AdamW steps are bit-equal to eager
fsdp2's for fp32 with ``reshard_after_forward`` True (resharding is gathering again in backward: the
backward all-gathers are counted), False (with activation checkpointing outside the hooks: none
gathered again) and None (HSDP 1 x 2: gathered again like True), bf16 ``param_dtype``, bf16 with
fp32 ``reduce_dtype`` (sharded on dim 0 and on dim 1), activation checkpointing (outside the FSDP
hooks, and around them as Hugging Face does it: the Llama below), HSDP (2 replicas of 1 shard, in
fp32 and bf16/fp32; 1 of 2), and transformers' Llama with and without its gradient checkpointing;
with ``inductor`` and its bucketing passes, within fp32 rounding. Each setting is compiled once: a
check that needs no setting of its own runs on a compile that runs anyway, and the settings that
change only each parameter's collectives (the dtypes, dim-1 shards, HSDP) compile ``Small``,
the Transformer without attention and norms (a third of the compile time). The eager engine does
not run (no event recorded); a forward that raises leaves the sharded parameters registered; the
state dict after compiled steps loads into an eager model that continues identically, and back; and
a model the compiled path does not cover (CPU offload here) compiles as before, with the eager hooks
and a graph break at each FSDP module, ``fullgraph=True`` failing with fsdp2's message naming the
module and setting. (Thread ranks cannot run the compiled path: torch's threaded process group has
no functional reduce-scatter, so these tests need processes.)
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import fsdp2
from fsdp2.compile import _compiled
from fsdp2.runtime._state import get_state as fsdp2_state
from tests._harness import run_multiprocess
from tests.models import ModelArgs, Transformer, make_tokens

pytestmark = pytest.mark.multiprocess  # spawns gloo processes (conftest: slow, their time limit)

WORLD_SIZE = 2
ARGS = ModelArgs(n_layers=2)


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(dim, 3 * dim + 2)
        self.w_out = nn.Linear(3 * dim + 2, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.w_out(F.gelu(self.w_in(h)))


class Small(nn.Module):
    """The Transformer's embedding, feed-forward blocks and output, without attention or norms: 10
    parameters instead of 29, a third of the compile time. For the settings that change each
    parameter's collectives (dtypes, dim-1 shards, HSDP) and nothing in the blocks' computation."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(_Block(args.dim) for _ in range(args.n_layers))
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = block(h)
        return self.output(h)


def _sharded(
    args: ModelArgs = ARGS, wrap_blocks: bool = False, small: bool = False, **options: Any
) -> Transformer | Small:
    torch.manual_seed(0)  # the same parameters in every process
    model = Small(args) if small else Transformer(args)
    for i, layer in enumerate(model.layers):
        if wrap_blocks:  # activation checkpointing outside the FSDP hooks (torchtitan's way)
            layer = model.layers[i] = checkpoint_wrapper(layer)
        fsdp2.fully_shard(layer, **options)
    fsdp2.fully_shard(model, **options)
    return model


def _counting_backend(counts: Counter[str]) -> Any:
    """``aot_eager`` with inductor's partitioner, counting the collectives in the two graphs."""

    def compiler(name: str) -> Any:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            for node in gm.graph.nodes:
                target = str(node.target)
                if "all_gather_into_tensor" in target:
                    counts[f"{name} all_gather"] += 1
                    counts[f"{name} all_gather {node.meta['val'].dtype}"] += 1
                elif "reduce_scatter_tensor" in target:
                    counts[f"{name} reduce_scatter"] += 1
                    counts[f"{name} reduce_scatter {node.meta['val'].dtype}"] += 1
                elif "all_reduce" in target:
                    counts[f"{name} all_reduce"] += 1
            return make_boxed_func(gm.forward)

        return compile_graph

    # inductor's partitioner (min-cut), which recomputes marked regions (aot_eager's does not)
    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        partition_fn=min_cut_rematerialization_partition,
    )


def _steps(model: Any, optim: torch.optim.Optimizer, first: int, count: int) -> list[torch.Tensor]:
    losses = []
    for step in range(first, first + count):
        loss = model(make_tokens(ARGS, dist.get_rank() * 10 + step)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


def _parity(options: dict[str, Any], replicas: int = 1) -> tuple[Counter[str], Transformer | Small, Any]:
    """Compiled whole model against eager fsdp2, bit for bit with aot_eager; collectives in the graph.

    Returns the counts, and the model with its compiled wrapper (after three steps)."""
    torch._dynamo.reset()
    eager, model = _sharded(**options), _sharded(**options)
    counts: Counter[str] = Counter()
    compiled = torch.compile(model, fullgraph=True, backend=_counting_backend(counts))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_optim = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    with fsdp2.record_events() as events:
        losses = _steps(compiled, optim, 0, 3)
    assert not list(events), "the eager engine ran under the compiled model"
    want = _steps(eager, eager_optim, 0, 3)
    where = f"{options}"
    for got, expected in zip(losses, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"{where}: {m}")
    for (name, param), ref in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert isinstance(param, type(ref)), name
        torch.testing.assert_close(param.full_tensor(), ref.full_tensor(), rtol=0, atol=0)
    n_params = len(list(model.parameters()))
    sharded = replicas < WORLD_SIZE  # (a shard group of one rank gathers and scatters nothing)
    # one all-gather per parameter in forward, one reduce-scatter (and one all-reduce across
    # replicas) per parameter in backward
    assert counts["forward all_gather"] == n_params * sharded, counts
    assert counts["backward reduce_scatter"] == n_params * sharded, counts
    assert counts["backward all_reduce"] == n_params * (replicas > 1), counts
    return counts, model, compiled


def _resume_eagerly(model: Transformer | Small, compiled: Any) -> None:
    """A state dict saved after compiled steps (``_parity``'s, default options) loads into an eager
    model, which continues the same, and the other way round."""
    # A forward that raises after the root's pre-forward ran (a frame of its own): the sharded
    # parameters are registered again, not the gathered tensors (the saved state below would hold
    # plain full tensors otherwise).
    registered = dict(model.named_parameters())
    tokens = make_tokens(ARGS, 0)
    with pytest.raises(RuntimeError, match="sequence too long"):
        compiled(torch.cat([tokens, tokens], dim=1))
    now = dict(model.named_parameters())
    assert now.keys() == registered.keys()
    assert all(now[name] is param for name, param in registered.items()), [type(p) for p in now.values()]
    saved = copy.deepcopy(model.state_dict())  # (also checks fsdp2's DTensor deepcopy)
    eager = _sharded()
    eager.load_state_dict(saved)
    after = [_steps(m, torch.optim.SGD(m.parameters(), lr=1e-2), 2, 1)[0] for m in (model, eager)]
    torch.testing.assert_close(after[0], after[1], rtol=0, atol=0)
    # and back: the eager model's state dict, loaded into a fresh model, continues compiled
    again = _sharded()
    again.load_state_dict(copy.deepcopy(eager.state_dict()))
    compiled = torch.compile(again, fullgraph=True, backend="aot_eager")
    runs = ((compiled, again), (eager, eager))
    then = [_steps(run, torch.optim.SGD(m.parameters(), lr=1e-2), 3, 1)[0] for run, m in runs]
    torch.testing.assert_close(then[0], then[1], rtol=0, atol=0)


def _not_traced_yet() -> None:
    """What the compiled path does not cover compiles as before: eager hooks, a graph break each."""
    torch._dynamo.reset()
    model, eager = (
        _sharded(offload_policy=fsdp2.CPUOffloadPolicy()),
        _sharded(offload_policy=fsdp2.CPUOffloadPolicy()),
    )
    problem = _compiled.untraceable([fsdp2_state(model), *fsdp2_state(model).descendants])
    assert problem is not None
    assert "CPU offload" in problem
    counts: Counter[str] = Counter()
    compiled = torch.compile(model, backend=_counting_backend(counts))
    got = _steps(compiled, torch.optim.AdamW(model.parameters(), lr=1e-2), 0, 2)
    want = _steps(eager, torch.optim.AdamW(eager.parameters(), lr=1e-2), 0, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not counts, counts  # no collective in any graph: the eager engine issued them
    with pytest.raises(
        Exception, match=r"cannot be put in the compiled graph \(module '<root>': CPU offload\)"
    ):
        torch.compile(model, fullgraph=True, backend="aot_eager")(make_tokens(ARGS, 0))


def _inductor_bucketed() -> None:
    """inductor with its bucketing passes: within fp32 rounding of eager fsdp2 (the same collectives,
    grouped; other kernels)."""
    torch._dynamo.reset()
    eager, model = _sharded(), _sharded()
    passes: dict[str, Any] = {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"}
    # Kernels compiled in this process: a pool of compile workers (their start-up) does not pay on
    # 2 cores that both ranks already use (cold caches: ~43 s instead of ~55 s).
    passes["compile_threads"] = 1
    with torch._inductor.config.patch(passes):
        compiled = torch.compile(model, fullgraph=True, backend="inductor")
        losses = _steps(compiled, torch.optim.AdamW(model.parameters(), lr=1e-2), 0, 2)
    want = _steps(eager, torch.optim.AdamW(eager.parameters(), lr=1e-2), 0, 2)
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-5)
    for param, ref in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(param.full_tensor(), ref.full_tensor(), rtol=1e-5, atol=1e-5)


def _hf_llama(checkpointing: bool) -> None:
    """transformers' Llama (GQA, RoPE, tied embeddings), each decoder layer a group, the user's
    loop (``labels=`` loss), with and without HF's gradient checkpointing: bit-equal to eager.

    Its "eager" attention: with "sdpa", transformers itself picks other kernels when traced than
    eagerly (a mask and repeated key/value heads instead of ``enable_gqa``), so even the unsharded
    model compiled with aot_eager differs from eager in the last bits."""
    torch._dynamo.reset()

    def build() -> Any:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            tie_word_embeddings=True, attn_implementation="eager",
        )  # fmt: skip
        llama = transformers.LlamaForCausalLM(config)
        if checkpointing:
            llama.gradient_checkpointing_enable({"use_reentrant": False})
        for layer in llama.model.layers:
            fsdp2.fully_shard(layer)
        return fsdp2.fully_shard(llama)

    model, eager = build(), build()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]
    generator = torch.Generator().manual_seed(dist.get_rank())
    # HF's checkpointing calls each layer (and its FSDP hooks) inside the checkpointed region
    allow = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=checkpointing)
    with allow:
        for _ in range(2):
            ids = torch.randint(0, 96, (2, 12), generator=generator)
            losses = []
            for run, optim in zip((compiled, eager), optims, strict=True):
                loss = run(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                optim.step()
                optim.zero_grad()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for param, ref in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(param.full_tensor(), ref.full_tensor(), rtol=0, atol=0)


def _blocks_read(small: bool = False) -> int:
    """Parameters a block's backward reads again after resharding: all but the Linear biases."""
    return sum(
        not (isinstance(m, nn.Linear) and n == "bias")
        for b in _sharded(small=small).layers
        for m in b.modules()
        for n, _ in m.named_parameters(recurse=False)
    )


def _dtypes_and_resume() -> None:
    # fp32, reshard_after_forward=True: the backward all-gathers are exactly those (10 a block; the
    # root keeps its own, its backward is first); then the state dict of this compiled run continues
    # eagerly and back
    counts, model, compiled = _parity({"reshard_after_forward": True})
    assert counts["backward all_gather"] == _blocks_read() == 20, counts
    _resume_eagerly(model, compiled)
    bf16 = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    _parity({"mp_policy": bf16, "small": True})
    # bf16 all-gathers, fp32 reductions: one of each per parameter, in those dtypes (FSDP; HSDP below)
    bf16_fp32 = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    counts = _parity({"mp_policy": bf16_fp32, "small": True})[0]
    assert counts["forward all_gather torch.bfloat16"] == counts["forward all_gather"] > 0, counts
    assert counts["backward reduce_scatter torch.float32"] == counts["backward reduce_scatter"], counts
    # ... and parameters sharded on dim 1: gathered in fp32 (cast after), reduced in fp32
    on_dim_1 = {
        "mp_policy": bf16_fp32,
        "shard_placement_fn": lambda p: Shard(1) if p.ndim == 2 else None,
        "small": True,
    }
    counts = _parity(on_dim_1)[0]
    assert counts["backward reduce_scatter torch.float32"] == counts["backward reduce_scatter"], counts


def _checkpointing_and_hsdp() -> None:
    # activation checkpointing (its regions draw randomness: attention is tagged random), outside
    # the FSDP hooks: blocks wrapped before fully_shard; with reshard_after_forward=False (fp32) no
    # all-gather runs again in backward. (Around the FSDP module's call, Hugging Face's way: the
    # Llama with its gradient checkpointing.)
    counts = _parity({"wrap_blocks": True, "reshard_after_forward": False})[0]
    assert counts["backward all_gather"] == 0, counts
    _parity({"wrap_blocks": True, "reshard_after_forward": True})
    # HSDP: 2 replicas of 1 shard (the gradients all-reduced across replicas) and 1 of 2; the latter
    # in fp32 with reshard_after_forward=None (the default: True for blocks) gathers again like True:
    # the blocks' weights (4 in Small)
    bf16_fp32 = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    _parity({"mesh": mesh, "small": True}, replicas=2)
    _parity({"mesh": mesh, "mp_policy": bf16_fp32, "small": True}, replicas=2)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    counts = _parity({"mesh": mesh, "reshard_after_forward": None, "small": True})[0]
    assert counts["backward all_gather"] == _blocks_read(small=True) == 4, counts
    _not_traced_yet()


def _clients_and_inductor() -> None:
    for checkpointing in (False, True):
        _hf_llama(checkpointing)
    _inductor_bucketed()


# Each setting once; checks that need no setting of their own ride along with one that runs anyway.
# Three worlds, so that the whole suite can run them side by side (each forks in under a second).
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "cases", [_dtypes_and_resume, _checkpointing_and_hsdp, _clients_and_inductor], ids=lambda f: f.__name__
)
def test_whole_model_compile_on_gloo(cases: Any) -> None:
    run_multiprocess(WORLD_SIZE, cases)

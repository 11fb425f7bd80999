"""The Python snippets of docs/compile.md, timeline.md, testing-your-model.md and checkpointing.md run
as printed, and what they compute, print or write is checked.

Which blocks run: every fenced ```` ```python ```` block of the page, in order (one indented in a list
item is dedented). A block a reader is not meant to run is marked in the markdown by the line
``<!-- not run: <reason> -->`` right above its fence; these pages have none. The blocks of a page run
one after the other in one namespace, as a reader running them in order would, in a working directory
of their own. Lines that call ``dist.init_process_group`` are dropped: the harness made the group
(the pages say they run under ``torchrun``). Tracebacks point at the markdown's lines.

docs/compile.md's ``torch.compile`` calls get the ``aot_eager`` backend (inductor's code generation,
tested in test_compile_gloo.py, would add about 20 s here).

Cost: the three pages that need a process group share one world of 2 spawned gloo processes (a
module-scoped fixture; a spawn costs seconds on a small machine), and each page's test reads what its
page left behind. testing-your-model.md uses thread ranks and runs in this process; its page defines
pytest-style ``test_*`` functions, which are called.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import io
import json
import os
import re
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp2
from tests._harness import run_multiprocess

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

DOCS = Path(__file__).resolve().parents[2] / "docs"
FENCE = re.compile(r"^(?P<indent>[ ]*)```python\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S)
NOT_RUN = re.compile(r"<!-- not run: \S.*-->")
GLOO_PAGES = ("compile", "timeline", "checkpointing")

Check = Callable[[dict[str, Any], str], None]


def snippets(text: str) -> list[tuple[int, str]]:
    """The runnable ```` ```python ```` blocks of a markdown text: (first code line, dedented code)."""
    found = []
    for match in FENCE.finditer(text):
        above = text[: match.start()].rstrip("\n").rpartition("\n")[2].strip()
        if NOT_RUN.fullmatch(above):
            continue
        found.append((text.count("\n", 0, match.start()) + 2, textwrap.dedent(match["body"])))
    return found


def run_page(page: str, namespace: dict[str, Any], after: dict[int, Check] | None = None) -> str:
    """Run docs/<page>.md's blocks in ``namespace``; ``after[i]`` checks the state after block ``i``.

    Returns what the blocks printed.
    """
    path = DOCS / f"{page}.md"
    blocks = snippets(path.read_text())
    assert blocks, f"{path} has no runnable python block"
    printed = io.StringIO()
    namespace.setdefault("__name__", f"docs_{page.replace('-', '_')}")
    for index, (line, code) in enumerate(blocks):
        kept = "\n".join("" if "dist.init_process_group(" in row else row for row in code.splitlines())
        tree = ast.parse(kept, filename=str(path))
        ast.increment_lineno(tree, line - 1)  # tracebacks name the markdown's lines
        with contextlib.redirect_stdout(printed):
            exec(compile(tree, str(path), "exec"), namespace)
        if after and index in after:
            after[index](namespace, printed.getvalue())
    return printed.getvalue()


def test_snippets_reads_python_blocks_and_honours_the_not_run_mark() -> None:
    text = (
        "intro\n```python\na = 1\n```\n```bash\nls\n```\n"
        "<!-- not run: needs GPUs -->\n```python\nb = 2\n```\n"
        "- item\n  ```python\n  c = 3\n  ```\n"
    )
    assert snippets(text) == [(3, "a = 1\n"), (14, "c = 3\n")]


# ---------------------------------------------------------------------------- compile.md


@contextlib.contextmanager
def _aot_eager_by_default() -> Iterator[None]:
    """``torch.compile`` (and ``module.compile()``) without a ``backend`` uses ``aot_eager``.

    The page's graphs are the same; inductor's code generation of them (about 20 s more, cold, on a
    2-core machine) is left to test_compile_gloo.py, which compiles the whole model with inductor.
    """
    original = torch.compile

    @functools.wraps(original)
    def compile_(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("backend", "aot_eager")
        return original(*args, **kwargs)

    torch.compile = compile_  # type: ignore[assignment]  # reason: a test's stand-in, restored below
    try:
        yield
    finally:
        torch.compile = original


def _compile_checks() -> dict[int, Check]:
    def per_block(ns: dict[str, Any], printed: str) -> None:
        model = ns["model"]
        assert isinstance(model, fsdp2.FSDPModule)
        for block in model.layers:
            assert isinstance(block, fsdp2.FSDPModule)
            assert block._compiled_call_impl is not None, "block.compile() did not take"

    def whole_model(ns: dict[str, Any], printed: str) -> None:
        # the compiled step equals the unsharded model's: same loss, same weights after AdamW
        tokens = ns["tokens"]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, tokens)
        ref = ns["Net"]()
        ref_loss = ref(tokens).sum()
        torch.testing.assert_close(ns["loss"].detach(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
        for other in every:
            (ref(other).sum() / len(every)).backward()
        lr = ns["optim"].param_groups[0]["lr"]
        torch.optim.AdamW(ref.parameters(), lr=lr).step()
        for (name, got), want in zip(ns["model"].named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(got.full_tensor(), want, rtol=1e-4, atol=1e-5, msg=name)

    def untraceable(ns: dict[str, Any], printed: str) -> None:
        assert printed.splitlines()[-2:] == ["None", "module '<root>': CPU offload"], printed
        # the other spellings the page names, and the error for anything else
        check, state_of = ns["untraceable"], ns["fully_shard"].state
        model, offloaded = ns["model"], ns["offloaded"]
        assert check(state_of(model)) is None
        assert check([model]) is None
        assert check([state_of(model), *state_of(model).descendants]) is None
        assert check(offloaded) == "module '<root>': CPU offload"
        assert check([model, offloaded]) == "module 'FSDPNet': CPU offload"  # named from the first
        for wrong in (nn.Linear(2, 2), None, "model", [model, 3]):
            with pytest.raises(TypeError, match=r"untraceable\(\) takes the model you compile"):
                check(wrong)

    return {1: per_block, 2: whole_model, 3: untraceable}


# ---------------------------------------------------------------------------- timeline.md


def _timeline_checks() -> dict[int, Check]:
    def files(ns: dict[str, Any], printed: str) -> None:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        mine = json.loads(Path(f"rank{rank}.json").read_text())["traceEvents"]
        assert mine
        assert {event["pid"] for event in mine} == {rank}
        assert Path(f"rank{rank}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if rank == 0:
            merged = json.loads(Path("timeline.json").read_text())["traceEvents"]
            for other in range(1, world_size):
                mine = mine + json.loads(Path(f"rank{other}.json").read_text())["traceEvents"]
            assert merged == mine
            assert {event["pid"] for event in merged} == set(range(world_size))

    def report(ns: dict[str, Any], printed: str) -> None:
        report, row = ns["report"], ns["row"]
        assert report.steps == 2
        assert "Communication per group over 2 steps" in printed
        # each step gathers blocks.0 for forward and again for backward (it reshards after forward)
        assert row.count == 4
        assert row.total_s >= row.exposed_s >= 0
        assert row.hidden_s == pytest.approx(row.total_s - row.exposed_s)
        assert printed.splitlines()[-1] == f"{row.count} {row.total_s} {row.exposed_s} {row.hidden_s}"

    return {1: files, 2: report}


# ---------------------------------------------------------------------------- checkpointing.md


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.up(x))


class Net(nn.Module):
    """What checkpointing.md assumes: an ``nn.Module`` with a ``.blocks`` list (and a buffer)."""

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


def _checkpointing_namespace() -> dict[str, Any]:
    if dist.get_rank() == 0:
        torch.save(Net().state_dict(), "plain_model.pt")  # "Loading plain full-size tensors" loads it
    dist.barrier()
    return {
        "Net": Net,
        "Block": Block,
        "batches": [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)],
        "eval_batch": torch.ones(4, 8),
    }


def _check_checkpointing(ns: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    root = Path("ckpt")
    assert Path("model.safetensors").exists()
    index = json.loads(Path("hf_model/model.safetensors.index.json").read_text())  # both ranks wrote
    assert sorted(p.name for p in Path("hf_model").glob("*.safetensors")) == sorted(
        set(index["weight_map"].values())
    )
    assert (root / "step100" / ".metadata").exists()
    # ShardedCheckpointer: both saves complete (their .metadata), one plan for both, one file per rank,
    # and the layout load_sharded reads
    assert ns["saver"].plans_built == 1
    assert ns["pending"].done()
    for step in ("step100", "step200"):
        assert sorted(p.name for p in Path("flat", step).iterdir()) == [
            ".fsdp2_layout",
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
        ]
    assert (root / "step_100" / "COMPLETE").read_text() == "step 100\n"
    assert torch.load(root / "step_100" / "train_state.pt", weights_only=False)["step"] == 100
    # save() again to the same step (a rerun, a resume) after a step that changed the weights: the
    # new checkpoint replaces the old, nothing is left over, and it holds the new weights
    model, optim = ns["model"], ns["optim"]
    before = {k: v.full_tensor() for k, v in get_model_state_dict(model).items() if "weight" in k}
    model(ns["eval_batch"]).sum().backward()
    optim.step()
    optim.zero_grad()
    ns["save"](root, 100, model, optim, ns["schedule"])
    assert sorted(path.name for path in root.iterdir()) == ["step100", "step_100"]
    assert (root / "step_100" / "COMPLETE").read_text() == "step 100\n"
    saved = {"model": get_model_state_dict(model)}
    saved["model"] = {k: torch.zeros_like(v) for k, v in saved["model"].items()}
    dcp.load(saved, checkpoint_id=str(root / "step_100"))
    for name, now in get_model_state_dict(model).items():
        local = now.to_local() if isinstance(now, DTensor) else now
        loaded = saved["model"][name]
        loaded = loaded.to_local() if isinstance(loaded, DTensor) else loaded
        assert torch.equal(loaded, local), f"{name}: step_100 does not hold the second save's values"
        if name in before:
            assert not torch.equal(before[name], now.full_tensor()), f"{name}: the step changed nothing"


# ---------------------------------------------------------------------------- the gloo world


def _gloo_pages(workdir: str) -> None:
    """On each of the 2 ranks: every gloo page in its own folder and namespace, then its checks."""
    rank = dist.get_rank()
    for page in GLOO_PAGES:
        here = Path(workdir) / page
        here.mkdir(exist_ok=True)
        os.chdir(here)
        if rank == 0:
            Path("STARTED").touch()
        if page == "compile":
            with _aot_eager_by_default():
                run_page(page, {}, _compile_checks())
        elif page == "timeline":
            run_page(page, {}, _timeline_checks())
        else:
            namespace = _checkpointing_namespace()
            run_page(page, namespace)
            _check_checkpointing(namespace)
        gc.collect()
        dist.barrier()
        if rank == 0:
            Path("PASSED").touch()
    os.chdir(workdir)


@pytest.fixture(scope="module")
def gloo_world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Runs the gloo pages once; returns their folder and the world's error ("" when none)."""
    workdir = tmp_path_factory.mktemp("docs")
    try:
        run_multiprocess(2, _gloo_pages, str(workdir))
    except Exception as exc:  # a rank failed: each page's test says whether its page got through
        return workdir, f"{type(exc).__name__}: {exc}"
    return workdir, ""


def _assert_page_ran(gloo_world: tuple[Path, str], page: str) -> Path:
    workdir, error = gloo_world
    here = workdir / page
    if not (here / "PASSED").exists():
        where = "failed" if (here / "STARTED").exists() else "was not reached (an earlier page failed)"
        pytest.fail(f"docs/{page}.md {where} in the 2-rank gloo world:\n{error}", pytrace=False)
    return here


def test_compile_page_runs(gloo_world: tuple[Path, str]) -> None:
    _assert_page_ran(gloo_world, "compile")


def test_timeline_page_runs(gloo_world: tuple[Path, str]) -> None:
    here = _assert_page_ran(gloo_world, "timeline")
    assert sorted(path.name for path in here.glob("rank*")) == [
        "rank0.json",
        "rank0.png",
        "rank1.json",
        "rank1.png",
    ]


def test_checkpointing_page_runs(gloo_world: tuple[Path, str]) -> None:
    here = _assert_page_ran(gloo_world, "checkpointing")
    assert not list((here / "ckpt").glob("step_100.*")), "a .partial or .replaced folder was left"


# ---------------------------------------------------------------------------- testing-your-model.md


def test_testing_your_model_page_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    run_page("testing-your-model", namespace)
    tests = sorted(name for name, value in namespace.items() if name.startswith("test_") and callable(value))
    assert tests == [
        "test_collectives_of_one_step",
        "test_one_all_gather_per_block",
        "test_sharded_net_trains_like_the_plain_one",
    ]
    for name in tests:
        namespace[name]()

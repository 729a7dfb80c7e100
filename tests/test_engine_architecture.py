"""The engine's house rules (issue 16), checked on the source: the dispatch points at the bottom
of the import graph, the environment read in one place, no private names reached across
modules, and the options object deciding the backend once at load. Import cycles and module
length are the whole project's rules: tests/test_project_architecture.py and
tests/test_module_size.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from architecture_support import find_cycle, is_type_checking

from engine.options import EngineOptions, default_dtype

ENGINE = Path(__file__).resolve().parent.parent / "engine"
MODULES = {
    ".".join(("engine", *p.relative_to(ENGINE).with_suffix("").parts)).removesuffix(".__init__"): p
    for p in sorted(ENGINE.rglob("*.py"))
}


def _top_level_imports(tree: ast.Module):
    """Import statements that run when the module is imported: module level, and inside
    module-level try/if blocks (not `if TYPE_CHECKING:`, not inside functions)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not is_type_checking(node):
            stack += node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                stack += handler.body


def _engine_imports(name: str, path: Path) -> set[str]:
    """The engine modules `name` imports at import time."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _top_level_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]  # fmt: skip
        out |= {t for t in targets if t in MODULES and t != name}
    return out


GRAPH = {name: _engine_imports(name, path) for name, path in MODULES.items()}


def test_the_walk_sees_real_imports() -> None:
    """The graph is not vacuous: known edges are found."""
    assert "engine.packed" in GRAPH["engine.checkpoint"]
    assert "engine.ops" in GRAPH["engine.model"]
    assert "engine.kernels.w4gemv_kernel" in GRAPH["engine.kernels.w4gemv"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_ops_imports_nothing_above_it() -> None:
    """The dispatch points depend only on the weight types and the chunked attention, which
    import no engine module themselves; the checkpoint reader does not depend on dispatch."""
    assert GRAPH["engine.ops"] <= {"engine.packed", "engine.attention"}
    assert GRAPH["engine.packed"] == set() and GRAPH["engine.attention"] == set()
    assert "engine.ops" not in GRAPH["engine.checkpoint"]


def test_only_the_env_and_options_modules_read_the_environment() -> None:
    """engine/env.py reads every GPURIG_* variable; options.py what is not gpurig's own
    (TRITON_INTERPRET, the allocator's variables)."""
    readers = {n for n, p in MODULES.items() if re.search(r"os\.environ|getenv", p.read_text())}
    assert "engine.env" in readers and readers <= {"engine.env", "engine.options"}, readers


def test_no_private_names_reached_across_modules_and_no_state_on_other_objects() -> None:
    pattern = re.compile(r"\bm\._(rope|embed)\b|\._packed_ok\b|_gpurig_|__dict__\[")
    hits = [
        f"{n}: {m.group(0)}" for n, p in MODULES.items() for m in pattern.finditer(p.read_text())
    ]
    assert hits == []


def test_deleted_experiments_stay_deleted() -> None:
    """v4's PDL with L2 prefetch, the residual epilogue, fused q/k/v attention: gone from the
    engine (PDL itself came back in v20, measured faster, without the prefetch)."""
    text = "\n".join(p.read_text() for p in MODULES.values())
    for name in ("pdl_enter", "prefetch_l2", "prefetch.global", "cp.async.bulk.prefetch",
                 "w4_gemv_residual", "attention_from_qkv", "GPURIG_PROLOGUE", "GPURIG_EPILOGUES",
                 "GPURIG_FUSE_QKV_ATTN", "GPURIG_PREFETCH", "attention_rope", "rope_attention"):  # fmt: skip
        assert name not in text, name


def test_options_from_the_environment() -> None:
    assert EngineOptions.from_env({}) == EngineOptions()
    opts = EngineOptions.from_env({"GPURIG_FAST": "force", "GPURIG_CUDA_GRAPH": "0",
                                   "GPURIG_PASS_GRAPHS": "0", "GPURIG_ASYNC_PROMPTS": "0",
                                   "GPURIG_PDL": "0", "GPURIG_KERNEL_AUTOTUNE": "0",
                                   "GPURIG_KERNEL_CACHE": "/tmp/k",
                                   "GPURIG_COMPILE_THREADS": "3"})  # fmt: skip
    assert opts == EngineOptions(fast="force", cuda_graph=False, pass_graphs=False,
                                 async_prompts=False, pdl=False, autotune=False,
                                 tuning_cache_dir=Path("/tmp/k"), compile_threads=3)  # fmt: skip
    assert EngineOptions.from_env({"GPURIG_FAST": "0"}).fast == "off"
    with pytest.raises(ValueError, match="fast"):
        EngineOptions(fast="sometimes")  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        opts.fast = "on"  # type: ignore[misc]  # frozen
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not EngineOptions().fast_on(cpu) and EngineOptions().fast_on(cuda)
    assert EngineOptions(fast="force").fast_on(cpu) and not EngineOptions(fast="off").fast_on(cuda)
    assert EngineOptions().graphs_on(cuda) and not EngineOptions(cuda_graph=False).graphs_on(cuda)
    assert not EngineOptions(fast="force").graphs_on(cpu)
    # prompt passes as graphs need the decode graphs
    bf16 = torch.bfloat16
    assert not EngineOptions(fast="force").pass_graphs_on(cpu, bf16)
    for off in ({"cuda_graph": False}, {"pass_graphs": False}, {"fast": "off"}):
        assert not EngineOptions(**off).pass_graphs_on(cuda, bf16), off


@pytest.mark.parametrize(
    ("device", "capability", "want"),
    [("cpu", None, torch.float32), ("cuda", (7, 5), torch.float16),  # Turing: bf16 emulated
     ("cuda", (6, 1), torch.float16), ("cuda", (8, 0), torch.bfloat16),
     ("cuda", (9, 0), torch.bfloat16)],
)  # fmt: skip
def test_default_dtype_follows_the_device_capability(device, capability, want) -> None:
    assert default_dtype(device, capability) == want


def test_the_backend_is_chosen_once_at_load(tmp_path, monkeypatch) -> None:
    """The options given to load decide the dispatch set and the decode step; the environment
    changed afterwards changes nothing."""
    import engine
    from engine.checkpoint_maker import make_checkpoint
    from engine.errors import EngineError
    from engine.fast.ops_fast import FastOps
    from engine.ops import Ops
    from engine.options import triton_interpreted

    make_checkpoint(tmp_path, preset="tiny", seed=1)
    ref = engine.load(tmp_path, device="cpu", max_context=64, options=EngineOptions(fast="off"))
    if not triton_interpreted():  # this file alone: tests/kernels/conftest.py sets it for the suite
        with pytest.raises(EngineError, match="TRITON_INTERPRET=1"):
            engine.load(tmp_path, device="cpu", max_context=64, options=EngineOptions(fast="force"))
        return
    fast = engine.load(tmp_path, device="cpu", max_context=64, options=EngineOptions(fast="force"))
    assert type(ref.model.ops) is Ops and isinstance(fast.model.ops, FastOps)
    # the runner's arrangement, chosen once: the fused batched step (one row included) or the
    # model's own rows
    assert not ref.runner.batched and fast.runner.batched
    monkeypatch.setenv("GPURIG_FAST", "0")
    assert fast.runner.batched and isinstance(fast.model.ops, FastOps)
    default = engine.load(tmp_path, device="cpu", max_context=64)
    assert default.options == EngineOptions() and default.dtype == torch.float32

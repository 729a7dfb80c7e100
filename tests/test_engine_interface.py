"""The engine's interface to its server (engine/interface.py): both engines implement
`ServedEngine` member for member (the in-process `Engine`, and the `EngineClient` of an engine in
its own process), engine/server reads nothing else of them (no probing, no stand-in config), and
the server's composition root (engine/server/main.py) starts as `python -m engine.server`,
refusing as `gpurig engine serve` does."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import time
from pathlib import Path

import pytest

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.interface import EngineFacts, ServedEngine
from engine.options import EngineOptions
from engine.process.client import EngineClient
from engine.runtime import Engine

ROOT = Path(__file__).resolve().parent.parent
MEMBERS = sorted(
    name
    for name, value in vars(ServedEngine).items()
    if not name.startswith("_") and (callable(value) or isinstance(value, property))
)
PROPERTIES = {n for n in MEMBERS if isinstance(vars(ServedEngine)[n], property)}
METHODS = [n for n in MEMBERS if n not in PROPERTIES]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("interface") / "tiny"
    make_checkpoint(path, preset="tiny", seed=2)
    return path


def _load(checkpoint: Path) -> Engine:
    return engine.load(checkpoint, device="cpu", max_context=128,
                       options=EngineOptions(fast="off"), warm_up=False)  # fmt: skip


@pytest.fixture(scope="module")
def eng(checkpoint):
    e = _load(checkpoint)
    yield e
    e.close()


def _shape(fn: object) -> tuple[bool, list[tuple[str, object, object]]]:
    """Whether `fn` is a coroutine function, and its parameters past self: (name, kind, default)."""
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    params = [(p.name, p.kind, p.default) for p in list(sig.parameters.values())[1:]]
    return inspect.iscoroutinefunction(fn), params


def test_the_protocol_is_what_the_server_needs() -> None:
    """Not vacuous: the members the server calls are there."""
    assert {"facts", "tokenizer", "has_work", "ended"} <= PROPERTIES
    assert {"add_request_async", "stats", "reset_stats", "start", "wake", "stop"} <= set(METHODS)


@pytest.mark.parametrize("cls", [Engine, EngineClient], ids=lambda c: c.__name__)
def test_both_engines_have_every_method_with_its_signature(cls: type) -> None:
    for name in METHODS:
        ours = getattr(cls, name, None)
        assert ours is not None, f"{cls.__name__} has no {name}"
        assert _shape(ours) == _shape(vars(ServedEngine)[name]), f"{cls.__name__}.{name}"


def test_the_client_has_every_property_on_its_class() -> None:
    for name in PROPERTIES:
        assert isinstance(getattr(EngineClient, name, None), property), name


def test_the_loaded_engine_is_a_served_engine_with_its_facts(eng: Engine) -> None:
    assert isinstance(eng, ServedEngine)
    for name in PROPERTIES:
        assert hasattr(eng, name), name
    facts = eng.facts
    assert isinstance(facts, EngineFacts)
    assert facts == EngineFacts(eng.model_dir, eng.model_name, 128, eng.config.vocab_size,
                                eng.bos_id, tuple(eng.eos_ids), eng.chat_template, "cpu")  # fmt: skip
    assert eng.ended is None
    with pytest.raises(AttributeError):
        facts.max_context = 1  # type: ignore[misc]  # frozen: one value for both engines


def test_the_in_process_engine_steps_itself_once_started(checkpoint: Path) -> None:
    """start/wake/stop: a request added from an event loop is stepped to its end by the
    engine's own thread, with nobody calling step; stop closes the engine."""
    eng = _load(checkpoint)
    import asyncio

    from engine.sampling import SamplingParams

    async def one() -> list[int]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[int]] = loop.create_future()
        tokens: list[int] = []

        def sink(_seq, out) -> None:
            tokens.extend(out.tokens)
            if out.finished or out.error is not None:
                loop.call_soon_threadsafe(done.set_result, tokens)

        await eng.add_request_async([2, 30, 40], SamplingParams(max_tokens=3, stop_ids=()), sink)
        return await asyncio.wait_for(done, 60)

    eng.start()
    try:
        assert len(asyncio.run(one())) == 3
        # the last token reaches the sink inside the thread's step: the step returns after it
        deadline = time.monotonic() + 10
        while eng.has_work and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not eng.has_work
    finally:
        eng.stop()
    with pytest.raises(engine.EngineError, match="closed"):
        eng.add_request([2, 30], SamplingParams(max_tokens=1))


def _server_sources() -> list[tuple[Path, ast.Module]]:
    return [
        (p, ast.parse(p.read_text())) for p in sorted((ROOT / "engine" / "server").glob("*.py"))
    ]


def _is_engine(node: ast.expr) -> bool:
    """`engine`, `eng`, `self.engine`, `state.engine`, ...: an expression naming the engine."""
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
    return name in ("engine", "eng")


def test_the_server_probes_no_engine_and_types_it() -> None:
    probes, untyped = [], []
    for path, tree in _server_sources():
        for node in ast.walk(tree):
            called = getattr(node.func, "id", None) if isinstance(node, ast.Call) else None
            if called == "getattr" and node.args and _is_engine(node.args[0]):
                probes.append(f"{path.name}:{node.lineno}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in node.args.args + node.args.kwonlyargs:
                    if a.arg in ("engine", "eng"):
                        note = ast.unparse(a.annotation) if a.annotation else "Any"
                        if "Any" in note:
                            untyped.append(f"{path.name}:{node.name}({a.arg}: {note})")
    assert probes == [] and untyped == []
    assert len(_server_sources()) > 10  # the scan saw the server, and would see a probe
    assert _is_engine(ast.parse("state.engine", mode="eval").body)


def test_no_stand_in_config_and_no_probe_in_the_chat_format() -> None:
    for sub in ("server", "process"):
        for path in (ROOT / "engine" / sub).glob("*.py"):
            assert "SimpleNamespace" not in path.read_text(), path
    render = ast.parse((ROOT / "engine" / "chat" / "render.py").read_text())
    calls = [n for n in ast.walk(render) if isinstance(n, ast.Call)]
    assert calls and not [n for n in calls if getattr(n.func, "id", None) == "getattr"]


def test_the_server_imports_neither_tools_nor_the_front_doors() -> None:
    for path, tree in _server_sources():
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not [n for n in names if n.split(".")[0] in ("tools", "mcp_server")], path


def test_python_m_engine_server_refuses_as_the_cli_does(tmp_path, run_gpurig) -> None:
    """The same words and exit code from both doors, flags named as flags."""
    for args, words in (
        (["--model", str(tmp_path / "nope")], "is not a directory"),
        (["--model", str(tmp_path), "--max-context", "0"], "--max-context 0 must be at least 1"),
    ):
        direct = subprocess.run([sys.executable, "-m", "engine.server", *args], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        cli = run_gpurig("engine", "serve", *args)
        assert direct.returncode == cli.returncode == 2, direct.stderr
        assert words in direct.stderr and direct.stderr == cli.stderr
        assert direct.stderr.startswith("gpurig: error: ") and "gpurig: what to do: " in cli.stderr
    usage = subprocess.run([sys.executable, "-m", "engine.server"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert usage.returncode == 2 and "--model" in usage.stderr


def test_the_serving_tools_launch_python_m_engine_server() -> None:
    from tools.serving.command import engine_command

    cmd = engine_command("/py", "/m", "127.0.0.1", 8100, 4096, "cpu", ["--no-warmup"])
    assert cmd[:5] == ["/py", "-m", "engine.server", "--model", "/m"]
    assert cmd[-1] == "--no-warmup" and "--max-context" in cmd


def test_importing_the_composition_root_is_light() -> None:
    """The spawned engine process imports it again (as its parent's main module): no torch, no
    web framework behind it."""
    probe = (
        "import sys, engine.server.main, mcp_server.cli_engine_serve\n"
        "print(sorted(m for m in ('torch', 'starlette', 'uvicorn') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

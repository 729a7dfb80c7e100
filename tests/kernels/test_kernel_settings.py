"""No setting lives in a module global of engine/kernels; the engine's tuning settings reach the
kernels it launches, whichever thread steps it.

Why: tuning._SETTINGS and launch._CARVEOUT were process-wide dicts and lists set at load, so two
engines in one process (a test run, the lab's A/B) silently shared the last one's choice. The
settings are now a frozen TuningSettings the engine's runner owns and puts in force (a
ContextVar) around each call that launches kernels (engine/kernels/tuning.py).
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.kernels import tuning
from engine.options import EngineOptions
from engine.sampling import SamplingParams

KERNELS = Path(__file__).resolve().parents[2] / "engine" / "kernels"
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "bytearray"}
MUTABLE_NODES = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, MUTABLE_NODES):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        return name in MUTABLE_CALLS
    return False


def module_settings(source: str) -> list[str]:
    """What a module holds that could be a setting: a module-level mutable container whose name
    does not say cache/memo (a memo of computed results), and any `global` statement."""
    found = []
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if not _mutable(value):
            continue
        for target in targets:
            name = ast.unparse(target)
            if not any(word in name.lower() for word in ("cache", "memo")):
                found.append(f"line {node.lineno}: {name} = {ast.unparse(value)[:40]}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"line {node.lineno}: global {', '.join(node.names)}")
    return found


def test_the_scan_finds_a_setting_a_global_and_spares_memos_locks_and_contextvars() -> None:
    source = (
        "import threading\nfrom contextvars import ContextVar\n"
        "_SETTINGS = {'autotune': True}\n_CARVEOUT: list[int | None] = [None]\n"
        "_TABLE_CACHE: dict = {}\n_STAND_IN_MEMO = dict()\nSHAPES = ((1, 2),)\n"
        "_LOCK = threading.Lock()\n_ON: ContextVar[bool] = ContextVar('on', default=False)\n"
        "def turn(v):\n    global _ON\n    _ON = v\n"
    )
    found = module_settings(source)
    assert [f.split(":")[1].split()[0] for f in found] == ["_SETTINGS", "_CARVEOUT", "global"]


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_no_kernel_module_holds_a_setting_in_a_module_global(path: Path) -> None:
    assert module_settings(path.read_text()) == [], path.name


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kernel_settings") / "tiny"
    make_checkpoint(path, preset="tiny", seed=3)
    return path


def test_the_engines_tuning_settings_are_in_force_on_the_thread_that_steps_it(
    tiny, tmp_path
) -> None:
    """Loaded with autotune off and its own cache directory, the engine's steps see those
    settings on a worker thread (as the server's engine loop steps it), and nothing outside
    the engine does: two engines in one process keep their own."""
    options = EngineOptions(fast="off", autotune=False, tuning_cache_dir=tmp_path)
    eng = engine.load(tiny, device="cpu", max_context=64, options=options, warm_up=False)
    seen: list[tuning.TuningSettings] = []
    step = eng.runner._step

    def noting(*args):
        seen.append(tuning.current())
        return step(*args)

    eng.runner._step = noting
    try:
        worker = threading.Thread(
            target=lambda: eng.generate([2, 40, 41], SamplingParams(max_tokens=3, stop_ids=()))
        )
        worker.start()
        worker.join(60)
        assert not worker.is_alive()
    finally:
        eng.close()
    assert len(seen) == 3
    assert set(seen) == {tuning.TuningSettings(autotune=False, cache_dir=tmp_path)}
    assert tuning.current() == tuning.TuningSettings()  # this thread: the defaults
    assert tuning.autotune_enabled() and tuning.cache_dir() != tmp_path

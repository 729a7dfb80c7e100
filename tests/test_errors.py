"""One error hierarchy (engine/errors.py, re-exported by tools/errors.py) understood by every
front door: the CLI (exit 2, message and what to do), the MCP server (the tool's error result)
and the engine's OpenAI server (400 for the caller's mistakes, 500 for the rest), with no code
translating the engine's errors into the tools' on the way.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from mcp.client import Client

import engine.errors as engine_errors
import tools.errors as tools_errors
from engine.errors import (
    CheckpointError,
    ContextLengthError,
    EngineError,
    GenerationError,
    GpurigError,
    InvalidInputError,
    NotFoundError,
    RefusedError,
)
from engine.memory import PromptMemoryError
from mcp_server.mcp_base import GpurigMCP
from mcp_server.wording import rendered

ROOT = Path(__file__).resolve().parent.parent


def test_one_hierarchy() -> None:
    """tools.errors is the engine's hierarchy, not a copy; each engine error is a GpurigError of
    the category that fits it."""
    for name in ("GpurigError", "InvalidInputError", "NotFoundError", "RefusedError",
                 "EngineError", "CheckpointError", "arg", "plain"):  # fmt: skip
        assert getattr(tools_errors, name) is getattr(engine_errors, name), name
    # the front doors' words are the front doors': the engine holds only the neutral placeholder
    for name in ("CLI_FLAGS", "cli_flag", "render_for", "either"):
        assert not hasattr(engine_errors, name), name
    cases = [
        (CheckpointError("no config.json", "restore it"), NotFoundError, "not_found"),
        (ContextLengthError(requested=9000, limit=8192), RefusedError, "refused"),
        (
            GenerationError("the prompt is empty", "pass a token"),
            InvalidInputError,
            "invalid_input",
        ),
        (PromptMemoryError(9000, 4000, 100 << 20, 200 << 20), EngineError, "failed"),
        (EngineError("another generation started", "one at a time"), GpurigError, "failed"),
    ]
    for err, kind, category in cases:
        assert isinstance(err, kind) and isinstance(err, EngineError)
        assert err.category == category, type(err).__name__
        assert err.remedy and str(err) == f"{err.message} -> {err.remedy}"


def test_engine_errors_render_like_the_tools() -> None:
    err = ContextLengthError(requested=9000, limit=8192)
    assert rendered(err, "mcp") == rendered(err, "cli") == (err.message, err.remedy)
    assert "9000" in err.message and "8192" in err.message


def test_no_translation_between_hierarchies() -> None:
    """No front door or tool catches an engine error to re-raise it as another class: an
    EngineError already is a GpurigError, which every front door handles."""
    engine_names = {"EngineError", "CheckpointError", "ContextLengthError", "GenerationError"}
    offenders = []
    for path in [*ROOT.glob("mcp_server/*.py"), *ROOT.glob("tools/**/*.py")]:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                names = {n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node.type) if isinstance(n, ast.Attribute)}
                if names & engine_names:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


# --- the front doors --------------------------------------------------------------------------


def _no_checkpoint(tmp_path: Path) -> Path:
    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    return empty


def test_cli_shows_an_engine_error_and_exits_2(tmp_path: Path) -> None:
    """`gpurig engine serve` on a directory with no config.json: the engine's CheckpointError
    reaches main() as is; message and remedy, exit 2, no traceback, and torch never imported."""
    code = (
        "import sys, json\n"
        "from mcp_server.cli import main\n"
        "rc = main(['engine', 'serve', '--model', sys.argv[1], '--port', '1'])\n"
        "print(json.dumps([rc, 'torch' in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(_no_checkpoint(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    rc, torch_loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert rc == 2, done.stderr
    assert "gpurig: error: " in done.stderr and "config.json" in done.stderr
    assert "gpurig: what to do: " in done.stderr
    assert "Traceback" not in done.stderr
    assert torch_loaded is False


def test_mcp_shows_an_engine_error_as_the_tools_error(tmp_path: Path) -> None:
    """A tool that lets the engine's CheckpointError propagate: the caller gets its message and
    remedy as the error result, like any tool's GpurigError."""
    from engine.config import load_config

    mcp = GpurigMCP("engine-error-test")

    @mcp.tool()
    def context_of(model_dir: str) -> int:
        """The checkpoint's max_position_embeddings (raises the engine's own errors)."""
        return load_config(Path(model_dir)).max_position_embeddings

    async def call():
        async with Client(mcp) as client:
            return await client.call_tool("context_of", {"model_dir": str(tmp_path)})

    result = anyio.run(call)
    assert result.is_error
    text = result.content[0].text
    assert "config.json" in text and " What to do: " in text
    expected = CheckpointError("x")
    try:
        load_config(tmp_path)
    except CheckpointError as err:
        expected = err
    assert expected.message[:40] in text and (expected.remedy or "")[:20] in text


@pytest.mark.parametrize(
    ("err", "status", "code"),
    [
        (GenerationError("the prompt is empty", "pass a token"), 400, None),
        (ContextLengthError(requested=9000, limit=8192), 400, "context_length_exceeded"),
        (PromptMemoryError(9000, 4000, 100 << 20, 200 << 20), 500, None),
        (EngineError("another generation started", "one at a time"), 500, None),
        (RuntimeError("a bug"), 500, None),
    ],
)
def test_engine_server_maps_the_category_to_a_status(err, status, code) -> None:
    from engine.server.errors import engine_error_to_api

    api = engine_error_to_api(err)
    assert api.status == status
    assert api.body.error.code == code
    assert (api.body.error.type == "server_error") == (status == 500)


# --- cheap to import --------------------------------------------------------------------------


def test_errors_and_the_help_import_no_torch() -> None:
    """The hierarchy lives in engine/, whose package must stay lazy about torch: `gpurig --help`
    (and every tool that imports tools.errors) must not pay torch's seconds."""
    code = (
        "import sys, json, contextlib, io\n"
        "import tools.errors\n"
        "after_errors = 'torch' in sys.modules\n"
        "from mcp_server.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "print(json.dumps([after_errors, sorted(m for m in sys.modules\n"
        "                  if m.split('.')[0] in ('torch', 'triton', 'transformers'))]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    after_errors, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    assert after_errors is False
    assert heavy == []

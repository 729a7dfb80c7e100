"""Every repo path a docstring or comment of the product names exists (issue 51, item 6).

Why: the code's prose is where a maintainer learns where the rest lives ("the figure:
docs/engine-findings.md", "tests/test_x.py checks it"); a path that moved or was deleted sends
them to nothing, and nobody notices, since no code runs it. A repo path here is one that starts
with a top-level folder of the repo (engine/, tools/, mcp_server/, bench/, patches/, lab/,
docs/, tests/, .ci/) and is not the tail of another path (GPURIG_HOME/..., ~/.cache/..., a
checkpoint's files). A `<placeholder>` or glob part ends what is checked: the prefix before it
must exist. A module may be named without its .py (tools/host); MCP's JSON-RPC methods
(tools/call, tools/list) only look like paths.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "tools", "mcp_server", "bench", "patches")
TOP = ("engine", "tools", "mcp_server", "bench", "patches", "lab", "docs", "tests", r"\.ci")
# a top-level folder, then path characters; not inside a longer path, a word or a dotted name
PATH = re.compile(rf"(?<![\w./~$-])(?:{'|'.join(TOP)})/[\w./<>*{{}}\[\]?-]*")
WILD = re.compile(r"[<>*{}\[\]?]")
MCP_METHODS = {"tools/call", "tools/list"}


def repo_paths(text: str) -> list[tuple[int, str]]:
    """(line offset in `text`, the part of the path that must exist) of each repo path named."""
    found = []
    for m in PATH.finditer(text):
        path = m.group(0)
        if (wild := WILD.search(path)) is not None:
            path = path[: wild.start()].rpartition("/")[0] + "/"
        path = path.rstrip(".-")  # the sentence's full stop, an en-dash written as "-"
        found.append((text.count("\n", 0, m.start()), path))
    return found


def _prose(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every docstring (any bare string statement) and comment."""
    out = [
        (node.lineno, node.value.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def named_paths() -> list[tuple[str, str]]:
    """("file:line", path) of every repo path the product's docstrings and comments name."""
    return [
        (f"{py.relative_to(ROOT).as_posix()}:{line + offset}", path)
        for package in PRODUCT
        for py in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in py.parts
        for line, text in _prose(py.read_text())
        for offset, path in repo_paths(text)
    ]


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("see engine/kernels/tuning.py.", ["engine/kernels/tuning.py"]),
        ("(bench/sweep/, lab/journal.md v12)", ["bench/sweep/", "lab/journal.md"]),
        ("run .ci/run; tests/test_x.py::test_y", [".ci/run", "tests/test_x.py"]),
        ("engine/chat/*.jinja and docs/<page>.md", ["engine/chat/", "docs/"]),
        ("GPURIG_HOME/tools/x, ~/.cache/engine/y, $HOME/lab/z, ckpt/tests/a", []),
        ("engine.kernels.tuning, tokens/s, subtools/x", []),
    ],
)
def test_what_counts_as_a_repo_path(text: str, want: list[str]) -> None:
    assert [path for _, path in repo_paths(text)] == want


def test_the_scan_reads_docstrings_and_comments() -> None:
    source = '"""Top: engine/a.py."""\nx = 1  # tools/b.py\ndef f():\n    """bench/c/"""\n'
    found = [(line + offset, path) for line, text in _prose(source)
             for offset, path in repo_paths(text)]  # fmt: skip
    assert sorted(found) == [(1, "engine/a.py"), (2, "tools/b.py"), (4, "bench/c/")]
    assert len(named_paths()) > 50  # the product names many: the walk is not vacuous


def _exists(path: str) -> bool:
    return path in MCP_METHODS or (ROOT / path).exists() or (ROOT / f"{path}.py").is_file()


def test_every_repo_path_named_in_the_product_exists() -> None:
    stale = [f"{where}: {path}" for where, path in named_paths() if not _exists(path)]
    assert stale == [], "\n".join(stale)

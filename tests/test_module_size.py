"""No Python module of the project over 500 lines (issue 51, item 6): product, tests and lab alike.

Why a limit at all: a module past a few hundred lines has grown a second job, and splitting it
along that job is cheaper while it is young. The lab is held to it too, since its instruments
are read (and copied from) as often as the product.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("engine", "tools", "mcp_server", "bench", "patches", "lab", "tests", ".ci")
LIMIT = 500


def _modules() -> dict[str, int]:
    """{repo-relative path: line count} of every .py file under the project's folders."""
    return {
        p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
        for folder in FOLDERS
        for p in sorted((ROOT / folder).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def test_the_walk_sees_every_folder() -> None:
    """Not vacuous: each kind of module is counted, this file among them."""
    seen = _modules()
    assert "tests/test_module_size.py" in seen
    for folder in ("engine", "tools", "mcp_server", "bench", "patches", "lab"):
        assert any(path.startswith(folder + "/") for path in seen), folder


def test_no_module_over_500_lines() -> None:
    long = {path: n for path, n in _modules().items() if n > LIMIT}
    assert long == {}, "split these along their second job: " + ", ".join(
        f"{path} ({n})" for path, n in sorted(long.items())
    )

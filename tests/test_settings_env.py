"""Every GPURIG_* variable is declared in engine/env.py and read through it, nowhere else.

Why: the variables used to be read by a dozen modules, so nobody could list what changes
gpurig's behaviour, and switches outlived the code they steered. Two scans of the product
packages (engine/, tools/, bench/, patches/, mcp_server/): no module but engine/env.py reads a
GPURIG_* key from a mapping (os.environ, os.getenv, or an alias of it), whether the key is
written out or held in a module constant; and every GPURIG_* name the product mentions (code,
docstrings, help texts) is one engine/env.py declares, so none names a variable that is gone.
The probes' stdout markers are not variables.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from engine import env

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engine", "tools", "bench", "patches", "mcp_server")
READER = ROOT / "engine" / "env.py"
# printed on stdout by the probes for their callers to find: not environment variables
MARKERS = {"GPURIG_PROBE_START", "GPURIG_PROBE_RESULT", "GPURIG_BANDWIDTH"}
NAME = re.compile(r"\bGPURIG_[A-Z0-9][A-Z0-9_]*")


def product_modules() -> list[Path]:
    return sorted(p for top in PRODUCT for p in (ROOT / top).rglob("*.py"))


def _gpurig(value: object) -> bool:
    return isinstance(value, str) and value.startswith("GPURIG_")


def constants(trees: list[ast.Module]) -> set[str]:
    """The names of module-level constants holding a GPURIG_* name, in any product module (a
    constant may be imported into the module that reads it)."""
    found = set()
    for tree in trees:
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(
                node.value, ast.Constant
            ):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if _gpurig(node.value.value):
                    found |= {t.id for t in targets if isinstance(t, ast.Name)}
    return found


def env_reads(tree: ast.Module, held: set[str]) -> list[str]:
    """Each place a GPURIG_* key is read from a mapping: `X.get(K)`, `X[K]`, `K in X`,
    `os.getenv(K)`, `X.pop(K)` / `X.setdefault(K)`, K a literal or a constant in `held`."""

    def key(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return _gpurig(node.value)
        if isinstance(node, ast.Name):
            return node.id in held
        if isinstance(node, ast.Attribute):
            return node.attr in held
        return False

    found = []
    for node in ast.walk(tree):
        hit = False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            hit = node.func.attr in ("get", "getenv", "pop", "setdefault") and key(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            hit = key(node.slice)
        elif isinstance(node, ast.Compare) and any(
            isinstance(op, ast.In | ast.NotIn) for op in node.ops
        ):
            hit = key(node.left)
        if hit:
            found.append(f"line {node.lineno}: {ast.unparse(node)[:70]}")
    return found


def test_the_scan_finds_reads_by_literal_constant_and_alias() -> None:
    source = (
        "import os\nfrom os import environ\nKEY = 'GPURIG_HOME'\n"
        "a = os.environ.get('GPURIG_PYTHON')\nb = os.getenv(KEY)\nc = environ[KEY]\n"
        "d = 'GPURIG_FAST' in os.environ\nchild = {**os.environ, 'GPURIG_HOME': '/x'}\n"
        "child['GPURIG_FAST'] = '0'\ne = os.environ.get('HOME')\n"
    )
    tree = ast.parse(source)
    found = env_reads(tree, constants([tree]))
    assert [f.split(":")[0] for f in found] == ["line 4", "line 5", "line 6", "line 7"]


@pytest.fixture(scope="module")
def parsed() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in product_modules()}


def test_no_product_module_but_engine_env_reads_a_gpurig_variable(parsed) -> None:
    held = constants(list(parsed.values()))
    offenders = {
        str(path.relative_to(ROOT)): reads
        for path, tree in parsed.items()
        if path != READER and (reads := env_reads(tree, held))
    }
    assert offenders == {}


def test_every_gpurig_name_the_product_mentions_is_declared() -> None:
    unknown: dict[str, set[str]] = {}
    for path in product_modules():
        names = set(NAME.findall(path.read_text())) - set(env.VARIABLES) - MARKERS
        if names:
            unknown[str(path.relative_to(ROOT))] = names
    assert unknown == {}


def test_every_declared_variable_is_named_by_the_product() -> None:
    """A declared variable no product module names would be a switch that outlived its code."""
    mentioned: set[str] = set()
    for path in product_modules():
        if path != READER:
            mentioned |= set(NAME.findall(path.read_text()))
    tests_only = {"GPURIG_TEST_WHEELS"}  # read by tests/ (the Turing-patch network tests)
    assert set(env.VARIABLES) - tests_only <= mentioned

"""The whole project's seams (issue 23, item 6), checked on the source.

Dependencies point down: mcp_server -> tools, patches, bench, engine; tools, bench and patches
never import mcp_server; the engine imports none of the others. No import cycle, within a
package or across them (a function-level import counts: it is a dependency all the same; so
does one under `if TYPE_CHECKING:`, as the two modules cannot be understood apart), and no
private name (`_name`) is imported or reached from another module: a name another module needs
is public, or lives with its user. The `gpurig engine serve` options are defined once, in
engine/serve_options.py, and both the CLI's flags and the serving tools' list of them come from
there.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from architecture_support import all_cycles, find_cycle

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "tools", "mcp_server", "bench", "patches")
MODULES = {
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
    for package in PACKAGES
    for p in sorted((ROOT / package).rglob("*.py"))
}


def _resolve(name: str, path: Path, node: ast.ImportFrom) -> str:
    base = node.module or ""
    if node.level:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
    return base


def _module_of(dotted: str) -> str | None:
    """The project module `dotted` is or lies in (engine.kernels.w4gemm.workspace ->
    engine.kernels.w4gemm), or None outside the project."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _scan(name: str, path: Path) -> tuple[set[str], set[str]]:
    """(the project modules `name` imports, the private names it takes from other modules: as
    `module._name`)."""
    imported: set[str] = set()
    private: set[str] = set()
    aliases: dict[str, str] = {}  # a local name bound to a project module
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (target := _module_of(a.name)) is None:
                    continue
                imported.add(target)
                aliases[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
                hidden = [
                    part
                    for part in a.name.split(".")
                    if part.startswith("_") and not part.startswith("__")
                ]
                if hidden:
                    private.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path, node)
            if _module_of(base) is None:
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in MODULES:
                    imported.add(full)
                    aliases[a.asname or a.name] = full
                else:
                    imported.add(_module_of(base) or base)
                if a.name.startswith("_") and not a.name.startswith("__"):
                    private.add(full)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                private.add(".".join([aliases[value.id], *reversed(chain)]))
    return imported - {name}, {p for p in private if _module_of(p) != name}  # fmt: skip


SCANS = {name: _scan(name, path) for name, path in MODULES.items()}
GRAPH = {name: imports for name, (imports, _) in SCANS.items()}


def _package(module: str) -> str:
    return module.split(".")[0]


def test_the_walk_sees_real_imports(tmp_path: Path) -> None:
    """Not vacuous: known edges, function-level ones included, and a known private import."""
    assert "engine.kernels.w4gemm_kernel" in GRAPH["engine.kernels.w4gemm"]
    assert "engine.serve_options" in GRAPH["tools.serving.lifecycle"]
    assert "mcp_server.wording" in GRAPH["mcp_server.output"]
    assert "tools.turing" in GRAPH["tools.serving.lifecycle"]  # imported inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    two = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}}
    assert all_cycles(two) == ["a -> b -> a", "c -> d -> c"] and two["b"] == {"a", "c"}
    probe = tmp_path / "probe.py"
    probe.write_text("from engine.attention import _x\nimport tools.gpu as g\ny = g._hidden\n")
    _, private = _scan("tools.probe", probe)
    assert private == {"engine.attention._x", "tools.gpu._hidden"}
    # an import only a type checker runs is an edge too
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import engine.ops\n")
    imported, _ = _scan("tools.probe", probe)
    assert imported == {"engine.ops"}


def test_no_import_cycle_in_the_project() -> None:
    """Across the five packages as within each (tools <-> bench would be one)."""
    assert all_cycles(GRAPH) == []


def test_dependencies_point_down() -> None:
    """tools, bench and patches never import mcp_server; the engine imports none of the others."""
    above = {
        "tools": {"mcp_server"},
        "bench": {"mcp_server"},
        "patches": {"mcp_server"},
        "engine": {"tools", "bench", "patches", "mcp_server"},
    }
    wrong = {
        (name, dep)
        for name, deps in GRAPH.items()
        for dep in deps
        if _package(dep) in above.get(_package(name), set())
    }
    assert wrong == set()


def test_no_private_name_imported_across_modules() -> None:
    found = {(name, p) for name, (_, private) in SCANS.items() for p in private}
    assert found == set()


def test_the_engine_serve_options_are_defined_once() -> None:
    """The CLI's `engine serve` flags, dests and defaults are engine/serve_options.py's; the
    serving tools take the accepted flags and the flags of the command they build from it;
    nobody builds those flags by hand or walks the CLI's parser."""
    from engine import serve_options
    from mcp_server.cli import build_parser
    from tools.serving import command

    parser = build_parser()
    serve = parser.parse_args(["engine", "serve", "--model", "m"])._parser
    actions = [a for a in serve._actions if a.dest not in ("help",)]
    assert {f for a in actions for f in a.option_strings} == serve_options.flags()
    by_dest = {a.dest: a for a in actions}
    for option in serve_options.OPTIONS:
        action = by_dest[option.name]
        assert tuple(action.option_strings) == option.flags
        assert action.default == (False if option.switch else option.default), option.name
        assert action.required == option.required, option.name
    built = command.engine_command("python3", "m", "127.0.0.1", 8100, 4096, "cpu", [])
    assert {a for a in built if a.startswith("--")} <= serve_options.flags()

    cli = ast.parse((ROOT / "engine" / "server" / "main.py").read_text())  # builds the flags
    by_hand = [
        node.lineno
        for node in ast.walk(cli)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", None) == "add_argument"
        and any(isinstance(a, ast.Constant) and str(a.value).startswith("-") for a in node.args)
    ]
    assert by_hand == []
    for path in (ROOT / "tools").rglob("*.py"):
        text = path.read_text()
        assert "build_parser" not in text and "_group_actions" not in text, path


def test_the_serve_options_module_is_light() -> None:
    """No web framework and no torch behind `import engine.serve_options` (the serving tools
    and `gpurig --help` import it)."""
    probe = (
        "import sys, engine.serve_options\n"
        "print(sorted(m for m in ('starlette', 'uvicorn', 'fastapi', 'torch', 'httpx')"
        " if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

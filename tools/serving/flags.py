"""Which `vllm serve` flags the installed vLLM accepts, so a typo fails in a second, not after
vLLM has spent a minute importing torch and then printed "unrecognized arguments".

The truth is the version's own parser: `vllm serve --help=all` (0.10+ hides most flags behind
`=all`; plain `--help` first lists them all in older releases) under the serving interpreter,
parsed for `--flag` words and cached per vLLM version under state_dir()/vllm-flags/. Where that
cannot run (no CUDA torch, so `import vllm` fails), the flags are read statically from the
installed source: every `add_argument("--x", ...)` in vllm/engine/arg_utils.py and the
entrypoints' cli_args.py, plus the dataclass fields of the *FrontendArgs classes, which vLLM
turns into `--field-name` flags. Booleans there become argparse.BooleanOptionalAction, so the
static set also accepts `--no-<flag>` (a superset: it never rejects a real flag).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from tools.fileio import write_atomic
from tools.settings import state_dir

HELP_TIMEOUT_S = 180
_FLAG_IN_HELP = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*(?:\.[a-z0-9_-]+)*)")
_FLAG_LITERAL = re.compile(r"^--?[A-Za-z0-9][A-Za-z0-9_-]*$")


class FlagSet(BaseModel):
    version: str
    source: Literal["help", "static", "none"] = Field(
        description="help: the version's own --help; static: read from its source; none: unknown"
    )
    flags: list[str] = Field(default_factory=list)
    note: str | None = None


def normalize(token: str) -> str | None:
    """`--max_model_len=8` -> `--max-model-len`; `--compilation-config.mode` -> its base flag
    (vLLM's FlexibleArgumentParser accepts underscores and dotted sub-keys). None: not a flag."""
    if not token.startswith("-") or token in ("-", "--") or re.match(r"^-\d", token):
        return None
    name = token.split("=", 1)[0]
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
        name = name.split(".", 1)[0]
    return name


def unknown_flags(args: list[str], flags: FlagSet) -> list[str]:
    """The flags in `args` that this vLLM does not accept (empty when the set is unknown)."""
    if flags.source == "none":
        return []
    known = set(flags.flags)
    bad: list[str] = []
    for token in args:
        name = normalize(token)
        if name is None or name in known:
            continue
        if flags.source == "static" and name.startswith("--no-") and "--" + name[5:] in known:
            continue
        bad.append(token)
    return bad


def closest(flag: str, flags: FlagSet) -> str | None:
    import difflib

    name = normalize(flag) or flag
    found = difflib.get_close_matches(name, flags.flags, n=1, cutoff=0.7)
    return found[0] if found else None


# ---------------------------------------------------------------------------------------------
# Reading the flags


def flags_from_help(text: str) -> list[str]:
    return sorted({m.group(1).split(".", 1)[0] for m in _FLAG_IN_HELP.finditer(text)})


def _literal_flags(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            for arg in node.args:
                literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                if literal and _FLAG_LITERAL.match(arg.value):
                    out.add(arg.value)
    return out


def _frontend_fields(tree: ast.AST) -> set[str]:
    """Fields of `class *FrontendArgs`: vLLM adds each as `--{name.replace('_', '-')}`."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name.endswith("FrontendArgs"):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    name = item.target.id
                    if not name.startswith("_"):
                        out.add("--" + name.replace("_", "-"))
    return out


def flags_from_source(package_dir: Path) -> list[str]:
    """Static reading of a vLLM package folder (installed, or unpacked from a wheel)."""
    files = [package_dir / "engine" / "arg_utils.py"]
    files += sorted((package_dir / "entrypoints").glob("**/cli_args.py"))
    found: set[str] = set()
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        found |= _literal_flags(tree) | _frontend_fields(tree)
    return sorted(found)


def _cache_path(version: str) -> Path:
    return state_dir() / "vllm-flags" / f"{re.sub(r'[^A-Za-z0-9.+_-]', '_', version)}.json"


def _run_help(launcher: list[str], env: dict[str, str]) -> tuple[list[str], str | None]:
    why: str | None = None
    for variant in ("--help=all", "--help"):
        try:
            proc = subprocess.run(
                [*launcher, variant],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=HELP_TIMEOUT_S,
                env=env,
                cwd="/",
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return [], f"`vllm serve --help` did not run: {exc}"
        found = flags_from_help(proc.stdout)
        if proc.returncode == 0 and "--port" in found and "--max-model-len" in found:
            return found, None
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        why = f"`vllm serve {variant}` exited {proc.returncode}: {last[0][:200]}"
    return [], why


def accepted_flags(
    version: str, launcher: list[str], package_dir: Path | None, env: dict[str, str]
) -> FlagSet:
    """The flags of this vLLM version: cached --help, else --help now (cached), else static."""
    cache = _cache_path(version)
    try:
        cached = FlagSet.model_validate_json(cache.read_text())
        if cached.source == "help" and cached.flags:
            return cached
    except (OSError, ValueError):
        pass
    found, why = _run_help(launcher, env)
    if found:
        result = FlagSet(version=version, source="help", flags=found)
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cache, json.dumps(result.model_dump(), indent=1) + "\n", mode=0o644)
        return result
    if package_dir is not None:
        static = flags_from_source(package_dir)
        if "--max-model-len" in static:
            return FlagSet(
                version=version,
                source="static",
                flags=static,
                note=f"read from vLLM's source ({why})",
            )
    return FlagSet(version=version, source="none", note=why or "no way to read vLLM's flags")


# ---------------------------------------------------------------------------------------------
# Tool calling

# vLLM's tool parser per model family (vllm/tool_parsers/__init__.py names them); Gemma 4 writes
# `<|tool_call>call:NAME{...}<tool_call|>`, which only its own parser reads
TOOL_PARSERS = {"gemma4": "gemma4"}
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser")


def model_family(model: str, local: str | None) -> str | None:
    """`gemma4` for a Gemma 4 checkpoint: its config.json's model_type (or the text config's),
    else, for a hub id, its name."""
    if local:
        try:
            config = json.loads((Path(local) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
        types = [config.get("model_type"), (config.get("text_config") or {}).get("model_type")]
        if any(str(t).startswith("gemma4") for t in types if t):
            return "gemma4"
    name = model.lower().replace("_", "-")
    return "gemma4" if "gemma-4" in name or "gemma4" in name else None


def parser_known(package_dir: Path | None, parser: str) -> bool:
    """Whether this vLLM ships the parser (its registry names it); true where it cannot be read."""
    registry = package_dir / "tool_parsers" / "__init__.py" if package_dir else None
    try:
        return registry is None or f'"{parser}"' in registry.read_text(encoding="utf-8")
    except OSError:
        return True


def tool_call_flags(
    model: str,
    local: str | None,
    extra_args: list[str],
    accepted: FlagSet,
    package_dir: Path | None,
) -> list[str]:
    """`--enable-auto-tool-choice --tool-call-parser gemma4` for a Gemma 4 model, so that
    `tools` in a chat request come back as `tool_calls` (without them vLLM refuses
    tool_choice=auto, the OpenAI default a client sends with tools). None where the user set
    either flag in extra_args, the version lacks them, or it does not ship the parser."""
    family = model_family(model, local)
    parser = TOOL_PARSERS.get(family or "")
    if parser is None or any(normalize(a) in TOOL_FLAGS for a in extra_args):
        return []
    if accepted.source != "none" and not all(f in accepted.flags for f in TOOL_FLAGS):
        return []
    if not parser_known(package_dir, parser):
        return []
    return ["--enable-auto-tool-choice", "--tool-call-parser", parser]

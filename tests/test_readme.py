"""README's and docs/*.md's commands, run as a new user runs them: every `gpurig ...` line of their
```bash blocks and every ```python block, on a tiny checkpoint, on the CPU, in a fresh directory;
and the shape of those pages (each heading once, README and the findings page short, every
relative link pointing at a file).

The convention (for whoever adds a section to README or a docs page):
- Each command of a ```bash block (lines joined at a trailing backslash, split at `&&`, `;`
  and `|`) that starts with `gpurig` is run by `test_readme_commands_run`, README's first, then
  each docs page's in the order of the pages' names, in one temporary directory (so the `ckpt/`
  README's tour makes is there for the pages' commands), with CUDA_VISIBLE_DEVICES="" and
  GPURIG_HOME inside that directory. It must exit 0, or a code listed in EXIT_CODES, and print no
  traceback. Write commands that run here as they are.
- A command that cannot run here (it needs a GPU, vLLM, the network, or it is a long-running
  server or demo) gets an entry in NOT_RUN_HERE: the command's leading words -> why, naming the
  test that covers it instead. A command that is neither run nor listed fails the test; an entry
  that matches no command in README or docs fails too (stale).
- ```python blocks are run the same way after the commands, each in a fresh interpreter; one that
  cannot run here goes in PYTHON_NOT_RUN_HERE (its first line -> why).
- Other languages (```text output, ```json config) are not run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]  # the order the commands run in
README_MAX_LINES = 300
FINDINGS = ROOT / "docs" / "engine-findings.md"
FINDINGS_MAX_LINES = 400

# Leading words of a README command -> why this file does not run it, and where it is tested.
# A `tests/FILE.py` or `tests/FILE.py::test_name` named in a reason must exist.
NOT_RUN_HERE: dict[str, str] = {
    "gpurig engine serve": "a long-running server; tests/test_server_api.py and "
    "tests/test_server_hardening.py start it on a free port",
    "gpurig demo": "starts the engine and its peers and sweeps them (75 s); its function runs on "
    "a smaller plan in tests/test_sweep_e2e.py::test_demo_starts_and_stops_its_servers and "
    "tests/test_sweep_e2e.py::test_demo_adds_llamacpp_where_it_is_built",
    "gpurig up": "starts a server that outlives the command (vLLM on a GPU, or the engine); "
    "tests/test_bring_up.py::test_the_cli_with_the_short_sweep runs `gpurig up --backend engine "
    "--sweep` on a tiny checkpoint and reuses the server the module brought up",
    "gpurig sweep run --target": "needs servers on ports 8000/8100 and /models/e2b-w4a16; "
    "tests/test_sweep_e2e.py::test_two_engines_same_prompts_every_cell sweeps real servers",
    "gpurig sweep run --serve": "starts vLLM (a GPU) on /models checkpoints; the engine-served "
    "path runs in tests/test_sweep_e2e.py::test_demo_starts_and_stops_its_servers",
    "gpurig sweep status": "needs the id of an earlier sweep; "
    "tests/test_sweep_units.py::test_cli_refuses_bad_targets_and_unknown_sweeps",
    "gpurig sweep run --resume": "needs an interrupted sweep; "
    "tests/test_sweep_e2e.py::test_resume_after_killing_the_sweep_process",
    "gpurig sweep compare": "BEFORE and AFTER stand for two finished sweeps; "
    "tests/test_sweep_load_e2e.py::test_compare_two_sweeps_through_the_cli compares two",
    "gpurig sweep report": "DIR stands for a finished sweep's directory; "
    "tests/test_sweep_e2e.py::test_resume_after_killing_the_sweep_process rebuilds one",
    "gpurig eval": "needs servers on ports 8000/8100 (and a GSM8K file); "
    "tests/test_eval_e2e.py::test_the_engine_twice_gives_the_same_answers runs real servers",
    "gpurig engine export-gguf": "needs gpurig's llama.cpp build (.ci/llama-cpp-build); "
    "tests/test_llamacpp.py::test_export_through_llamacpps_converter runs it",
    "gpurig eval --resume": "needs an interrupted run; "
    "tests/test_eval_e2e.py::test_resume_asks_only_what_a_kill_lost",
    "gpurig compare": "needs two servers on ports 8000/8100; "
    "tests/test_compare.py::test_cli_table_json_and_exit_codes compares real engine servers",
    "gpurig serve stop": "stops the tour's server, which `gpurig up` (not run here) starts; "
    "tests/test_serve_cli.py::test_refusals_exit_2_with_the_fix runs it and "
    "tests/test_serve_engine.py::test_engine_lifecycle_across_two_mcp_processes stops a server",
}
# The first line of a README ```python block -> why this file does not run it.
PYTHON_NOT_RUN_HERE: dict[str, str] = {}
# Leading words -> the exit codes accepted (default: 0 only).
# (e.g. "gpurig doctor": {0, 1}: a check fails on a machine without a GPU)
EXIT_CODES: dict[str, set[int]] = {"gpurig doctor": {0, 1}}  # 1: no GPU, the driver check fails
SEPARATORS = {"&&", ";", "|", "||"}


def blocks(text: str, language: str) -> list[str]:
    """The bodies of a page's ```LANGUAGE fenced blocks, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def commands(block: str) -> list[list[str]]:
    """The shell commands of a bash block as argument lists: continuation lines joined, a
    quoted string that spans lines kept whole, comments dropped, split at && ; | ||."""
    out: list[list[str]] = []
    pending = ""
    for line in block.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:
            lexer = shlex.shlex(pending, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            words = list(lexer)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        pending = ""
        current: list[str] = []
        for word in [*words, ";"]:
            if word in SEPARATORS:
                if current:
                    out.append(current)
                current = []
            else:
                current.append(word)
    assert not pending, f"unclosed quote in a bash block: {pending!r}"
    return out


def page_commands(page: Path) -> list[list[str]]:
    """Every command of a page's bash blocks, in order."""
    return [c for b in blocks(page.read_text(), "bash") for c in commands(b)]


def readme_gpurig_commands() -> list[list[str]]:
    """The `gpurig` commands of README and every docs page, in the order they run."""
    return [c for page in PAGES for c in page_commands(page) if c[0] == "gpurig"]


def python_blocks() -> list[str]:
    return [b for page in PAGES for b in blocks(page.read_text(), "python")]


def all_text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def _matches(prefix: str, argv: list[str]) -> bool:
    words = prefix.split()
    return argv[: len(words)] == words


def _entry(table: dict[str, object], argv: list[str]) -> str | None:
    """The longest key of `table` whose words lead `argv`."""
    found = [k for k in table if _matches(k, argv)]
    return max(found, key=len) if found else None


def test_the_parser_finds_readmes_commands() -> None:
    """Guards the test itself: a parser that found nothing would pass everything."""
    readme = [" ".join(c) for c in page_commands(README)]
    assert "gpurig engine make-checkpoint --preset tiny --out ckpt/" in readme
    assert "gpurig --version" in readme
    assert "pip install -e . && gpurig demo" in README.read_text()  # the first block's two
    assert "pip install -e '.[dev]' && python3 -m pytest -q" in README.read_text()  # (CI reads it)
    found = [" ".join(c) for c in readme_gpurig_commands()]
    assert "gpurig host --path ." in found  # docs pages' commands are found too
    assert len(DOCS) >= 5
    assert "pip install -e ." in [" ".join(c) for c in commands("pip install -e . && gpurig x")]
    assert python_blocks() and all(len(b.strip()) > 0 for b in python_blocks())
    curl = [c for page in PAGES for c in page_commands(page) if c[0] == "curl"]
    assert curl and all(any(w.startswith("{") for w in c) for c in curl if "-d" in c)  # JSON whole


def test_every_not_run_entry_is_used_and_says_why() -> None:
    argvs = readme_gpurig_commands()
    for prefix, why in NOT_RUN_HERE.items():
        assert any(_matches(prefix, a) for a in argvs), f"stale NOT_RUN_HERE entry: {prefix}"
        assert len(why) > 10, f"say why {prefix} is not run here"
        for named, test in re.findall(r"(tests/\S+?\.py)(?:::(\w+))?", why):
            assert (ROOT / named).is_file(), f"{prefix}: {named} does not exist"
            if test:
                assert f"def {test}(" in (ROOT / named).read_text(), f"{prefix}: no {test}"
    firsts = [b.strip().splitlines()[0] for b in python_blocks()]
    for first in PYTHON_NOT_RUN_HERE:
        assert first in firsts, f"stale PYTHON_NOT_RUN_HERE entry: {first}"
    for prefix in EXIT_CODES:
        assert any(_matches(prefix, a) for a in argvs), f"stale EXIT_CODES entry: {prefix}"


def _env(tmp_path: Path) -> dict[str, str]:
    gpurig_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "GPURIG_HOME": str(tmp_path / "state"),
        "PATH": f"{gpurig_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }


@pytest.mark.slow
def test_readme_commands_run(tmp_path: Path, gpurig_bin: str) -> None:
    """Each README and docs `gpurig` command, in order, in one directory; then the python
    blocks."""
    env = _env(tmp_path)
    failures: list[str] = []
    ran = 0
    for argv in readme_gpurig_commands():
        if _entry(NOT_RUN_HERE, argv):
            continue
        codes = EXIT_CODES.get(_entry(EXIT_CODES, argv) or "", {0})
        done = subprocess.run(
            [gpurig_bin, *argv[1:]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
        ran += 1
        shown = shlex.join(argv)
        if done.returncode not in codes:
            failures.append(f"{shown}: exit {done.returncode}\n{done.stderr[-2000:]}")
        elif "Traceback" in done.stderr or not done.stdout.strip():
            failures.append(f"{shown}: no output, or a traceback\n{done.stderr[-2000:]}")
    for block in python_blocks():
        if block.strip().splitlines()[0] in PYTHON_NOT_RUN_HERE:
            continue
        done = subprocess.run(
            [sys.executable, "-c", block],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        ran += 1
        if done.returncode != 0:
            failures.append(f"python block {block.splitlines()[0]!r}:\n{done.stderr[-2000:]}")
    assert ran >= 5
    assert not failures, "README/docs commands that fail:\n\n" + "\n\n".join(failures)


def prose_lines(page: Path) -> list[str]:
    """A page's lines outside its fenced blocks (a `# comment` in a bash block is no heading)."""
    out: list[str] = []
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    assert not fenced, f"{page.name}: a fenced block is never closed"
    return out


def headings(page: Path) -> list[str]:
    return [m.group(1).strip() for line in prose_lines(page) if (m := HEADING.match(line))]


HEADING = re.compile(r"^#{1,6} (.+)$")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def test_each_heading_appears_once_across_readme_and_docs() -> None:
    """One place per subject: a heading that appears twice is a section written twice (README
    once held the whole `gpurig up` section two times)."""
    seen: dict[str, str] = {}
    repeated: list[str] = []
    for page in PAGES:
        for heading in headings(page):
            key = heading.casefold()
            if key in seen:
                repeated.append(f"{heading!r}: {seen[key]} and {page.relative_to(ROOT)}")
            seen.setdefault(key, str(page.relative_to(ROOT)))
    assert len(seen) > 20  # the parser found the pages' headings
    assert not repeated, "headings that appear more than once:\n" + "\n".join(repeated)


def test_readme_and_the_findings_page_stay_short() -> None:
    readme = len(README.read_text().splitlines())
    assert readme < README_MAX_LINES, f"README.md is {readme} lines: move a section to docs/"
    findings = len(FINDINGS.read_text().splitlines())
    assert findings < FINDINGS_MAX_LINES, f"{FINDINGS.name} is {findings} lines: one line each"


def test_every_relative_link_points_at_a_file() -> None:
    """Links outside code: a URL or an in-page anchor is not checked, a path (its #anchor
    dropped) must exist relative to the page."""
    checked = 0
    broken: list[str] = []
    for page in PAGES:
        for line in prose_lines(page):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue
                checked += 1
                path = target.split("#", 1)[0]
                if not (page.parent / path).exists():
                    broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert checked > 20
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def _vllm_extra():
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (req,) = project["optional-dependencies"]["vllm"]
    return Requirement(req).specifier


def test_the_vllm_extra_agrees_with_readme() -> None:
    """pyproject's `vllm` extra allows exactly the releases README calls supported: Gemma 4's
    minimum and the Turing patch's known range, both stated in the docs (install, patching)."""
    from packaging.version import Version

    text = " ".join(all_text().split())
    spec = _vllm_extra()
    low, high = re.search(r"at a version this project supports: (\S+) to (\S+) \(", text).groups()
    assert low in spec and high.replace(".x", ".0") in spec
    patch_high = re.search(r"Supported: vLLM [\d.]+ to ([\d.]+)", text).group(1)
    assert high.replace(".x", "") == patch_high.rsplit(".", 1)[0]
    gemma_min = re.search(r"Gemma 4 needs vLLM ([\d.]+) or newer", text).group(1)
    assert Version(low) >= Version(gemma_min)  # nothing older than Gemma 4 needs
    assert "0.27.1" not in spec and "0.34.0" not in spec


@pytest.mark.network
def test_the_vllm_extras_lower_bound_was_published() -> None:
    """`pip install '.[vllm]'` must find a release: the lower bound exists on PyPI."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "vllm"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    published = re.search(r"Available versions: (.+)", done.stdout).group(1).split(", ")
    lower = next(s.version for s in _vllm_extra() if s.operator == ">=")
    assert lower in published

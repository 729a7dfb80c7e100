"""What a new user meets first at the CLI: --version, usage errors routed to the subcommand,
engine paths checked before torch loads, one context flag, honest speed reports, --threads."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from mcp_server.cli import build_parser, main

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tiny W4A16 checkpoint (max_position_embeddings 4096), made once for this file."""
    from engine.checkpoint_maker import make_checkpoint

    out = tmp_path_factory.mktemp("front") / "tiny"
    make_checkpoint(out, preset="tiny", seed=1)
    return out


def test_version_is_the_installed_distributions(run_gpurig) -> None:
    out = run_gpurig("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"gpurig {version('gpurig')}"


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["doctor", "--bogus"], "usage: gpurig doctor "),
        (["host", "--need-gib", "1", "extra"], "usage: gpurig host "),
        (["patch", "verify", "--zzz"], "usage: gpurig patch verify "),
        (["engine", "memory", "--model", "m", "--nope"], "usage: gpurig engine memory "),
        (["--bogus"], "usage: gpurig [-h]"),
    ],
)
def test_a_stray_argument_shows_its_subcommands_usage(argv, usage, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert f"unrecognized arguments: {argv[-1]}" in err


def _in_process(argv: list[str]) -> tuple[int, bool, float, str]:
    """Run the CLI's main in a fresh interpreter: exit code, whether torch got imported, and
    the seconds main() took (torch alone takes 2 s to import here; the checks take ms)."""
    code = (
        "import sys, time, json\n"
        "from mcp_server.cli import main\n"
        "t = time.perf_counter()\n"
        "rc = main(json.loads(sys.argv[1]))\n"
        "print(json.dumps([rc, 'torch' in sys.modules, time.perf_counter() - t]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rc, torch_loaded, seconds = json.loads(done.stdout.strip().splitlines()[-1])
    return rc, torch_loaded, seconds, done.stderr


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["engine", "generate", "--model", "{tmp}/none", "--prompt", "x"], "--model"),
        (["engine", "memory", "--model", "{tmp}"], "config.json does not exist"),
        (["engine", "memory", "--model", "{tmp}/file"], "is not a directory"),
        (["engine", "make-checkpoint", "--out", "{tmp}"], "--out"),
        (["engine", "make-checkpoint", "--out", "{tmp}/file"], "is a file"),
        (["engine", "quantize", "--in", "{tmp}/none", "--out", "{tmp}/q"], "--in"),
        (["engine", "quantize", "--in", "{tiny}", "--out", "{tmp}/q"], "already quantized"),
    ],
)
def test_engine_paths_are_checked_before_torch(argv, says, tmp_path: Path, tiny: Path) -> None:
    (tmp_path / "file").write_text("not a checkpoint")
    argv = [a.format(tmp=tmp_path, tiny=tiny) for a in argv]
    rc, torch_loaded, seconds, err = _in_process(argv)
    assert rc == 2 and says in err and "what to do:" in err, err
    assert not torch_loaded, "torch was imported before the path was checked"
    assert not (tmp_path / "q").exists()


def test_max_ctx_is_an_alias_of_max_context() -> None:
    parser = build_parser()
    for command in ("memory", "generate"):
        extra = ["--prompt", "x"] if command == "generate" else []
        for flag in ("--max-context", "--max-ctx"):
            args = parser.parse_args(["engine", command, "--model", "m", flag, "77", *extra])
            assert args.max_context == 77


def test_an_over_long_context_is_capped_with_a_note(run_gpurig, tiny: Path) -> None:
    out = run_gpurig("engine", "memory", "--model", str(tiny), "--max-context", "8192", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["max_context"] == 4096
    assert "--max-context 8192 is more than this model's 4,096 positions" in out.stderr


@pytest.mark.parametrize("flag", ["--max-context", "--threads", "--prefill-chunk"])
def test_zero_is_a_usage_error(flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["engine", "memory", "--model", "m", flag, "0"])
    assert exc.value.code == 2
    assert "'0' is not a whole number >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("max_tokens", ["0", "1"])
def test_no_decode_to_time_is_said_not_none(run_gpurig, tiny: Path, max_tokens: str) -> None:
    out = run_gpurig(
        "engine", "generate", "--model", str(tiny), "--prompt", "hi", "--max-tokens", max_tokens
    )
    assert out.returncode == 0, out.stderr
    assert "None" not in out.stdout
    assert f"not timed: {max_tokens} new token" in out.stdout


def test_threads_flag_sets_torchs_threads(run_gpurig, tiny: Path) -> None:
    out = run_gpurig(
        "engine", "generate", "--model", str(tiny), "--prompt", "hi", "--max-tokens", "3",
        "--threads", "1", "--device", "cpu", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["cpu_threads"] == 1


def test_default_threads_leaves_busy_cores_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default counts the cores this process may use, less the busy ones, at least 1."""
    import os

    import psutil

    from engine.threads import default_threads

    cores = min(len(os.sched_getaffinity(0)), psutil.cpu_count(logical=False) or 99)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert default_threads() == cores
    monkeypatch.setattr(os, "getloadavg", lambda: (float(os.cpu_count() or 1) * 4, 0.0, 0.0))
    assert default_threads() == 1


def test_unquantized_checkpoint_counts_its_plain_linears(tmp_path: Path) -> None:
    from engine.checkpoint_maker import make_checkpoint

    q = make_checkpoint(tmp_path / "q", preset="tiny")
    plain = make_checkpoint(tmp_path / "bf16", preset="tiny", quantized=False)
    linears = q.quantized_linears + q.plain_linears
    assert linears > 0
    assert plain.plain_linears == linears and plain.quantized_linears == 0


def test_disk_advice_names_each_filesystem_once_and_says_what_happened(tmp_path: Path) -> None:
    """Two paths that do not exist yet are both measured at tmp_path, and tmp_path's parent
    is on the same filesystem: `df -h` gets one argument for it (df prints a row per argument).
    The staging advice tells what went wrong on a real host, not where the numbers came from."""
    from tools.host import check_host_capacity

    paths = [tmp_path / "later", tmp_path.parent, tmp_path / "also-later"]
    report = check_host_capacity(paths=[str(p) for p in paths], need_gib=999_999)
    disk = next(a for a in report.advice if a.rule == "disk_space")
    df = next(c for c in disk.commands if c.startswith("df -h"))
    assert df.split()[2:] == [str(tmp_path)]
    staging = next(a for a in report.advice if a.rule == "memory_staging")
    assert "seed" not in staging.reason and "OOM-killed" in staging.reason


def test_omp_num_threads_is_respected_and_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from engine.threads import set_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert set_threads(None) == 1 == torch.get_num_threads()
        assert set_threads(2) == 2 == torch.get_num_threads()
        monkeypatch.setenv("OMP_NUM_THREADS", "junk")
        assert set_threads(None) >= 1
    finally:
        torch.set_num_threads(before)


def test_importing_the_command_line_imports_no_subcommand() -> None:
    """The engine process (spawned) imports the server's main module again: importing
    mcp_server.cli must not import the subcommands (the sweep's stack, the MCP tools, torch),
    which cost it 0.6 s before it could import torch and load."""
    loaded = _modules_after("import mcp_server.cli")
    assert not [m for m in loaded if m.startswith(("mcp_server.cli_", "bench", "torch",
                                                   "mcp_server.output"))]  # fmt: skip
    assert "serve" in build_parser().format_help()  # the parser still has every subcommand


def test_building_the_parser_imports_no_sweep_machinery_and_no_torch() -> None:
    """Every `gpurig` start builds the whole parser before it runs a subcommand (`engine
    serve` before it starts its engine process): the sweep package's entry points and torch
    stay out of it."""
    loaded = _modules_after("from mcp_server.cli import build_parser\nbuild_parser()")
    assert not loaded & {"bench.sweep.run", "bench.sweep.lookup", "torch", "engine.runtime"}


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    script = f"import sys\n{code}\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=60)  # fmt: skip
    return set(out.stdout.split())

"""The vLLM command lines gpurig builds, checked against the real wheels' argument definitions.

vLLM's own parser does not run here: importing it needs some twenty packages, and even with
them installed (tried with 0.33.0 and torch 2.14 CPU) building the `serve` parser fails with
"RuntimeError: Failed to infer device type" on a host without a GPU. So the flags are read
statically from each wheel's source, the same reading gpurig falls back to on such a host
(tools/serving/flags.py): every `add_argument("--x")` in vllm/engine/arg_utils.py and the
entrypoints' cli_args.py (its folder moved: openai/ -> launchers/ -> common/), plus the fields of
the *FrontendArgs dataclasses that vLLM turns into flags. On a GPU host gpurig reads
`vllm serve --help=all` instead.

The wheels are cached outside the clone by tests/test_patch_wheels.py's `wheel()`; offline:
`pytest -m "not network"`.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from test_patch_wheels import wheel

from tools.serving.command import VllmInstall, vllm_command
from tools.serving.flags import FlagSet, flags_from_source, unknown_flags

pytestmark = [pytest.mark.network]

VERSIONS = ["0.29.0", "0.31.0", "0.33.0"]


def unpack(version: str, dest: Path) -> Path:
    with zipfile.ZipFile(wheel(version)) as z:
        names = [
            n for n in z.namelist()
            if n == "vllm/engine/arg_utils.py" or n.endswith("/cli_args.py")
            or n in ("vllm/entrypoints/cli/main.py", "vllm/entrypoints/cli/serve.py",
                     "vllm/entrypoints/openai/api_server.py")
        ]  # fmt: skip
        z.extractall(dest, members=names)
    return dest / "vllm"


@pytest.mark.parametrize("version", VERSIONS)
def test_command_flags_exist_in_the_wheel(version, tmp_path):
    package = unpack(version, tmp_path)
    flags = FlagSet(version=version, source="static", flags=flags_from_source(package))
    assert len(flags.flags) > 150
    for frontend_field in ("--host", "--port", "--api-key", "--served-model-name"):
        assert frontend_field in flags.flags
    # `python -m vllm.entrypoints.cli.main serve MODEL` is what the console script runs
    main = (package / "entrypoints" / "cli" / "main.py").read_text()
    assert 'if __name__ == "__main__":' in main
    assert "make_arg_parser" in (package / "entrypoints" / "cli" / "serve.py").read_text()
    install = VllmInstall(python="/usr/bin/python3", version=version, package_dir=str(package),
                          cli_main=True, api_server=True)  # fmt: skip
    # the seeds' T4 flags plus everything gpurig may add
    command, ours = vllm_command(
        install, "google/gemma-4-E2B-it", "127.0.0.1", 8000, "float16", "auto", 2, 2, 0.9,
        16384, 8, "TRITON_ATTN", ["--seed", "0", "--enforce-eager", "--max_num_batched_tokens=8192"],
    )  # fmt: skip
    assert command[:5] == ["/usr/bin/python3", "-m", "vllm.entrypoints.cli.main", "serve",
                           "google/gemma-4-E2B-it"]  # fmt: skip
    assert "--pipeline-parallel-size" in ours and "--attention-backend" in ours
    assert unknown_flags(command[5:], flags) == []
    assert unknown_flags(["--max-modle-len", "1", "--tensor-paralel-size"], flags) == [
        "--max-modle-len", "--tensor-paralel-size"
    ]  # fmt: skip
    # without the CLI module: the deprecated api_server with --model
    old = install.model_copy(update={"cli_main": False})
    command, _ = vllm_command(old, "m", "127.0.0.1", 8000, "auto", "auto", 1, 1, 0.9,
                              None, None, None, [])  # fmt: skip
    assert command[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    assert unknown_flags(command[3:], flags) == []

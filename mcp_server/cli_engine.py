"""`gpurig engine make-checkpoint | quantize | generate | export-gguf | memory`: the engine core's CLI face.

Thin: each command calls one engine function and prints its pydantic result (table or --json).
Nothing heavy at import time, and every path is checked before torch is imported (2 s on a cold
cache): a mistyped --model fails at once. Engine errors become GpurigErrors (message + what to
do, exit 2).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from engine.threads import set_threads
from mcp_server.output import kv_table, print_result
from tools.errors import NotFoundError, RefusedError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-checkpoint",
        help="write a random-weight Gemma 4 W4A16 checkpoint (tiny | small | e2b)",
        description="A random-weight Gemma 4 checkpoint in the real compressed-tensors W4A16 "
        "format, with a synthetic tokenizer (real special ids), generation_config and chat "
        "template. 'e2b' is the real E2B shape (about 3.5 GB written, for GPU benchmarks).",
    )
    p.add_argument("--preset", choices=["tiny", "small", "e2b"], default="tiny")
    p.add_argument("--out", required=True, help="new directory to write")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    p.add_argument("--emb4", action="store_true", help="store the embedding tables in 4-bit too")
    p.add_argument("--unquantized", action="store_true", help="write plain bf16 weights instead")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_make)

    p = subparsers.add_parser(
        "quantize",
        help="quantize a 16-bit Gemma 4 checkpoint to W4A16 group 32",
        description="Symmetric 4-bit groups of 32 (scale = max|w| / 7.5), written in "
        "compressed-tensors pack-quantized format, tensor by tensor.",
    )
    p.add_argument("--in", dest="in_dir", required=True, help="16-bit checkpoint directory")
    p.add_argument("--out", required=True, help="new directory to write")
    p.add_argument("--emb4", action="store_true", help="store the embedding tables in 4-bit too")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_quantize)

    p = subparsers.add_parser(
        "generate",
        help="generate text with the in-process engine and print the speed",
        description="Load a W4A16 Gemma 4 checkpoint, read the prompt, generate, and print the "
        "text with the prompt-read time and decode tokens/s.",
    )
    p.add_argument("--model", required=True, help="checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw prompt text (bos is prepended, no chat template)")
    src.add_argument("--chat", help="one user message, rendered with the chat template")
    p.add_argument("--max-tokens", type=_count, default=128, help="new tokens at most (128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at an end-of-sequence token: generate exactly --max-tokens",
    )
    _add_load_args(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_generate)

    p = subparsers.add_parser(
        "export-gguf",
        help="write a 16-bit checkpoint as a GGUF file for llama.cpp (f16 | bf16 | q4_0)",
        description="Through llama.cpp's own convert_hf_to_gguf.py from gpurig's llama.cpp build "
        "(.ci/llama-cpp-build); q4_0 converts to f16, then runs llama-quantize. Serve the file "
        "with: gpurig serve start FILE.gguf --backend llamacpp",
    )
    p.add_argument("model", help="16-bit checkpoint directory (make-checkpoint --unquantized)")
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.add_argument("--outtype", choices=["f16", "bf16", "q4_0"], default="f16")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_export_gguf)

    p = subparsers.add_parser(
        "memory",
        help="bytes the engine holds per part (embeddings, layers, per-layer table, cache)",
    )
    p.add_argument("--model", required=True, help="checkpoint directory")
    _add_load_args(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_memory)


def _add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda when present)")
    p.add_argument(
        "--max-context",
        "--max-ctx",
        dest="max_context",
        type=_positive,
        metavar="N",
        help="KV cache positions (default and most: the model's max_position_embeddings; "
        "more is capped to it, with a note)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=_positive,
        help="most prompt tokens per chunk (default: the largest that fits the memory left, at most 4096 on CUDA)",
    )
    p.add_argument("--memory-cap-mib", type=_positive, help="cap this process's CUDA memory (MiB)")
    p.add_argument(
        "--threads",
        type=_positive,
        metavar="N",
        help="CPU threads for torch (default: OMP_NUM_THREADS if set, else the idle cores this "
        "process may run on, at least 1; oversubscribed cores make the decode crawl)",
    )


def _positive(text: str) -> int:
    return _int_at_least(text, 1)


def _count(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {low}")
    return value


def _check_model_dir(
    path: str, flag: str, maker: str = "`gpurig engine make-checkpoint --out DIR`"
) -> Path:
    """A checkpoint directory with a readable config.json and tokenizer.json, checked without
    torch; returns it. Anything wrong is a NotFoundError naming the flag (exit 2)."""
    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        what = "does not exist" if not model_dir.exists() else "is not a directory"
        raise NotFoundError(
            f"{flag} {path}: {what}",
            f"pass a checkpoint directory to {flag} (make one with {maker})",
        )
    for name in ("config.json", "tokenizer.json"):
        if not (model_dir / name).is_file():
            raise NotFoundError(
                f"{flag} {path}: {model_dir / name} does not exist",
                f"pass a checkpoint directory holding config.json and tokenizer.json to {flag}",
            )
    return model_dir


def _check_out_dir(path: str, flag: str) -> None:
    """A directory that make-checkpoint / quantize may create: new or empty, its nearest
    existing parent writable. Checked before torch loads, so a bad path costs no 2 s."""
    out = Path(path).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is not empty" if out.is_dir() else "is a file"
        raise RefusedError(
            f"{flag} {path} already exists and {what}",
            f"choose a new directory for {flag}, or remove the old one first",
        )
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise RefusedError(
            f"{flag} {path}: cannot create it ({parent} is not a writable directory)",
            f"choose a directory you can write to for {flag}",
        )


def _load(args: argparse.Namespace):
    """Check the checkpoint (no torch yet), cap --max-context at the model's limit with a note
    (as `engine serve` does), set the CPU threads, then load."""
    from engine.config import load_config  # json only: no torch

    model_dir = _check_model_dir(args.model, "--model")
    limit = load_config(model_dir).max_position_embeddings
    max_context = args.max_context
    if max_context is not None and max_context > limit:
        sys.stderr.write(
            f"gpurig: note: --max-context {max_context} is more than this model's "
            f"{limit:,} positions (max_position_embeddings); using {limit}\n"
        )
        max_context = limit
    set_threads(args.threads)

    import engine

    return engine.load(
        model_dir,
        device=args.device,
        max_context=max_context,
        memory_cap_mib=args.memory_cap_mib,
        prefill_chunk=args.prefill_chunk,
        options=engine.EngineOptions.from_env(),
    )


def _render_info(r) -> str:
    return kv_table(
        [
            ("path", r.path),
            ("preset", r.preset),
            ("parameters", f"{r.parameters:,}"),
            ("bytes on disk", f"{r.bytes_on_disk:,}"),
            ("4-bit linears", r.quantized_linears),
            ("plain linears", r.plain_linears),
            ("4-bit embeddings", r.emb4),
            ("files", ", ".join(r.files)),
        ]
    )


def _run_make(args: argparse.Namespace) -> int:
    _check_out_dir(args.out, "--out")
    from engine.checkpoint_maker import make_checkpoint

    info = make_checkpoint(
        args.out,
        preset=args.preset,
        seed=args.seed,
        emb4=args.emb4,
        quantized=not args.unquantized,
    )
    print_result(info, args.json, _render_info)
    return 0


def _run_quantize(args: argparse.Namespace) -> int:
    from engine.config import parse_config, read_config_json  # json only: no torch

    in_dir = _check_model_dir(args.in_dir, "--in", "`gpurig engine make-checkpoint --unquantized`")
    raw = read_config_json(in_dir)
    parse_config(raw)  # a Gemma 4 config, or exit 2 now
    if raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config"):
        raise RefusedError(
            f"--in {args.in_dir} is already quantized (config.json has a quantization_config)",
            "pass a 16-bit checkpoint to --in",
        )
    _check_out_dir(args.out, "--out")
    from engine.checkpoint_maker import quantize_checkpoint

    info = quantize_checkpoint(args.in_dir, args.out, emb4=args.emb4)
    print_result(info, args.json, _render_info)
    return 0


def _run_export_gguf(args: argparse.Namespace) -> int:
    from tools.llamacpp import export_gguf

    _check_model_dir(args.model, "MODEL", "`gpurig engine make-checkpoint --unquantized --out DIR`")
    result = export_gguf(args.model, args.out, outtype=args.outtype, overwrite=args.overwrite)
    print_result(
        result,
        args.json,
        lambda r: kv_table(
            [
                ("file", r.path),
                ("type", r.outtype),
                ("bytes", f"{r.bytes:,}"),
                ("seconds", r.seconds),
                ("converter", r.converter),
            ]
        ),  # fmt: skip
    )
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    eng = _load(args)  # checks the paths before torch is imported
    from engine.textgen import generate_text

    def show(piece: str) -> None:  # the reply as it is made (not with --json)
        sys.stdout.write(piece)
        sys.stdout.flush()

    from engine.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_ids=() if args.ignore_eos else None,
    )
    result = generate_text(eng, args.prompt, args.chat, params, None if args.json else show)

    print_result(result, args.json, render_generation)
    return 0


def _threads(n: int | None) -> str:
    return "" if n is None else f" ({n} thread{'' if n == 1 else 's'}; --threads)"


def render_generation(r) -> str:  # r: engine.textgen.GenerationReport
    """The speed report under the streamed reply. With fewer than two new tokens there is no
    decode step to time: say so instead of printing "None tok/s"."""
    if r.decode_tokens_per_s is None:
        decode = (
            f"not timed: {r.new_tokens} new token{'' if r.new_tokens == 1 else 's'} "
            "(the first comes from reading the prompt; decode speed needs 2 or more)"
        )
        bandwidth = "not timed (no decode steps)"
    else:
        decode = f"{r.decode_tokens_per_s} tok/s over {r.decode_seconds:.3f} s"
        bandwidth = f"{r.effective_gb_per_s} GB/s"
    prompt = f"{r.prompt_tokens} tokens"
    if r.new_tokens:
        prompt += f" in {r.prefill_seconds:.3f} s ({r.prefill_tokens_per_s} tok/s)"
    speed = kv_table(
        [
            ("model", f"{r.model} on {r.device}" + _threads(r.cpu_threads)),
            ("prompt", prompt),
            ("reply", f"{r.new_tokens} tokens, finish: {r.finish_reason}"),
            ("decode", decode),
            ("weights read per token", f"{r.weight_bytes_per_token / 2**20:.1f} MiB"),
            ("bandwidth achieved", bandwidth),
        ]
    )
    return f"\n\n{speed}"  # the text was shown as it came


def _run_memory(args: argparse.Namespace) -> int:
    eng = _load(args)
    report = eng.memory_report()
    print_result(
        report, args.json, lambda r: kv_table([(name, f"{mib} MiB") for name, mib in r.rows()])
    )
    return 0

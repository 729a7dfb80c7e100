"""`gpurig engine make-checkpoint | quantize | generate | memory`: the engine core's CLI face.

Thin: each command calls one engine function and prints its pydantic result (table or --json).
Nothing heavy at import time; engine errors become GpurigErrors (message + what to do, exit 2).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from mcp_server.output import kv_table, print_result
from tools.errors import InvalidInputError, NotFoundError, RefusedError


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
    p.add_argument("--seed", type=int, default=0)
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
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    _add_load_args(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_generate)

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
    p.add_argument("--max-context", type=int, help="KV cache positions (default: the model's)")
    p.add_argument("--prefill-chunk", type=int, help="prompt tokens per forward pass (default 256)")
    p.add_argument("--memory-cap-mib", type=int, help="cap this process's CUDA memory (MiB)")


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run an engine function, turning its errors into the CLI's error types."""
    from engine.errors import CheckpointError, ContextLengthError, EngineError

    try:
        return fn(*args, **kwargs)
    except ContextLengthError as err:
        raise RefusedError(err.message, err.remedy) from err
    except CheckpointError as err:
        raise NotFoundError(err.message, err.remedy) from err
    except EngineError as err:
        raise InvalidInputError(err.message, err.remedy) from err


def _load(args: argparse.Namespace):
    import engine

    return _call(
        engine.load,
        args.model,
        device=args.device,
        max_context=args.max_context,
        memory_cap_mib=args.memory_cap_mib,
        prefill_chunk=args.prefill_chunk,
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
    from engine.checkpoint_maker import make_checkpoint

    info = _call(
        make_checkpoint,
        args.out,
        preset=args.preset,
        seed=args.seed,
        emb4=args.emb4,
        quantized=not args.unquantized,
    )
    print_result(info, args.json, _render_info)
    return 0


def _run_quantize(args: argparse.Namespace) -> int:
    from engine.checkpoint_maker import quantize_checkpoint

    info = _call(quantize_checkpoint, args.in_dir, args.out, emb4=args.emb4)
    print_result(info, args.json, _render_info)
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    from engine.textgen import generate_text

    eng = _load(args)

    def show(piece: str) -> None:  # the reply as it is made (not with --json)
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = _call(
        generate_text,
        eng,
        on_text=None if args.json else show,
        prompt=args.prompt,
        chat=args.chat,
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )

    def render(r) -> str:
        speed = kv_table(
            [
                ("model", f"{r.model} on {r.device}"),
                (
                    "prompt",
                    f"{r.prompt_tokens} tokens in {r.prefill_seconds:.3f} s ({r.prefill_tokens_per_s} tok/s)",
                ),
                ("reply", f"{r.new_tokens} tokens, finish: {r.finish_reason}"),
                ("decode", f"{r.decode_tokens_per_s} tok/s over {r.decode_seconds:.3f} s"),
                ("weights read per token", f"{r.weight_bytes_per_token / 2**20:.1f} MiB"),
                ("bandwidth achieved", f"{r.effective_gb_per_s} GB/s"),
            ]
        )
        return f"\n\n{speed}"  # the text was shown as it came

    print_result(result, args.json, render)
    return 0


def _run_memory(args: argparse.Namespace) -> int:
    eng = _load(args)
    report = eng.memory_report()
    print_result(
        report, args.json, lambda r: kv_table([(name, f"{mib} MiB") for name, mib in r.rows()])
    )
    return 0

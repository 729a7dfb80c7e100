"""transformers in-process as the reference two servers should match (compare_outputs).

The checkpoint loads through `AutoModelForCausalLM` (Gemma 4 text: `Gemma4ForCausalLM`; a
compressed-tensors W4A16 checkpoint is decompressed by transformers on load, which needs the
`compressed-tensors` package), eager attention, in float32 unless asked otherwise. Greedy decoding
runs the model's own KV cache; every step keeps the whole log_softmax row, so at the position
where a server departs the reference says exactly how far apart it rates its own token and the
server's (its margin): a margin near 0 is a near-tie the server's rounding may flip, a large one
means the server computed something else.
"""

from __future__ import annotations

import json
from pathlib import Path

from tools.compare_types import leading_token_apart
from tools.errors import InvalidInputError, NotFoundError

DTYPES = ("float32", "float64", "bfloat16")


def check_checkpoint(path: Path) -> None:
    """Refuse a reference directory transformers cannot load, before any server is asked."""
    if not path.is_dir():
        raise NotFoundError(
            f"the reference checkpoint {path} does not exist",
            "pass the local directory of the checkpoint both servers serve (config.json, "
            "*.safetensors, tokenizer files)",
        )
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise NotFoundError(
            f"{path} holds no checkpoint (config.json and *.safetensors)",
            "pass the checkpoint directory itself (a hub id must be downloaded first: "
            "`huggingface-cli download ID --local-dir DIR`)",
        )
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise InvalidInputError(
            "the reference needs transformers, which is not installed here",
            "pip install -e '.[dev]' (transformers and compressed-tensors)",
        ) from None
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("quantization_config"):
        try:
            import compressed_tensors  # noqa: F401
        except ImportError:
            raise InvalidInputError(
                f"{path} is quantized, and transformers needs compressed-tensors to load it",
                "pip install compressed-tensors (or pip install -e '.[dev]')",
            ) from None


class ReferenceRun:
    """One prompt's greedy tokens and the log-probability rows they were chosen from."""

    def __init__(self, tokens: list[int], rows: list) -> None:
        self.tokens = tokens
        self._rows = rows  # [V] float tensors, one per new token

    def logprob(self, position: int, token: int) -> float:
        return float(self._rows[position][token])

    def margin(self, position: int, token: int) -> float:
        """The reference's log-probability of its own token less that of `token` there."""
        return self.logprob(position, self.tokens[position]) - self.logprob(position, token)


class Reference:
    def __init__(self, path: Path, model, tokenizer, dtype) -> None:
        self.path = path
        self.model = model
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.vocab_size = int(model.config.get_text_config().vocab_size)

    @classmethod
    def load(cls, path: Path, dtype: str = "float32") -> Reference:
        check_checkpoint(path)
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch_dtype = getattr(torch, dtype)
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch.float32, attn_implementation="eager"
            )
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:  # transformers' own errors: an architecture it does not know
            raise InvalidInputError(
                f"transformers {transformers.__version__} cannot load {path}: {exc}"[:600],
                "use a checkpoint transformers supports (Gemma 4 needs transformers >= 5.5)",
            ) from None
        return cls(path, model.eval().to(torch_dtype), tokenizer, torch_dtype)

    def check_prompts(
        self, prompts: list[list[int]], text: str, server_ids: list[int] | None
    ) -> None:
        """The servers' vocabulary is the reference's: the same text gives the same ids (when
        the server says how it tokenised it; a leading token only one side adds is its BOS
        policy, not another vocabulary), and every prompt id is inside the vocabulary."""
        ids = list(self.tokenizer(text)["input_ids"])
        if server_ids is not None and not leading_token_apart(ids, server_ids):
            raise InvalidInputError(
                f"the reference's tokenizer ({self.path}) and the servers' disagree on "
                f"{text!r}: {ids[:16]} against {server_ids[:16]}",
                "pass the checkpoint the servers serve as the reference",
            )
        for i, p in enumerate(prompts):
            bad = [t for t in p if t >= self.vocab_size]
            if bad:
                raise InvalidInputError(
                    f"prompt {i} has ids {bad[:5]} outside the reference's vocabulary "
                    f"[0, {self.vocab_size})",
                    "pass token ids of this checkpoint's tokenizer",
                )

    def run(self, prompt: list[int], max_tokens: int) -> ReferenceRun:
        import torch

        tokens: list[int] = []
        rows = []
        with torch.inference_mode():
            ids = torch.tensor([prompt], dtype=torch.int64)
            out = self.model(input_ids=ids, use_cache=True)
            for _ in range(max_tokens):
                row = torch.log_softmax(out.logits[0, -1].double(), dim=-1)
                token = int(row.argmax())
                tokens.append(token)
                rows.append(row)
                if len(tokens) == max_tokens:
                    break
                out = self.model(input_ids=torch.tensor([[token]]), use_cache=True,
                                 **_cache_of(self.model, out))  # fmt: skip
        return ReferenceRun(tokens, rows)


def _cache_of(model, out) -> dict:
    """The KV cache of the last call, under the name this transformers takes (`cache` from
    5.x's later releases, `past_key_values` before)."""
    import inspect

    if "cache" in inspect.signature(model.forward).parameters and hasattr(out, "cache"):
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}

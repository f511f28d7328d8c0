"""Generate text with a trained GPT (GPT-2 or Llama style) from a checkpoint:

    .venv/bin/python tools/generate.py --checkpoint runs/gpt_tiny/checkpoints --prompt "def " \\
        --max-new-tokens 64 --temperature 0.8 --top-k 40 --seed 1
    .venv/bin/python tools/generate.py --checkpoint exported/llama --prompt "import " --greedy

``--checkpoint``: a native checkpoint (``iter_XXXXXXX``, or a checkpoints directory with
``latest``; any parallel layout and precision level) or a Hugging Face directory, loaded as one
single-process FP32 model (``families.load_pretrained``). The tokenizer is the run's own: the
cached stdlib SentencePiece model (``data.corpus: stdlib``; rebuilt, identically, if the cache
is gone) or ``data.tokenizer_model``; a Hugging Face directory's ``tokenizer.json``, also as
carried into a native checkpoint by an import (its ``tokenizer/`` folder);
``--tokenizer`` overrides (a SentencePiece ``.model``, or a Hugging Face ``tokenizer.json`` or
its directory). Decoding runs with a KV cache (``--no-cache``: rerun the whole sequence for
every token, same tokens, slower) and stops at the end-of-document token. The prompt and its
continuation go to stdout, a timing line to stderr; any failure prints one ``error:`` line and
exits 2.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# megatron-core (imported with the checkpoint reader) warns that TE/apex are absent.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

import torch  # noqa: E402

__all__ = ["checkpoint_tokenizer", "filter_logits", "generate", "main", "sample_token"]


def filter_logits(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """``logits`` ``[V]`` with everything outside the top-k tokens, then outside the nucleus
    (the most probable tokens whose probabilities sum to ``top_p``), set to -inf. The most
    probable token always survives."""
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        probs, order = torch.softmax(logits, -1).sort(descending=True)
        # Drop a token when the more probable ones already reach top_p; the first never is.
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample_token(
    logits: torch.Tensor,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """The next token from one position's logits ``[V]`` (float32, CPU, already masked)."""
    if greedy:
        return int(logits.argmax())
    logits = filter_logits(logits / temperature, top_k, top_p)
    probs = torch.softmax(logits, -1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    true_vocab: int | None = None,
) -> list[int]:
    """Up to ``max_new_tokens`` token ids continuing ``prompt_ids`` (the prompt itself is not
    returned; generation stops after ``eos_id``, which is included).

    ``model``: a single-process causal LM in eval mode (``GPTModel``; ``[1, s]`` ids ->
    ``[1, s, V]`` logits). ``greedy`` takes the argmax; otherwise sampling at ``temperature``
    from the ``top_k`` most probable tokens and the ``top_p`` nucleus, drawn from
    ``generator`` (a CPU ``torch.Generator``: a seed reproduces the output). ``true_vocab``:
    ids from there up are vocabulary padding and never chosen. ``use_cache``: decode with a
    KV cache (one new token per step) instead of rerunning the whole sequence; both give the
    same logits up to float rounding.
    """
    config = model.config
    vocab = config.vocab_size
    true_vocab = vocab if true_vocab is None else true_vocab
    # The last new token is sampled, never fed back: it needs no position of its own.
    positions = len(prompt_ids) + max(max_new_tokens - 1, 0)
    if model.training:
        raise ValueError("generate: the model must be in eval mode (call model.eval())")
    if not prompt_ids:
        raise ValueError("generate: the prompt has no tokens")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    if positions > config.max_position_embeddings:
        raise ValueError(
            f"{len(prompt_ids)} prompt + {max_new_tokens} new tokens need {positions} "
            f"positions; the model has {config.max_position_embeddings} "
            "(max_position_embeddings)"
        )
    if not 1 <= true_vocab <= vocab:
        raise ValueError(f"true_vocab={true_vocab}: must be in [1, {vocab}] (the model's rows)")
    if not greedy:
        if temperature <= 0:
            raise ValueError(f"temperature={temperature}: must be > 0 (or sample greedily)")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k}: must be >= 1")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p}: must be in (0, 1]")
    if max_new_tokens == 0:
        return []

    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, s]
    cache = model.new_kv_cache(positions) if use_cache else None
    feed = ids  # what the next forward runs: all of it without a cache, the new tail with one
    out: list[int] = []
    while True:
        logits = model(feed, kv_cache=cache) if use_cache else model(feed)  # [1, s, V]
        last = logits[0, -1].float().cpu()  # sampling on CPU: one generator on any device
        last[true_vocab:] = float("-inf")  # padding rows are not tokens
        token = sample_token(
            last, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
            generator=generator,
        )  # fmt: skip
        out.append(token)
        if token == eos_id or len(out) == max_new_tokens:
            return out
        new = torch.tensor([[token]], dtype=torch.long, device=device)  # [1, 1]
        feed = new if use_cache else torch.cat([feed, new], dim=1)


def checkpoint_tokenizer(checkpoint: str | Path):
    """The tokenizer a checkpoint was trained with (see the module doc)."""
    from checkpoint.store import read_metadata, resolve_checkpoint
    from data.prepare import prepare_default_data
    from data.tokenizer import SentencePieceTokenizer, load_tokenizer
    from training.tokenizer_files import FOLDER as TOKENIZER_FOLDER
    from training.tokenizer_files import run_cache_dir

    path = Path(checkpoint)
    if (path / "config.json").is_file():  # a Hugging Face directory
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path}: no tokenizer.json beside the model; pass --tokenizer")
        return load_tokenizer("huggingface", path)
    checkpoint_dir = resolve_checkpoint(path)
    carried = checkpoint_dir / TOKENIZER_FOLDER  # an imported model's own tokenizer
    if (carried / "tokenizer.json").is_file():
        return load_tokenizer("huggingface", carried)
    metadata = read_metadata(checkpoint_dir)
    if metadata.get("weights_only"):
        # An import's run config is a placeholder: its data section is not the model's.
        raise ValueError(
            f"{path}: model weights only ({metadata['weights_only']}), no tokenizer of its "
            "own; pass --tokenizer"
        )
    config = metadata.get("config", {})
    data = config.get("data") or {}
    if data.get("corpus") == "stdlib":
        # A cache hit returns the run's tokenizer; a miss retrains the same one (same corpus,
        # vocabulary size and seed), which takes a while.
        seed = config.get("training", {}).get("seed", 1234)
        cache_dir = run_cache_dir(data["cache_dir"])
        prepared = prepare_default_data(cache_dir, data["vocab_size"], seed=seed)
        tokenizer = SentencePieceTokenizer(prepared.tokenizer_model)
    elif data.get("tokenizer_model"):
        kind = data.get("tokenizer_type", "sentencepiece")
        tokenizer = load_tokenizer(kind, data["tokenizer_model"])
    else:
        raise ValueError(f"{path}: the checkpoint names no tokenizer; pass --tokenizer")
    trained = metadata.get("model_structure", {}).get("vocab_size")
    if trained is not None and tokenizer.vocab_size != trained:
        # Not the tokenizer the model learned (e.g. a tokenizer file replaced since the run).
        raise ValueError(
            f"{path}: the run's tokenizer now has {tokenizer.vocab_size} tokens, the model was "
            f"trained with {trained}; pass --tokenizer"
        )
    return tokenizer


class UsageError(Exception):
    """A bad command line, reported as one ``error:`` line like every other failure."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + message; keep to one line
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint, checkpoints dir or HF dir")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to add (default 64)")
    p.add_argument("--greedy", action="store_true", help="always take the most probable token")
    p.add_argument("--temperature", type=float, help="sampling temperature (default 1.0)")
    p.add_argument("--top-k", type=int, help="sample from the k most probable tokens")
    p.add_argument("--top-p", type=float, help="sample from the top-p probability nucleus")
    p.add_argument("--seed", type=int, help="sampling seed (default: a fresh random one)")
    p.add_argument("--no-cache", action="store_true", help="no KV cache (rerun every step)")
    p.add_argument("--tokenizer", help="tokenizer to use instead of the checkpoint's")
    p.add_argument("--device", default="cpu", help="where the model runs (default cpu)")
    return p


def _check_args(args) -> None:
    sampling = {"--temperature": args.temperature, "--top-k": args.top_k, "--top-p": args.top_p}
    given = [flag for flag, value in sampling.items() if value is not None]
    if args.greedy and given:
        raise UsageError(f"--greedy takes no sampling options ({', '.join(given)})")
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: must be >= 0")
    if args.temperature is not None and args.temperature <= 0:
        raise UsageError(f"--temperature {args.temperature}: must be > 0 (or use --greedy)")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k {args.top_k}: must be >= 1")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p {args.top_p}: must be in (0, 1]")
    if not Path(args.checkpoint).exists():
        raise UsageError(f"--checkpoint {args.checkpoint}: no such file or directory")
    if args.tokenizer is not None and not Path(args.tokenizer).exists():
        raise UsageError(f"--tokenizer {args.tokenizer}: no such file or directory")


def _run(args) -> None:
    from checkpoint.store import read_metadata, resolve_checkpoint
    from data.tokenizer import load_tokenizer
    from families import load_pretrained
    from models.gpt import GPTModel
    from training.checkpointer import checkpoint_config

    if not (Path(args.checkpoint) / "config.json").is_file():
        # A native checkpoint: a damaged saved config is named (file and key) before a model
        # is built from it.
        checkpoint_config(read_metadata(resolve_checkpoint(args.checkpoint)), ("model",))
    model = load_pretrained(args.checkpoint, device=args.device)
    if not isinstance(model, GPTModel):
        name = type(getattr(model, "model", model)).__name__
        raise ValueError(f"--checkpoint {args.checkpoint}: a {name}, not a GPT (causal) model")
    if args.tokenizer is not None:
        tokenizer = load_tokenizer("auto", args.tokenizer)
    else:
        tokenizer = checkpoint_tokenizer(args.checkpoint)
    true_vocab = tokenizer.vocab_size
    if true_vocab > model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {true_vocab} tokens, the model only {model.config.vocab_size} rows: "
            "not this checkpoint's tokenizer"
        )
    try:
        eos_id = tokenizer.eod
    except ValueError:  # a Hugging Face tokenizer without an eos token: stop at the length
        eos_id = None
    prompt_ids = tokenizer.encode(args.prompt)
    # An empty prompt starts a fresh document: documents follow an end-of-document token.
    start = prompt_ids or ([eos_id] if eos_id is not None else [])
    if not start:
        raise ValueError("--prompt: empty, and the tokenizer has no end-of-document token")
    limit = model.config.max_position_embeddings
    if len(start) > limit:
        raise ValueError(f"--prompt: {len(start)} tokens exceed the model's {limit} positions")
    room = limit - len(start) + 1  # the last new token needs no position (see generate)
    max_new = args.max_new_tokens
    if max_new > room:
        print(f"> only {room} new tokens fit the model's context", file=sys.stderr)
        max_new = room
    generator = torch.Generator()
    if args.seed is None:
        generator.seed()
    else:
        generator.manual_seed(args.seed)
    began = time.perf_counter()
    new_ids = generate(
        model, start, max_new, greedy=args.greedy,
        temperature=1.0 if args.temperature is None else args.temperature,
        top_k=args.top_k, top_p=args.top_p, use_cache=not args.no_cache,
        generator=generator, eos_id=eos_id, true_vocab=true_vocab,
    )  # fmt: skip
    seconds = time.perf_counter() - began
    # Decoding prompt and continuation together keeps the spacing at the seam right; the
    # prompt is then shown exactly as typed.
    head = tokenizer.decode(prompt_ids)
    text = tokenizer.decode(prompt_ids + new_ids)
    continuation = text[len(head) :] if text.startswith(head) else tokenizer.decode(new_ids)
    print(args.prompt + continuation)
    mode = "no cache" if args.no_cache else "KV cache"
    print(
        f"> {len(new_ids)} tokens in {seconds:.2f} s ({len(new_ids) / max(seconds, 1e-9):.1f} "
        f"tokens/s, {mode})",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    from checkpoint.store import CheckpointError

    try:
        args = _parser().parse_args(argv)
        _check_args(args)
        _run(args)
    # A damaged checkpoint (truncated safetensors, garbled JSON) is a CheckpointError naming
    # the file; an unreadable one an OSError naming it.
    except (UsageError, CheckpointError, OSError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

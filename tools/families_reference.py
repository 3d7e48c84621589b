"""Tiny checkpoints of each supported model family, with transformers' own logits and greedy
continuations: called by make_reference_data.py (same scratch venv, same conventions).

One checkpoint per family and variant, each with a sliding window (where the family has one)
shorter than the 32-token test prompt, so masks that cut or ignore the window show:

  tiny_llama3      Llama, RoPE scaling 'llama3' (original context 64: one frequency band
                   between the low and high wavelengths, so the smoothing is exercised)
  tiny_qwen3       Qwen3: q/k RMSNorm, head width not d_model / heads
  tiny_qwen3_yarn  the same with RoPE scaling 'yarn'
  tiny_mistral     Mistral, sliding window 8 on every layer
  tiny_gemma2      Gemma 2: window 8 on alternate layers, attention and final logit
                   soft-capping low enough to bite, query_pre_attn_scalar != head width
  tiny_gemma3      Gemma 3 (text): window 8 on 2 of 3 layers, q/k norms, local RoPE base,
                   linear RoPE scaling on the global layer; config.json in the layout of the
                   checkpoints in the wild (rope_theta, rope_local_base_freq, rope_scaling,
                   sliding_window_pattern; no layer_types), checked to reload identically

reference.npz: tokens int32 [32], logits float32 [32, 300] (one pass, no cache, eager
attention), greedy int32 [64] (generate, greedy, no EOS stop, with transformers' cache),
greedy_margin float32 [64] (top-1 minus top-2 logit at each step, recomputed without the
cache; the greedy path is asserted equal to the argmax of those passes).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

N_PROMPT, N_GREEDY, WINDOW = 32, 64, 8
_SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
              eos_token_id=None, pad_token_id=0)


def _specs():
    qwen3 = dict(_SHAPE, num_hidden_layers=2, head_dim=24, rope_theta=1000000.0,
                 tie_word_embeddings=False, rms_norm_eps=1e-6)
    gemma = dict(_SHAPE, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24,
                 sliding_window=WINDOW, rms_norm_eps=1e-6, tie_word_embeddings=True)
    return {
        "tiny_llama3": (LlamaForCausalLM, LlamaConfig(
            **_SHAPE, num_hidden_layers=2, tie_word_embeddings=False, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}), 21),
        "tiny_qwen3": (Qwen3ForCausalLM, Qwen3Config(**qwen3), 22),
        "tiny_qwen3_yarn": (Qwen3ForCausalLM, Qwen3Config(**{**qwen3, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
            "original_max_position_embeddings": 32}}), 23),
        "tiny_mistral": (MistralForCausalLM, MistralConfig(
            **_SHAPE, num_hidden_layers=2, sliding_window=WINDOW, tie_word_embeddings=False,
            rms_norm_eps=1e-5, rope_theta=10000.0), 24),
        "tiny_gemma2": (Gemma2ForCausalLM, Gemma2Config(
            **gemma, attn_logit_softcapping=5.0, final_logit_softcapping=3.0), 25),
        "tiny_gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(
            **gemma, sliding_window_pattern=3, rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), 26),
    }


def _gemma3_v4_style(path: Path) -> None:
    """config.json as Gemma 3 checkpoints on the hub write it (transformers 4.x)."""
    cfg = json.loads(path.read_text())
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp["full_attention"]["rope_theta"]
    cfg["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
    cfg["rope_scaling"] = {k: v for k, v in rp["full_attention"].items() if k != "rope_theta"}
    cfg["sliding_window_pattern"] = 3
    cfg.pop("layer_types")
    cfg["torch_dtype"] = cfg.pop("dtype")
    path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")


@torch.no_grad()
def _greedy(model, tokens: np.ndarray):
    x = torch.from_numpy(tokens.astype(np.int64))[None]
    gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=N_GREEDY, min_new_tokens=N_GREEDY, eos_token_id=None,
                         pad_token_id=0, repetition_penalty=1.0)
    new = gen[0, x.shape[1]:].tolist()
    seq, margins = tokens.tolist(), []
    for token in new:
        top = torch.topk(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1], 2)
        assert int(top.indices[0]) == token, "cached greedy differs from uncached argmax"
        margins.append(float(top.values[0] - top.values[1]))
        seq.append(token)
    return np.asarray(new, np.int32), np.asarray(margins, np.float32)


@torch.no_grad()
def families(out: Path, init, to_np) -> dict:
    """Write each family's folder under `out`; `init(model, seed)` sets random weights
    (RMSNorm gains 1 + N(0, 0.2)), `to_np` makes float32 numpy arrays. Returns a summary."""
    summary = {}
    for name, (cls, cfg, seed) in _specs().items():
        torch.manual_seed(seed)
        cfg.dtype = torch.float32
        model = cls(cfg).to(torch.float32).eval()
        model.config._attn_implementation = "eager"
        init(model, seed)
        if "gemma" in name:  # Gemma's norms scale by (1 + w): gains near 1 as for the others
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.sub_(1.0)
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(d, safe_serialization=True)
        for p in d.iterdir():
            if p.name not in ("config.json", "model.safetensors"):
                p.unlink()
        if name == "tiny_gemma3":
            _gemma3_v4_style(d / "config.json")
        rng = np.random.RandomState(2000 + seed)
        tokens = rng.randint(3, cfg.vocab_size, size=N_PROMPT).astype(np.int32)
        ids = torch.from_numpy(tokens.astype(np.int64))[None]
        logits = model(input_ids=ids, use_cache=False).logits[0]
        again = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        assert torch.allclose(logits, again(input_ids=ids, use_cache=False).logits[0],
                              atol=1e-5, rtol=1e-5), name
        greedy, margins = _greedy(again, tokens)
        np.savez_compressed(d / "reference.npz", tokens=tokens, logits=to_np(logits),
                            greedy=greedy, greedy_margin=margins)
        for p in d.iterdir():
            p.chmod(0o644)
        with safe_open(str(d / "model.safetensors"), "pt") as sf:
            keys = sorted(sf.keys())
        summary[name] = {"class": cls.__name__, "seed": seed, "safetensors_keys": keys,
                         "logits_std": float(logits.std()),
                         "greedy_min_margin": float(margins.min())}
    return summary

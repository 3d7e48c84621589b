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
  tiny_gemma3_mm   Gemma3ForConditionalGeneration, as Gemma 3 4B/12B/27B are published: a
                   2-layer text model (window 8 on layer 0, linear scaling on layer 1) with a
                   tiny SigLIP vision tower and projector; config.json in the hub's layout (a
                   `text_config` holding only what differs from Gemma3TextConfig's defaults),
                   weights in bfloat16 under the hub's names (language_model.model.*,
                   vision_tower.vision_model.*, multi_modal_projector.*); the reference is the
                   text logits of a text-only prompt, checked to reload identically

tiny_spm.json: two SentencePiece BPE vocabularies (byte fallback, identity normalization,
with and without the dummy space prefix) trained here by the `sentencepiece` package, as a
GGUF file stores them (tokens, scores, token types, add_space_prefix, unknown id), and
SentencePiece's own ids and decoded text for a few hundred strings (code, prose, unicode
outside the vocabulary, whitespace runs, tabs, newlines).

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
from safetensors.torch import save_file
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
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


def _reference(d: Path, cls, model, vocab: int, seed: int, to_np) -> dict:
    """reference.npz for the checkpoint saved in `d` from `model` (see the module's doc),
    after checking that transformers reloads the folder to the same logits."""
    rng = np.random.RandomState(2000 + seed)
    tokens = rng.randint(3, vocab, size=N_PROMPT).astype(np.int32)
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    logits = model(input_ids=ids, use_cache=False).logits[0]
    again, info = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager",
                                      output_loading_info=True)
    assert not any(info.values()), (d.name, info)  # every weight read, none left over
    again.eval()
    assert torch.allclose(logits, again(input_ids=ids, use_cache=False).logits[0],
                          atol=1e-5, rtol=1e-5), d.name
    greedy, margins = _greedy(again, tokens)
    np.savez_compressed(d / "reference.npz", tokens=tokens, logits=to_np(logits),
                        greedy=greedy, greedy_margin=margins)
    for p in d.iterdir():
        p.chmod(0o644)
    with safe_open(str(d / "model.safetensors"), "pt") as sf:
        keys = sorted(sf.keys())
    return {"class": cls.__name__, "seed": seed, "safetensors_keys": keys,
            "logits_std": float(logits.std()), "greedy_min_margin": float(margins.min())}


def _new_model(cls, cfg, seed: int, init):
    torch.manual_seed(seed)
    cfg.dtype = torch.float32
    model = cls(cfg).to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    init(model, seed)
    if "Gemma" in cls.__name__:  # Gemma's norms scale by (1 + w): gains near 1 as for the others
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.sub_(1.0)
    return model


@torch.no_grad()
def families(out: Path, init, to_np, only=None) -> dict:
    """Write each family's folder under `out` (those named in `only`, if given);
    `init(model, seed)` sets random weights (RMSNorm gains 1 + N(0, 0.2)), `to_np` makes
    float32 numpy arrays. Returns a summary."""
    summary = {}
    for name, (cls, cfg, seed) in _specs().items():
        if only is not None and name not in only:
            continue
        model = _new_model(cls, cfg, seed, init)
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(d, safe_serialization=True)
        for p in d.iterdir():
            if p.name not in ("config.json", "model.safetensors"):
                p.unlink()
        if name == "tiny_gemma3":
            _gemma3_v4_style(d / "config.json")
        summary[name] = _reference(d, cls, model, cfg.vocab_size, seed, to_np)
    if only is None or "tiny_gemma3_mm" in only:
        summary["tiny_gemma3_mm"] = gemma3_multimodal(out / "tiny_gemma3_mm", init, to_np)
    return summary


# The hub's names of Gemma3ForConditionalGeneration's weights (transformers 4.50's layout,
# which the published checkpoints keep; transformers >= 4.52 renames them when loading).
_HUB_NAMES = ((r"^model\.language_model\.", "language_model.model."),
              (r"^lm_head\.", "language_model.lm_head."),
              (r"^model\.vision_tower\.", "vision_tower.vision_model."),
              (r"^model\.multi_modal_projector\.", "multi_modal_projector."))


def _non_default(values: dict, defaults: dict) -> dict:
    return {k: v for k, v in sorted(values.items()) if k not in defaults or defaults[k] != v}


@torch.no_grad()
def gemma3_multimodal(d: Path, init, to_np) -> dict:
    """tiny_gemma3_mm (see the module's doc)."""
    import re

    seed = 27
    text = dict(_SHAPE, num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=24,
                sliding_window=WINDOW, sliding_window_pattern=2, rms_norm_eps=1e-6,
                rope_scaling={"rope_type": "linear", "factor": 2.0})
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
                  vision_use_head=False)
    top = dict(mm_tokens_per_image=4, boi_token_index=297, eoi_token_index=298,
               image_token_index=299)
    cfg = Gemma3Config(text_config=Gemma3TextConfig(**text), vision_config=vision, **top)
    model = _new_model(Gemma3ForConditionalGeneration, cfg, seed, init)
    for p in model.parameters():  # stored in bfloat16, as published: the reference is exact
        p.copy_(p.to(torch.bfloat16).to(torch.float32))
    d.mkdir(parents=True, exist_ok=True)
    for p in d.iterdir():
        p.unlink()
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied to the embedding, not stored
            continue
        for pattern, hub in _HUB_NAMES:
            name = re.sub(pattern, hub, name)
        state[name] = t.to(torch.bfloat16).contiguous()
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    text_defaults = Gemma3TextConfig().to_dict()
    vision_defaults = type(model.config.vision_config)().to_dict()
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              **top, "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
              "text_config": {**_non_default(text, text_defaults), "model_type": "gemma3_text"},
              "vision_config": _non_default(vision, vision_defaults) | {
                  "model_type": "siglip_vision_model"}}
    config["text_config"].pop("bos_token_id", None)
    (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return _reference(d, Gemma3ForConditionalGeneration, model, text["vocab_size"], seed, to_np)


def _spm_texts(rng: np.random.RandomState) -> tuple[list[str], list[str]]:
    """(training lines, test strings): Python's own sources and docstrings, and made-up
    strings with what a vocabulary of a few hundred pieces lacks."""
    import inspect
    import textwrap

    import argparse as m1, json as m2, textwrap as m3, pathlib as m4  # noqa: E401
    lines = []
    for mod in (m1, m2, m3, m4):
        lines += [ln for ln in inspect.getsource(mod).splitlines() if ln.strip()]
    train, held = lines[::2], lines[1::2]
    extra = ["naïve café — “quotes” ß ü Ω 中文 日本語", "emoji: 😀🚀👍🏽 ❤️", "  leading", "trailing  ",
             "a\tb\t\tc", "two\nlines\n", "\n\n\n", " ", "   ", "", "x", "Ωmega", "0xFF 3.14159",
             "tab\t and  double  spaces", "\u2581 literal block", "ﬁ ligature", "e\u0301 combining"]
    picked = [held[i] for i in rng.choice(len(held), 240, replace=False)]
    mixed = [held[i][: rng.randint(1, 40)] + rng.choice(extra) for i in rng.choice(len(held), 60)]
    return train + [textwrap.dedent(t) for t in extra[:3]], extra + picked + mixed


def spm_reference(out: Path) -> dict:
    """tiny_spm.json (see the module's doc)."""
    import io

    import sentencepiece as spm

    train, texts = _spm_texts(np.random.RandomState(31))
    models = {}
    for name, prefix in (("prefix", True), ("no_prefix", False)):
        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(train), model_writer=buf, model_type="bpe", vocab_size=600,
            byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=prefix,
            remove_extra_whitespaces=False, character_coverage=0.995, split_digits=True,
            minloglevel=2)
        sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
        ids = range(sp.get_piece_size())
        # SentencePiece's piece types (GGUF's numbering): 1 normal, 2 unknown, 3 control, 6 byte
        types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                 else 5 if sp.is_unused(i) else 1 for i in ids]
        cases = [[t, sp.encode(t), sp.decode(sp.encode(t))] for t in texts]
        models[name] = {"tokens": [sp.id_to_piece(i) for i in ids],
                        "scores": [sp.get_score(i) for i in ids], "token_types": types,
                        "add_space_prefix": prefix, "unk_id": sp.unk_id(), "cases": cases}
    (out / "tiny_spm.json").write_text(json.dumps(
        {"sentencepiece": spm.__version__, "models": models}, ensure_ascii=False) + "\n")
    return {name: {"pieces": len(m["tokens"]), "cases": len(m["cases"]),
                   "byte_fallbacks": sum(any(m["token_types"][i] == 6 for i in c[1])
                                         for c in m["cases"])}
            for name, m in models.items()}


if __name__ == "__main__":  # regenerate some folders: families_reference.py NAME... [--out DIR]
    import argparse
    import sys

    from make_reference_data import REPO, _init_big, _np_f32

    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+")
    ap.add_argument("--out", default=str(REPO / "tests" / "data"))
    args = ap.parse_args()
    summary = families(Path(args.out), _init_big, _np_f32, set(args.names) - {"tiny_spm"})
    if "tiny_spm" in args.names:
        summary["tiny_spm"] = spm_reference(Path(args.out))
    print(json.dumps(summary, indent=1), file=sys.stdout)

"""Tiny, deterministic checkpoints for tests: a Hugging Face folder with random weights and a
small byte-level BPE tokenizer, and a llama.cpp-style GGUF converter for such folders.

The tokenizer does not depend on the seed, so any two tiny checkpoints (a target and a draft
with different depths) share a vocabulary. Ids: 0 <|endoftext|>, 1 <|im_start|> (BOS),
2 <|im_end|> (EOS), 3..258 the 256 bytes, 259..299 merges learnt from a fixed text.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter

import ml_dtypes
import numpy as np

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 300
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = (
    "the quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n"
    "speculative sampling drafts tokens with a small model and the target checks them. "
    "for i in range(10):\n    print(i)\nthe end of the story is the start of another one."
)


def make_tiny_checkpoint(path: str, seed: int = 0, n_layers: int = 2, tied: bool = True,
                         qkv_bias: bool = False) -> str:
    """Write a Llama (or, with qkv_bias, Qwen2) Hugging Face folder at `path`: config.json,
    model.safetensors (float32, std 0.2 so logits are far from flat), tokenizer.json,
    tokenizer_config.json (ChatML template, EOS <|im_end|>). Returns `path`."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    d, f, heads, kv_heads, e = 64, 160, 4, 2, 16
    config = {
        "architectures": ["Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if qkv_bias else "llama",
        "vocab_size": VOCAB_SIZE, "hidden_size": d, "intermediate_size": f,
        "num_hidden_layers": n_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": e, "hidden_act": "silu",
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "rope_scaling": None, "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    rng = np.random.default_rng(seed)

    def normal(*shape, std=0.2):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    weights = {"model.embed_tokens.weight": normal(VOCAB_SIZE, d),
               "model.norm.weight": 1 + normal(d, std=0.1)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (heads * e, d), "self_attn.k_proj": (kv_heads * e, d),
                  "self_attn.v_proj": (kv_heads * e, d), "self_attn.o_proj": (d, heads * e),
                  "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d), "mlp.down_proj": (d, f)}
        for name, shape in shapes.items():
            weights[f"{p}{name}.weight"] = normal(*shape)
            if qkv_bias and name[-6:] in ("q_proj", "k_proj", "v_proj"):
                weights[f"{p}{name}.bias"] = normal(shape[0])
        weights[p + "input_layernorm.weight"] = 1 + normal(d, std=0.1)
        weights[p + "post_attention_layernorm.weight"] = 1 + normal(d, std=0.1)
    if not tied:
        weights["lm_head.weight"] = normal(VOCAB_SIZE, d)
    save_file(weights, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    write_tiny_tokenizer(path)
    return path


def write_tiny_tokenizer(path: str) -> None:
    """tokenizer.json and tokenizer_config.json of the tiny vocabulary into folder `path`."""
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as fh:
        fh.write(tiny_tokenizer().to_str(pretty=True))
    tok_config = {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "add_bos_token": False,
        "clean_up_tokenization_spaces": False, "chat_template": CHATML,
        "tokenizer_class": "GPT2Tokenizer", "model_max_length": 256,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(tok_config, fh, indent=2)


def tiny_tokenizer():
    """The tiny byte-level BPE as a `tokenizers.Tokenizer` (same for every call)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_chars = [_BYTE_TO_CHAR[b] for b in range(256)]
    vocab = {t: i for i, t in enumerate([*SPECIALS, *byte_chars])}
    merges = _learn_merges(VOCAB_SIZE - len(vocab))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab, merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tk


def _learn_merges(n: int) -> list[tuple[str, str]]:
    """Plain BPE training on the fixed corpus; ties go to the smallest pair, so the result
    never depends on library versions or hash order."""
    from tokenizers import pre_tokenizers

    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(_CORPUS)
    words = [list(w) for w, _ in pieces]
    merges = []
    for _ in range(n):
        pairs = Counter(p for w in words for p in zip(w, w[1:]))
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        words = [_merge(w, best) for w in words]
    return merges


def _merge(word: list[str], pair: tuple[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


_BYTE_TO_CHAR = _byte_to_char()


def write_gguf(folder: str, out_path: str, tensor_type: str = "F32") -> str:
    """Convert a tiny Hugging Face folder to GGUF the way llama.cpp's converter does,
    including its Q/K row permutation for 'llama' models, with 2-D weights stored as
    `tensor_type` (F32, F16, BF16, Q8_0, Q4_0, Q4_1). Returns `out_path`."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(folder, "config.json")) as fh:
        c = json.load(fh)
    arch = _GGUF_ARCH[c["architectures"][0]]
    writer = gguf.GGUFWriter(out_path, arch)
    _write_gguf_metadata(writer, c, folder)
    _write_family_metadata(writer, c, arch)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    heads = {"q_proj": c["num_attention_heads"], "k_proj": c["num_key_value_heads"]}
    for name, w in sorted(load_file(os.path.join(folder, "model.safetensors")).items()):
        kind = name.split(".")[-2]
        if arch == "llama" and kind in heads:  # llama.cpp's permute, for its interleaved RoPE
            n = heads[kind]
            w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + np.float32(1.0)  # llama.cpp stores Gemma's (1 + w)
        names = {**_GGUF_NAMES, **_GEMMA_NAMES} if arch.startswith("gemma") else _GGUF_NAMES
        target = names[name.split(".", 3)[-1] if ".layers." in name else name]
        target = target.format(name.split(".")[2]) if "{}" in target else target
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(target, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(target, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    **{f"{hf}.{kind}": f"blk.{{}}.{ours}.{kind}" for hf, ours in (
        ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
        ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"))
       for kind in ("weight", "bias")},
    "input_layernorm.weight": "blk.{}.attn_norm.weight",
    "post_attention_layernorm.weight": "blk.{}.ffn_norm.weight",
    "self_attn.q_norm.weight": "blk.{}.attn_q_norm.weight",
    "self_attn.k_norm.weight": "blk.{}.attn_k_norm.weight",
}
_GEMMA_NAMES = {"post_attention_layernorm.weight": "blk.{}.post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "blk.{}.ffn_norm.weight",
                "post_feedforward_layernorm.weight": "blk.{}.post_ffw_norm.weight"}
_GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
              "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
              "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}


def _write_family_metadata(writer, c: dict, arch: str) -> None:
    """What llama.cpp's converter writes beyond Llama's keys: head width, Gemma's window
    and soft caps (and, unlike it, Gemma 3's layers with a window, when not its fixed
    five-of-six), RoPE scaling (Llama 3's as the rope_freqs divisors)."""
    import gguf

    from specsamp.loading.families import config_from_hf

    cfg = config_from_hf(c)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    if arch.startswith("gemma"):
        writer.add_sliding_window(cfg.sliding_window)
        if arch == "gemma3":
            writer.add_sliding_window_pattern(list(cfg.sliding_layers))
        for key, cap in (("attn", cfg.attn_softcap), ("final", cfg.final_softcap)):
            if cap is not None:
                getattr(writer, f"add_{key}_logit_softcapping")(cap)
    scaling = dict(cfg.rope_scaling)
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif scaling.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    elif scaling.get("rope_type") == "llama3":
        divisors = _llama3_divisors(cfg.head_dim, cfg.rope_theta, scaling)
        writer.add_tensor("rope_freqs.weight", divisors)


def _llama3_divisors(head_dim: int, theta: float, p: dict) -> np.ndarray:
    """llama.cpp's converter's rope_freqs for Llama 3 scaling: per frequency, 1 (short
    wavelengths), the factor (long ones), or the smoothed blend's inverse."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _write_gguf_metadata(writer, c: dict, folder: str) -> None:
    from tokenizers import Tokenizer

    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    rope = c.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(c.get("rope_theta", rope.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_dimension_count(c.get("head_dim")
                                    or c["hidden_size"] // c["num_attention_heads"])
    tk = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    model = json.loads(tk.to_str())["model"]
    vocab = tk.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)


# --- bfloat16 checkpoints of a real model's shape (loading at scale) ---------------------

_ROWS = 8192  # rows generated at a time


def _llama_shapes(vocab, d, layers, heads, kv_heads, head_dim, ff, tied) -> dict:
    """HF name -> shape, in the order written."""
    shapes = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (heads * head_dim, d),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, d),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, d),
            p + "self_attn.o_proj.weight": (d, heads * head_dim),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (ff, d),
            p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
        })
    shapes["model.norm.weight"] = (d,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, d)
    return shapes


def _write_tensor(f, name: str, shape, rng) -> None:
    if len(shape) == 1:  # norm scales near 1
        f.write((1 + 0.05 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16).tobytes())
        return
    std = 1 / math.sqrt(shape[1])  # outputs of unit scale: logits neither flat nor huge
    for start in range(0, shape[0], _ROWS):
        rows = min(_ROWS, shape[0] - start)
        block = rng.standard_normal((rows, shape[1]), np.float32) * std
        f.write(block.astype(ml_dtypes.bfloat16).tobytes())


def _write_shard(path: str, shapes: dict, rng) -> None:
    """One safetensors file of bfloat16 tensors, written as they are generated."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, shape in shapes.items():
            _write_tensor(f, name, shape, rng)


def write_bf16_checkpoint(path: str, vocab: int = 4096, d: int = 256, layers: int = 4,
                          heads: int = 8, kv_heads: int = 2, head_dim: int = 32, ff: int = 512,
                          tied: bool = True, shards: int = 2, seed: int = 0) -> int:
    """A Llama-shaped Hugging Face folder in bfloat16 at `path` (random weights, the tiny
    tokenizer; the embedding padded to `vocab` rows), in `shards` shards written tensor by
    tensor as generated (little memory at any size). Returns the parameter count."""
    os.makedirs(path, exist_ok=True)
    shapes = _llama_shapes(vocab, d, layers, heads, kv_heads, head_dim, ff, tied)
    names = list(shapes)
    per = -(-len(names) // shards)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: shapes[n] for n in names[i * per:(i + 1) * per]}
        _write_shard(os.path.join(path, shard), part, rng)
        weight_map.update({n: shard for n in part})
    total = sum(math.prod(s) for s in shapes.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total * 2}, "weight_map": weight_map}, f, indent=1)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": d, "intermediate_size": ff, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": tied, "bos_token_id": 1,
        "eos_token_id": 2, "torch_dtype": "bfloat16",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_tiny_tokenizer(path)
    return total

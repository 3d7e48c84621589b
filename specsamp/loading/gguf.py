"""GGUF files (llama.cpp's format) -> ModelConfig, float32 parameters, Tokenizer.

Two layout facts matter here:
- GGUF lists a tensor's dimensions fastest-first, so the array of a weight is [out, in]
  (PyTorch's layout); our Dense kernels are [in, out].
- llama.cpp's converter permutes the rows of Q and K of 'llama' models so that its
  interleaved RoPE (pairs 2i, 2i+1) computes what Hugging Face's rotate-half RoPE (pairs
  i, i + E/2) computed. Our model is rotate-half, so the permutation is undone. Keeping it
  runs without error and produces fluent-looking nonsense, so tests check logits against an
  independent implementation. 'qwen2', 'qwen3' and Gemma models are written unpermuted
  (llama.cpp runs them with rotate-half), so nothing is undone there.

Gemma: llama.cpp's converter stores each RMSNorm weight plus one, so its norms scale by w
as stored (not 1 + w), and llama.cpp fixes what the format does not carry: the query
scale (head width, or D / H for the 27B models), the layers with a window (every other for
Gemma 2, five of six for Gemma 3, unless the file lists them) and Gemma 3's local RoPE base
10000 (unless the file gives one). Llama 3's RoPE scaling comes as the tensor of per-
frequency divisors `rope_freqs.weight`.
"""

from __future__ import annotations

import numpy as np

from specsamp.errors import UserError
from specsamp.loading.tokenizer import Tokenizer, TokenizerMeta, bpe_from_gguf, spm_from_gguf
from specsamp.models.llama import ModelConfig

_GEMMA = {"embed_scale": True, "post_norms": True, "activation": "gelu_tanh"}
# Per architecture: features it always has (ModelConfig fields), and llama.cpp's fixed rules.
_FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"qk_norm": True},
    "gemma2": {**_GEMMA, "window_every": 2, "big_layers": 46},
    "gemma3": {**_GEMMA, "qk_norm": True, "window_every": 6, "big_layers": 62,
               "local_rope_theta": 10000.0},
}
ARCHITECTURES = tuple(_FAMILIES)
_PERMUTED_QK = ("llama",)

# GGUF per-layer tensor -> our path under `layers` (kernels are transposed to [in, out])
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm/scale",
    "attn_q.weight": "attn/q/kernel",
    "attn_k.weight": "attn/k/kernel",
    "attn_v.weight": "attn/v/kernel",
    "attn_output.weight": "attn/o/kernel",
    "attn_q.bias": "attn/q/bias",
    "attn_k.bias": "attn/k/bias",
    "attn_v.bias": "attn/v/bias",
    "ffn_norm.weight": "mlp_norm/scale",
    "attn_q_norm.weight": "attn/q_norm/scale",
    "attn_k_norm.weight": "attn/k_norm/scale",
    "post_attention_norm.weight": "post_attn_norm/scale",
    "post_ffw_norm.weight": "post_mlp_norm/scale",
    "ffn_gate.weight": "mlp/gate/kernel",
    "ffn_up.weight": "mlp/up/kernel",
    "ffn_down.weight": "mlp/down/kernel",
}
_GLOBAL_TENSORS = ("token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight")


# Block formats kept as they are stored with `stored=True` (others are dequantized).
STORED_KINDS = ("Q4_0", "Q4_1", "Q8_0")


def read_gguf(path: str, stored: bool = False) -> tuple[ModelConfig, dict, Tokenizer]:
    """(config, flat {"layers/attn/q/kernel": array} in the Transformer's layout, tokenizer).
    Arrays are float32; with `stored`, matrices in STORED_KINDS come as block fields
    (`specsamp.quant.blocks.from_gguf_blocks`, plus 'transposed')."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise UserError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{path}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    tensors = {t.name: t for t in reader.tensors}
    cfg = _config(meta, arch, tensors)
    params = _params(tensors, cfg, permuted_qk=arch in _PERMUTED_QK, stored=stored)
    return cfg, params, _tokenizer(meta)


class _Metadata:
    def __init__(self, reader):
        self.fields = reader.fields

    def get(self, key, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def strings(self, key) -> list[str]:
        # contents() builds one Python object per element; decoding the parts directly skips
        # them, which is what a vocabulary of tens of thousands of entries needs.
        field = self.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    def ints(self, key) -> list[int]:
        field = self.fields[key]
        return [int(field.parts[i][0]) for i in field.data]


def _config(meta: _Metadata, arch: str, tensors: dict) -> ModelConfig:
    def need(key):
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise UserError(f"GGUF metadata lacks {arch}.{key}")
        return value

    family = _FAMILIES[arch]
    d_model, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    n_layers = int(need("block_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", d_model // n_heads))
    if int(meta.get(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise UserError("partial rotary embeddings are not supported")
    window, sliding = _windows(meta, arch, family, n_layers)
    cap = {k: meta.get(f"{arch}.{k}_logit_softcapping") for k in ("attn", "final")}
    features = {k: v for k, v in family.items() if k in ModelConfig.__dataclass_fields__}
    return ModelConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(need("feed_forward_length")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        max_seq_len=int(meta.get(f"{arch}.context_length", 8192)),
        rope_scaling=_rope_scaling(meta, arch, tensors),
        query_scale=_query_scale(meta, arch, family, n_layers, d_model // n_heads),
        attn_softcap=None if cap["attn"] is None else float(cap["attn"]),
        final_softcap=None if cap["final"] is None else float(cap["final"]),
        sliding_window=window,
        sliding_layers=sliding,
        **{**features, "local_rope_theta": _local_theta(meta, arch, family)},
    )


def _rope_scaling(meta: _Metadata, arch: str, tensors: dict) -> tuple:
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in tensors:  # Llama 3: inverse frequencies divided by these
        if scaling not in (None, "none"):
            raise UserError(f"RoPE scaling {scaling!r} with rope_freqs is not supported")
        factors = dequantize(tensors["rope_freqs.weight"]).reshape(-1)
        return (("divisors", tuple(float(f) for f in factors)), ("rope_type", "divisors"))
    if scaling in (None, "none"):
        return ()
    factor = ("factor", float(meta.get(f"{arch}.rope.scaling.factor", 1.0)))
    if scaling == "linear":
        return (factor, ("rope_type", "linear"))
    if scaling == "yarn":  # with transformers' defaults for what the file leaves out
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise UserError(f"GGUF metadata lacks {arch}.rope.scaling.original_context_length")
        extra = [(k, float(v)) for k, v in (
            ("beta_fast", meta.get(f"{arch}.rope.scaling.yarn_beta_fast")),
            ("beta_slow", meta.get(f"{arch}.rope.scaling.yarn_beta_slow"))) if v is not None]
        return tuple(sorted([factor, ("original_max_position_embeddings", int(original)),
                             ("rope_type", "yarn"), *extra]))
    raise UserError(f"GGUF RoPE scaling {scaling!r} is not supported (supported: linear, yarn, "
                    "Llama 3's rope_freqs)")


def _query_scale(meta: _Metadata, arch: str, family: dict, n_layers: int, width: int):
    scale = meta.get(f"{arch}.attention.scale")
    if scale is not None:
        return float(scale)
    if n_layers == family.get("big_layers"):  # llama.cpp: Gemma's 27B scales by D / H
        return width ** -0.5
    return None


def _local_theta(meta: _Metadata, arch: str, family: dict):
    if "local_rope_theta" not in family:
        return None
    return float(meta.get(f"{arch}.rope.freq_base_swa", family["local_rope_theta"]))


def _windows(meta: _Metadata, arch: str, family: dict, n_layers: int):
    window = meta.get(f"{arch}.attention.sliding_window")
    if not window or "window_every" not in family:
        return None, ()
    listed = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(listed, list) and len(listed) == n_layers:
        flags = tuple(bool(f) for f in listed)
    else:
        every = family["window_every"]
        flags = tuple(i % every < every - 1 for i in range(n_layers))
    return (int(window), flags) if any(flags) else (None, ())


def dequantize(tensor) -> np.ndarray:
    """float32 array of a GGUF tensor, in numpy (row-major, slowest dimension first) order."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize as gguf_dequantize

    try:
        out = gguf_dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise UserError(f"GGUF tensor type {Q(tensor.tensor_type).name} ({tensor.name}) "
                        "is not supported") from None
    return np.asarray(out, dtype=np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's HF->GGUF `permute`: rows [out] (optionally with an [in] axis)
    go from per-head interleaved (2i, 2i+1) pairs back to rotate-half (i, i + E/2) order."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _matrix(tensor, stored: bool, transposed: bool, unpermute: int = 0):
    """A GGUF matrix [out, in]: float32 (transposed to [in, out] for kernels), or with
    `stored` and a block format, its fields {codes, scale, min, transposed} in [out] rows.
    `unpermute`: the head count whose Q/K row permutation to undo (0: none)."""
    from gguf import GGMLQuantizationType as Q

    from specsamp.quant.blocks import from_gguf_blocks

    kind = Q(tensor.tensor_type).name
    if stored and kind in STORED_KINDS:
        cols, rows = (int(n) for n in tensor.shape)
        fields = from_gguf_blocks(np.asarray(tensor.data), kind, rows, cols)
        if unpermute:
            fields = {k: None if v is None else np.ascontiguousarray(unpermute_qk(v, unpermute))
                      for k, v in fields.items()}
        return {**fields, "transposed": transposed}
    w = dequantize(tensor)
    if unpermute:
        w = unpermute_qk(w, unpermute)
    return w.T if transposed else w


def _stack(items: list):
    """Stack per-layer arrays, or per-layer block fields field by field."""
    if isinstance(items[0], dict):
        return {k: (None if items[0][k] is None else np.stack([it[k] for it in items]))
                if k != "transposed" else items[0][k] for k in items[0]}
    # np.stack keeps the transposed views' strides; safetensors writes raw buffers.
    return np.ascontiguousarray(np.stack(items))


def _params(tensors: dict, cfg: ModelConfig, permuted_qk: bool, stored: bool = False) -> dict:
    known = set(_GLOBAL_TENSORS) | {f"blk.{i}.{n}" for i in range(cfg.n_layers)
                                    for n in _LAYER_TENSORS}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise UserError(f"unexpected GGUF tensors (unsupported model variant): {unknown[:4]}")
    heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}
    params = {"embed/embedding": _matrix(tensors["token_embd.weight"], stored, transposed=False),
              "final_norm/scale": dequantize(tensors["output_norm.weight"])}
    for suffix, dest in _LAYER_TENSORS.items():
        if f"blk.0.{suffix}" not in tensors:
            continue
        kind = suffix.split(".")[0]
        unpermute = heads[kind] if permuted_qk and kind in heads else 0
        stack = []
        for i in range(cfg.n_layers):
            t = tensors[f"blk.{i}.{suffix}"]
            if dest.endswith("kernel"):
                stack.append(_matrix(t, stored, transposed=True, unpermute=unpermute))
            else:
                w = dequantize(t)
                stack.append(unpermute_qk(w, unpermute) if unpermute else w)
        params[f"layers/{dest}"] = _stack(stack)
    if not cfg.tie_embeddings:
        w = _matrix(tensors["output.weight"], stored, transposed=True)
        params["lm_head/kernel"] = w if stored and isinstance(w, dict) else np.ascontiguousarray(w)
    return params


def _tokenizer(meta: _Metadata) -> Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise UserError(f"GGUF tokenizer model {model!r} is not supported (supported: gpt2, "
                        "i.e. byte-level BPE, and llama, i.e. SentencePiece BPE); load the "
                        "model from its Hugging Face folder instead")
    tokens = meta.strings("tokenizer.ggml.tokens")
    types = meta.ints("tokenizer.ggml.token_type") if "tokenizer.ggml.token_type" in meta.fields \
        else [1] * len(tokens)
    ids = {name: meta.get(f"tokenizer.ggml.{name}_token_id")
           for name in ("bos", "eos", "eot", "eom", "unknown", "padding")}
    if model == "gpt2":
        tk = bpe_from_gguf(tokens, meta.strings("tokenizer.ggml.merges"), types,
                           meta.get("tokenizer.ggml.pre", "default"))
    else:  # llama.cpp's default for a SentencePiece vocabulary: a space before the text
        tk = spm_from_gguf(tokens, [float(x) for x in meta.get("tokenizer.ggml.scores")], types,
                           bool(meta.get("tokenizer.ggml.add_space_prefix", True)), ids["unknown"])
    specials = {f"{name}_token": tokens[i] for name, i in
                (("bos", ids["bos"]), ("eos", ids["eos"]), ("unk", ids["unknown"]),
                 ("pad", ids["padding"])) if i is not None and 0 <= i < len(tokens)}
    tk_meta = TokenizerMeta(
        bos_id=ids["bos"],
        eos_ids=tuple(sorted({int(ids[k]) for k in ("eos", "eot", "eom") if ids[k] is not None})),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_spaces=False,  # llama.cpp sets this only for old pre-tokenizers we refuse
        special_strings=specials,
    )
    return Tokenizer(tk, tk_meta)

"""Hugging Face model families: a checkpoint's config.json -> ModelConfig, and the names of
its per-layer weights in our layout. What a family always has is data (`_FAMILIES`); what a
checkpoint may choose (RoPE scaling, windows, soft caps) is read from its config, with the
defaults transformers gives a config that leaves them out.

Supported: Llama (1-3.x; RoPE scaling 'llama3', 'linear', 'yarn'), Mistral (a sliding
window on every layer), Qwen2/2.5 (q/k/v biases; windows from `max_window_layers` when
`use_sliding_window`), Qwen3 (q/k norms), Gemma 2 and Gemma 3 text (see
`specsamp.models.config` for what each feature computes), and the text model of
Gemma3ForConditionalGeneration (how Gemma 3 4B/12B/27B are published: the text model's
settings in `text_config`, its weights under `language_model.model.`; the vision tower and
projector are not read).
"""

from __future__ import annotations

from specsamp.errors import UserError
from specsamp.models.config import ModelConfig
from specsamp.models.rope import SCALINGS

_GEMMA = {"norm_plus_one": True, "embed_scale": True, "post_norms": True, "tie": True,
          "activation": "gelu_tanh", "query_pre_attn_scalar": 256}
# Per architecture: the features it always has, and its defaults for fields a config omits.
_FAMILIES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {"window_on": "all"},
    "Qwen2ForCausalLM": {"qkv_bias": True, "window_on": "qwen"},
    "Qwen3ForCausalLM": {"qk_norm": True, "window_on": "qwen"},
    "Gemma2ForCausalLM": {**_GEMMA, "window_on": "even", "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0},
    "Gemma3ForCausalLM": {**_GEMMA, "qk_norm": True, "window_on": "pattern",
                          "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0},
}
# Multimodal checkpoints whose text model we run: architecture -> (the text model's
# architecture, the defaults of its `text_config`, which the published configs leave out).
# Gemma3TextConfig's defaults (transformers 4.50-5.x); rope_theta, rope_local_base_freq and
# sliding_window_pattern default as for Gemma3ForCausalLM (`_FAMILIES`, `_windows`).
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "use_bidirectional_attention": False,
}
_MULTIMODAL = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", _GEMMA3_TEXT_DEFAULTS)}
ARCHITECTURES = (*_FAMILIES, *_MULTIMODAL)

# HF per-layer weight -> our path under `layers` (kernels are transposed to [in, out]):
# Llama's names, which every family shares.
LAYER_WEIGHTS = {
    "input_layernorm.weight": "attn_norm/scale",
    "self_attn.q_proj.weight": "attn/q/kernel",
    "self_attn.k_proj.weight": "attn/k/kernel",
    "self_attn.v_proj.weight": "attn/v/kernel",
    "self_attn.o_proj.weight": "attn/o/kernel",
    "self_attn.q_proj.bias": "attn/q/bias",
    "self_attn.k_proj.bias": "attn/k/bias",
    "self_attn.v_proj.bias": "attn/v/bias",
    "post_attention_layernorm.weight": "mlp_norm/scale",
    "mlp.gate_proj.weight": "mlp/gate/kernel",
    "mlp.up_proj.weight": "mlp/up/kernel",
    "mlp.down_proj.weight": "mlp/down/kernel",
}
_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
_QK_NORMS = {"self_attn.q_norm.weight": "attn/q_norm/scale",
             "self_attn.k_norm.weight": "attn/k_norm/scale"}
# Gemma 2/3: `post_attention_layernorm` normalizes the attention's output (not the MLP's
# input, as in Llama); the MLP has its own pre- and post-norms.
_POST_NORMS = {"post_attention_layernorm.weight": "post_attn_norm/scale",
               "pre_feedforward_layernorm.weight": "mlp_norm/scale",
               "post_feedforward_layernorm.weight": "post_mlp_norm/scale"}
# RoPE parameters kept in ModelConfig.rope_scaling (the rest of a rope dict is not ours).
_ROPE_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
              "mscale", "mscale_all_dim", "truncate")


def layer_weights(cfg: ModelConfig) -> dict[str, str]:
    """{HF per-layer suffix: our path under `layers`} of every weight `cfg`'s layers have."""
    names = {k: v for k, v in LAYER_WEIGHTS.items() if cfg.qkv_bias or k not in _BIASES}
    if cfg.qk_norm:
        names.update(_QK_NORMS)
    if cfg.post_norms:
        names.update(_POST_NORMS)
    return names


def text_config(c: dict) -> dict:
    """The config of the text model: `c` itself, or a multimodal checkpoint's text_config
    with the defaults it leaves out filled in (tie_word_embeddings is read at the top
    level, as transformers ties a multimodal model's head)."""
    arch = (c.get("architectures") or ["?"])[0]
    if arch not in _MULTIMODAL:
        return c
    text_arch, defaults = _MULTIMODAL[arch]
    text = {**defaults, **(c.get("text_config") or {}), "architectures": [text_arch]}
    text["tie_word_embeddings"] = c.get("tie_word_embeddings",
                                        text.get("tie_word_embeddings", True))
    return text


def config_from_hf(c: dict) -> ModelConfig:
    c = text_config(c)
    arch = (c.get("architectures") or ["?"])[0]
    if arch not in _FAMILIES:
        raise UserError(f"architecture {arch!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    family = _FAMILIES[arch]
    if c.get("use_bidirectional_attention"):
        raise UserError("bidirectional attention (an embedding model) is not supported")
    activation = _activation(c, family)
    n_heads = int(c["num_attention_heads"])
    n_layers = int(c["num_hidden_layers"])
    theta, scaling, local_theta = _rope(c, family)
    window, sliding = _windows(c, family, n_layers)
    scalar = c.get("query_pre_attn_scalar", family.get("query_pre_attn_scalar"))
    return ModelConfig(
        vocab_size=int(c["vocab_size"]),
        d_model=int(c["hidden_size"]),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // n_heads),
        d_ff=int(c["intermediate_size"]),
        rope_theta=theta,
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", family.get("tie", False))),
        # Qwen2 always has q/k/v biases; Llama/Mistral only with attention_bias.
        qkv_bias=family.get("qkv_bias", False) or bool(c.get("attention_bias", False)),
        max_seq_len=int(c.get("max_position_embeddings", 8192)),
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        activation=activation,
        norm_plus_one=family.get("norm_plus_one", False),
        embed_scale=family.get("embed_scale", False),
        post_norms=family.get("post_norms", False),
        qk_norm=family.get("qk_norm", False),
        query_scale=None if scalar is None else float(scalar) ** -0.5,
        attn_softcap=_cap(c, family, "attn_logit_softcapping"),
        final_softcap=_cap(c, family, "final_logit_softcapping"),
        sliding_window=window,
        sliding_layers=sliding,
    )


def _activation(c: dict, family: dict) -> str:
    if c.get("mlp_bias"):
        raise UserError("MLP biases are not supported")
    if family.get("activation") == "gelu_tanh":
        act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UserError(f"Gemma activation {act!r} is not supported "
                            "(supported: gelu_pytorch_tanh)")
        return "gelu_tanh"
    if c.get("hidden_act", "silu") != "silu":
        raise UserError(f"activation {c['hidden_act']!r} is not supported (supported: silu)")
    return "silu"


def _cap(c: dict, family: dict, key: str) -> float | None:
    if key not in family and key not in c:
        return None
    value = c.get(key, family.get(key))
    return None if value is None else float(value)


def _rope(c: dict, family: dict) -> tuple[float, tuple, float | None]:
    """(global base, global scaling, base of the sliding layers or None) from either config
    layout: transformers 4.x (rope_theta, rope_scaling, rope_local_base_freq) or 5.x
    (rope_parameters, per layer type where they differ)."""
    params = c.get("rope_parameters") or {}
    per_type = "full_attention" in params or "sliding_attention" in params
    if per_type:
        glob = params.get("full_attention") or {}
    else:
        glob = params or c.get("rope_scaling") or {}
    theta = float(c.get("rope_theta", glob.get("rope_theta", family.get("rope_theta", 10000.0))))
    local = None
    if "rope_local_base_freq" in family:
        loc = (params.get("sliding_attention") or {}) if per_type else {}
        if _scaling(loc, c):
            raise UserError("RoPE scaling on sliding-window layers is not supported")
        local = float(c.get("rope_local_base_freq",
                            loc.get("rope_theta", family["rope_local_base_freq"])))
    return theta, _scaling(glob, c), local


def _scaling(rope: dict, c: dict) -> tuple:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return ()
    if kind not in SCALINGS:
        raise UserError(f"RoPE scaling {kind!r} is not supported "
                        f"(supported: {', '.join(s for s in SCALINGS if s != 'default')})")
    if float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UserError("partial rotary embeddings are not supported")
    p = {k: rope[k] for k in _ROPE_KEYS if rope.get(k) is not None}
    p["rope_type"] = kind
    # As transformers: the original context defaults to max_position_embeddings; yarn's
    # factor to the ratio of the two.
    original = p.setdefault("original_max_position_embeddings",
                            int(c.get("max_position_embeddings", 8192)))
    if "factor" not in p:
        if kind != "yarn":
            raise UserError(f"RoPE scaling {kind!r} needs a factor")
        p["factor"] = int(c.get("max_position_embeddings", 8192)) / original
    return tuple(sorted(p.items()))


def _windows(c: dict, family: dict, n_layers: int) -> tuple[int | None, tuple]:
    """(sliding window, per-layer flags): from `layer_types` where the config lists them,
    else by the family's rule."""
    window = c.get("sliding_window")
    rule = family.get("window_on")
    if rule == "qwen" and not c.get("use_sliding_window", False):
        window = None
    if not window:
        return None, ()
    types = c.get("layer_types")
    if types and rule != "all":  # transformers' Mistral ignores layer_types
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != n_layers:
            raise UserError(f"layer types {unknown or types} are not supported "
                            "(supported: sliding_attention, full_attention, one per layer)")
        flags = [t == "sliding_attention" for t in types]
    elif rule == "all":
        flags = [True] * n_layers
    elif rule == "even":
        flags = [i % 2 == 0 for i in range(n_layers)]
    elif rule == "pattern":
        pattern = int(c.get("sliding_window_pattern", 6))
        flags = [(i + 1) % pattern != 0 for i in range(n_layers)]
    elif rule == "qwen":
        flags = [i >= int(c.get("max_window_layers", 0)) for i in range(n_layers)]
    else:
        return None, ()
    return (int(window), tuple(flags)) if any(flags) else (None, ())

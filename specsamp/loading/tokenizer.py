"""Text <-> token ids, stop tokens and the chat template, for every checkpoint format.

The work is done by the `tokenizers` library (the engine behind Hugging Face's fast
tokenizers), so ids match Hugging Face exactly. A GGUF file stores the vocabulary, merges and
a pre-tokenizer *name*; `bpe_from_gguf` rebuilds the equivalent `tokenizers` pipeline. A
SentencePiece vocabulary in GGUF (tokens, scores, types: Gemma, Llama 1/2) becomes the
`tokenizers` pipeline of SentencePiece's BPE (`spm_from_gguf`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from specsamp.errors import UserError

# Special tokens that end a turn or a document in the common chat formats. llama.cpp treats
# these as end-of-generation too: a chat model that emits one has finished its answer.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>",
              "<end_of_turn>", "<|eom_id|>")

# GGUF token types (llama.cpp, SentencePiece's numbering): 1 = normal, 3 = control (special),
# 4 = user-defined (added, not special).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# Hugging Face's `clean_up_tokenization` replacements, applied in this order.
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


@dataclass(frozen=True)
class TokenizerMeta:
    """What the vocabulary alone does not say: which ids start and stop text, and the chat
    format. Stored next to tokenizer.json in the conversion cache."""

    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    add_bos: bool = False
    chat_template: str | None = None
    clean_up_spaces: bool = False
    special_strings: dict = field(default_factory=dict)  # bos_token, eos_token, ... for templates


class Tokenizer:
    def __init__(self, tk, meta: TokenizerMeta):
        self._tk = tk
        self.meta = meta
        self.bos_id = meta.bos_id
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        ends = [tk.token_to_id(t) for t in END_TOKENS if _is_special(tk, t)]
        self.eos_ids = tuple(sorted({*meta.eos_ids, *(i for i in ends if i is not None)}))
        self._bos_text = tk.id_to_token(meta.bos_id) if meta.bos_id is not None else None
        vocab = sorted(tk.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        self.fingerprint = hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        """Ids as Hugging Face's `tokenizer(text)` gives them: special-token strings such as
        <|im_start|> in the text become their ids; BOS is prepended only when the model's
        metadata asks for it, and not twice when the text (a rendered chat template) already
        starts with it."""
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if self.meta.add_bos and self.bos_id is not None and not text.startswith(self._bos_text):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.meta.clean_up_spaces:
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text

    def token_text(self, token_id: int) -> str | None:
        return self._tk.id_to_token(int(token_id))

    def chat(self, user_text: str, system: str | None = None) -> str:
        """The prompt for one user turn in the model's own chat format, ending where the
        assistant's answer begins (Hugging Face's apply_chat_template with
        add_generation_prompt=True)."""
        if not self.meta.chat_template:
            raise UserError("this model has no chat template; drop --chat and give a plain prompt")
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": user_text})
        return render_chat(self.meta.chat_template, messages, self.meta.special_strings)

    def to_json(self) -> str:
        return self._tk.to_str()


def render_chat(template: str, messages: list[dict], specials: dict) -> str:
    """Render a Jinja chat template in the sandbox and with the options Hugging Face uses,
    so that the prompt is the one the model was tuned on, byte for byte."""
    try:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise UserError("chat prompts need jinja2: pip install 'jinja2>=3.1'") from None

    def raise_exception(message):
        raise UserError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            **specials)


def _is_special(tk, text: str) -> bool:
    return any(t.content == text and t.special for t in tk.get_added_tokens_decoder().values())


# --- Hugging Face folders ---------------------------------------------------------------


def from_hf_files(tokenizer_json: str, tok_config: dict, model_config: dict,
                  generation_config: dict, chat_template: str | None = None) -> Tokenizer:
    """A tokenizer from a Hugging Face folder's files (already read; `chat_template` is the
    content of chat_template.jinja when the folder has one, which newer transformers write
    instead of the tokenizer_config.json entry)."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tk = HFTokenizer.from_str(tokenizer_json)
    except Exception as e:
        raise UserError(f"cannot read tokenizer.json: {e}") from None
    specials = {k: _token_text(v) for k, v in tok_config.items()
                if k.endswith("_token") and _token_text(v) is not None}
    bos_id = _id_of(tk, specials.get("bos_token"), model_config.get("bos_token_id"))
    eos = [tk.token_to_id(specials["eos_token"])] if "eos_token" in specials else []
    for source in (model_config, generation_config):
        eos += _as_list(source.get("eos_token_id"))
    template = chat_template or tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: the one called "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    meta = TokenizerMeta(
        bos_id=bos_id,
        eos_ids=tuple(sorted({int(i) for i in eos if i is not None})),
        add_bos=_adds_bos(tk, bos_id, tok_config),
        chat_template=template,
        clean_up_spaces=bool(tok_config.get("clean_up_tokenization_spaces", False)),
        special_strings=specials,
    )
    return Tokenizer(tk, meta)


def _adds_bos(tk, bos_id, tok_config) -> bool:
    """Whether the model expects BOS first: tokenizer_config's add_bos_token when present,
    else whatever the tokenizer's own post-processor does."""
    if "add_bos_token" in tok_config:
        return bool(tok_config["add_bos_token"]) and bos_id is not None
    ids = tk.encode("a", add_special_tokens=True).ids
    return bos_id is not None and bool(ids) and ids[0] == bos_id


def _token_text(value):
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _id_of(tk, text, fallback):
    found = tk.token_to_id(text) if text else None
    return found if found is not None else (int(fallback) if isinstance(fallback, int) else None)


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


# --- GGUF ----------------------------------------------------------------------------------


def bpe_from_gguf(tokens: list[str], merges: list[str], token_types: list[int], pre: str):
    """The `tokenizers` pipeline equivalent to llama.cpp's byte-level BPE ('gpt2' model) with
    the named pre-tokenizer. Returns a `tokenizers.Tokenizer` (BOS is `Tokenizer.encode`'s
    business, from the metadata)."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models

    bpe = models.BPE({t: i for i, t in enumerate(tokens)},
                     [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False, byte_fallback=False)
    tk = HFTokenizer(bpe)
    tk.pre_tokenizer = _pre_tokenizer(pre)
    tk.decoder = decoders.ByteLevel()
    return _with_added(tk, tokens, token_types)


def _with_added(tk, tokens: list[str], token_types: list[int]):
    """Control tokens as special tokens, user-defined ones as added tokens: both matched
    whole in the raw text, as llama.cpp matches them."""
    from tokenizers import AddedToken

    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, k in zip(tokens, token_types) if k == _CONTROL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, k in zip(tokens, token_types) if k == _USER_DEFINED])
    return tk


def spm_from_gguf(tokens: list[str], scores: list[float], token_types: list[int],
                  add_space_prefix: bool, unk_id: int | None):
    """SentencePiece's BPE ('llama' model in GGUF) as a `tokenizers` pipeline: spaces as
    '▁' (and one before the text, or after a special token, with `add_space_prefix`, as
    llama.cpp does), then adjacent pieces merged, always the pair whose merged piece has
    the highest score, until none is in the vocabulary; a character outside it becomes its
    UTF-8 bytes' <0xNN> tokens. The merges are ranked by their result's score (then id):
    equal scores of different pieces, which BPE training does not give, may break ties
    otherwise than SentencePiece's leftmost-first."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers

    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    bpe = models.BPE(vocab, _merges_by_score(tokens, scores, token_types),
                     unk_token=tokens[unk_id] if unk_id is not None else None,
                     fuse_unk=True, byte_fallback=True)
    tk = HFTokenizer(bpe)
    spaces = [normalizers.Replace(" ", "\u2581")]
    tk.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), *spaces] if add_space_prefix else spaces)
    tk.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return _with_added(tk, tokens, token_types)


def _merges_by_score(tokens, scores, token_types) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a normal piece, both halves normal
    pieces, best merged piece first."""
    normal = {t: i for i, (t, k) in reversed(list(enumerate(zip(tokens, token_types))))
              if k == _NORMAL}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _pre_tokenizer(pre: str):
    """llama.cpp pre-tokenizer names -> the Hugging Face pre-tokenizer of the same model.
    Only those whose equivalence is known are accepted: a near miss would still run and
    silently split text differently from training."""
    from tokenizers import pre_tokenizers as pt

    byte_level = pt.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in ("gpt2", "default"):
        return byte_level
    if pre == "smollm":  # SmolLM/SmolLM2: every digit on its own, then GPT-2's split
        return pt.Sequence([pt.Digits(individual_digits=True), byte_level])
    raise UserError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: gpt2, smollm); "
                    "load the model from its Hugging Face folder instead")


def meta_to_json(meta: TokenizerMeta) -> dict:
    return {"bos_id": meta.bos_id, "eos_ids": list(meta.eos_ids), "add_bos": meta.add_bos,
            "chat_template": meta.chat_template, "clean_up_spaces": meta.clean_up_spaces,
            "special_strings": meta.special_strings}


def from_saved(tokenizer_json: str, meta: dict) -> Tokenizer:
    """Inverse of (`Tokenizer.to_json()`, `meta_to_json`): the conversion cache's copy."""
    from tokenizers import Tokenizer as HFTokenizer

    meta = dict(meta, eos_ids=tuple(meta["eos_ids"]))
    return Tokenizer(HFTokenizer.from_str(tokenizer_json), TokenizerMeta(**meta))

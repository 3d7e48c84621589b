"""Tokenizers: ids and decodes equal Hugging Face's exactly (reference data), the chat
template renders the same prompt, stop tokens and BOS follow the model's metadata, and a
GGUF-stored vocabulary rebuilds the same tokenizer as its tokenizer.json."""

import json
import os

import pytest

from specsamp.errors import UserError
from specsamp.loading import tokenizer as tok
from specsamp.loading.hf import read_hf
from specsamp.testing import CHATML, make_tiny_checkpoint, tiny_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")))
    return read_hf(folder)[2]


def test_tiny_tokenizer_is_deterministic():
    """Target and draft checkpoints made apart must share the vocabulary."""
    assert tiny_tokenizer().to_str() == tiny_tokenizer().to_str()
    assert tiny_tokenizer().get_vocab_size() == 300


def test_round_trip_and_specials(tiny):
    text = "the quick brown fox 2024, naïve 😀 <|im_start|>user\nhi<|im_end|>"
    ids = tiny.encode(text)
    assert tiny.decode(ids) == text
    assert ids[-1] == 2 and 1 in ids  # special strings map to their ids
    assert tiny.decode(ids, skip_special_tokens=True) == text.replace("<|im_start|>", "").replace(
        "<|im_end|>", "")
    assert tiny.encode("") == []


def test_metadata(tiny):
    assert tiny.bos_id == 1
    assert tiny.eos_ids == (0, 2)  # <|im_end|> (eos_token) and <|endoftext|>
    assert tiny.vocab_size == 300
    assert tiny.encode("hi")[0] != tiny.bos_id  # add_bos_token is false


def test_chat_template(tiny):
    assert tiny.chat("hi") == (
        "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tiny.chat("hi", system="Be brief.").startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_bos_added_once_when_metadata_asks():
    meta = tok.TokenizerMeta(bos_id=1, eos_ids=(2,), add_bos=True, chat_template=CHATML)
    t = tok.Tokenizer(tiny_tokenizer(), meta)
    assert t.encode("hi")[0] == 1
    # A rendered chat template that already starts with BOS gets no second one.
    assert t.encode("<|im_start|>user") == tiny_tokenizer().encode("<|im_start|>user").ids


def test_no_chat_template_is_a_user_error():
    t = tok.Tokenizer(tiny_tokenizer(), tok.TokenizerMeta())
    with pytest.raises(UserError, match="no chat template"):
        t.chat("hi")


def test_gguf_vocabulary_rebuilds_the_same_tokenizer(tiny):
    """bpe_from_gguf on the tokens/merges/types that a GGUF file stores (as in
    specsamp.testing.write_gguf) encodes exactly like the tokenizer.json it came from."""
    data = json.loads(tiny.to_json())
    tokens = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    types = [3 if i < 3 else 1 for i in range(len(tokens))]
    rebuilt = tok.Tokenizer(tok.bpe_from_gguf(tokens, merges, types, "gpt2"), tiny.meta)
    assert rebuilt.fingerprint == tiny.fingerprint
    for text in ["the quick brown fox", "  spaces  ", "x<|im_end|>y", "123 4567", "é中😀"]:
        assert rebuilt.encode(text) == tiny.encode(text)


def test_unknown_gguf_pre_tokenizer_is_refused():
    with pytest.raises(UserError, match="pre-tokenizer 'tekken' is not supported"):
        tok.bpe_from_gguf(["a"], [], [1], "tekken")


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    """Ids, decodes (with and without special tokens), digits split one by one (the
    'smollm' pre-tokenizer), Unicode, emoji, CRLF: all equal to Hugging Face."""
    with open(os.path.join(DATA, "smollm2_reference.json")) as f:
        ref = json.load(f)
    t = smollm2.tokenizer
    for case in ref["tokenizer_round_trips"]:
        assert t.encode(case["text"]) == case["ids"], case["text"]
        assert t.decode(case["ids"]) == case["decode"]
        assert t.decode(case["ids"], skip_special_tokens=True) == case["decode_skip_special"]
    user = ref["chat_messages"][0]["content"]
    assert t.chat(user) == ref["chat_template_output"]
    assert t.bos_id == ref["tokenizer"]["bos_token_id"] and t.vocab_size == 49152
    assert ref["tokenizer"]["eos_token_id"] in t.eos_ids

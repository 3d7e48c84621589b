"""GGUF SentencePiece vocabularies ('llama' tokenizer model: Gemma, Llama 1/2) against the
`sentencepiece` package: tests/data/tiny_spm.json holds two BPE vocabularies it trained
(with and without the dummy space prefix), as a GGUF file stores them, and its ids and
decoded text for a few hundred strings (tools/families_reference.py)."""

import json
import os

import pytest

from specsamp.loading import gguf as gguf_loader
from specsamp.loading.tokenizer import (
    Tokenizer,
    TokenizerMeta,
    from_saved,
    meta_to_json,
    spm_from_gguf,
)

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="module")
def reference():
    with open(os.path.join(DATA, "tiny_spm.json"), encoding="utf-8") as f:
        return json.load(f)["models"]


def _tokenizer(m) -> Tokenizer:
    tk = spm_from_gguf(m["tokens"], m["scores"], m["token_types"], m["add_space_prefix"],
                       m["unk_id"])
    return Tokenizer(tk, TokenizerMeta())


@pytest.mark.parametrize("model", ["prefix", "no_prefix"])
def test_ids_and_text_match_sentencepiece(reference, model):
    """Catches merges in another order than by score, spaces not turned into '▁' (or a
    prefix added where the vocabulary has none, or missing where it has one), characters
    outside the vocabulary not spelled as their UTF-8 bytes' <0xNN> tokens, and decoding
    that does not undo all of these: every string's ids and decoded text are
    SentencePiece's; so they are after the conversion cache's round trip."""
    m = reference[model]
    tok = _tokenizer(m)
    assert tok.vocab_size == len(m["tokens"])
    wrong = [(text, ids, tok.encode(text)) for text, ids, _ in m["cases"] if tok.encode(text) != ids]
    assert not wrong, (len(wrong), wrong[:3])
    assert sum(any(m["token_types"][i] == 6 for i in ids) for _, ids, _ in m["cases"]) >= 20
    for text, ids, decoded in m["cases"]:
        assert tok.decode(ids) == decoded, (text, ids)
    again = from_saved(tok.to_json(), meta_to_json(tok.meta))  # the conversion cache's copy
    assert all(again.encode(text) == ids for text, ids, _ in m["cases"])


def _gguf_tokenizer(m, path, add_space_prefix):
    """The tokenizer the loader reads from a GGUF file holding `m`'s vocabulary as
    llama.cpp's converter writes a SentencePiece one (gguf-py's writer)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list(m["tokens"])
    w.add_token_scores(m["scores"])
    w.add_token_types(m["token_types"])
    w.add_unk_token_id(m["unk_id"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_loader._tokenizer(gguf_loader._Metadata(gguf.GGUFReader(str(path))))


def test_gguf_llama_tokenizer_is_read(reference, tmp_path):
    """Catches a SentencePiece GGUF refused, or read with llama.cpp's defaults misapplied:
    the file's add_space_prefix decides the prefix (absent: a prefix, as llama.cpp), its
    control tokens in the text become their ids, and BOS comes from the metadata."""
    m = reference["no_prefix"]
    tok = _gguf_tokenizer(m, tmp_path / "a.gguf", False)
    text, ids, _ = m["cases"][30]
    assert tok.encode(text) == [1, *ids] and tok.eos_ids == (2,)
    assert tok.encode(f"{m['tokens'][2]}{text}") == [1, 2, *ids]
    with_prefix = _gguf_tokenizer(m, tmp_path / "b.gguf", None)
    assert not tok.token_text(tok.encode("hello")[1]).startswith("\u2581")
    assert with_prefix.token_text(with_prefix.encode("hello")[1]).startswith("\u2581")

"""Distillation data: the target's own completions and standard-library source, with the
target's top-k next-token probabilities at every trained position, cached as shards.

Why this shape: sampling text from the target is slow (one decode step per token), scoring
text is fast (one forward per sequence). So text is sampled in batches with the engine
(greedy and T=1 alternately), then one teacher-forced forward gives the teacher's
probabilities for every position at once. Source code needs no sampling at all.

A shard is an .npz file (written atomically, so a killed run leaves none half-written):
  tokens   [N, T] int32     the sequence, right-padded with 0
  mask     [N, T] uint8     1 where position t is trained (predicts tokens[t + 1])
  domain   [N]    uint8     0 code, 1 prose
  top_ids  [N, T, k] uint16 the teacher's k most likely next tokens at t (T=1, raw logits)
  top_p    [N, T, k] float16 their probabilities
Shards are numbered in a fixed order from a fixed prompt list, so a resumed run skips the
shards that exist and produces the same data as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import time
from typing import Callable

import numpy as np

from specsamp.distill import corpus


@dataclasses.dataclass(frozen=True)
class DataConfig:
    dir: str  # shard folder (train/ and heldout/ inside)
    seq_len: int = 256
    max_prompt_tokens: int = 96
    max_new_tokens: int = 160
    batch_size: int = 8  # prompts per generation batch (= one shard of generated text)
    top_k: int = 64
    heldout_batches: int = 4  # held-out shards (batch_size prompts each), code and prose
    source_rows_per_shard: int = 8  # stdlib source chunks after each generated train shard
    max_train_batches: int = 10_000
    seed: int = 0


def _write(path: str, **arrays) -> None:
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def features_path(shard: str) -> str:
    """Where a shard's cached hidden states live: <split>/../features/<split>/<name>.npy."""
    split_dir, name = os.path.split(shard)
    return os.path.join(os.path.dirname(split_dir), "features", os.path.basename(split_dir),
                        name[:-len(".npz")] + ".npy")


def _write_features(shard: str, hidden: np.ndarray) -> None:
    """Written before the shard itself, so a shard on disk always has its features (a run
    killed between the two leaves features that the rerun overwrites)."""
    dest = features_path(shard)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    np.save(dest + ".tmp.npy", hidden)
    os.replace(dest + ".tmp.npy", dest)


def load_shards(folder: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.npz"))):
        if path.endswith(".tmp.npz"):
            continue
        with np.load(path) as z:
            out.append({k: z[k] for k in z.files})
    return out


def concat(shards: list[dict]) -> dict:
    return {k: np.concatenate([s[k] for s in shards]) for k in shards[0]} if shards else {}


class Teacher:
    """Top-k next-token probabilities of the target for whole sequences, in one forward,
    and the final hidden states of that forward (float16): the feature draft's inputs,
    cached beside the shard (`specsamp.distill.feature.features_path`) so that training
    need not run the target again."""

    def __init__(self, target, seq_len: int, batch: int, top_k: int):
        import jax
        import jax.numpy as jnp

        from specsamp.models import Model

        cfg = target.cfg
        self.params, self.seq_len, self.batch = target.params, seq_len, batch

        @jax.jit
        def forward(params, tokens):
            model = Model(cfg)
            hidden = model.full_forward(params, tokens, head=False)
            probs = jax.nn.softmax(model.logits(params, hidden).astype(jnp.float32), axis=-1)
            p, ids = jax.lax.top_k(probs, top_k)
            return ids, p, hidden.astype(jnp.float16)

        self._forward = forward

    def __call__(self, tokens: np.ndarray):
        """tokens [N, T] -> (top_ids uint16 [N, T, k], top_p float16 [N, T, k],
        hidden float16 [N, T, D])."""
        n = tokens.shape[0]
        outs = []
        for i in range(0, n, self.batch):
            chunk = tokens[i:i + self.batch]
            pad = self.batch - chunk.shape[0]
            if pad:
                chunk = np.concatenate([chunk, np.zeros((pad, chunk.shape[1]), chunk.dtype)])
            ids, p, hidden = self._forward(self.params, chunk)
            keep = self.batch - pad
            outs.append((np.asarray(ids)[:keep].astype(np.uint16),
                         np.asarray(p)[:keep].astype(np.float16), np.asarray(hidden)[:keep]))
        return tuple(np.concatenate(parts) for parts in zip(*outs))


class Sampler:
    """The target's completions for chat prompts: greedy on even batches, T=1 on odd ones."""

    def __init__(self, target, cfg: DataConfig):
        from specsamp.decoding.config import SamplingParams
        from specsamp.decoding.decode import Program
        from specsamp.decoding.engine import Engine

        self.target, self.cfg = target, cfg
        eos = tuple(target.tokenizer.eos_ids)
        self.engines = [
            Engine(Program(target.cfg, SamplingParams(t), None), target.params, None,
                   eos_ids=eos, max_new_tokens=cfg.max_new_tokens)
            for t in (0.0, 1.0)
        ]

    def encode(self, text: str) -> list[int]:
        tok = self.target.tokenizer
        return tok.encode(tok.chat(text))

    def __call__(self, batch_index: int, prompt_ids: list[list[int]]):
        engine = self.engines[batch_index % 2]
        seeds = [self.cfg.seed * 1_000_003 + batch_index * 1000 + i for i in range(len(prompt_ids))]
        raws = engine.run(prompt_ids, seeds)
        return [list(p) + list(r.token_ids) for p, r in zip(prompt_ids, raws)]


def _rows(seqs: list[list[int]], starts: list[int], seq_len: int):
    """Pad sequences to [N, T]; mask positions start-1 .. len-2 (those predict trained tokens)."""
    n = len(seqs)
    tokens = np.zeros((n, seq_len), np.int32)
    mask = np.zeros((n, seq_len), np.uint8)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        s = s[:seq_len]
        tokens[i, : len(s)] = s
        mask[i, max(start - 1, 0): len(s) - 1] = 1
    return tokens, mask


def build(cfg: DataConfig, target, log: Callable[[str], None] = print,
          deadline: float | None = None) -> None:
    """Write the held-out shards, then train shards until max_train_batches or the deadline
    (time.time() value). Existing shards are kept (resume)."""
    for split in ("train", "heldout"):
        os.makedirs(os.path.join(cfg.dir, split), exist_ok=True)
    teacher = Teacher(target, cfg.seq_len, cfg.batch_size, cfg.top_k)
    sampler = Sampler(target, cfg)
    plan = corpus.prompts(cfg.seed)
    encoded = {}
    for split, items in plan.items():
        encoded[split] = []
        for domain, text in items:
            ids = sampler.encode(text)
            if len(ids) <= cfg.max_prompt_tokens:
                encoded[split].append((domain, ids))
    log(f"prompts: {len(encoded['train'])} train, {len(encoded['heldout'])} held-out "
        f"(<= {cfg.max_prompt_tokens} tokens)")
    source = corpus.code_chunks(target.tokenizer, cfg.seq_len, cfg.seed)
    train_source = (ids for split, ids in source if split == "train")

    def gen_shard(split: str, index: int, items) -> None:
        path = os.path.join(cfg.dir, split, f"gen_{index:05d}.npz")
        if os.path.exists(path):
            return
        t0 = time.time()
        seqs = sampler(index + (10_000 if split == "heldout" else 0), [ids for _, ids in items])
        tokens, mask = _rows(seqs, [len(ids) for _, ids in items], cfg.seq_len)
        t1 = time.time()
        top_ids, top_p, hidden = teacher(tokens)
        _write_features(path, hidden)
        _write(path, tokens=tokens, mask=mask, domain=np.array([d for d, _ in items], np.uint8),
               top_ids=top_ids, top_p=top_p)
        log(f"{split} shard {index}: {int(mask.sum())} positions, "
            f"sample {t1 - t0:.1f}s, teacher {time.time() - t1:.1f}s")

    def source_shard(index: int) -> None:
        path = os.path.join(cfg.dir, "train", f"src_{index:05d}.npz")
        chunks = [next(train_source, None) for _ in range(cfg.source_rows_per_shard)]
        chunks = [c for c in chunks if c]
        if os.path.exists(path) or not chunks:  # the generator still advances: same data on resume
            return
        tokens, mask = _rows(chunks, [1] * len(chunks), cfg.seq_len)
        top_ids, top_p, hidden = teacher(tokens)
        _write_features(path, hidden)
        _write(path, tokens=tokens, mask=mask, domain=np.zeros(len(chunks), np.uint8),
               top_ids=top_ids, top_p=top_p)

    b = cfg.batch_size
    for i in range(cfg.heldout_batches):
        gen_shard("heldout", i, encoded["heldout"][i * b:(i + 1) * b])
    for i in range(cfg.max_train_batches):
        items = encoded["train"][i * b:(i + 1) * b]
        if not items or (deadline is not None and time.time() > deadline):
            break
        gen_shard("train", i, items)
        if cfg.source_rows_per_shard:
            source_shard(i)
    log("data: done")

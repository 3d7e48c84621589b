"""Distillation training: the draft learns the target's next-token distributions.

Acceptance of a draft token is alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q) (p the draft,
q the target, the paper's letters reversed in the code's `draft`/`teacher` names to avoid
confusion), so the loss is the teacher-weighted cross-entropy (KL up to a constant) plus
`tv_weight` * (1 - sum over the teacher's top-k of min(draft, teacher)). With the
teacher's top-k only, the measured alpha is a lower bound: it misses at most the teacher's
mass outside the top k (reported as `tail`).

Batches are chosen from the step number alone (a generator seeded by (seed, step)), so a
run resumed from a checkpoint sees the same batches as one that never stopped.
A checkpoint is one .npz: step, trainable parameters and optimizer state (tree leaves in
order), written atomically.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable

import numpy as np

from specsamp.distill import corpus
from specsamp.distill.draft import merge


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    n_layers: int = 2
    init_layers: tuple[int, ...] = (0, 1)
    learning_rate: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    batch_rows: int = 8
    steps: int = 100_000
    max_minutes: float | None = None
    tv_weight: float = 2.0
    # > 0: the training loss normalises over the N tokens with most teacher mass only (the
    # head's cost dominates a step; N = 16,384 covers ~0.99 of code, ~0.93 of prose mass).
    # The draft itself keeps the full head; held-out acceptance is always measured with it.
    train_vocab: int = 0
    checkpoint_every: int = 50
    eval_every: int = 200  # steps; also at the end
    seed: int = 0


def optimizer(cfg: TrainConfig):
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, max(cfg.warmup_steps, 1), max(cfg.steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, weight_decay=cfg.weight_decay))


def _bucket(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def token_subset(data: dict, n: int) -> np.ndarray:
    """The n token ids with the most teacher probability mass over trained positions."""
    weights = data["top_p"].astype(np.float32) * data["mask"][..., None]
    mass = np.bincount(data["top_ids"].ravel().astype(np.int64), weights=weights.ravel())
    return np.sort(np.argsort(-mass, kind="stable")[:n]).astype(np.int32)


def make_fns(draft_cfg, tv_weight: float, opt, subset: np.ndarray | None = None):
    """(train_step, position_stats), jitted. With `subset`, the training loss uses a head
    restricted to those token ids (teacher mass outside it is dropped); stats use the full head."""
    import jax
    import jax.numpy as jnp

    from specsamp.models import Model

    model = Model(draft_cfg)
    if subset is not None:
        sub = jnp.asarray(subset)
        to_sub = jnp.full((draft_cfg.vocab_size,), -1, jnp.int32).at[sub].set(jnp.arange(len(subset)))

    def forward_subset(params, tokens):
        hidden = model.full_forward(params, tokens, head=False)
        rows = model.head_rows(params, sub)
        logits = jnp.einsum("btd,nd->btn", hidden, rows).astype(jnp.float32)
        return jax.nn.log_softmax(logits, axis=-1)

    def subset_terms(params, batch):
        logq = forward_subset(params, batch["tokens"])
        ids = to_sub[batch["top_ids"].astype(jnp.int32)]
        p = jnp.where(ids >= 0, batch["top_p"].astype(jnp.float32), 0.0)
        logq_k = jnp.take_along_axis(logq, jnp.maximum(ids, 0), axis=-1)
        ce = -jnp.sum(p * logq_k, axis=-1)
        overlap = jnp.sum(jnp.minimum(p, jnp.exp(logq_k)), axis=-1)
        return ce, overlap

    def forward(params, tokens):
        logits = model.full_forward(params, tokens)
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    def stats(params, batch):
        """Per position: cross-entropy, 1 - sum_topk min(p, q), top-1 agreement."""
        logq = forward(params, batch["tokens"])
        ids = batch["top_ids"].astype(jnp.int32)
        p = batch["top_p"].astype(jnp.float32)
        logq_k = jnp.take_along_axis(logq, ids, axis=-1)
        ce = -jnp.sum(p * logq_k, axis=-1)
        overlap = jnp.sum(jnp.minimum(p, jnp.exp(logq_k)), axis=-1)
        top1 = (jnp.argmax(logq, axis=-1) == ids[..., 0]).astype(jnp.float32)
        return ce, overlap, top1

    def loss_fn(trainable, frozen, batch):
        if subset is not None:
            ce, overlap = subset_terms(merge(trainable, frozen), batch)
        else:
            ce, overlap, _ = stats(merge(trainable, frozen), batch)
        m = batch["mask"].astype(jnp.float32)
        per_pos = ce + tv_weight * (1.0 - overlap)
        return jnp.sum(per_pos * m) / jnp.maximum(jnp.sum(m), 1.0), jnp.sum(overlap * m) / jnp.maximum(jnp.sum(m), 1.0)

    return make_train_step(loss_fn, opt), jax.jit(stats)


def make_train_step(loss_fn, opt):
    """Jitted (trainable, frozen, opt_state, batch) -> (trainable, opt_state, loss, alpha)
    for loss_fn(trainable, frozen, batch) -> (loss, alpha)."""
    import jax
    import optax

    @jax.jit
    def train_step(trainable, frozen, opt_state, batch):
        (loss, alpha), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, frozen, batch)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss, alpha

    return train_step


def _coverage(data: dict, subset: np.ndarray) -> float:
    inside = np.isin(data["top_ids"], subset)
    p = data["top_p"].astype(np.float32) * data["mask"][..., None]
    return float((p * inside).sum() / max(p.sum(), 1e-9))


def pick_batch(data: dict, step: int, rows: int, seed: int) -> dict:
    rng = np.random.default_rng([seed, step])
    idx = np.sort(rng.choice(len(data["tokens"]), size=min(rows, len(data["tokens"])), replace=False))
    return trim({k: v[idx] for k, v in data.items() if k != "domain"})


def trim(batch: dict) -> dict:
    """Cut the time axis to the last used position (rounded up to 64: few compiled shapes)."""
    used = np.flatnonzero(batch["mask"].any(axis=0))
    t = min(_bucket(int(used[-1]) + 2 if len(used) else 1), batch["tokens"].shape[1])
    return {k: v[:, :t] for k, v in batch.items()}


def evaluate(stats_fn, params, heldout: dict, rows: int = 8) -> dict:
    """Held-out alpha (lower bound from the top-k), top-1 agreement and teacher tail, per domain."""
    sums = {d: np.zeros(4) for d in corpus.DOMAINS}  # overlap, top1, tail, count
    for i in range(0, len(heldout["tokens"]), rows):
        batch = trim({k: v[i:i + rows] for k, v in heldout.items() if k != "domain"})
        pad = rows - batch["tokens"].shape[0]
        if pad:  # keep one compiled shape per length bucket
            batch = {k: np.concatenate([v, np.zeros((pad, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}
        _, overlap, top1 = (np.asarray(a) for a in stats_fn(params, batch))
        m = batch["mask"].astype(bool)
        tail = 1.0 - batch["top_p"].astype(np.float32).sum(-1)
        dom = heldout["domain"][i:i + rows]
        for r, d in enumerate(dom):
            s = sums[corpus.DOMAINS[int(d)]]
            s += [overlap[r][m[r]].sum(), top1[r][m[r]].sum(), tail[r][m[r]].sum(), m[r].sum()]
    out = {}
    for d, (o, t1, tl, n) in sums.items():
        if n:
            out.update({f"alpha_{d}": o / n, f"top1_{d}": t1 / n, f"tail_{d}": tl / n, f"positions_{d}": int(n)})
    return out


# --- checkpoints ---------------------------------------------------------------------------

def save_checkpoint(path: str, step: int, trainable, opt_state) -> None:
    import jax

    leaves = jax.tree.leaves((trainable, opt_state))
    tmp = path + ".tmp.npz"
    np.savez(tmp, step=np.int64(step), **{f"leaf_{i:04d}": np.asarray(a) for i, a in enumerate(leaves)})
    os.replace(tmp, path)


def load_checkpoint(path: str, trainable, opt_state):
    """(step, trainable, opt_state) with the structure of the given trees."""
    import jax
    import jax.numpy as jnp

    treedef = jax.tree.structure((trainable, opt_state))
    with np.load(path) as z:
        n = treedef.num_leaves
        leaves = [jnp.asarray(z[f"leaf_{i:04d}"]) for i in range(n)]
        step = int(z["step"])
    trainable, opt_state = jax.tree.unflatten(treedef, leaves)
    return step, trainable, opt_state


def train(cfg: TrainConfig, draft_cfg, trainable, frozen, data: dict, heldout: dict,
          out_dir: str, log: Callable[[str], None] = print,
          on_eval: Callable[[int, dict, dict], None] | None = None,
          until: int | None = None, refresh: Callable[[], dict] | None = None,
          fns: Callable | None = None) -> dict:
    """Train from the latest checkpoint in out_dir (or from `trainable`); returns the last
    evaluation. Metrics go to out_dir/metrics.jsonl, one line per evaluation. `until` stops
    early at that step (as an interrupted run would), leaving a checkpoint to resume.
    `refresh()` (optional) is called after each evaluation and returns the training data
    again, grown by a data stage running beside training; batches then depend on what had
    arrived, so such a run is not bit-for-bit reproducible (one without refresh is).
    `fns(opt) -> (train_step, stats)` (optional) replaces the wide draft's loss and
    statistics (`make_fns`): the feature-conditioned draft trains through the same loop.
    `cfg` needs TrainConfig's schedule and loop fields (steps, batch_rows, seed, ...)."""
    opt = optimizer(cfg)
    opt_state = opt.init(trainable)
    ckpt = os.path.join(out_dir, "checkpoint.npz")
    step = 0
    if os.path.exists(ckpt):
        step, trainable, opt_state = load_checkpoint(ckpt, trainable, opt_state)
        log(f"resumed from {ckpt} at step {step}")
    if fns is None:
        subset = token_subset(data, cfg.train_vocab) if cfg.train_vocab else None
        if subset is not None:
            log(f"training head: {len(subset)} tokens covering "
                f"{_coverage(data, subset):.3f} of the teacher's top-k mass")
        train_step, stats_fn = make_fns(draft_cfg, cfg.tv_weight, opt, subset)
    else:
        subset = None
        train_step, stats_fn = fns(opt)
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.time()
    deadline = t_start + 60 * cfg.max_minutes if cfg.max_minutes else None
    positions = int(data["mask"].sum())
    losses, alphas = [], []
    result: dict = {}

    def do_eval():
        nonlocal result, data, positions
        params = merge(trainable, frozen)
        result = {"step": step, "epoch": step * cfg.batch_rows / len(data["tokens"]),
                  "train_positions": positions, "train_loss": float(np.mean(losses)) if losses else None,
                  "train_alpha": float(np.mean(alphas)) if alphas else None,
                  "minutes": (time.time() - t_start) / 60,
                  **evaluate(stats_fn, params, heldout, rows=cfg.batch_rows)}
        with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(result) + "\n")
        log("eval " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
        losses.clear(); alphas.clear()
        if on_eval is not None:
            on_eval(step, result, params)
        if refresh is not None:
            data = refresh()
            positions = int(data["mask"].sum())
            if subset is not None:
                log(f"data: {len(data['tokens'])} rows, {positions} positions; training head "
                    f"covers {_coverage(data, subset):.3f}")

    if step == 0:
        do_eval()
    last = min(cfg.steps, until) if until is not None else cfg.steps
    while step < last and (deadline is None or time.time() < deadline):
        batch = pick_batch(data, step, cfg.batch_rows, cfg.seed)
        trainable, opt_state, loss, alpha = train_step(trainable, frozen, opt_state, batch)
        step += 1
        losses.append(float(loss)); alphas.append(float(alpha))
        if step % cfg.checkpoint_every == 0:
            save_checkpoint(ckpt, step, trainable, opt_state)
        if step % cfg.eval_every == 0:
            do_eval()
        elif step % 10 == 0:
            log(f"step {step} loss {np.mean(losses[-10:]):.3f} train-alpha {np.mean(alphas[-10:]):.3f} "
                f"{(time.time() - t_start) / 60:.1f} min")
    save_checkpoint(ckpt, step, trainable, opt_state)
    if not result or result["step"] != step:
        do_eval()
    return result

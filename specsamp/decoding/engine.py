"""The engine: one `Program` on fixed weights, a small device API and the host runner on
top of it. Works on token ids; text lives in `specsamp.decoding.generator`.

Device API (each call compiles its program on first use of a shape, before any clock
starts, `specsamp.compilation`, and returns the seconds compiling took):
`empty` (a state of free slots), `insert` (prefill prompts into slots), `generate` (a
chunk of rounds at one K: `decode.generate`, the one round program), `gather` (rows into
fewer slots) and `resync` (a drafter's cache after plain rounds). `run` and `steps` are
the host runner (`specsamp.decoding.batching`) under a batching policy: `Static` (the
default: every prompt at once) or `Continuous` (slots refilled as rows finish).

Shapes are bucketed so that few programs are compiled: prompts pad to
`batching.prompt_bucket`, the cache to a multiple of 128 slots. Prefill runs passes of 32
positions up to each prompt's own length (their count is traced, so prompt lengths compile
nothing new); a batch whose prompts need different counts of passes is prefilled in groups
(`batching.prefill_groups`) rather than every row for the longest one's.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Generator, Sequence

import jax.numpy as jnp
import numpy as np

from specsamp.compilation import compiled
from specsamp.decoding import decode
from specsamp.decoding.batching import Batching, Continuous, Static, steps
from specsamp.decoding.config import KChoice, fixed_k, shape_key
from specsamp.decoding.decode import Program
from specsamp.decoding.rounds import RawSample
from specsamp.decoding.shapes import width_for
from specsamp.decoding.state import DecodeState
from specsamp.errors import UserError
from specsamp.mesh import replicate
from specsamp.models import Model

# policy(accepted, tested, depth[, tree_tokens]) -> index into the engine's k.shapes (its
# k.ks, then its k.trees): accepted and tested draft tokens of each running row so far,
# the engine's (accepted, tested) by draft position (of chain rounds, and of tree rounds'
# spines), and, where it has trees, each tree's tokens and its spines' (`tree_tokens`;
# `specsamp.decoding.kpolicy.KPolicy`).
PolicyFn = Callable[..., int]


@dataclasses.dataclass
class Engine:
    """Runs one `Program` on fixed weights.

    target_params / draft_params: pytrees (draft_params None for n-gram and the baseline).
    eos_ids: token ids that end a sample (kept in the output).
    k: the K values rounds may run at (default the program's own K), and tree shapes
      (`KChoice.trees`); with more than one, `policy` picks one before each chunk of rounds.
    Statistics over every run: rounds per K or tree (`k_rounds`, a tree by its widths,
    '2x1') and per slot count (`slot_rounds`), the drafter's accepted and tested tokens
    by draft position in chain rounds and tree rounds' spines (`depth`), and per tree the
    tokens its rounds emitted and those their spines would have (`tree_tokens`, keyed as
    `k_rounds`), for the K policy: a property of the drafter, not of a run; and the wall
    seconds of inserts and chunks (`prefill_s`, `decode_s`).
    """

    prog: Program
    target_params: object
    draft_params: object = None
    eos_ids: tuple[int, ...] = ()
    max_new_tokens: int = 256
    mesh: Any = None  # a tensor-parallel mesh (specsamp.mesh) the params are placed on
    k: KChoice | None = None
    policy: PolicyFn | None = None

    def __post_init__(self):
        self.prog = self.prog.with_backend()  # native kernels or XLA: once, for every program
        self.k = self.k or fixed_k(self.prog.k)
        self.k_rounds = collections.Counter()
        self.slot_rounds = collections.Counter()
        self.depth = (np.zeros(max(self.k.largest, 1)), np.zeros(max(self.k.largest, 1)))
        self.tree_tokens = {shape_key(t): np.zeros(2) for t in self.k.trees}
        self.prefill_s = self.decode_s = 0.0

    # -- sizes ---------------------------------------------------------------------------

    @property
    def max_prompt_tokens(self) -> int:
        return self.prog.target.max_seq_len - self.max_new_tokens - max(self.k.span, self.prog.span) - 2

    def slots_for(self, prompts: Sequence[Sequence[int]]) -> int:
        """Cache slots per row for a run of `prompts` (one size for every slot)."""
        need = width_for(prompts) + self.max_new_tokens + max(self.k.span, self.prog.span) + 2
        return -(-need // 128) * 128

    def check_prompt(self, ids: Sequence[int]) -> None:
        if not ids:
            raise UserError("empty prompt")
        if len(ids) > self.max_prompt_tokens:
            raise UserError(
                f"prompt has {len(ids)} tokens; at most {self.max_prompt_tokens} fit with "
                f"max-new-tokens {self.max_new_tokens} in the model's context of "
                f"{self.prog.target.max_seq_len}"
            )

    # -- device API ----------------------------------------------------------------------

    def place(self, state: DecodeState) -> DecodeState:
        """The decode state on the mesh: replicated, except the target's KV cache, which
        is split as the target's weights are (`Model.cache_sharding`)."""
        if self.mesh is None:
            return state
        cache = Model(self.prog.target, self.mesh).shard_cache(state.target_cache)
        return replicate(state.replace(target_cache=None), self.mesh).replace(target_cache=cache)

    def empty(self, prog: Program, batch: int, slots: int) -> DecodeState:
        """`batch` free slots of `slots` cache positions each, placed on the mesh."""
        return self.place(decode.empty_state(prog, batch, slots, self.max_new_tokens))

    def _params(self) -> dict:
        return dict(target_params=self.target_params, draft_params=self.draft_params)

    def insert(self, prog: Program, state: DecodeState, prompts: np.ndarray, lens: np.ndarray,
               seeds: np.ndarray, slots: np.ndarray, chunks: int,
               source: np.ndarray | None = None) -> tuple[DecodeState, float]:
        """Prefill prompts [n, P] (right-padded; lens [n], seeds [n] uint32) into state's
        rows `slots` [n] (a slot past the batch: a padding row, dropped) in `chunks` prefill
        passes (at least each prompt's `decode.prefill_chunks`). Every field of a slot is
        replaced, so nothing of its previous occupant survives. With `source` [n], prompts
        [u, P] and lens [u] are distinct prompts, each prefilled once, and slot i takes
        prompt source[i] (`decode.insert`)."""
        traced = dict(self._params(), state=state, prompts=jnp.asarray(prompts),
                      lens=jnp.asarray(lens), seeds=jnp.asarray(seeds),
                      slots=jnp.asarray(slots), chunks=jnp.int32(chunks),
                      source=None if source is None else jnp.asarray(source, jnp.int32))
        exe, seconds = compiled(decode.insert, dict(prog=prog, max_new=self.max_new_tokens), traced)
        return exe(**traced), seconds

    def generate(self, prog: Program, k: int, state: DecodeState, eos_ids, stop_ids,
                 max_rounds: int, refill_at: int) -> tuple[DecodeState, int, float]:
        """Rounds at K = k (0: plain) until no row runs, `max_rounds` have run or at least
        `refill_at` slots are free. Returns (state, rounds run: waits for them, compile s)."""
        traced = dict(self._params(), state=state, eos_ids=eos_ids, stop_ids=stop_ids,
                      max_rounds=jnp.int32(max_rounds), refill_at=jnp.int32(refill_at))
        exe, seconds = compiled(decode.generate, dict(prog=prog, k=k), traced)
        state, rounds = exe(**traced)
        return state, int(rounds), seconds

    def gather(self, state: DecodeState, rows: Sequence[int]) -> tuple[DecodeState, float]:
        """A state of len(rows) slots: state's rows `rows`, in that order (every field)."""
        traced = dict(state=state, rows=jnp.asarray(rows, jnp.int32))
        exe, seconds = compiled(decode.gather_rows, {}, traced)
        return exe(**traced), seconds

    def resync(self, prog: Program, state: DecodeState, width: int) -> tuple[DecodeState, float]:
        """The drafter's cache rebuilt from each row's first `width` tokens."""
        traced = dict(draft_params=self.draft_params, state=state)
        exe, seconds = compiled(decode.resync, dict(prog=prog, width=width), traced)
        return exe(**traced), seconds

    # -- host runner ---------------------------------------------------------------------

    def run(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], stop_ids: Sequence[int] = (),
            should_stop: Callable[[int, list[int]], bool] | None = None,
            progress: Callable[[int], None] | None = None,
            batching: Batching = Static()) -> list[RawSample]:
        """Generate for token-id prompts, one seed each. should_stop(i, generated_ids) is
        asked for prompt i between device calls (every `chunk_rounds` rounds) for stop
        strings; progress(n_done_prompts) likewise."""
        run = self.steps(prompts, seeds, stop_ids, should_stop, progress, batching)
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def steps(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], stop_ids: Sequence[int] = (),
              should_stop: Callable[[int, list[int]], bool] | None = None,
              progress: Callable[[int], None] | None = None,
              batching: Batching = Static()) -> Generator[None, None, list[RawSample]]:
        """`run`, one chunk at a time (`batching.steps`)."""
        return steps(self, batching, prompts, seeds, stop_ids, should_stop, progress)


__all__ = ["Continuous", "Engine", "RawSample", "Static"]

"""The engine's program carries its backend: native kernels or XLA is decided once."""

from specsamp.decoding.config import KChoice, SamplingParams
from specsamp.decoding.engine import Continuous
from specsamp.quant import kernels
from tests.test_exactness import PROMPT, make_engine


def test_backend_is_decided_once_per_program(monkeypatch):
    """Building the engine decides native kernels or XLA for its program and drafter; no
    program it traces afterwards (inserts, rounds at every K, a resync, a greedy draft
    from a reduced head) asks again. Catches a model, drafter or argmax in the loop built
    without the program's choice (e.g. `first_argmax(logits)` in `decode._score`)."""
    import dataclasses

    eng = make_engine(SamplingParams(0.0), "hybrid", 2, max_new=13)  # shapes no other test compiles
    eng = dataclasses.replace(eng, k=KChoice((0, 2), auto=True), policy=_Alternate())
    want = kernels.on_one_cpu_device()
    assert eng.prog.native is want and eng.prog.drafter.model.native is want

    def asked():
        raise AssertionError("backend decided while tracing")

    monkeypatch.setattr(kernels, "on_one_cpu_device", asked)
    got = eng.run([PROMPT, [5, 4, 3]], [0, 1], batching=Continuous(2, chunk_rounds=2))
    assert set(eng.k_rounds) == {0, 2} and all(len(r.token_ids) == 13 for r in got)


class _Alternate:
    """A K policy alternating between index 1 and 0 (plain rounds)."""

    def __init__(self):
        self.i = 0  # the first chunk drafts

    def __call__(self, accepted, tested, depth):
        self.i = 1 - self.i
        return self.i

"""The shapes a run compiles for: the prompt buffer's width and the prefill's groups.

Few shapes, few programs: prompts pad to a bucket, and rows are prefilled in groups of a
power of two rows, each for its own count of prefill passes.
"""

from __future__ import annotations

from typing import Sequence

from specsamp.decoding.decode import prefill_chunks

_MIN_BUCKET = 32


def prompt_bucket(n: int) -> int:
    """The padded length of a prompt of n tokens: 32, 64, 96, 128, then 192, 256, 384,
    512, 768, ... (1.5x and 2x each power of two). It sizes the run's arrays (the prompt
    buffer, and with max_new_tokens the cache), so few shapes are compiled; prefill does
    not compute the padding (it runs passes of `decode.PREFILL_CHUNK` positions up to each
    prompt's own length)."""
    n = max(n, 1)
    if n <= 128:
        return max(_MIN_BUCKET, -(-n // 32) * 32)
    top = 1 << (n - 1).bit_length()
    middle = top // 2 + top // 4
    return middle if n <= middle else top


def width_for(prompts: Sequence[Sequence[int]]) -> int:
    """The prompt buffer's width for a run of `prompts`: its longest one's bucket."""
    return prompt_bucket(max((len(p) for p in prompts), default=1))


def prefill_groups(lens: Sequence[int]) -> list[tuple[list[int], int]]:
    """How to prefill prompts of these lengths: groups (row indices, passes of the prefill
    loop, `decode.prefill_chunks`).

    One group (every row run for the longest prompt's passes) unless splitting saves at
    least a fifth of the positions computed. Rows are grouped by their own count of
    passes, each group split into powers of two (few shapes to compile: 18 rows -> 16 +
    2). Each row's numbers do not depend on its group (rows are computed alike whatever
    else is in a call, and passes past a row's prompt only write padding), so neither
    does its sample."""
    by_count: dict[int, list[int]] = {}
    for i, n in enumerate(lens):
        by_count.setdefault(prefill_chunks(int(n)), []).append(i)
    groups = []
    for count in sorted(by_count):
        rows = by_count[count]
        while rows:
            size = 1 << (len(rows).bit_length() - 1)
            groups.append((rows[:size], count))
            rows = rows[size:]
    whole = len(lens) * max(by_count)
    if sum(len(rows) * count for rows, count in groups) > 0.8 * whole:
        return [(list(range(len(lens))), max(by_count))]
    return groups

"""Latency, acceptance and speed-up per group of completions (`specsamp report`).

All aggregation is SQL over the DuckDB views of `specsamp.analysis.outputs`; Python only pairs
groups and applies two formulas:

- Speed-up of a speculative group = mean ms/token of its autoregressive baseline / its own
  mean ms/token (means over samples; the run summary of `specsamp run` uses the same). The baseline is the autoregressive group with equal values of every
  grouping key except mode, k and draft (so the same dataset and sampling settings). Its
  95% interval is the delta method on the log of the ratio of two means. When every sample
  of both groups pairs up with one of the other (same prompt id, seed, sampling settings
  and run: the same prompt decoded both ways) it is paired, which removes the spread of
  prompt lengths and difficulty that both sides share:
  se(log R)^2 = (v_b / m_b^2 + v_s / m_s^2 - 2 cov_bs / (m_b m_s)) / n;
  otherwise the two means are taken as independent:
  se(log R)^2 = v_b / (n_b m_b^2) + v_s / (n_s m_s^2). Interval: R exp(+-1.96 se).
  It needs two or more samples on each side; otherwise it is n/a.
- Two acceptance figures. `acceptance_rate` is token-weighted: accepted draft tokens /
  drafted tokens. `alpha` is the cost model's per-token acceptance probability: accepted /
  tested, where a loop tests its draft tokens up to and including the first rejection (a
  loop with fewer than K accepted has one rejection). Under the model's i.i.d. assumption
  alpha is the maximum-likelihood estimate; accepted/drafted is smaller (about 0.59 for
  alpha = 0.8, K = 4), so the prediction uses alpha. Accepted counts are of emitted draft
  tokens: a loop ended inside its draft by EOS, a stop string or id, or the token limit
  counts the draft tokens it emitted and one rejection, a small downward bias on short
  samples (at most one such loop per sample, its last).
- Predicted speed-up (Leviathan et al.; the cost model in docs/paper.md):
  (1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)), with K the group's draft length and c its
  mean cost_ratio (draft step time / target step time).

- Token trees (a setting with `tree` other than 'off'): a tree round scores its N nodes
  (drafted_per_loop) and keeps a path of 0..D of them (accepted_per_loop, D the depth, the
  k column). Such groups also get the histogram of the accepted depth per round and the
  mean nodes scored per round; alpha and the acceptance by position count a round's D
  levels (a round with fewer than D kept has one rejection), and the chain cost model's
  prediction is n/a. Tree and chain rows never share a group: when the tables hold tree
  rows, `tree` joins the grouping keys.

Percentiles are linear interpolation (numpy's default). A group of one sample has its
value as every percentile, and sd and intervals n/a.
"""

from __future__ import annotations

import dataclasses
import math

from specsamp.decoding import stats
from specsamp.errors import UserError

GROUP_KEYS = (
    "dataset", "mode", "target", "draft", "k", "tree", "temperature", "top_k", "top_p",
    "run_id", "config_hash", "worker_host", "device_kind",
)
DEFAULT_BY = ("dataset", "mode", "k", "temperature")
# A speculative group and its autoregressive baseline differ only in these keys.
_BASELINE_FREE = ("mode", "k", "draft", "tree")
QUANTILES = (0.1, 0.5, 0.9, 0.99)
Z95 = 1.959964


def parse_by(text: str | None) -> tuple[str, ...]:
    """The grouping keys from a comma list (default DEFAULT_BY); a UserError if unknown."""
    if not text:
        return DEFAULT_BY
    keys = tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    unknown = [k for k in keys if k not in GROUP_KEYS]
    if unknown or not keys:
        raise UserError(f"--by: unknown key(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(GROUP_KEYS)}")
    return keys


@dataclasses.dataclass(frozen=True)
class Summary:
    """Mean, sample sd and percentiles of one per-sample quantity (None where undefined)."""

    n: int
    mean: float | None
    sd: float | None
    p10: float | None
    p50: float | None
    p90: float | None
    p99: float | None


@dataclasses.dataclass(frozen=True)
class SpeedUp:
    measured: float
    low: float | None
    high: float | None
    baseline: dict


@dataclasses.dataclass
class Group:
    """Everything the report says about one group of completions."""

    key: dict
    samples: int = 0
    tokens: int = 0
    total_s: Summary | None = None
    ms_per_token: Summary | None = None
    acceptance_rate: float | None = None
    alpha: float | None = None
    tokens_per_call: float | None = None
    cost_ratio: float | None = None
    k: int | None = None
    nodes_per_round: float | None = None  # tree groups: mean drafted_per_loop (nodes scored)
    acceptance_by_position: list = dataclasses.field(default_factory=list)
    accepted_histogram: dict = dataclasses.field(default_factory=dict)
    errors: dict = dataclasses.field(default_factory=dict)
    speedup: SpeedUp | None = None
    predicted_speedup: float | None = None

    @property
    def speculative(self) -> bool:
        return bool(self.k) or self.key.get("mode") == "speculative"

    @property
    def tree(self) -> str:
        """The group's token tree ('off': chains; groups of tree rows always have the key)."""
        return self.key.get("tree") or "off"


def with_tree(con, by) -> tuple[str, ...]:
    """`by`, plus `tree` when the tables hold rows of a token tree: a tree round's counts
    (nodes scored, accepted depth) must not pool with a chain's."""
    by = tuple(by)
    if "tree" in by:
        return by
    sql = ("SELECT count(*) FROM (SELECT tree FROM completions UNION ALL SELECT tree FROM errors) "
           "WHERE tree <> 'off'")
    return by + ("tree",) if con.execute(sql).fetchone()[0] else by


def sql_columns(by) -> str:
    return ", ".join(f'"{k}"' for k in by)


def _stats_sql(column: str) -> str:
    q = ", ".join(str(x) for x in QUANTILES)
    return (f"count({column}), avg({column}), stddev_samp({column}), "
            f"quantile_cont({column}, [{q}])")


def _summary(n, mean, sd, qs) -> Summary:
    qs = [float(x) for x in qs] if qs else [None] * len(QUANTILES)
    return Summary(int(n), _num(mean), _num(sd), *qs)


def _num(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _group_rows(con, by) -> list[Group]:
    sql = f"""
        SELECT {sql_columns(by)}, count(*), sum(generated_tokens),
            {_stats_sql('total_s')}, {_stats_sql('ms_per_token')},
            sum(list_sum(accepted_per_loop)), sum(list_sum(drafted_per_loop)),
            sum(target_calls), avg(cost_ratio), min(k), max(k)
        FROM completions GROUP BY ALL ORDER BY ALL"""
    groups = []
    for row in con.execute(sql).fetchall():
        key = dict(zip(by, row[: len(by)]))
        (samples, tokens, *rest) = row[len(by):]
        total, ms, (accepted, drafted, calls, cost, kmin, kmax) = rest[:4], rest[4:8], rest[8:]
        groups.append(Group(
            key=key, samples=int(samples), tokens=int(tokens or 0),
            total_s=_summary(*total), ms_per_token=_summary(*ms),
            acceptance_rate=_num(stats.acceptance_rate(float(accepted or 0), drafted or 0)),
            tokens_per_call=_num(stats.tokens_per_call(float(tokens or 0), calls or 0)), cost_ratio=_num(cost),
            k=int(kmin) if kmin == kmax else None,
        ))
    return groups


def _loops_sql(by) -> str:
    """One row per speculative loop: the group keys, the draft positions it tested (_k: its
    K; a tree round's depth), its accepted count (_a) and the draft tokens it scored (_n:
    K, or a tree's nodes)."""
    return (f"SELECT {sql_columns(by)}, CASE WHEN tree = 'off' THEN _n ELSE k END AS _k, _a, _n "
            f"FROM (SELECT *, unnest(drafted_per_loop) AS _n, unnest(accepted_per_loop) AS _a "
            f"FROM completions)")


def _attach_loops(con, by, groups: dict) -> None:
    """alpha; the chance that draft position i is kept (accepted >= i) over loops that
    drafted i; the histogram of accepted tokens per loop; a tree's mean nodes per round."""
    sql = (f"SELECT {sql_columns(by)}, sum(_a), sum(CASE WHEN _a < _k THEN 1 ELSE 0 END) "
           f"FROM ({_loops_sql(by)}) GROUP BY ALL")
    for row in con.execute(sql).fetchall():
        accepted, rejected = float(row[-2]), int(row[-1])
        groups[tuple(row[: len(by)])].alpha = _num(stats.alpha(accepted, accepted + rejected))
    sql = f"""
        WITH loops AS ({_loops_sql(by)}),
        pos AS (SELECT {sql_columns(by)}, _a, unnest(range(1, _k + 1)) AS _i FROM loops)
        SELECT {sql_columns(by)}, _i, avg(CASE WHEN _a >= _i THEN 1.0 ELSE 0.0 END)
        FROM pos GROUP BY ALL ORDER BY ALL"""
    for row in con.execute(sql).fetchall():
        groups[tuple(row[: len(by)])].acceptance_by_position.append(float(row[-1]))
    sql = f"SELECT {sql_columns(by)}, _a, count(*) FROM ({_loops_sql(by)}) GROUP BY ALL ORDER BY ALL"
    for row in con.execute(sql).fetchall():
        groups[tuple(row[: len(by)])].accepted_histogram[int(row[-2])] = int(row[-1])
    if "tree" in by:
        sql = (f"SELECT {sql_columns(by)}, avg(_n) FROM ({_loops_sql(by)}) WHERE tree <> 'off' "
               f"GROUP BY ALL")
        for row in con.execute(sql).fetchall():
            groups[tuple(row[: len(by)])].nodes_per_round = _num(row[-1])


def _attach_errors(con, by, groups: dict) -> None:
    sql = f"SELECT {sql_columns(by)}, error_kind, count(*) FROM errors GROUP BY ALL ORDER BY ALL"
    for row in con.execute(sql).fetchall():
        key = tuple(row[: len(by)])
        if key not in groups:  # every prompt of this group failed
            groups[key] = Group(key=dict(zip(by, key)))
        groups[key].errors[row[-2]] = int(row[-1])


def ratio_ci(base: Summary, spec: Summary, z: float = Z95) -> tuple[float | None, float | None]:
    """Delta-method interval for base.mean / spec.mean (independent samples)."""
    if base.n < 2 or spec.n < 2 or base.sd is None or spec.sd is None:
        return None, None
    if not base.mean or not spec.mean:
        return None, None
    se = math.sqrt(base.sd**2 / (base.n * base.mean**2) + spec.sd**2 / (spec.n * spec.mean**2))
    ratio = base.mean / spec.mean
    return ratio * math.exp(-z * se), ratio * math.exp(z * se)


@dataclasses.dataclass(frozen=True)
class Pairs:
    """ms/token of a speculative group's samples paired with their baseline samples."""

    n: int
    var_base: float | None
    var_spec: float | None
    cov: float | None


# Columns that identify the same prompt decoded both ways (modes differ in nothing else).
_PAIR_ON = ("id", "dataset", "target", "temperature", "top_k", "top_p", "seed", "run_id")


def _paired(con, by) -> dict:
    """{group key: Pairs} for speculative groups, over (speculative, baseline) row pairs."""
    if "mode" not in by:
        return {}
    on = ", ".join(_PAIR_ON)
    sql = f"""
        WITH s AS (SELECT {sql_columns(by)}, {on}, ms_per_token AS _m FROM completions
                   WHERE mode = 'speculative'),
             b AS (SELECT {on}, ms_per_token AS _m FROM completions WHERE mode = 'autoregressive')
        SELECT {", ".join(f's."{k}"' for k in by)}, count(*), var_samp(b._m), var_samp(s._m),
               covar_samp(b._m, s._m)
        FROM s JOIN b USING ({on}) GROUP BY ALL"""
    return {tuple(row[: len(by)]): Pairs(int(row[-4]), *(_num(x) for x in row[-3:]))
            for row in con.execute(sql).fetchall()}


def paired_ratio_ci(base: Summary, spec: Summary, pairs: Pairs | None,
                    z: float = Z95) -> tuple[float | None, float | None]:
    """Paired delta-method interval for base.mean / spec.mean when every sample is in
    exactly one pair; otherwise the independent one (`ratio_ci`)."""
    if (pairs is None or pairs.n != base.n or pairs.n != spec.n or pairs.n < 2
            or None in (pairs.var_base, pairs.var_spec, pairs.cov) or not base.mean or not spec.mean):
        return ratio_ci(base, spec, z)
    mb, ms = base.mean, spec.mean
    var = (pairs.var_base / mb**2 + pairs.var_spec / ms**2 - 2 * pairs.cov / (mb * ms)) / pairs.n
    se = math.sqrt(max(var, 0.0))
    ratio = mb / ms
    return ratio * math.exp(-z * se), ratio * math.exp(z * se)


def predicted_speedup(a: float | None, k: int | None, c: float | None) -> float | None:
    """(1 - a^(K+1)) / ((1 - a)(K c + 1)) (`specsamp.decoding.stats`); None when unknown."""
    if a is None or not k or c is None:
        return None
    return _num(stats.predicted_speedup(a, k, c))


def baseline_key(key: dict) -> tuple:
    """What a group must share with its autoregressive baseline."""
    return tuple((k, v) for k, v in key.items() if k not in _BASELINE_FREE)


def _attach_speedups(groups: list[Group], pairs: dict | None = None) -> None:
    for g in groups:  # the chain cost model does not model a tree's round
        g.predicted_speedup = predicted_speedup(g.alpha, g.k, g.cost_ratio) if g.tree == "off" else None
    if not groups or "mode" not in groups[0].key:
        return  # modes are mixed inside each group: no baseline to compare with
    baselines = {baseline_key(g.key): g for g in groups
                 if g.key["mode"] == "autoregressive" and g.samples}
    for g in groups:
        base = baselines.get(baseline_key(g.key))
        if g.key["mode"] != "speculative" or base is None or not g.samples:
            continue
        b, s = base.ms_per_token, g.ms_per_token
        if b.mean and s.mean:
            ci = paired_ratio_ci(b, s, (pairs or {}).get(tuple(g.key.values())))
            g.speedup = SpeedUp(b.mean / s.mean, *ci, baseline=base.key)


def summarize(con, by=DEFAULT_BY) -> list[Group]:
    """One Group per distinct value of the `by` keys (and `tree`, `with_tree`), completions
    and errors together."""
    by = with_tree(con, by)
    groups = {tuple(g.key.values()): g for g in _group_rows(con, by)}
    _attach_loops(con, by, groups)
    _attach_errors(con, by, groups)
    ordered = [groups[k] for k in sorted(groups, key=group_sort_key)]
    _attach_speedups(ordered, _paired(con, by))
    return ordered


def group_sort_key(key: tuple):
    return tuple((v is None, "" if v is None else v) for v in key)


def to_json(groups: list[Group]) -> list[dict]:
    """Plain JSON-able dicts (NaN and missing values as None)."""
    out = []
    for g in groups:
        d = dataclasses.asdict(g)
        d["accepted_histogram"] = {str(k): v for k, v in g.accepted_histogram.items()}
        d["error_count"] = sum(g.errors.values())
        out.append(d)
    return out

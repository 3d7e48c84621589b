"""`specsamp report`: figures checked against numpy on synthetic tables with the real schema."""

from __future__ import annotations

import json
import math

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas import COMPLETIONS
from specsamp import cli
from specsamp.analysis import outputs, report, report_text
from specsamp.errors import UserError
from tests.synthetic_tables import completion_row, error_row, random_rows, write, write_errors


def _summarize(paths, by=report.DEFAULT_BY):
    return report.summarize(outputs.connect(outputs.resolve([str(p) for p in paths])), by)


def _by_key(groups):
    return {(g.key["mode"], g.key["k"]): g for g in groups}


@pytest.fixture
def sweep(tmp_path):
    """AR baseline, K=4 (with one zero-token row), and a K=2 group of a single sample."""
    rng = np.random.default_rng(7)
    ar = [completion_row(i, mode="autoregressive", tokens=int(rng.integers(5, 40)),
                         decode_s=float(rng.uniform(0.5, 2.0))) for i in range(30)]
    spec = random_rows(rng, 40, k=4)
    spec.append(completion_row(99, k=4, accepted=[], tokens=0, decode_s=0.0))  # ms/token NaN
    single = [completion_row(0, k=2, accepted=[2, 1, 0], decode_s=0.7)]
    write(tmp_path / "completions-0.parquet", ar + spec[:20])
    write(tmp_path / "completions-1.parquet", spec[20:] + single)
    return tmp_path, ar, spec, single


def _expect_summary(values, s: report.Summary):
    v = np.array([x for x in values if np.isfinite(x)])
    assert s.n == len(v)
    assert s.mean == pytest.approx(v.mean(), rel=1e-12)
    assert s.sd == pytest.approx(v.std(ddof=1), rel=1e-9)
    for q, got in zip((10, 50, 90, 99), (s.p10, s.p50, s.p90, s.p99)):
        assert got == pytest.approx(np.percentile(v, q), rel=1e-12)


def test_group_figures_match_numpy(sweep):
    """Catches wrong aggregates: mean/sd/percentiles, token sums, NaN rows leaking into means."""
    path, ar, spec, _ = sweep
    groups = _by_key(_summarize([path]))
    for rows, g in ((ar, groups[("autoregressive", 0)]), (spec, groups[("speculative", 4)])):
        assert g.samples == len(rows)
        assert g.tokens == sum(r["generated_tokens"] for r in rows)
        _expect_summary([r["total_s"] for r in rows], g.total_s)
        _expect_summary([r["ms_per_token"] for r in rows], g.ms_per_token)
        calls = sum(r["target_calls"] for r in rows)
        assert g.tokens_per_call == pytest.approx(g.tokens / calls)
    assert groups[("autoregressive", 0)].acceptance_rate is None


def test_acceptance_figures_match_loops(sweep):
    """Catches acceptance averaged per sample instead of per token, off-by-one positions."""
    path, _, spec, _ = sweep
    g = _by_key(_summarize([path]))[("speculative", 4)]
    loops = np.array([a for r in spec for a in r["accepted_per_loop"]])
    assert g.acceptance_rate == pytest.approx(loops.sum() / (4 * len(loops)))
    assert g.alpha == pytest.approx(loops.sum() / (loops.sum() + (loops < 4).sum()))
    assert g.acceptance_by_position == pytest.approx([(loops >= i).mean() for i in range(1, 5)])
    assert g.accepted_histogram == {a: int((loops == a).sum()) for a in range(5) if (loops == a).any()}


def test_speedup_and_prediction(sweep):
    """Speed-up is baseline mean / group mean; prediction uses alpha, K and mean c."""
    path, ar, spec, _ = sweep
    g = _by_key(_summarize([path]))[("speculative", 4)]
    base = np.mean([r["ms_per_token"] for r in ar])
    own = np.nanmean([r["ms_per_token"] for r in spec])
    assert g.speedup.measured == pytest.approx(base / own)
    assert g.speedup.low < g.speedup.measured < g.speedup.high
    a, c = g.alpha, 0.1
    assert g.predicted_speedup == pytest.approx((1 - a**5) / ((1 - a) * (4 * c + 1)))


def test_single_sample_group(sweep):
    """A group of one: sd and intervals n/a, percentiles = the value, no crash when printed."""
    path, _, _, single = sweep
    groups = _summarize([path])
    g = _by_key(groups)[("speculative", 2)]
    assert g.samples == 1 and g.total_s.sd is None and g.ms_per_token.sd is None
    assert g.ms_per_token.p99 == pytest.approx(single[0]["ms_per_token"])
    assert g.speedup.low is None and g.speedup.high is None
    assert g.acceptance_by_position == [2 / 3, 1 / 3]
    text = report_text.render(groups)
    assert "n/a" in text and "speculative" in text
    json.dumps(report.to_json(groups))


def test_predicted_speedup_known_values():
    """Hand-worked cost-model values (alpha = 0.8, K = 4, c = 0.1: 0.67232 / 0.28)."""
    assert report.predicted_speedup(0.8, 4, 0.1) == pytest.approx(0.67232 / 0.28)
    assert report.predicted_speedup(1.0, 3, 0.5) == pytest.approx(4 / 2.5)
    assert report.predicted_speedup(0.3, 1, 0.3) == pytest.approx(1.0)  # gain needs alpha > c
    assert report.predicted_speedup(None, 4, 0.1) is None


def test_ratio_interval_covers_true_ratio():
    """The delta-method interval covers the true ratio of means about 95% of the time."""
    rng = np.random.default_rng(0)
    trials = 600
    # E[lognormal(mu, s)] = e^(mu + s^2/2), so the true ratio of means is:
    true = 2.0 * math.exp(0.3**2 / 2 - 0.5**2 / 2)
    hits = 0
    for _ in range(trials):
        b = rng.lognormal(np.log(30), 0.3, 40)
        s = rng.lognormal(np.log(15), 0.5, 60)
        summ = [report.Summary(len(x), x.mean(), x.std(ddof=1), *([None] * 4)) for x in (b, s)]
        low, high = report.ratio_ci(*summ)
        hits += low <= true <= high
    assert 0.92 <= hits / trials <= 0.98


def test_error_rows_counted_per_group(tmp_path):
    """Error tables beside the completions are counted per group, including all-failed groups."""
    write(tmp_path / "completions-0.parquet",
          [completion_row(i, k=4) for i in range(3)] + [completion_row(9, mode="autoregressive")])
    write_errors(tmp_path / "errors-0.parquet",
                 [error_row(0, k=4), error_row(1, k=4, kind="empty_prompt"), error_row(2, k=4),
                  error_row(3, k=3, kind="generation_failed")])
    groups = _by_key(_summarize([tmp_path / "completions-0.parquet"]))
    assert groups[("speculative", 4)].errors == {"too_long": 2, "empty_prompt": 1}
    assert groups[("speculative", 3)].samples == 0
    assert groups[("speculative", 3)].errors == {"generation_failed": 1}
    assert groups[("autoregressive", 0)].errors == {}
    text = report_text.render(list(groups.values()))
    assert "generation_failed 1" in text and "too_long 2" in text


def test_older_schema_version_refused(tmp_path, capsys):
    """A table written by another schema version is refused with one line naming the version."""
    table = pa.Table.from_pylist([completion_row(0)], schema=COMPLETIONS)
    old = table.replace_schema_metadata({b"specsamp.schema_version": b"0"})
    pq.write_table(old, tmp_path / "completions-old.parquet")
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "schema version 0" in err


def test_missing_column_refused(tmp_path):
    table = pa.Table.from_pylist([completion_row(0)], schema=COMPLETIONS).drop_columns(["ms_per_token"])
    pq.write_table(table, tmp_path / "completions-0.parquet")
    with pytest.raises(UserError, match="missing column 'ms_per_token'"):
        outputs.resolve([str(tmp_path)])


def test_no_tables_and_bad_keys(tmp_path):
    with pytest.raises(UserError, match="no completion tables"):
        outputs.resolve([str(tmp_path)])
    with pytest.raises(UserError, match="does not exist"):
        outputs.resolve([str(tmp_path / "nope.parquet")])
    with pytest.raises(UserError, match="unknown key"):
        report.parse_by("dataset,colour")


def test_remote_tables_read_through_fsspec(sweep):
    """gs:// goes through fsspec into Arrow; memory:// exercises the same path offline."""
    path, *_ = sweep
    fs = fsspec.filesystem("memory")
    for name in ("completions-0.parquet", "completions-1.parquet"):
        fs.pipe(f"/bucket/run/{name}", (path / name).read_bytes())
    remote = _summarize(["memory://bucket/run"])
    local = _summarize([path])
    flat_remote, flat_local = _flatten(report.to_json(remote)), _flatten(report.to_json(local))
    assert flat_remote.keys() == flat_local.keys()
    for name, value in flat_local.items():  # equal up to summation order
        assert flat_remote[name] == (pytest.approx(value) if isinstance(value, float) else value), name


def _flatten(x, prefix=""):
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in _flatten(val, f"{prefix}.{key}").items()}
    if isinstance(x, list):
        return {k: v for i, val in enumerate(x) for k, v in _flatten(val, f"{prefix}[{i}]").items()}
    return {prefix: x}


def test_cli_json_and_plots(sweep, tmp_path_factory, capsys):
    path, *_ = sweep
    out = tmp_path_factory.mktemp("plots")
    assert cli.main(["report", str(path), "--json", "--plot", str(out), "--by", "dataset,mode,k"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {d["key"]["k"] for d in data} == {0, 2, 4}
    for name in ("ms_per_token_vs_k.png", "accepted_per_loop.png", "acceptance_by_position.png"):
        blob = (out / name).read_bytes()
        assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 10_000


def test_auto_setting_reads_auto_in_tables_and_figures(tmp_path, tmp_path_factory, capsys):
    """Catches `k: auto` rows (k = -1 in the output tables) shown as K = -1, or drawn at
    K = -1 in the per-K figures (which failed with a traceback): the text tables and the run
    summary say auto, the JSON keeps the tables' -1, the latency figure draws auto beside
    the fixed K, the per-K figures leave it out, and a run of auto alone still plots."""
    from pipelines.summary import summarize as run_summary
    from specsamp.analysis import plots

    rng = np.random.default_rng(9)
    ar = [completion_row(i, mode="autoregressive", decode_s=float(rng.uniform(0.5, 1.5)))
          for i in range(12)]
    fixed = random_rows(rng, 12, k=2)
    auto = [completion_row(i, k=-1, accepted=[2, 1, 4, 0], drafted=[2, 2, 4, 1],
                           decode_s=float(rng.uniform(0.3, 0.9))) for i in range(12)]
    write(tmp_path / "completions-0.parquet", ar + fixed + auto)
    out = tmp_path_factory.mktemp("plots")
    assert cli.main(["report", str(tmp_path), "--plot", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    ks = {line.split()[2] for line in lines if line.startswith("humaneval") and "speculative" in line}
    assert ks == {"2", "auto"}
    assert cli.main(["report", str(tmp_path), "--json"]) == 0
    assert {d["key"]["k"] for d in json.loads(capsys.readouterr().out)} == {0, 2, -1}
    for name in ("ms_per_token_vs_k.png", "accepted_per_loop.png", "acceptance_by_position.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    groups = report.summarize(outputs.connect(outputs.resolve([str(tmp_path)])), ("mode", "k"))
    [(base, spec, autos)] = plots._series(groups).values()
    assert [g.k for g in spec] == [2] and [g.k for g in autos] == [-1]
    auto_group = autos[0]
    assert auto_group.acceptance_rate == pytest.approx(7 / 9)  # accepted over drafted, per round's K
    summary = run_summary(str(tmp_path)).text()
    assert any(line.startswith("speculative") and " auto " in line for line in summary.splitlines())

    alone = tmp_path_factory.mktemp("auto_only")
    write(alone / "completions-0.parquet", ar + auto)
    figures = tmp_path_factory.mktemp("auto_only_plots")
    assert cli.main(["report", str(alone), "--plot", str(figures)]) == 0
    assert sorted(p.name for p in figures.iterdir()) == ["ms_per_token_vs_k.png"]


def test_paired_interval_covers_true_ratio_and_is_tighter():
    """Prompts differ a lot in ms/token, shared by both modes; the paired interval removes
    that spread: it covers the true ratio about 95% of the time and is much narrower."""
    rng = np.random.default_rng(1)
    trials, n, true = 600, 24, 1.5  # E[b] / E[s] = true: both carry the same noise law
    hits, widths = 0, []
    for _ in range(trials):
        prompt = rng.lognormal(np.log(20), 0.5, n)  # per-prompt cost, shared
        b = prompt * rng.lognormal(0, 0.05, n)
        s = prompt / true * rng.lognormal(0, 0.05, n)
        summ = [report.Summary(n, x.mean(), x.std(ddof=1), *([None] * 4)) for x in (b, s)]
        pairs = report.Pairs(n, b.var(ddof=1), s.var(ddof=1), np.cov(b, s, ddof=1)[0, 1])
        low, high = report.paired_ratio_ci(*summ, pairs)
        hits += low <= true <= high
        ind_low, ind_high = report.ratio_ci(*summ)
        widths.append((high - low) / (ind_high - ind_low))
    assert 0.91 <= hits / trials <= 0.98
    assert np.median(widths) < 0.3


def test_report_pairs_samples_by_prompt(tmp_path):
    """Through DuckDB: the same prompts decoded both ways give the paired interval; an
    unpaired baseline (other ids) falls back to the independent one."""
    rng = np.random.default_rng(3)
    ar, spec, other = [], [], []
    for i in range(10):
        tokens = int(rng.integers(20, 60))
        base_s = tokens * float(rng.uniform(0.01, 0.05))
        ar.append(completion_row(i, mode="autoregressive", tokens=tokens, decode_s=base_s))
        spec.append(completion_row(i, k=4, accepted=[4] * (tokens // 5), decode_s=base_s / 1.5))
        other.append(completion_row(100 + i, mode="autoregressive", tokens=tokens, decode_s=base_s))
    paired = _by_key(_summarize([write(tmp_path / "a.parquet", ar + spec)]))[("speculative", 4)]
    unpaired = _by_key(_summarize([write(tmp_path / "b.parquet", other + spec)]))[("speculative", 4)]
    b = np.array([r["ms_per_token"] for r in ar])
    sv = np.array([r["ms_per_token"] for r in spec])
    summ = [report.Summary(10, x.mean(), x.std(ddof=1), *([None] * 4)) for x in (b, sv)]
    expected = report.paired_ratio_ci(*summ, report.Pairs(10, b.var(ddof=1), sv.var(ddof=1),
                                                          np.cov(b, sv, ddof=1)[0, 1]))
    assert (paired.speedup.low, paired.speedup.high) == pytest.approx(expected, rel=1e-6)
    assert (unpaired.speedup.low, unpaired.speedup.high) == pytest.approx(report.ratio_ci(*summ), rel=1e-6)
    assert paired.speedup.high - paired.speedup.low < 0.5 * (unpaired.speedup.high - unpaired.speedup.low)


def test_run_summary_and_report_give_the_same_speedup(tmp_path):
    """The summary `specsamp run` prints and `specsamp report` must agree on acceptance,
    tokens per call and speed-up for the same tables. Catches one of them weighting
    ms/token by tokens (total time / total tokens) while the other averages samples:
    the two differ whenever samples of different lengths run at different speeds."""
    from pipelines.summary import summarize as run_summary

    rng = np.random.default_rng(5)
    ar = [completion_row(i, mode="autoregressive", tokens=int(rng.integers(5, 60)),
                         decode_s=float(rng.uniform(0.2, 3.0))) for i in range(25)]
    spec = random_rows(rng, 25, k=4)
    write(tmp_path / "completions-0.parquet", ar + spec)
    groups = _by_key(_summarize([tmp_path]))
    settings = {(s.mode, s.k): s for s in run_summary(str(tmp_path)).settings}
    base, g = settings[("autoregressive", 0)], groups[("speculative", 4)]
    mine = settings[("speculative", 4)]
    assert base.ms_per_token / mine.ms_per_token == pytest.approx(g.speedup.measured, rel=1e-12)
    assert mine.acceptance == pytest.approx(g.acceptance_rate, rel=1e-12)
    assert mine.tokens_per_call == pytest.approx(g.tokens_per_call, rel=1e-12)
    pooled = sum(r["decode_s"] for r in ar) / sum(r["generated_tokens"] for r in ar)
    assert abs(1000 * pooled - base.ms_per_token) > 1e-3  # the two definitions differ here


def test_tree_groups_show_accepted_depth_histogram_and_nodes(tmp_path, tmp_path_factory, capsys):
    """A tree setting (2x1: 4 nodes scored, depth 2) beside a chain of the same drafter and
    K, on the same prompt ids: tree joins the grouping keys, the tree group's histogram of
    accepted depth and mean nodes per round are its own rounds' counts (computed here from
    the rows), its alpha and positions count 2 levels, and the chain's figures and text
    are what they are without the tree."""
    from collections import Counter

    from pipelines.summary import summarize as run_summary

    rng = np.random.default_rng(11)
    ar = [completion_row(i, mode="autoregressive", decode_s=float(rng.uniform(0.5, 1.5))) for i in range(10)]
    chain = random_rows(rng, 10, k=2)
    trees = [completion_row(i, k=2, tree="2x1", accepted=acc, drafted=[4] * len(acc),
                            decode_s=float(rng.uniform(0.3, 0.9)))
             for i, acc in enumerate(rng.integers(0, 3, size=n).tolist() for n in rng.integers(1, 7, size=10))]
    write(tmp_path / "completions-0.parquet", ar + chain)
    only_chain = _summarize([tmp_path])
    write(tmp_path / "completions-1.parquet", trees)
    groups = _summarize([tmp_path])
    assert all("tree" in g.key for g in groups)
    by = {(g.key["mode"], g.key["k"], g.key["tree"]): g for g in groups}
    assert set(by) == {("autoregressive", 0, "off"), ("speculative", 2, "off"), ("speculative", 2, "2x1")}
    tree = by[("speculative", 2, "2x1")]
    depths = [a for r in trees for a in r["accepted_per_loop"]]
    assert tree.accepted_histogram == dict(Counter(depths))
    assert tree.samples == len(trees) and sum(tree.accepted_histogram.values()) == len(depths)
    assert tree.nodes_per_round == pytest.approx(4.0)
    loops = np.array(depths)
    assert tree.acceptance_rate == pytest.approx(loops.sum() / (4 * len(loops)))
    assert tree.alpha == pytest.approx(loops.sum() / (loops.sum() + (loops < 2).sum()))
    assert tree.acceptance_by_position == pytest.approx([(loops >= i).mean() for i in (1, 2)])
    assert tree.predicted_speedup is None and tree.speedup is not None
    assert tree.speedup.baseline["tree"] == "off"
    [before] = [g for g in only_chain if g.key["mode"] == "speculative"]
    after = by[("speculative", 2, "off")]
    assert (after.accepted_histogram, after.alpha, after.samples) == (
        before.accepted_histogram, before.alpha, before.samples)
    assert after.nodes_per_round is None

    text = report_text.render(groups)
    section = text[text.index("Token trees"):].splitlines()
    [line] = [s for s in section if "2x1" in s]
    counts = " ".join(str(depths.count(d)) for d in range(3))
    assert line.split()[-5:] == [str(len(depths)), "4.00", *counts.split()]
    assert "Token trees" not in report_text.render(only_chain) and "tree" not in report_text.render(only_chain)
    summary = run_summary(str(tmp_path)).text()
    assert any(line.startswith("speculative") and " tree 2x1 " in line for line in summary.splitlines())
    assert cli.main(["report", str(tmp_path), "--json"]) == 0
    rows = {d["key"]["tree"]: d for d in json.loads(capsys.readouterr().out) if d["key"]["mode"] == "speculative"}
    assert rows["2x1"]["accepted_histogram"] == {str(k): v for k, v in Counter(depths).items()}
    figures = tmp_path_factory.mktemp("tree_plots")
    assert cli.main(["report", str(tmp_path), "--plot", str(figures)]) == 0

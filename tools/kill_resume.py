"""Kill a real run at random moments, resume it each time, and compare with an unkilled run.

    python tools/kill_resume.py --config configs/humaneval.yaml --limit 8 --kills 5 --work /tmp/kr
    python tools/kill_resume.py --config configs/humaneval.yaml --kills 3 --dask-workers 2 --work /tmp/kd

1. An uninterrupted reference run into WORK/reference (on the same runner).
2. The same run into WORK/killed, killed at `--kills` random moments, each after it has
   committed at least one new row:
   - by default the whole process tree is SIGKILLed (as when a machine dies) and the run
     started again each time, then run to the end;
   - with --dask-workers N the runs are on a Dask LocalCluster of N worker processes, and
     one worker process is SIGKILLed each time while the run goes on (Dask reruns its
     tasks); should the run fail anyway, the same command is run again.
3. Prints rows in, completions, errors, duplicates, rows missing, and whether the greedy
   table (id, setting, token ids, text) equals the reference's; exits 1 if anything differs.
Slow: it loads the real model once per run (per worker on Dask). Timings vary; the counts
must not.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = ["id", "draft", "k", "tree"]  # pipelines.commit.row_key's columns
COLUMNS = KEY + ["completion_token_ids", "completion"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/humaneval.yaml")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--max-wait", type=float, default=8.0, help="most seconds after a new row before a kill")
    ap.add_argument("--dask-workers", type=int, default=0,
                    help="run on a Dask LocalCluster of N workers and kill one worker at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", required=True)
    ap.add_argument("extra", nargs="*", help="more `specsamp run` flags (after --)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    dask = ["--runner", "DaskRunner", "--dask_workers", str(a.dask_workers)] if a.dask_workers else []
    base = ["--config", a.config, "--limit", str(a.limit), *dask, *a.extra]

    ref = os.path.join(a.work, "reference")
    start = time.time()
    _finish(base + ["--output", ref])
    print(f"reference run: {time.time() - start:.0f} s", flush=True)

    out = os.path.join(a.work, "killed")
    kill = _kill_workers if a.dask_workers else _kill_runs
    kills = kill(base + ["--output", out], out, a.kills, lambda: rng.uniform(0, a.max_wait), rng)
    _finish(base + ["--output", out])
    return _compare(ref, out, kills)


def _kill_runs(args: list[str], out: str, n: int, pause, rng) -> int:
    """SIGKILL the whole run n times, starting it again after each kill."""
    kills = 0
    while kills < n:
        before = _count(out)
        proc = _start(args)
        if not _wait_for_more(proc, out, before):
            print(f"run ended before kill {kills + 1} (rows: {_count(out)})", flush=True)
            break
        time.sleep(pause())
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        print(f"kill {kills}: {_count(out)} rows committed", flush=True)
    return kills


def _kill_workers(args: list[str], out: str, n: int, pause, rng) -> int:
    """SIGKILL one Dask worker process n times while one run goes on."""
    if ROOT not in sys.path:  # the tool runs from a checkout, like the runs it starts
        sys.path.insert(0, ROOT)
    from pipelines.stop import spawned_processes

    kills = 0
    proc = _start(args)
    while kills < n and _wait_for_more(proc, out, _count(out)):
        time.sleep(pause())
        workers = spawned_processes(proc.pid)
        if proc.poll() is not None or not workers:
            break
        os.kill(rng.choice(workers), signal.SIGKILL)
        kills += 1
        print(f"kill {kills}: worker killed at {_count(out)} rows committed", flush=True)
    if kills < n:
        print(f"run ended before kill {kills + 1} (rows: {_count(out)})", flush=True)
    code = proc.wait()
    print(f"the killed run ended with exit status {code}", flush=True)
    return kills


def _start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, "-m", "specsamp.cli", "run", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _finish(args: list[str]) -> None:
    proc = _start(args)
    if proc.wait() != 0:
        raise SystemExit(f"specsamp run {' '.join(args)} failed with {proc.returncode}")


def _rows(out: str, table: str, columns=tuple(KEY)) -> list[dict]:
    if not os.path.isdir(out):
        return []
    paths = sorted(os.path.join(out, n) for n in os.listdir(out) if n.startswith(f"{table}-") and n.endswith(".parquet"))
    return [r for p in paths for r in pq.read_table(p, columns=list(columns)).to_pylist()]


def _count(out: str) -> int:
    return len(_rows(out, "completions")) + len(_rows(out, "errors"))


def _wait_for_more(proc: subprocess.Popen, out: str, before: int) -> bool:
    while proc.poll() is None:
        if _count(out) > before:
            return True
        time.sleep(0.2)
    return False


def _compare(ref: str, out: str, kills: int) -> int:
    def keyed(rows):
        return [(tuple(r[c] for c in KEY), (tuple(r.get("completion_token_ids") or ()), r.get("completion")))
                for r in rows]

    want = keyed(_rows(ref, "completions", COLUMNS)) + keyed(_rows(ref, "errors"))
    got = keyed(_rows(out, "completions", COLUMNS)) + keyed(_rows(out, "errors"))
    keys = [k for k, _ in got]
    duplicates = len(keys) - len(set(keys))
    missing = len({k for k, _ in want} - set(keys))
    same = sorted(want) == sorted(got)
    print(f"kills: {kills}; rows in: {len(want)}; written: {len(got)} "
          f"({len(_rows(out, 'completions'))} completions, {len(_rows(out, 'errors'))} errors); "
          f"duplicated: {duplicates}; lost: {missing}; greedy table equal to the unkilled run's: {same}")
    return 0 if same and not duplicates and not missing else 1


if __name__ == "__main__":
    sys.exit(main())

"""gs:// inputs, outputs and checkpoints against a real local GCS emulator started here.

Beam's own gs:// IO looks for credentials for ~20 s per process, so only one test runs a
Beam job; the others exercise the checks made before a job starts.
"""

import os
import socket
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas import COMPLETIONS
from specsamp.cli import main
from specsamp.fs import filesystem, glob
from tests.pipeline_support import tiny_models

BUCKET = "specsamp-test"
PROMPTS = ["def add(a, b):", "the quick brown fox", "hello world", "for i in range(3):"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gcp-storage-emulator exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("gcp-storage-emulator did not start")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator with one bucket, and the environment that points clients at it."""
    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
    proc = subprocess.Popen([exe, "start", "--host", "127.0.0.1", "--port", str(port),
                             "--default-bucket", BUCKET, "--in-memory", "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
        mp.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        # Remote checkpoints are copied into the cache: keep those copies in tmp, but
        # keep sharing compiled programs with the other tests.
        jax_cache = os.environ.get("SPECSAMP_JAX_CACHE") or os.path.join(
            os.environ.get("SPECSAMP_CACHE", os.path.expanduser("~/.cache/specsamp")), "jax")
        mp.setenv("SPECSAMP_JAX_CACHE", jax_cache)
        mp.setenv("SPECSAMP_CACHE", str(tmp_path_factory.mktemp("cache")))
        try:
            _wait_for(port, proc)
            yield f"gs://{BUCKET}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def _upload(local_dir: str, url: str) -> None:
    fs, path = filesystem(url)
    for name in os.listdir(local_dir):
        fs.put(os.path.join(local_dir, name), f"{path}/{name}")


def test_gs_round_trip(gcs, tmp_path, capsys):
    """Prompts, checkpoints and tables all on gs://: prepare, run, read back, resume."""
    target, draft = tiny_models(str(tmp_path / "models"))
    _upload(target, f"{gcs}/models/target")
    local = tmp_path / "prompts.jsonl"
    local.write_text("\n".join('{"text": "%s"}' % p for p in PROMPTS))
    assert main(["prepare", "file", str(local), "--prompt-column", "text", "--out", f"{gcs}/prompts",
                 "--shard-size", "3"]) == 0
    config = tmp_path / "gs.yaml"
    config.write_text(f"input: {gcs}/prompts/prompts-*.parquet\noutput: {gcs}/runs/one\n"
                      f"target: {gcs}/models/target\nmax_new_tokens: 8\n"
                      f"settings:\n  - {{draft: none}}\n  - {{draft: {draft}, k: 2}}\n")
    capsys.readouterr()
    assert main(["run", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"{gcs}/runs/one/completions-*.parquet  8 rows" in out

    paths = glob(f"{gcs}/runs/one/completions-*.parquet")
    fs, _ = filesystem(gcs)
    table = pa.concat_tables([pq.read_table(filesystem(p)[1], filesystem=fs) for p in paths])
    assert sorted(table.column("id").to_pylist()) == sorted(f"prompts/{i}" for i in range(4) for _ in range(2))
    assert set(table.column("target").to_pylist()) == {f"{gcs}/models/target"}
    assert table.schema.field("accepted_per_loop").type.equals(COMPLETIONS.field("accepted_per_loop").type)
    assert not glob(f"{gcs}/runs/one/errors-*.parquet")  # shards hold rows: none failed

    assert main(["run", "--config", str(config)]) == 0  # resume: nothing left, no Beam job
    assert "nothing to do" in capsys.readouterr().err
    assert glob(f"{gcs}/runs/one/completions-*.parquet") == paths


def test_unreachable_bucket_and_missing_input_fail_before_work(gcs, tmp_path, capsys):
    local = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["a"], "prompt": ["hi"]}), str(local))
    config = tmp_path / "c.yaml"
    config.write_text(f"input: {local}\noutput: gs://no-such-bucket-here/out\nsettings: [{{draft: none}}]\n")
    assert main(["run", "--config", str(config)]) == 2
    assert "gs://no-such-bucket-here does not exist or is not reachable" in capsys.readouterr().err
    assert main(["run", "--config", str(config), "--input", f"{gcs}/nothing/*.parquet"]) == 2
    assert "no input files match" in capsys.readouterr().err


class _Flaky:
    """An HTTP proxy in front of the emulator that answers every `every`-th request with
    503 Service Unavailable instead of forwarding it (a storage service having a moment)."""

    def __init__(self, upstream: str, every: int = 4):
        import http.client
        import http.server
        import threading
        import urllib.parse

        up = urllib.parse.urlsplit(upstream)
        state = {"n": 0, "failed": 0}
        lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    state["n"] += 1
                    fail = state["n"] % every == 0
                    state["failed"] += fail
                if fail:
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _any

        self.state = state
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_transient_503s_lose_and_duplicate_nothing(gcs, tmp_path, capsys, monkeypatch):
    """Every 4th storage request fails with 503 (reads, listings, uploads of shards): the
    client's retries absorb them; every prompt x setting is written once."""
    target, draft = tiny_models(str(tmp_path / "models"))
    fs, _ = filesystem(gcs)
    table = pa.table({"id": [f"q{i}" for i in range(len(PROMPTS))], "prompt": PROMPTS})
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    fs.pipe_file(f"{BUCKET}/flaky/in/p-0.parquet", buf.getvalue().to_pybytes())
    proxy = _Flaky(os.environ["STORAGE_EMULATOR_HOST"])
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    type(fs).clear_instance_cache()  # clients are cached with their endpoint
    try:
        config = tmp_path / "flaky.yaml"
        config.write_text(f"input: {gcs}/flaky/in/*.parquet\noutput: {gcs}/flaky/out\ntarget: {target}\n"
                          f"max_new_tokens: 6\nsettings:\n  - {{draft: none}}\n  - {{draft: ngram, k: 2}}\n")
        assert main(["run", "--config", str(config)]) == 0, capsys.readouterr().err
        assert proxy.state["failed"] >= 3
    finally:
        proxy.close()
        monkeypatch.undo()
        type(fs).clear_instance_cache()
    keys = []
    for name in ("completions", "errors"):
        for path in glob(f"{gcs}/flaky/out/{name}-*.parquet"):
            got = pq.read_table(filesystem(path)[1], filesystem=filesystem(path)[0])
            keys += [(r["id"], r["draft"], r["k"]) for r in got.to_pylist()]
    assert sorted(keys) == sorted((f"q{i}", d, k) for i in range(len(PROMPTS)) for d, k in (("none", 0), ("ngram", 2)))

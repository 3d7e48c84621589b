"""Mistakes in inputs, outputs and options: one clear error (exit 2) before work starts."""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specsamp.cli import main


@pytest.fixture
def setup(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"input: {tmp_path}/in/*.parquet\noutput: {tmp_path}/out\n"
                      "settings: [{draft: none}, {draft: ngram, k: 2}]\nmax_new_tokens: 4\n")
    (tmp_path / "in").mkdir()
    return tmp_path, str(config)


def put(folder, name, **columns):
    pq.write_table(pa.table(columns), os.path.join(folder, "in", name))


def fails(capsys, config, *extra, match):
    assert main(["run", "--config", config, *extra]) == 2
    err = capsys.readouterr().err
    assert match in err, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("columns, match", [
    ({"id": ["a"], "text": ["hi"]}, "has no 'prompt' column"),
    ({"prompt": ["hi"]}, "has no 'id' column"),
    ({"id": [1], "prompt": ["hi"]}, "column 'id' is int64, expected a string"),
    ({"id": ["a"], "prompt": [3.5]}, "column 'prompt' is double, expected a string"),
    ({"id": ["a", "a"], "prompt": ["x", "y"]}, "ids must be unique"),
    ({"id": ["a", None], "prompt": ["x", "y"]}, "have no id"),
])
def test_bad_prompt_tables(setup, capsys, columns, match):
    root, config = setup
    put(root, "p.parquet", **columns)
    fails(capsys, config, match=match)
    assert not (root / "out").exists() or not any((root / "out").iterdir())


def test_ids_repeated_across_files(setup, capsys):
    root, config = setup
    put(root, "a.parquet", id=["x", "y"], prompt=["1", "2"])
    put(root, "b.parquet", id=["z", "x"], prompt=["3", "4"])
    fails(capsys, config, match="1 repeated, e.g. ['x']")


def test_missing_and_corrupt_inputs(setup, capsys):
    root, config = setup
    fails(capsys, config, match="no input files match")
    fails(capsys, config, "--input", str(root / "in"), match="is a folder")
    (root / "in" / "bad.parquet").write_bytes(b"PAR1 truncated")
    fails(capsys, config, match="cannot read prompt file")


def test_output_of_another_config_is_refused(setup, capsys):
    root, config = setup
    put(root, "p.parquet", id=["a"], prompt=["hi"])
    (root / "out").mkdir()
    from schemas import ERRORS
    row = {f.name: None for f in ERRORS}
    row.update(id="a", error="x", error_kind="bad_row", dataset="p", mode="autoregressive", target="smollm2",
               draft="none", k=0, tree="off", temperature=0.0, top_k=0, top_p=1.0, seed=1, run_id="r",
               config_hash="0123456789abcdef", worker_host="h", device_kind="", schema_version=1)
    pq.write_table(pa.Table.from_pylist([row], schema=ERRORS), str(root / "out" / "errors-r-00000-of-00001.parquet"))
    fails(capsys, config, match="holds rows of another config")


def test_bad_beam_options(setup, capsys):
    root, config = setup
    put(root, "p.parquet", id=["a"], prompt=["hi"])
    fails(capsys, config, "--runner", "NoSuchRunner", match="invalid pipeline options")


def test_model_that_does_not_load_is_one_line(setup, capsys):
    """A target folder that is not a checkpoint fails on the worker; the user gets the
    engine's one-line reason, not the runner's traceback."""
    root, config = setup
    put(root, "p.parquet", id=["a"], prompt=["hi"])
    (root / "empty-model").mkdir()
    cfg = root / "c2.yaml"
    cfg.write_text(open(config).read() + f"target: {root}/empty-model\n")
    err = fails(capsys, str(cfg), match="specsamp run: error:")
    assert len(err.strip().splitlines()[-1]) < 400


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.pipeline_support import tiny_models

    return tiny_models(str(tmp_path_factory.mktemp("check-models")))[0]


def test_max_new_tokens_beyond_the_context_is_refused_before_work(setup, capsys, tiny):
    """The tiny target has 256 positions: 300 new tokens can never fit. One line before
    any work, and the output folder is not claimed by the config."""
    root, config = setup
    put(root, "p.parquet", id=["a"], prompt=["hi"])
    cfg = root / "c2.yaml"
    cfg.write_text(open(config).read().replace("max_new_tokens: 4", "max_new_tokens: 300") + f"target: {tiny}\n")
    fails(capsys, str(cfg), match="max_new_tokens 300 does not fit the target's context of 256 tokens")
    assert not list((root / "out").glob("*.parquet"))


def test_output_that_cannot_be_written(setup, capsys):
    """A folder under a file, and (where mounting works) a read-only file system: one
    line naming the output, before any model loads."""
    root, config = setup
    put(root, "p.parquet", id=["a"], prompt=["hi"])
    (root / "afile").write_text("x")
    fails(capsys, config, "--output", str(root / "afile" / "out"), match=f"cannot write to output {root}/afile/out")
    ro = root / "ro"
    ro.mkdir()
    import subprocess
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only file system here")
    try:
        fails(capsys, config, "--output", str(ro), match=f"cannot write to output {ro}")
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


def test_unreachable_storage_endpoint_is_one_line(setup, capsys, monkeypatch):
    """Nothing listens at the storage endpoint: the message comes from one probe, not
    after minutes of the client's retries (it names the endpoint)."""
    import socket

    root, config = setup
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    fails(capsys, config, "--input", "gs://some-bucket/p/*.parquet", match=f"cannot reach 127.0.0.1:{port}")


@pytest.mark.parametrize("value", ["maybe", "tru"])
def test_booleans_are_parsed_strictly(setup, capsys, value):
    root, config = setup
    put(root, "p.parquet", id=["a"], prompt=["hi"])
    fails(capsys, config, "--dry_run", value, match=f"--dry_run takes true or false, got '{value}'")


def test_retry_errors_takes_kinds(setup, capsys):
    root, config = setup
    put(root, "p.parquet", id=["a"], prompt=["hi"])
    fails(capsys, config, "--retry-errors", "too long!", match="--retry-errors takes error kinds")

"""Prompt preparation: HumanEval, XSum (local files; the hub offline), any prompt file, shards."""

import json

import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest

from specsamp import prompts
from specsamp.cli import main
from specsamp.errors import UserError

XSUM = [{"id": "x1", "document": "The cat sat on the mat.", "summary": "Cat sits."},
        {"id": "x2", "document": "Rain fell in Leeds.", "summary": "Wet Leeds."}]


def read_all(paths):
    return pa.concat_tables([pq.read_table(p) for p in paths])


def test_humaneval_has_all_problems_and_what_evaluation_needs():
    t = prompts.humaneval()
    assert len(t) == 164 and len(set(t.column("id").to_pylist())) == 164
    assert t.column_names[:3] == ["id", "prompt", "dataset"]
    assert {"entry_point", "test", "canonical_solution"} <= set(t.column_names)
    row = t.slice(0, 1).to_pylist()[0]
    assert row["id"] == "HumanEval/0" and row["prompt"].startswith("from typing import List")


def test_shards_split_and_round_trip(tmp_path):
    t = prompts.humaneval()
    paths = prompts.write_shards(t, str(tmp_path), shard_size=50, prefix="humaneval")
    assert [p.rsplit("/", 1)[1] for p in paths] == [f"humaneval-0000{i}-of-00004.parquet" for i in range(4)]
    assert [pq.read_metadata(p).num_rows for p in paths] == [50, 50, 50, 14]
    assert read_all(paths).equals(t)


def test_shards_refuse_to_mix_with_old_ones(tmp_path):
    t = prompts.humaneval()
    prompts.write_shards(t, str(tmp_path), shard_size=100)
    with pytest.raises(UserError, match="already holds"):
        prompts.write_shards(t, str(tmp_path), shard_size=50)
    paths = prompts.write_shards(prompts.limit(t, 10), str(tmp_path), shard_size=50, overwrite=True)
    assert len(paths) == 1 and len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize("ext", ["jsonl", "csv", "parquet"])
def test_xsum_from_local_files(tmp_path, ext):
    path = tmp_path / f"xsum.{ext}"
    table = pa.Table.from_pylist(XSUM)
    if ext == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in XSUM))
    elif ext == "csv":
        pyarrow.csv.write_csv(table, str(path))
    else:
        pq.write_table(table, str(path))
    t = prompts.xsum(str(path))
    rows = t.to_pylist()
    assert [r["id"] for r in rows] == ["x1", "x2"]
    assert rows[0]["prompt"] == prompts.XSUM_FORMATS["instruct"].replace("{document}", XSUM[0]["document"])
    assert rows[1]["summary"] == "Wet Leeds." and rows[1]["dataset"] == "xsum"


def test_xsum_formats(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(json.dumps({k: v for k, v in r.items() if k != "id"}) for r in XSUM))
    raw = prompts.xsum(str(path), template="raw").to_pylist()
    assert raw[0]["prompt"] == "Article: The cat sat on the mat.\n\nOne-sentence summary:"
    assert [r["id"] for r in raw] == ["xsum/0", "xsum/1"]  # ids made when the file has none
    custom = prompts.xsum(str(path), template="TL;DR {document} ->").to_pylist()
    assert custom[1]["prompt"] == "TL;DR Rain fell in Leeds. ->"
    with pytest.raises(UserError, match="document"):
        prompts.xsum(str(path), template="no placeholder")


def test_xsum_needs_document_and_summary(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"text": "a"}))
    with pytest.raises(UserError, match="document"):
        prompts.xsum(str(path))


def test_xsum_hub_unreachable_is_one_clear_error(monkeypatch):
    """Offline, `datasets` retries for ~25 s; we fail at once and say what to do instead."""
    def offline(*a, **k):
        raise OSError("no network")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(prompts, "_probe_hub", offline)
    with pytest.raises(UserError, match="--from FILE"):
        prompts.xsum()


def test_any_file_with_prompt_column(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(json.dumps({"question": q, "level": i}) for i, q in enumerate(["a?", "b?", "c?"])))
    t = prompts.from_file(str(path), prompt_column="question")
    assert t.to_pylist()[2] == {"id": "questions/2", "prompt": "c?", "dataset": "questions", "level": 2}
    with pytest.raises(UserError, match="no column 'prompt'"):
        prompts.from_file(str(path))


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        prompts.read_table(str(tmp_path / "none.parquet"))
    with pytest.raises(UserError, match="unknown file type"):
        prompts.read_table(str(tmp_path / "x.txt"))
    corrupt = tmp_path / "c.parquet"
    corrupt.write_bytes(b"PAR1 not really")
    with pytest.raises(UserError, match="cannot read"):
        prompts.read_table(str(corrupt))


def test_ids_must_be_unique_and_present(tmp_path):
    with pytest.raises(UserError, match="unique"):
        prompts.write_shards(pa.table({"id": ["a", "a"], "prompt": ["x", "y"]}), str(tmp_path))
    with pytest.raises(UserError, match="no id"):
        prompts.write_shards(pa.table({"id": ["a", None], "prompt": ["x", "y"]}), str(tmp_path))


def test_cli_prepare(tmp_path, capsys):
    out = tmp_path / "he"
    assert main(["prepare", "humaneval", "--out", str(out), "--shard-size", "50", "--limit", "120"]) == 0
    assert "wrote 120 prompts in 3 shard(s)" in capsys.readouterr().out
    assert len(read_all(sorted(str(p) for p in out.iterdir()))) == 120
    assert main(["prepare", "humaneval", "--out", str(out)]) == 2  # refuses to mix shards
    assert "already holds" in capsys.readouterr().err

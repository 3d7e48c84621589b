"""User mistakes give one clear line on stderr and exit status 2, never a traceback."""

import subprocess
import sys

import pytest

from specsamp.testing import make_tiny_checkpoint

CASES = [
    (["generate", "--prompt", "hi", "--k", "0"], "K (draft tokens per loop) must be"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature must be"),
    (["generate", "--prompt", "hi", "--top-p", "1.5"], "top-p must be in (0, 1]"),
    (["generate", "--prompt", "hi", "--top-p", "0"], "top-p must be in (0, 1]"),
    (["generate", "--prompt", "hi", "--target", "/no/such/model"], "/no/such/model"),
    (["generate", "--prompt", "hi", "--draft", "early-exit:x"], "early exit needs a layer count"),
    (["bench", "--k", "2,x"], "comma-separated list"),
    (["bench", "--k", "auto"], "--k auto needs --throughput"),
    (["bench", "--throughput", "--batching", "dynamic"], "--batching takes static and/or continuous"),
    (["bench", "--throughput", "--batch-size", "0,8"], "--batch-size takes integers >= 1"),
    (["bench", "--throughput", "--repeats", "0"], "--repeats must be >= 1"),
    (["bench", "--throughput", "--temperature", "0,1"], "runs one sampling setting"),
    (["bench", "--repeats", "0"], "--repeats must be >= 1"),
    (["generate", "--prompt", "hi", "--draft", "ngram+"], "a hybrid drafter is 'ngram[:N]+"),
    (["generate", "--prompt", "hi", "--draft", "ngram+/no/such/draft"], "feature-conditioned"),
    (["generate", "--prompt", "hi", "--weights", "int4"], "weights must be among"),
    (["bench", "--weights", "stored,fp8"], "weights must be among"),
    (["generate", "--prompt", "hi", "--kv-cache", "int8"], "kv cache must be among"),
    (["bench", "--throughput", "--kv-cache", "float32,x"], "kv cache must be among"),
    (["generate", "--prompt", "hi", "--dtype", "float16"], "dtype must be among"),
    (["bench", "--dtype", "bfloat16,float32"], "one dtype value here"),
]


def _cli(args, tmp_path):
    env = {"SPECSAMP_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "specsamp.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.parametrize("args,message", CASES)
def test_bad_arguments_are_one_line(args, message, tmp_path):
    out = _cli(args, tmp_path)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], out.stderr
    assert "Traceback" not in out.stderr and "usage:" not in out.stderr


def test_vocab_mismatch_is_one_line(tmp_path):
    """A draft with another vocabulary is refused before any work starts."""
    import json

    target = make_tiny_checkpoint(str(tmp_path / "target"), n_layers=2)
    draft = make_tiny_checkpoint(str(tmp_path / "draft"), n_layers=1)
    tok = json.loads((tmp_path / "draft" / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, different tokens
    (tmp_path / "draft" / "tokenizer.json").write_text(json.dumps(tok))
    out = _cli(["generate", "--prompt", "hi", "--target", target, "--draft", draft], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "vocab" in errors[0].lower(), out.stderr
    assert f"token 100 is {a!r} in the target, {b!r} in the draft" in errors[0], out.stderr


def test_generate_json_on_tiny_model(tmp_path):
    import json

    target = make_tiny_checkpoint(str(tmp_path / "target"), n_layers=2)
    out = _cli(["generate", "--prompt", "the quick", "--target", target, "--draft", "early-exit:1",
                "--max-new-tokens", "8", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    for key in ["text", "token_ids", "generated_tokens", "target_calls", "draft_calls",
                "accepted_per_loop", "acceptance_rate", "tokens_per_call", "prefill_s",
                "decode_s", "ms_per_token", "stop_reason"]:
        assert key in obj
    assert obj["generated_tokens"] == len(obj["token_ids"]) <= 8
    assert obj["draft_calls"] == obj["k"] * obj["target_calls"]


def test_generate_says_auto_for_k_auto(tmp_path):
    """Catches `generate --k auto` reporting the largest K the policy may pick as the K
    (it printed K=4): JSON k is -1 as in the output tables, and the text says K=auto with
    the rounds at each K, which add up to the target calls (the policy may run plain
    rounds, K = 0, or draft, depending on this machine's measured costs)."""
    import json

    from specsamp.commands.generate import rounds_at_k

    target = make_tiny_checkpoint(str(tmp_path / "target"), n_layers=2)
    args = ["generate", "--prompt", "the quick", "--target", target, "--draft", "early-exit:1",
            "--k", "auto", "--max-new-tokens", "8"]
    out = _cli(args + ["--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert obj["k"] == -1
    rounds = rounds_at_k(obj)
    assert sum(rounds.values()) == obj["target_calls"] > 0
    text = _cli(args, tmp_path)
    assert text.returncode == 0, text.stderr
    listed = ", ".join(f"{k}: {n}" for k, n in rounds.items())
    assert f"K=auto (rounds at K: {listed})" in text.stderr, text.stderr


def test_rounds_at_k_counts_plain_rounds():
    """Catches the rounds at K leaving out plain rounds (they score no draft, so they are
    not in drafted_per_loop): a run of plain rounds only listed no round at all."""
    from specsamp.commands.generate import rounds_at_k

    assert rounds_at_k({"drafted_per_loop": [2, 1, 2], "target_calls": 5}) == {0: 2, 1: 1, 2: 2}
    assert rounds_at_k({"drafted_per_loop": [], "target_calls": 8}) == {0: 8}
    assert rounds_at_k({"drafted_per_loop": [4, 4], "target_calls": 2}) == {4: 2}




@pytest.mark.parametrize("spoil,message", [("truncate", "truncated: tensor"),
                                           ("remove", "has no model-00002-of-00002.safetensors")])
def test_broken_checkpoint_is_one_line(spoil, message, tmp_path):
    """A truncated or missing shard of a bfloat16 checkpoint: one line, exit 2, and nothing
    left in the model cache."""
    import os

    from specsamp.testing import write_bf16_checkpoint

    folder = str(tmp_path / "bf16")
    write_bf16_checkpoint(folder, vocab=320, d=64, layers=2, heads=2, kv_heads=1, head_dim=32, ff=96)
    shard = os.path.join(folder, "model-00002-of-00002.safetensors")
    if spoil == "truncate":
        os.truncate(shard, os.path.getsize(shard) - 64)
    else:
        os.remove(shard)
    out = _cli(["generate", "--prompt", "hi", "--target", folder, "--dtype", "bfloat16"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], out.stderr
    assert not any(files for _, _, files in os.walk(tmp_path / "cache")), "half-written cache"


def test_run_comes_from_the_pipelines_entry_point(capsys):
    """Catches `specsamp run` lost or changed in moving it out of the library: the entry
    point pyproject.toml declares is the one installed (else run `pip install -e .`
    again), and the command keeps its place in `specsamp --help`, its flags and its
    pass-through of Beam options."""
    import tomllib
    from importlib.metadata import entry_points
    from pathlib import Path

    from specsamp.cli import ENTRY_POINTS, build_parser

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["entry-points"][ENTRY_POINTS]
    installed = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS)}
    assert "run" in declared and installed == declared, (
        f"installed {installed}, pyproject.toml declares {declared}: run pip install -e .")
    parser = build_parser()
    help_text = parser.format_help()
    assert help_text.index(" prepare ") < help_text.index(" run ") < help_text.index(" report ")
    args = parser.parse_args(["run", "--config", "c.yaml", "--limit", "3", "--runner", "DirectRunner"])
    assert (args.config, args.limit, args.beam_args) == ("c.yaml", 3, ["--runner", "DirectRunner"])
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["run", "--help"])
    assert stop.value.code == 0
    assert "--retry-errors" in capsys.readouterr().out

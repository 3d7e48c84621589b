"""`configs/distill_<name>.yaml` -> a frozen, checked `DistillConfig`.

    target: null            # the embedded default, or a path (like --target)
    out_dir: runs/distill/wide2
    data: {seq_len: 256, max_new_tokens: 160, batch_size: 8, top_k: 64, ...}   # DataConfig
    train: {n_layers: 2, init_layers: [0, 1], learning_rate: 3e-4, ...}        # TrainConfig

Unknown keys are refused (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import os

from specsamp.distill.data import DataConfig
from specsamp.distill.train import TrainConfig
from specsamp.errors import UserError


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    name: str
    out_dir: str
    data: DataConfig
    train: TrainConfig
    target: str | None = None
    # 'wide': n target-width layers, shared embedding (train: TrainConfig);
    # 'feature': EAGLE-style feature-conditioned draft (feature: FeatureTrainConfig).
    architecture: str = "wide"
    feature: object = None  # specsamp.distill.feature.FeatureTrainConfig for 'feature'

    @property
    def train_dir(self) -> str:
        return os.path.join(self.out_dir, "train")

    @property
    def draft_dir(self) -> str:
        return os.path.join(self.out_dir, "draft")


def _section(cls, raw, where: str, **defaults):
    raw = dict(raw or {})
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {unknown}; known: {sorted(names)}")
    for key, value in defaults.items():
        raw.setdefault(key, value)
    if "init_layers" in raw:
        raw["init_layers"] = tuple(int(i) for i in raw["init_layers"])
    try:
        return cls(**raw)
    except TypeError as e:
        raise UserError(f"{where}: {e}") from None


def load_config(path: str) -> DistillConfig:
    import yaml

    if not os.path.exists(path):
        raise UserError(f"no config at {path}")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping at the top level")
    known = {"name", "out_dir", "data", "train", "target", "architecture", "feature"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise UserError(f"{path}: unknown key(s) {unknown}; known: {sorted(known)}")
    name = raw.get("name") or os.path.splitext(os.path.basename(path))[0].removeprefix("distill_")
    out_dir = raw.get("out_dir") or os.path.join("runs", "distill", name)
    arch = raw.get("architecture", "wide")
    if arch not in ("wide", "feature"):
        raise UserError(f"{path}: architecture must be 'wide' or 'feature', got {arch!r}")
    data = _section(DataConfig, raw.get("data"), f"{path}: data", dir=os.path.join(out_dir, "data"))
    feature = None
    if arch == "feature":
        from specsamp.distill.feature import FeatureTrainConfig

        feature = _section(FeatureTrainConfig, raw.get("feature"), f"{path}: feature",
                           data_dir=data.dir, out_dir=out_dir)
    train = _section(TrainConfig, raw.get("train"), f"{path}: train")
    if train.n_layers != len(train.init_layers):
        raise UserError(f"{path}: train.init_layers needs one target layer per draft layer "
                        f"({train.n_layers}), got {list(train.init_layers)}")
    if train.batch_rows < 1 or train.steps < 1 or data.top_k < 1:
        raise UserError(f"{path}: batch_rows, steps and top_k must be >= 1")
    return DistillConfig(name=name, out_dir=out_dir, data=data, train=train,
                         target=raw.get("target"), architecture=arch, feature=feature)

"""`specsamp distill` and `specsamp distill-data`: train a draft for a target.

Both read one recipe, `configs/distill_<name>.yaml`, and resume whatever a previous run left
(data shards that exist are kept; training restarts from its checkpoint).
"""

from __future__ import annotations

from specsamp.commands.common import status


def register(sub) -> None:
    p = sub.add_parser("distill", help="train a draft model for a target by distillation")
    p.add_argument("--config", required=True, help="configs/distill_<name>.yaml")
    p.add_argument("--stage", choices=("data", "train", "all"), default="train",
                   help="data: sample text and teacher probabilities; train: train on the data "
                        "there is (default); all: data then train")
    p.add_argument("--minutes", type=float, default=None,
                   help="wall-clock budget for this stage (data: stop adding shards; train: stop "
                        "and checkpoint); a later run resumes")
    p.add_argument("--follow-data", action="store_true",
                   help="reload the data after each evaluation (a data stage is running beside)")
    p.set_defaults(func=run)
    d = sub.add_parser("distill-data", help="only the data stage of `specsamp distill`")
    d.add_argument("--config", required=True)
    d.add_argument("--minutes", type=float, default=None)
    d.set_defaults(func=run, stage="data", follow_data=False)


def run(args) -> int:
    from specsamp.reductions import batched_products

    # Nothing here needs rows bit-equal across batches; batched products make the
    # teacher-forced passes, the sampling and the training steps several times faster.
    with batched_products():
        return _run(args)


def _run(args) -> int:
    import dataclasses
    import json
    import os
    import time

    from specsamp.distill import data as data_mod
    from specsamp.distill.config import load_config
    from specsamp.errors import UserError
    from specsamp.loading import load_model

    cfg = load_config(args.config)

    def log(msg: str) -> None:
        status(f"{time.strftime('%H:%M:%S')} {msg}")

    target = load_model(cfg.target, "float32")  # training differentiates through its weights
    os.makedirs(cfg.out_dir, exist_ok=True)
    if args.stage in ("data", "all"):
        deadline = time.time() + 60 * args.minutes if args.minutes else None
        data_mod.build(cfg.data, target, log=log, deadline=deadline)
    if args.stage == "data":
        return 0
    if cfg.architecture == "feature":
        return _train_feature(cfg, target, args, log)

    from specsamp.distill import draft as draft_mod
    from specsamp.distill import train as train_mod

    def load_train():
        return data_mod.concat(data_mod.load_shards(os.path.join(cfg.data.dir, "train")))

    shards = data_mod.load_shards(os.path.join(cfg.data.dir, "train"))
    held = data_mod.load_shards(os.path.join(cfg.data.dir, "heldout"))
    if not shards or not held:
        raise UserError(f"no training data in {cfg.data.dir}: run `specsamp distill-data --config {args.config}` first")
    data, heldout = data_mod.concat(shards), data_mod.concat(held)
    log(f"data: {len(data['tokens'])} train rows ({int(data['mask'].sum())} positions), "
        f"{len(heldout['tokens'])} held-out rows ({int(heldout['mask'].sum())} positions)")
    tcfg = cfg.train
    if args.minutes:
        tcfg = dataclasses.replace(tcfg, max_minutes=args.minutes)
    dcfg = draft_mod.draft_config(target.cfg, tcfg.n_layers)
    trainable, frozen = draft_mod.init_from_target(target.params, tcfg.init_layers, target.cfg.n_layers)
    log(f"draft: {tcfg.n_layers} layers of width {dcfg.d_model}, own weights "
        f"{draft_mod.own_bytes(trainable) / 1e6:.1f} MB at float16")

    def export(step, result, params):
        draft_mod.save_hf(cfg.draft_dir, dcfg, params, target.tokenizer,
                          extra={"config": args.config, "step": step, "heldout": result})

    result = train_mod.train(tcfg, dcfg, trainable, frozen, data, heldout, cfg.train_dir,
                             log=log, on_eval=export,
                             refresh=load_train if args.follow_data else None)
    log(f"draft written to {cfg.draft_dir}")
    print(json.dumps({k: v for k, v in result.items()}))
    return 0


def _train_feature(cfg, target, args, log) -> int:
    import dataclasses
    import json

    from specsamp.distill.feature import train_feature_draft

    tc = cfg.feature
    if args.minutes:
        tc = dataclasses.replace(tc, max_minutes=args.minutes)
    result = train_feature_draft(target, tc, log=log)
    log(f"draft written to {tc.out_dir}/draft")
    print(json.dumps(result, default=float))
    return 0

"""Distilling drafts for a target: data from the target itself, training, export.

    specsamp distill-data --config configs/distill_wide2.yaml   # text + teacher top-k shards
    specsamp distill --config configs/distill_wide2.yaml        # train (resumes), export draft

Modules: `corpus` (training prompts and source text, never evaluation prompts), `data`
(sampling and teacher shards), `draft` (the wide shallow draft, HF export), `train` (loss,
held-out acceptance, checkpoints), `config` (the YAML recipe).
"""

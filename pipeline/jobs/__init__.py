"""Built-in jobs: declarative specs (a dataclass of fields, TOML and/or flags)
plus the pure functions the pipeline roles run (data, gradients, optimizer).

`get_job(name)` returns the job class; `JOBS` lists them.
"""
from __future__ import annotations

import importlib

JOBS = {"spirals": "pipeline.jobs.spirals", "lm": "pipeline.jobs.lm", "pretrain": "pipeline.jobs.pretrain",
        "sft": "pipeline.jobs.sft", "finetune": "pipeline.jobs.finetune"}


def get_job(name: str):
    from ..errors import UserError
    if name not in JOBS:
        raise UserError(f"unknown job {name!r}; built-in jobs: {', '.join(JOBS)}")
    return importlib.import_module(JOBS[name]).JOB

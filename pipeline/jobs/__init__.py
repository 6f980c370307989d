"""Built-in jobs: declarative specs (a dataclass of fields, TOML and/or flags)
plus the pure functions the pipeline roles run (data, gradients, optimizer).

`get_job(name)` returns the job class; `JOBS` lists them.
"""
from __future__ import annotations

import importlib

JOBS = {"spirals": "pipeline.jobs.spirals", "lm": "pipeline.jobs.lm", "pretrain": "pipeline.jobs.pretrain",
        "sft": "pipeline.jobs.sft", "finetune": "pipeline.finetune.job"}
# ES jobs run the es_member task kind (pipeline/runtime/es_scheduler.py), not the trainer plan of `fucina launch`
ES_JOBS = {"es-spirals": "pipeline.es.run", "es-finetune": "pipeline.finetune.es"}


def get_job(name: str):
    from ..errors import UserError
    modules = {**JOBS, **ES_JOBS}
    if name not in modules:
        raise UserError(f"unknown job {name!r}; built-in jobs: {', '.join(modules)}")
    return importlib.import_module(modules[name]).JOB

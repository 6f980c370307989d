"""Fine-tuning of a frozen GGUF model: the LoRA model, the jobs' specs, one builder, the jobs.

  model.py     LoraModel (the one LoRA model of the tree), Frozen, adapted_linears, batch_loss,
               the run's fingerprint and stored LoRA config
  schedule.py  lr_factor: the one LR schedule (warm-up, then constant, linear or cosine decay)
  spec.py      FinetuneSpec (`fucina finetune`, `launch finetune`) and ESFinetuneSpec (`fucina es-finetune`,
               `launch es-finetune`): their fields ARE the flags
  build.py     one builder from a spec to the model, tokenizer, data, loader and scorer
  job.py       the `finetune` job (backprop) on pipeline/runtime
  es.py        ESFinetune (ES over the adapters) and the `es-finetune` job
  session.py   Session (accumulation windows in this process) and verify_grads

Layering: this package sits beside pipeline/jobs (it reads models, llm, es and runtime); the commands call it,
it never imports them. Nothing is imported here: `import pipeline.finetune.model` loads only the model.
"""

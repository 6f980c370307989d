"""The old home of LoRA fine-tuning, now pipeline/finetune/ (model.py: LoraModel). Kept only for the kernel
cold-cache probe of tests/kernels/test_cold_cache.py, which imports `swiglu` from here; new code imports it
from pipeline.models.decoder."""
from pipeline.models.decoder import swiglu  # noqa: F401

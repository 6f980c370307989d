"""llama.cpp as the parity tests' oracle, in the set-up that `--llama-numerics` reproduces bit for bit: plain CPU
buffers (the repacked "extra buffer" kernels are another arithmetic, and their AMX int8 path dies with SIGILL on
some VMs), an f32 KV cache, no flash attention, one batch for the whole context, every position's logits kept
(without logits_all llama-cpp-python 0.3.x leaves `scores` all zero). Every folder of tests/ is on sys.path
(conftest.py), so any test imports it by name."""


def plain_llama(path, n_ctx=256, n_threads=2):
    import llama_cpp
    import llama_cpp.llama as ll
    orig = ll.llama_cpp.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = False
        return p

    ll.llama_cpp.llama_model_default_params = params
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                               n_threads=n_threads, type_k=0, type_v=0, flash_attn=False, verbose=False)
    finally:
        ll.llama_cpp.llama_model_default_params = orig

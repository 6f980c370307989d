"""`fucina bench llm --model M.gguf`: prefill and decode speed and peak memory, vs llama.cpp.

Trade-off: the cases are whole-model work a user feels (prefill of 64 and 256
tokens, per-token decode after a 64-token prompt), not kernel micro-timings.
Each side runs them in a fresh subprocess of its own, and its peak RSS is that
process's VmHWM: Fucina's imports what `fucina generate` imports and holds what it
holds (model, tokenizer, chat template), llama.cpp's is Python with numpy and
llama_cpp imported; a crash in llama.cpp cannot take the benchmark down.
llama.cpp (llama-cpp-python, when installed) runs the same file with the same
thread count, twice: `llama.cpp` as its users run it
(its defaults: repacked CPU buffers, except block formats where the CPU has AMX,
whose int8 path dies on some VMs; f16 KV cache) and `llama.cpp fixed`, the layout
the parity mode mirrors (plain CPU buffers for block formats, f32 KV cache like ours).
The accuracy row measures what the speed costs: the mean per-position KL(exact || tested) over a fixed English
text (token ids when the file has no tokenizer), where "exact" is the quantized model's own function, every tensor
dequantized to F32 (llama.cpp running that F32 copy when installed, else Fucina), for Fucina's default mode (the
whole text as one prompt, and fed one token at a time: the decode products), its --llama-numerics mode and llama.cpp
on the file with its default KV cache (f16), both ways too.
Per-kernel rows then time one decode matvec and 64- and 256-row prefill products per
weight format and shape of the file, as GB/s of weight bytes and GFLOP/s beside
the machine's measured memory bandwidth and f32 BLAS peak, the output head's decode product, and the
thread pool's cost per dispatch times the dispatches a decode token makes (`--no-kernels` skips them).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from ..threads import add_threads_flag
from . import timed
from ..runtime.metrics import peak_rss_mb

NAME = "llm"
HELP = "GGUF (any registered architecture) prefill/decode tok/s and peak RSS, with llama.cpp ratios when installed"


def add_arguments(parser):
    parser.add_argument("--model", required=True,
                        help="path to a GGUF of any registered architecture (e.g. from tools/make_*_shaped.py)")
    add_threads_flag(parser, 2, "Fucina's kernels", also="; llama.cpp gets the same N (give N >= 1)")
    parser.add_argument("--decode-tokens", type=int, default=16, help="tokens timed in the decode case (default 16)")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions per case; the median is reported")
    parser.add_argument("--blas-threads", type=int, default=1,
                        help="OpenBLAS threads for numpy work outside Fucina's GEMM tiles, i.e. the attention "
                             "matmuls (default 1); the tiles always run BLAS on one thread per Fucina thread "
                             "(docs/models.md, 'Threads')")
    parser.add_argument("--no-llama", action="store_true", help="skip the llama.cpp baseline")
    parser.add_argument("--no-accuracy", action="store_true",
                        help="skip the accuracy row (mean per-position KL of the next-token distributions to the "
                             "exact forward of the quantized model: every tensor dequantized to F32; writes that "
                             "F32 copy to a temporary directory, 4 bytes per weight)")
    parser.add_argument("--no-kernels", action="store_true",
                        help="skip the per-kernel rows (decode matvec and prefill GEMM per weight format and shape, "
                             "beside the measured memory bandwidth and f32 BLAS peak)")


def _prompt(n, vocab):
    return (np.arange(n, dtype=np.int64) * 7919 + 13) % min(vocab, 500)


def _ours(path, threads, decode_tokens, repeat, blas_threads=1):
    """Runs in a fresh subprocess (_ours_worker), as llama.cpp's side does: the process imports what `fucina
    generate` imports (the command line's modules), holds what it holds (model, tokenizer, chat template:
    LoadedModel) and nothing of the bench's, so its peak RSS is a user's and the two figures compare alike."""
    from threadpoolctl import threadpool_limits
    from .. import cli
    from ..llm.generate import LoadedModel
    from ..llm.quants import FrozenWeight
    from ..models import decoder  # noqa: F401  (the kernels' modules: imported before the load, as generate does)
    from ..threads import pin_threads
    cli.build_parser("generate")  # what `fucina generate` imports (pipeline/cli.py: its own command module)
    pin_threads(threads)
    with threadpool_limits(blas_threads, user_api="blas"):
        rss0 = peak_rss_mb()
        t0 = time.perf_counter()
        model = LoadedModel(path, log=lambda m: None).model
        load_ms = (time.perf_counter() - t0) * 1e3
        vocab = model.config.vocab_size
        res = {"load_ms": load_ms, "weight_mb": model.weight_bytes / 2 ** 20, "load_rss_mb": peak_rss_mb()}
        for n in (64, 256):
            ids = _prompt(n, vocab)
            res[f"prefill{n}"], res[f"prefill{n}_cpu"] = timed(lambda: model.infer(ids, model.new_cache(n)), repeat)
        ids = _prompt(64, vocab)

        def decode():
            cache = model.new_cache(64 + decode_tokens)
            model.infer(ids, cache)
            t, c = time.perf_counter(), time.process_time()
            token = 1
            for _ in range(decode_tokens):
                token = int(np.argmax(model.infer(np.array([token]), cache)))
            return ((time.perf_counter() - t) * 1e3 / decode_tokens, (time.process_time() - c) * 1e3 / decode_tokens)

        decode()  # warm-up (numba compilation)
        runs = [decode() for _ in range(repeat)]
        res["decode"], res["decode_cpu"] = (float(np.median([r[k] for r in runs])) for k in (0, 1))
        res["peak_rss_mb"] = peak_rss_mb()
        res["tile_mb"] = sum(w.tile_bytes for w in model.named_weights().values()
                             if isinstance(w, FrozenWeight)) / 2 ** 20
        res["rss_before_mb"] = rss0
    return res


def _ours_worker(path, threads, decode_tokens, repeat, blas_threads):
    """Runs in a subprocess: prints _ours's figures as JSON."""
    print(json.dumps(_ours(path, threads, decode_tokens, repeat, blas_threads)))


ACCURACY_TEXT = ("The old lighthouse keeper climbed the stairs every evening at dusk. He wound the clockwork, "
                 "trimmed the wick and watched the ships pass the rocks below. In winter the storms came from the "
                 "north, and the waves rose higher than the harbour wall; in summer the sea was calm and blue.")


def mean_kl(ref_logits, logits) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(logits)), nats."""
    from ..llm.export import log_softmax
    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def _accuracy(path, threads, use_llama):
    """{name: mean KL to the exact forward} (module docstring) and the reference's name."""
    import tempfile
    from ..llm.generate import LoadedModel
    from ..llm.gguf_write import write_dequantized
    from ..models.registry import load_model
    from ..threads import pin_threads
    pin_threads(threads)
    with tempfile.TemporaryDirectory(prefix="fucina-bench-f32-") as tmp:
        exact_path = os.path.join(tmp, "exact-f32.gguf")
        write_dequantized(path, exact_path)
        loaded = LoadedModel(path)
        default, tokenizer = loaded.model, loaded.tokenizer
        ids = _prompt(64, default.config.vocab_size) if tokenizer is None else \
            np.asarray(tokenizer.encode(ACCURACY_TEXT), np.int64)
        got = {"fucina": default.infer(ids, all_logits=True)}
        cache = default.new_cache(len(ids))  # one token at a time: the decode products' own arithmetic
        got["fucina decode"] = np.stack([default.infer(ids[i:i + 1], cache) for i in range(len(ids))])
        del loaded, default, cache
        got["fucina --llama-numerics"] = load_model(path, llama_numerics=True).infer(ids, all_logits=True)
        exact = load_model(exact_path).infer(ids, all_logits=True)
        ref, ref_name = exact, "Fucina on the F32 copy"
        if use_llama:
            theirs = {}
            for name, file in (("llama.cpp", path), ("exact", exact_path)):
                theirs[name], why = _llama_logits(file, threads, ids, os.path.join(tmp, f"{name}.npy"))
                if theirs[name] is None:
                    return {"error": why}, None
            ref, ref_name = theirs["exact"][0], "llama.cpp on the F32 copy"
            got["llama.cpp"], got["llama.cpp decode"] = theirs["llama.cpp"]
            got["fucina on the F32 copy"] = exact
    return {name: mean_kl(ref, logits) for name, logits in got.items()} | {"positions": len(ids)}, ref_name


def _machine_limits(threads, repeat):
    """(read GB/s, copy GB/s, f32 GFLOP/s): numpy sum and copy of a 256 MB buffer (far beyond the caches), and
    a 1024^3 f32 BLAS matmul at `threads` threads: the physical limits the kernel rows are measured against."""
    from threadpoolctl import threadpool_limits
    buf = np.ones(64 << 20, np.float32)
    dst = np.empty_like(buf)
    read_ms = timed(lambda: buf.sum(), repeat)[0]
    copy_ms = timed(lambda: np.copyto(dst, buf), repeat)[0]
    a = np.ones((1024, 1024), np.float32)
    with threadpool_limits(threads, user_api="blas"):
        gemm_ms = timed(lambda: a @ a, repeat)[0]
    return buf.nbytes / read_ms / 1e6, 2 * buf.nbytes / copy_ms / 1e6, 2 * 1024 ** 3 / gemm_ms / 1e6


def _dispatch_row(gg, threads, repeat):
    """The thread pool's fixed cost: one dispatch of an empty decode product (a native job with no pieces,
    pipeline/kernels/qint.py) to `threads` threads, a mean over 200 back to back as a decode makes them, and what the 4
    dispatches per layer plus the output head's add per token; beside it an empty dispatch of Python tasks
    (what the GEMM tiles and row kernels pay)."""
    from pipeline.kernels import qint, workpool
    layers = sum(1 for name in gg.tensor_names if name.endswith(".ffn_down.weight"))
    per_token = 4 * layers + 1
    calls = 200
    ms = timed(lambda: [qint.empty_dispatch(threads) for _ in range(calls)], repeat)[0] / calls
    python_ms = timed(lambda: [workpool.run_dynamic(threads, lambda i: None) for _ in range(calls)], repeat)[0] / calls
    return {"case": "machine/dispatch", "ms": ms, "baselines": {}, "dispatches_per_token": per_token,
            "python_ms": python_ms,
            "notes": f"one empty {threads}-thread decode-product dispatch: {ms * 1e3:.1f} us; a decode token makes "
                     f"{per_token} ({layers} layers x 4 + the output head): {per_token * ms:.2f} ms per token; "
                     f"an empty dispatch of Python tasks: {python_ms * 1e3:.1f} us"}


def _kernel_rows(path, threads, repeat):
    """One decode row (1 activation row, no graph: FrozenWeight's default path) and two prefill rows (64 and 256
    rows) per (format, shape) of the model's projection weights, and for the formats with integer kernels the
    other path too (f32 where the default is integer, integer where it is f32), plus the output head's decode
    row: ms, GB/s of weight bytes read, GFLOP/s (2 n_out n_in per activation row), the path that ran. The pool
    is held (its threads spin between calls, as inside a model forward)."""
    from pipeline.kernels import qint, workpool
    from ..autograd import no_grad
    from ..llm.gguf import GGUFFile
    from ..threads import pin_threads
    pin_threads(threads)
    gg = GGUFFile(path)
    read_gbs, copy_gbs, peak = _machine_limits(threads, repeat)
    rows = [{"case": "machine/memory_read", "ms": (256 << 20) / read_gbs / 1e6, "baselines": {}, "gbps": read_gbs,
             "copy_gbps": copy_gbs, "peak_gflops": peak,
             "notes": f"numpy sum of 256 MB: {read_gbs:.1f} GB/s (copy {copy_gbs:.1f} GB/s "
                      f"read+write); f32 BLAS 1024^3 at {threads} thread(s): {peak:.1f} GFLOP/s"}]
    rows.append(_dispatch_row(gg, threads, repeat))
    seen = set()
    head = "output.weight" if "output.weight" in gg.tensor_names else "token_embd.weight"
    for name in gg.tensor_names:
        if name != head and (not name.endswith(".weight") or ".attn_" not in name and ".ffn_" not in name):
            continue
        w = gg.weight(name)
        if len(w.shape) != 2 or "norm" in name or (w.format.name, w.shape) in seen:
            continue
        seen.add((w.format.name, w.shape))
        if name == head:  # the output head: one decode product, the largest weight a token reads
            cases = [("decode_head", 1, True)]
        else:
            cases = [("decode", 1, True), ("prefill64", 64, True), ("prefill256", 256, True)]
            w.inference = True  # an inference prompt's path (quants.for_inference), as generate and serve take
            if qint.supports(w.format.qtype):  # the A/B: the same products through the other kernels
                cases.append(("decode_f32", 1, False))
                w.integer_dot, w.llama_numerics = True, False
                with no_grad():  # prefill's default path (integer for the K-quants), then the other one
                    cases += [(f"prefill{m}_f32", m, False) if w.uses_integer_dot(m)
                              else (f"prefill{m}_integer", m, None) for m in (64, 256)]
        for kind, m, integer in cases:
            x = np.random.default_rng(0).standard_normal((m, w.shape[1])).astype(np.float32)
            w.integer_dot, w.llama_numerics = integer is not False, integer is None  # parity mode forces integer
            with no_grad(), workpool.hold():  # the pool held spinning between calls, as inside a forward
                path_name = "integer" if w.uses_integer_dot(m) else "f32"
                ms = timed(lambda: w.matmul_t(x), repeat if m > 1 else 10 * repeat)[0]
            gbs, gflops = w.nbytes / ms / 1e6, 2.0 * m * w.shape[0] * w.shape[1] / ms / 1e6
            rows.append({"case": f"kernel/{w.format.name}/{w.shape[0]}x{w.shape[1]}/{kind}", "ms": ms, "baselines": {},
                         "gbps": gbs, "gflops": gflops, "path": path_name, "format": w.format.name,
                         "shape": list(w.shape), "activation_rows": m,
                         "notes": f"{path_name} path; {gbs:.1f} GB/s of weights ({100 * gbs / read_gbs:.0f}% of "
                                  f"measured read), {gflops:.1f} GFLOP/s ({100 * gflops / peak:.0f}% of f32 BLAS)"})
    return rows


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            return "amx_int8" in fh.read()
    except OSError:
        return False


def _open_llama(path, threads, extra_bufts, **kw):
    """llama_cpp.Llama on `path` with the repacked "extra buffer" CPU kernels on or off (llama-cpp-python has no
    argument for it: its default model params are patched)."""
    import llama_cpp
    import llama_cpp.llama as ll
    orig = ll.llama_cpp.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = extra_bufts
        return p

    ll.llama_cpp.llama_model_default_params = params
    return llama_cpp.Llama(model_path=path, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=threads,
                           n_threads_batch=threads, verbose=False, **kw)


def _llama_worker(path, threads, decode_tokens, repeat, quantized, defaults=False):
    """Runs in a subprocess: prints llama.cpp's timings as JSON. defaults: as its users run it (repacked "extra
    buffer" CPU kernels, f16 KV cache); else the fixed layout Fucina's parity mode mirrors (plain CPU buffers for
    block formats, f32 KV cache). llama.cpp's AMX int8 path dies with SIGILL on some VMs: where the CPU has AMX,
    block formats run without the extra buffers either way."""
    import llama_cpp  # noqa: F401  (its libraries: the interpreter's share, before any model)
    rss0 = peak_rss_mb()
    llm = _open_llama(path, threads, not quantized or (defaults and not _has_amx()),
                      **({} if defaults else {"type_k": 0, "type_v": 0}))
    vocab = llm.n_vocab()
    res = {}
    for n in (64, 256):
        ids = [int(i) for i in _prompt(n, vocab)]

        def prefill():
            llm.reset()  # rewinds the KV cache: the next eval starts at position 0
            llm.eval(ids)

        res[f"prefill{n}"], res[f"prefill{n}_cpu"] = timed(prefill, repeat)
    ids = [int(i) for i in _prompt(64, vocab)]

    def decode():
        llm.reset()
        llm.eval(ids)
        t, c = time.perf_counter(), time.process_time()
        for _ in range(decode_tokens):
            llm.eval([1])
        return ((time.perf_counter() - t) * 1e3 / decode_tokens, (time.process_time() - c) * 1e3 / decode_tokens)

    decode()
    runs = [decode() for _ in range(repeat)]
    res["decode"], res["decode_cpu"] = (float(np.median([r[k] for r in runs])) for k in (0, 1))
    res["peak_rss_mb"], res["rss_before_mb"] = peak_rss_mb(), rss0
    print(json.dumps(res))


def _llama_logits_worker(path, threads, ids, out):
    """Runs in a subprocess: every position's logits of `ids` by llama.cpp (its default KV cache) into `out`,
    [2, positions, vocab]: the ids as one prompt, then fed one at a time. No extra buffers (AMX: _llama_worker)."""
    llm = _open_llama(path, threads, False, logits_all=True)
    llm.eval([int(i) for i in ids])
    prompt = np.asarray(llm.scores[:len(ids)], np.float32)
    llm.reset()
    for i in ids:  # one token at a time: its decode arithmetic
        llm.eval([int(i)])
    np.save(out, np.stack([prompt, np.asarray(llm.scores[:len(ids)], np.float32)]), allow_pickle=False)


def _in_subprocess(call, threads, who="llama.cpp"):
    """(stdout, None) of `python -c "from pipeline.bench.llm import ...; call"`, or (None, why) if it failed.
    llama.cpp's side gets OMP_NUM_THREADS = threads; Fucina's (who="Fucina") the environment as it is."""
    name = call.split("(", 1)[0]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if who == "llama.cpp" else None
    proc = subprocess.run([sys.executable, "-c", f"from pipeline.bench.llm import {name}; {call}"],
                          capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if proc.returncode != 0:
        return None, f"{who} failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
    return proc.stdout, None


def _llama_logits(path, threads, ids, out):
    _, why = _in_subprocess(f"_llama_logits_worker({str(path)!r}, {threads}, {[int(i) for i in ids]!r}, "
                            f"{str(out)!r})", threads)
    return (None, why) if why else (np.load(out, allow_pickle=False), None)


def _llama(path, threads, decode_tokens, repeat, quantized, defaults=False):
    out, why = _in_subprocess(f"_llama_worker({str(path)!r}, {threads}, {decode_tokens}, {repeat}, {quantized}, "
                              f"{defaults})", threads)
    return (None, why) if why else (json.loads(out.strip().splitlines()[-1]), None)


def _accuracy_row(args, use_llama):
    t0 = time.perf_counter()
    kl, ref = _accuracy(os.path.abspath(args.model), args.threads, use_llama)  # the workers run from the root
    row = {"case": f"{os.path.basename(args.model)}/kl_exact", "ms": (time.perf_counter() - t0) * 1e3,
           "baselines": {}, "kl": kl, "reference": ref}
    if "error" in kl:
        row["notes"] = kl["error"]
        return row
    row["notes"] = (f"ms: the measurement; mean per-position KL to the exact forward ({ref}, "
                    f"{kl['positions']} positions): "
                    + ", ".join(f"{name} {value:.3g}" for name, value in kl.items() if name != "positions"))
    return row


def run(args):
    import importlib.util
    from ..errors import UserError
    from ..llm.gguf import GGUFFile
    if not os.path.isfile(args.model):
        raise UserError(f"{args.model}: no such GGUF file")
    if args.threads < 1:
        raise UserError(f"bench llm times both sides at one thread count: --threads must be >= 1, got {args.threads}")
    gg = GGUFFile(args.model)
    quantized = any(gg.tensor_type(n) not in ("F32", "F16", "BF16") for n in gg.tensor_names)
    model = os.path.abspath(args.model)  # both sides' workers run from the project root: a relative path is this cwd's
    out, why = _in_subprocess(f"_ours_worker({model!r}, {args.threads}, {args.decode_tokens}, "
                              f"{args.repeat}, {args.blas_threads})", args.threads, who="Fucina")
    if why:  # the file loads in this process (GGUFFile above) but not as a model there: one error line
        raise UserError(f"{args.model}: {why}")
    ours = json.loads(out.strip().splitlines()[-1])
    theirs, fixed, why = None, None, "llama-cpp-python not installed"
    if not args.no_llama and importlib.util.find_spec("llama_cpp") is not None:
        theirs, why = _llama(model, args.threads, args.decode_tokens, args.repeat, quantized, defaults=True)
        fixed, why_fixed = _llama(model, args.threads, args.decode_tokens, args.repeat, quantized)
        if theirs is None:  # the defaults failed (their kernels on this VM): the fixed layout is still a baseline
            theirs, fixed, why = fixed, None, f"llama.cpp's defaults: {why}; shown: the fixed layout"
        elif fixed is None:
            why = f"llama.cpp fixed: {why_fixed}"
    elif args.no_llama:
        why = "--no-llama"
    rows = []
    for case, tokens in (("prefill64", 64), ("prefill256", 256), ("decode", 1)):
        ms = ours[case]
        row = {"case": f"{os.path.basename(args.model)}/{case}", "ms": ms, "baselines": {},
               "tok_s": tokens * 1e3 / ms, "cpu_ms": ours[case + "_cpu"]}
        note = f"{row['tok_s']:.1f} tok/s"
        if theirs:
            row["baselines"]["llama.cpp"] = theirs[case]
            row["llama_tok_s"] = tokens * 1e3 / theirs[case]
            row["llama_cpu_ms"] = theirs[case + "_cpu"]
            note += (f" vs llama.cpp {row['llama_tok_s']:.1f} tok/s (its defaults); CPU-time ratio "
                     f"x{row['llama_cpu_ms'] / row['cpu_ms']:.2f}")
        if fixed:
            row["baselines"]["llama.cpp fixed"] = fixed[case]
            note += f"; llama.cpp fixed (no repack, f32 KV) {tokens * 1e3 / fixed[case]:.1f} tok/s"
        if why:
            note += f"; {why}" if theirs else f"; no baseline: {why}"
        if case == "decode":
            note = f"per token after a 64-token prompt; {note}"
        row["notes"] = note
        rows.append(row)
    mem = {"case": f"{os.path.basename(args.model)}/peak_rss", "ms": ours["load_ms"], "baselines": {},
           "peak_rss_mb": ours["peak_rss_mb"], "weight_mb": ours["weight_mb"], "tile_mb": ours["tile_mb"],
           "import_rss_mb": ours["rss_before_mb"], "load_rss_mb": ours["load_rss_mb"],
           "notes": f"load ms; peak RSS {ours['peak_rss_mb']:.0f} MB (after the command's imports "
                    f"{ours['rss_before_mb']:.0f}, after loading model + tokenizer {ours['load_rss_mb']:.0f}; "
                    f"weights {ours['weight_mb']:.0f} MB, mmapped pages count once touched; prompt tiles "
                    f"{ours['tile_mb']:.0f} MB)"}
    if theirs:
        mem["llama_peak_rss_mb"] = theirs["peak_rss_mb"]
        mem["llama_import_rss_mb"] = theirs.get("rss_before_mb")
        mem["notes"] += (f"; llama.cpp peak RSS {theirs['peak_rss_mb']:.0f} MB (after importing llama_cpp "
                         f"{theirs['rss_before_mb']:.0f}); each side's VmHWM in its own fresh process")
    rows.append(mem)
    if not args.no_accuracy:
        rows.append(_accuracy_row(args, theirs is not None))
    if not args.no_kernels:
        rows += _kernel_rows(args.model, args.threads, args.repeat)
    return rows

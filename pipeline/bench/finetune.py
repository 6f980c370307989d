"""`fucina bench finetune`: ms per optimizer step of the LoRA fine-tune on a GGUF.

Rank-8 LoRA on q+v (the defaults) at sequence length 128, AdamW, clip 1.0, on
one synthetic sample (random tokens, the first quarter masked as prompt),
in-process with the base kept in its file format. The runtime rows run the
`finetune` job itself on two synthetic pairs (one accumulation window of 2
per step): in-process vs 1 trainer process vs 2, each compute process on the
same threads, the median of the scheduler's own step times after the first
(warm-up) step. The torch baseline runs the same LoRA on the
dequantized f32 weights with the same thread count, in the same run; its steps
alternate with ours (one of each, repeated), so a machine whose speed drifts
over minutes slows both sides alike.

Long sequences: --seq takes a list (512,1024,2048), one row per length, named `<label>/seq<N>` with --label
(the model's name). --memory also runs each side alone in a fresh child process (load, build, two steps) and
reports the peak resident set of its steps (VmHWM reset after the build: weights as each side holds them plus
the step's activations; the torch child drops the GGUF mapping once its f32 tensors exist). --checkpoint on
recomputes each layer in backward, as `finetune --checkpoint-layers` does (off by default, as there: from
1024 keys the attention recomputes its probabilities anyway, pipeline/autograd/ops.ATTN_RECOMPUTE_MIN_KEYS,
which keeps the step under torch's peak without it; docs/finetune.md#long-sequences).

Trade-off: one synthetic sample keeps the bench independent of a tokenizer and
a dataset; the per-step work (forward, backward, optimizer) is what a real run
does per micro-batch.
"""
from __future__ import annotations

import time

import numpy as np

from ..threads import add_threads_flag
from . import timed
from ..runtime.metrics import peak_rss_mb

NAME = "finetune"
HELP = "LoRA fine-tune step time (rank-8 q+v, seq 128) vs torch; the finetune job in-process vs 1 and 2 trainers"


def add_arguments(p):
    p.add_argument("--model", required=True,
                   help="GGUF of any registered architecture (e.g. from tools/make_*_shaped.py)")
    p.add_argument("--seq", type=_seqs, default=(128,),
                   help="sequence length(s) (input positions): N or a comma list, one row each (default 128)")
    p.add_argument("--label", default="", help="name the rows LABEL/seq<N> (e.g. smollm2-135m); default "
                                               "step/in-process (step/seq<N> for several lengths)")
    p.add_argument("--memory", action="store_true",
                   help="also measure each side's peak resident set over two steps, each alone in a fresh process")
    p.add_argument("--checkpoint", choices=("on", "off"), default="off",
                   help="on: recompute each layer in backward (finetune --checkpoint-layers)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--targets", default="q,v", help="adapted projections")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per case (median reported)")
    add_threads_flag(p, 2, "the bench", also="; torch gets the same N, a trainer process N/2")
    p.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    p.add_argument("--no-trainers", action="store_true", help="skip the runtime rows (in-process vs 1 and 2 trainers)")
    p.add_argument("--pack", type=int, default=0, metavar="N",
                   help="also time one step's N short samples (seq/8 .. seq/4 tokens) one per micro-batch vs packed "
                        "into windows of --seq tokens (finetune --pack); 0: off")


def _seqs(text):
    try:
        seqs = tuple(int(v) for v in str(text).split(","))
    except ValueError:
        seqs = ()
    if not seqs or min(seqs) < 2:
        import argparse
        raise argparse.ArgumentTypeError(f"--seq wants N or N,M,... (each >= 2), got {text!r}")
    return seqs


def _checkpointing(mode, seq):
    return mode == "on"


def _sample(vocab, seq, seed=0):
    from pipeline.llm.data import IGNORE_INDEX, Sample
    ids = np.random.default_rng(seed).integers(0, vocab, seq + 1).astype(np.int64)
    labels = ids[1:].copy()
    labels[: seq // 4] = IGNORE_INDEX
    return Sample(ids[:-1].copy(), labels, seq // 4 + 1)


def _session(args, model, samples, accum, checkpoint_layers=False):
    from pipeline.llm.data import Loader
    from pipeline.finetune.model import LoraModel
    from pipeline.finetune.session import Session
    from pipeline.optim import AdamW
    targets = tuple(args.targets.split(","))
    trainer = LoraModel(model, targets=targets, rank=args.rank, alpha=2.0 * args.rank,
                        checkpoint_layers=checkpoint_layers)
    opt = AdamW(trainer.named_parameters(), lr=1e-3, weight_decay=0.0)
    return Session(trainer, opt, samples, Loader(len(samples)), accum_steps=accum)


def _pack_rows(args, model, desc):
    """--pack N: the forward+backward of N short synthetic samples (lengths seq/8 .. seq/4, seeded), one per
    micro-batch vs packed first-fit into windows of seq tokens (segmented attention), alternating. -> rows."""
    from pipeline.finetune.model import LoraModel, pack_windows, packed
    from pipeline.kernels.workpool import hold, single_thread_blas
    from pipeline.llm.data import IGNORE_INDEX, Sample
    g = np.random.default_rng(1)
    lengths = g.integers(max(2, args.seq // 8), max(3, args.seq // 4 + 1), args.pack)
    samples = []
    for n in lengths:
        labels = g.integers(0, model.config.vocab_size, n)
        labels[: n // 2] = IGNORE_INDEX
        samples.append(Sample(g.integers(0, model.config.vocab_size, n), labels, n // 2 + 1))
    plan = [[samples[i] for i in w] for w in pack_windows([int(n) for n in lengths], args.seq)]
    trainer = LoraModel(model, targets=tuple(args.targets.split(",")), rank=args.rank, alpha=2.0 * args.rank)
    scale = 1.0 / sum(s.n_valid for s in samples)

    def run(batches):
        trainer.zero_grad()
        for tokens, labels, segments in batches:
            with single_thread_blas(), hold():
                trainer.loss(tokens, labels, reduction="sum", loss_scale=scale, segments=segments).backward()

    one = [(s.inputs, s.labels, None) for s in samples]
    windows = [packed(w) for w in plan]
    (one_ms, _), (pack_ms, _) = _timed_alternating([lambda: run(one), lambda: run(windows)], args.steps)
    tokens = int(lengths.sum())
    note = f"{desc}; {args.pack} samples of {lengths.min()}-{lengths.max()} tokens, forward+backward"
    return [{"case": f"pack {args.pack} short/one per micro-batch", "ms": one_ms, "baselines": {},
             "tokens_s": tokens / one_ms * 1e3, "notes": f"{note}, {args.pack} micro-batches"},
            {"case": f"pack {args.pack} short/packed", "ms": pack_ms, "baselines": {"one_per_micro_batch": one_ms},
             "tokens_s": tokens / pack_ms * 1e3, "notes": f"{note}, {len(plan)} windows of {args.seq}"}]


def _runtime_rows(args, desc):
    """One accumulation window of 2 synthetic pairs per step: the finetune job in-process, on 1 and on 2
    trainer processes (each compute process on `per_process` threads). -> rows."""
    import dataclasses
    import json
    import os
    import tempfile

    from ..finetune.job import Finetune
    from ..finetune.spec import FinetuneSpec
    from ..runtime.inprocess import run_inprocess
    from ..runtime.launch import Supervisor
    from ..runtime.metrics import read_metrics
    from ..threads import pin_threads
    words = np.random.default_rng(0).choice(["ahoy", "matey", "sail", "sea", "ship", "crew", "gold"], (2, args.seq))
    per_process = max(1, (args.threads or 2) // 2)
    with tempfile.TemporaryDirectory(prefix="fucina-bench-finetune-") as tmp:
        data = os.path.join(tmp, "pairs.jsonl")
        with open(data, "w") as fh:
            for i, w in enumerate(words):
                fh.write(json.dumps({"instruction": f"pair {i}", "response": " ".join(w[: args.seq // 4])}) + "\n")
        spec = FinetuneSpec(model=os.path.abspath(args.model), data=data, steps=args.steps + 1, batch_size=2,
                            seq_max=4 * args.seq, rank=args.rank, alpha=2.0 * args.rank, targets=args.targets,
                            lr=1e-3, max_new_tokens=0)
        spec.validate()

        def median_step_ms(run_dir):
            ms = [r["step_ms"] for r in read_metrics(run_dir) if r.get("kind") == "metrics" and r["step"] > 1]
            return float(np.median(ms))

        pin_threads(per_process)
        run_inprocess(Finetune(spec), os.path.join(tmp, "inprocess"), log=lambda m: None)
        in_ms = median_step_ms(os.path.join(tmp, "inprocess"))
        pin_threads(args.threads)
        job_tokens = sum(len(s.inputs) for s in Finetune(spec).window(0))
        rows = [{"case": "runtime window accum2/in-process", "ms": in_ms, "baselines": {},
                 "tokens_s": job_tokens / in_ms * 1e3,
                 "notes": f"{desc}; the finetune job; {job_tokens} tokens per window; "
                          f"1 process x {per_process} threads"}]
        trainer_ms = {}
        for n in (1, 2):
            run_dir = os.path.join(tmp, f"trainers-{n}")
            Supervisor("finetune", dataclasses.asdict(spec), run_dir, trainers=n, threads=per_process,
                       quiet=True).run()
            trainer_ms[n] = median_step_ms(run_dir)
            base = {"in_process": in_ms} if n == 1 else {"in_process": in_ms, "trainers_1": trainer_ms[1]}
            rows.append({"case": f"runtime window accum2/trainers {n}", "ms": trainer_ms[n], "baselines": base,
                         "tokens_s": job_tokens / trainer_ms[n] * 1e3,
                         "notes": f"{desc}; {n} trainer process(es) x {per_process} threads; targets: 1 trainer >= "
                                  "0.9x in-process, 2 trainers >= 1.6x 1 trainer"})
    return rows


def _timed_alternating(fns, steps):
    """[(median wall ms, median CPU ms)] per fn, the fns called in turn `steps` times
    after one warm-up call each: drift in the machine's speed hits all of them alike."""
    for fn in fns:
        fn()
    wall, cpu = [[] for _ in fns], [[] for _ in fns]
    for _ in range(steps):
        for j, fn in enumerate(fns):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[j].append((time.perf_counter() - t0) * 1e3)
            cpu[j].append((time.process_time() - c0) * 1e3)
    return [(float(np.median(w)), float(np.median(c))) for w, c in zip(wall, cpu)]


def _torch_step(model, sample, args):
    """A callable running the same LoRA step in torch on the dequantized f32 weights
    (None when torch is absent)."""
    steps = _torch_steps(model, [sample], args)
    return steps and steps[0]


def _torch_steps(model, samples, args):
    """[a callable running the same LoRA step in torch on the dequantized f32 weights, per sample]: one set of
    weights, adapters and optimizer for all samples (None when torch is absent)."""
    try:
        import torch
    except ImportError:
        return None
    from pipeline.finetune.model import TARGETS, Frozen
    if args.threads:
        torch.set_num_threads(args.threads)
    c = model.config
    dense = lambda proj: torch.from_numpy(np.ascontiguousarray(Frozen(proj).dense()))
    layers = []
    targets = set(args.targets.split(","))
    lora = []
    vector = lambda v: torch.from_numpy(np.array(getattr(v, "data", v), np.float32))  # writable (the map is read-only)
    for b in model.blocks:
        layer = {t: dense(b.projection(t)) for t in TARGETS}
        for t in TARGETS:
            if b.projection(t).bias is not None:
                layer["bias_" + t] = vector(b.projection(t).bias)
        for nm, v in (("attn_norm", b.attn_norm), ("ffn_norm", b.ffn_norm), ("q_norm", b.attn.q_norm),
                      ("k_norm", b.attn.k_norm), ("post_attn_norm", b.post_attn_norm),
                      ("post_ffn_norm", b.post_ffn_norm)):
            if v is not None:
                layer[nm] = vector(v)
        for t in targets:
            out_dim, in_dim = layer[t].shape
            a = torch.empty(args.rank, in_dim).uniform_(-in_dim ** -0.5, in_dim ** -0.5).requires_grad_()
            bb = torch.zeros(out_dim, args.rank).requires_grad_()
            layer["lora_" + t] = (a, bb)
            lora += [a, bb]
        layers.append(layer)
    embed = dense(model.embed)
    head = embed if c.tied_output else dense(model.output)
    out_norm = torch.from_numpy(np.array(model.out_norm.data, np.float32))
    opt = torch.optim.AdamW(lora, lr=1e-3, weight_decay=0.0)
    scale = 2.0
    fam = model.family
    rope_factors = None if model._rope_factors is None else vector(model._rope_factors)

    def make(sample):  # holds no reference to model: the caller may drop it (and its file mapping)
        T = len(sample.inputs)
        ids = torch.from_numpy(sample.inputs)
        labels = torch.from_numpy(sample.labels)

        def rope_tables(base, position_scale):
            pos = torch.arange(T, dtype=torch.float32) * position_scale
            inv = base ** (-torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
            if rope_factors is not None:
                inv = inv / rope_factors
            return torch.cos(pos[:, None] * inv)[:, None], torch.sin(pos[:, None] * inv)[:, None]

        tables = {key: rope_tables(*key) for key in {c.layer_rope(i) for i in range(c.layers)}}
        interleaved = fam.rope == "normal"
        query, key = torch.arange(T)[:, None], torch.arange(T)[None, :]
        window_masks = {w: (key <= query) & (query - key < w) for w in {c.window(i) for i in range(c.layers)} if w}
        act = ((lambda g: torch.nn.functional.gelu(g, approximate="tanh")) if fam.activation == "gelu_tanh"
               else torch.nn.functional.silu)

        def rms(x, w):
            return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + c.rms_eps) * w

        def rope(x, cos, sin):
            if interleaved:  # pairs (x[2i], x[2i+1])
                x1, x2 = x[..., 0::2], x[..., 1::2]
                return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
            h = c.head_dim // 2
            return torch.cat([x[..., :h] * cos - x[..., h:] * sin, x[..., h:] * cos + x[..., :h] * sin], -1)

        def head_norm(x, L, name):
            return rms(x, L[name]) if name in L else x

        def proj(x, layer, t):
            y = x @ layer[t].T
            if "bias_" + t in layer:
                y = y + layer["bias_" + t]
            if "lora_" + t in layer:
                a, bb = layer["lora_" + t]
                y = y + scale * (x @ a.T) @ bb.T
            return y

        def step():
            x = embed[ids] * c.hidden ** 0.5 if fam.embed_scale else embed[ids]
            for i, L in enumerate(layers):
                cos, sin = tables[c.layer_rope(i)]
                a = rms(x, L["attn_norm"])
                q = rope(head_norm(proj(a, L, "q").view(T, c.heads, c.head_dim), L, "q_norm"), cos, sin)
                k = rope(head_norm(proj(a, L, "k").view(T, c.kv_heads, c.head_dim), L, "k_norm"), cos, sin)
                v = proj(a, L, "v").view(T, c.kv_heads, c.head_dim)
                mask = window_masks.get(c.window(i))
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
                    is_causal=mask is None, scale=c.attn_scale or None, enable_gqa=True)
                o = o[0].transpose(0, 1).reshape(T, -1)
                x = x + head_norm(proj(o, L, "o"), L, "post_attn_norm")
                m = rms(x, L["ffn_norm"])
                x = x + head_norm(proj(act(proj(m, L, "gate")) * proj(m, L, "up"), L, "down"), L, "post_ffn_norm")
            loss = torch.nn.functional.cross_entropy(rms(x, out_norm) @ head.T, labels, ignore_index=-100)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lora, 1.0)
            opt.step()
            opt.zero_grad()

        return step

    return [make(s) for s in samples]


def _vm_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def side_peak(side, model_path, seq, argv):
    """In a fresh process: build one side ("ours" / "torch") for one sequence length, reset the peak resident
    set (/proc/self/clear_refs 5), run two steps -> {"peak_rss_mb" of the steps, "rss_mb" before them,
    "process_peak_rss_mb" of the whole process (loading included)}."""
    import argparse
    import gc
    from pipeline.models.registry import load_model
    from pipeline.threads import pin_threads
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", model_path, *argv])
    pin_threads(args.threads)
    model = load_model(model_path)
    sample = _sample(model.config.vocab_size, seq)
    if side == "torch":
        step = _torch_step(model, sample, args)
        del model  # the torch side holds its f32 tensors only: the GGUF mapping goes
    else:
        from pipeline.finetune.model import keep_freed_memory
        keep_freed_memory()  # as the finetune job runs (build.lora_model)
        step = _session(args, model, [sample], 1, _checkpointing(args.checkpoint, seq)).window
    gc.collect()
    process_peak = _vm_kb("VmHWM")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    rss = _vm_kb("VmRSS")
    for _ in range(2):
        step()
    return {"peak_rss_mb": _vm_kb("VmHWM") / 1024, "rss_mb": rss / 1024,
            "process_peak_rss_mb": max(process_peak, _vm_kb("VmHWM")) / 1024}


def _child_peak(side, args, seq):
    """side_peak in a child process (the same interpreter and flags) -> its dict, or None on failure."""
    import json
    import subprocess
    import sys
    argv = ["--rank", str(args.rank), "--targets", args.targets, "--checkpoint", args.checkpoint]
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    code = ("import json, sys; from pipeline.bench.finetune import side_peak; "
            "print('PEAK ' + json.dumps(side_peak(*json.loads(sys.argv[1]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps([side, args.model, seq, argv])],
                         capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("PEAK "):
            return json.loads(line[5:])
    print(f"bench finetune: the {side} memory child failed ({out.returncode}): {out.stderr[-400:]}")
    return None


def run(args):
    import argparse
    from pipeline.models.registry import load_model
    from pipeline.threads import pin_threads
    pin_threads(args.threads)
    model = load_model(args.model)
    samples = [_sample(model.config.vocab_size, seq) for seq in args.seq]
    torch_steps = None if args.no_torch else _torch_steps(model, samples, args)
    rows = []
    for j, (seq, sample) in enumerate(zip(args.seq, samples)):
        n_sup = sample.n_valid
        ckpt = _checkpointing(args.checkpoint, seq)
        ours = _session(args, model, [sample], 1, ckpt).window
        if torch_steps is None:
            (ms, cpu), (torch_ms, torch_cpu) = timed(ours, args.steps), (None, None)
        else:
            (ms, cpu), (torch_ms, torch_cpu) = _timed_alternating([ours, torch_steps[j]], args.steps)
            torch_steps[j] = None  # its activations are not needed past here
        del ours
        baselines = {"torch_f32": torch_ms} if torch_ms else {}
        desc = f"rank {args.rank} {args.targets} seq {seq}" + ("; layers recomputed in backward" if ckpt else "")
        note = f"CPU {cpu:.0f} ms"
        if torch_cpu:
            note += f" vs torch {torch_cpu:.0f} ms (x{torch_cpu / cpu:.2f})"
        if args.label:
            case = f"{args.label}/seq{seq}"
        else:
            case = "step/in-process" if len(args.seq) == 1 else f"step/seq{seq}"
        row = {"case": case, "ms": ms, "cpu_ms": cpu, "baselines": baselines, "seq": seq,
               "checkpoint_layers": ckpt, "baseline_cpu_ms": {"torch_f32": torch_cpu},
               "supervised_tok_s": n_sup / ms * 1e3, "peak_rss_mb": peak_rss_mb(),
               "notes": f"{desc}; base stays in its file format; {note}"}
        if args.memory:
            mine = _child_peak("ours", args, seq)
            theirs = None if args.no_torch else _child_peak("torch", args, seq)
            row["step_peak_rss_mb"] = mine and mine["peak_rss_mb"]
            row["step_start_rss_mb"] = mine and mine["rss_mb"]
            row["baseline_step_start_rss_mb"] = {"torch_f32": theirs and theirs["rss_mb"]}
            row["baseline_step_peak_rss_mb"] = {"torch_f32": theirs and theirs["peak_rss_mb"]}
            row["process_peak_rss_mb"] = mine and mine["process_peak_rss_mb"]
            row["baseline_process_peak_rss_mb"] = {"torch_f32": theirs and theirs["process_peak_rss_mb"]}
            if mine:
                row["notes"] += f"; peak RSS of the steps {mine['peak_rss_mb']:.0f} MB"
                if theirs:
                    row["notes"] += f" vs torch {theirs['peak_rss_mb']:.0f} MB"
        rows.append(row)
    one = argparse.Namespace(**{**vars(args), "seq": args.seq[0]})  # the pack and runtime rows: the first length
    desc = f"rank {args.rank} {args.targets} seq {one.seq}"
    if args.pack:
        rows += _pack_rows(one, model, desc)
    if not args.no_trainers:
        rows += _runtime_rows(one, desc)
    return rows

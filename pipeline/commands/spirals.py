"""`fucina spirals`: train the two-spirals MLP full-batch and report accuracy.

First version: plain SGD written inline (p -= lr * grad), so the demo depends
on nothing but the autograd engine.
"""
from __future__ import annotations

import time

from pipeline.autograd import cross_entropy
from pipeline.errors import UserError
from pipeline.models.spirals import SpiralsMLP, accuracy, make_spirals
from threadpoolctl import threadpool_limits

NAME = "spirals"
HELP = "train the two-spirals MLP (400 points, 2-64-64-2 tanh) full-batch"


def add_arguments(parser):
    parser.add_argument("--optimizer", default="sgd", choices=["sgd"], help="optimizer (only plain SGD in this version)")
    parser.add_argument("--lr", type=float, default=0.5, help="learning rate")
    parser.add_argument("--steps", type=int, default=2000, help="full-batch training steps")
    parser.add_argument("--seed", type=int, default=0, help="seed for the data noise and the init")
    parser.add_argument("--hidden", type=int, default=64, help="hidden width")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (400 points are too few to profit from more)")
    parser.add_argument("--log-every", type=int, default=200, help="print loss and accuracy every N steps")


def run(args):
    if args.steps < 0 or args.lr <= 0 or args.log_every <= 0:
        raise UserError("spirals: --steps must be >= 0, --lr and --log-every > 0")
    threadpool_limits(max(1, args.threads))  # BLAS; the row kernels run serially at this size anyway
    print(f"spirals: optimizer={args.optimizer} lr={args.lr} steps={args.steps} seed={args.seed} hidden={args.hidden}")
    X, y = make_spirals(seed=args.seed)
    model = SpiralsMLP(seed=args.seed, hidden=args.hidden)
    params = model.parameters()
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = cross_entropy(model(X), y)
        loss.backward()
        for p in params:
            p.data -= args.lr * p.grad
            p.grad = None
        if step % args.log_every == 0 or step == args.steps:
            print(f"step {step:5d}  loss {loss.item():.4f}  accuracy {accuracy(model, X, y):.3f}")
    acc = accuracy(model, X, y)
    print(f"final accuracy {acc:.3f} ({time.perf_counter() - t0:.1f} s)")
    return 0

"""Tutorial 7: pipelining and sharding a model over several IPUs.

    python examples/ipu/07_pipelining.py [--stages 2 --batch-size 2 --calls 2]

A model too big for one IPU is split into **stages**, one IPU each. The split only changes where each part
runs: the numbers are the unsplit model's. PopTorch's tools:

* ``poptorch.BeginBlock(module, user_id, ipu_id)``: the module, and everything the forward runs after it
  (until the next block), runs on IPU ``ipu_id``. Ops before the first block run on IPU 0.
* ``with poptorch.Block(user_id, ipu_id):`` and ``@poptorch.BlockFunction(user_id, ipu_id)``: the same for a
  piece of ``forward`` or a function.
* ``Options.setExecutionStrategy(...)``: ``PipelinedExecution()`` (the default; stage = ipu_id) keeps every
  IPU busy on successive micro-batches; ``ShardedExecution()`` runs the stages one after the other;
  ``SerialPhasedExecution`` / ``ParallelPhasedExecution`` run explicit phases. ``Stage("A", "B").ipu(1)``
  groups blocks; ``AutoStage.AutoIncrement`` gives a return to an earlier IPU its own stage.

The pipeline rule: a pipeline of S forward stages trains as 2S - 1 stages (the backward pass adds S - 1), so
``Training.gradientAccumulation`` must be at least 2S - 1; an inference pipeline needs ``deviceIterations``
>= S. A model on S IPUs with R replicas takes S x R IPUs (a power of two, or ``autoRoundNumIPUs``).

The script checks:

1. an S-stage pipeline (BeginBlock at S - 1 layers) trains to the weights of plain SGD on the host, the
   unsplit model's (within 1e-6 on the emulator, whose float sums run in another order than the host loop's;
   within a small tolerance on IPUs, whose arithmetic differs);
2. PopTorch's error when gradientAccumulation is below 2S - 1;
3. the same model sharded (no accumulation needed) and a pipelined inference model (deviceIterations >= S).

With accelbatch, ``--pipeline NAME,...`` does step 1 for an agent's model (see the README).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from poptorch_or_emulator import import_poptorch  # examples/ipu/poptorch_or_emulator.py


class Tower(torch.nn.Module):
    """``layers`` linear layers with tanh between them and a cross-entropy loss: forward(x, t) -> (scores, loss)."""

    def __init__(self, layers: int = 4, width: int = 16):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x, t):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        x = self.layers[-1](x)
        return x, F.cross_entropy(x, t)


def split(model: Tower, stages: int, poptorch) -> Tower:
    """BeginBlock at evenly spaced layers: layer k * L / S starts stage k on IPU k."""
    n = len(model.layers)
    for k in range(1, stages):
        poptorch.BeginBlock(model.layers[k * n // stages], user_id=f"stage{k}", ipu_id=k)
    return model


def train_ipu(poptorch, model, x, t, *, b, d, g, lr, calls, strategy=None):
    opts = poptorch.Options().deviceIterations(d)
    opts.Training.gradientAccumulation(g)
    if strategy is not None:
        opts.setExecutionStrategy(strategy)
    training = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
    rows = b * d * g
    for c in range(calls):
        training(x[c * rows:(c + 1) * rows], t[c * rows:(c + 1) * rows])
    training.copyWeightsToHost()
    training.destroy()
    return model


def train_host(model, x, t, *, rows_per_update, updates, lr):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for u in range(updates):
        rows = slice(u * rows_per_update, (u + 1) * rows_per_update)
        opt.zero_grad()
        model(x[rows], t[rows])[1].backward()
        opt.step()
    return model


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2, help="IPUs to split the model over (a power of 2: 2 or 4)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--device-iterations", type=int, default=2,
                        help="raised to --stages when below it (an inference pipeline needs D >= S)")
    parser.add_argument("--calls", type=int, default=2, help="host calls (each D weight updates)")
    parser.add_argument("--emulator", action="store_true", help="use the CPU emulator even if poptorch exists")
    args = parser.parse_args(argv)
    for name in ("batch_size", "device_iterations", "calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    s = args.stages
    if s < 2:
        parser.error(f"--stages {s}: a pipeline needs at least 2 stages (one IPU each); use 2 or 4")
    if s > 64:
        parser.error(f"--stages {s}: {s} stages need {s} IPUs, and PopTorch drives at most 64 from one process "
                     "(more need distributed execution); use 64 or fewer (2 or 4 run in seconds)")
    if s & (s - 1):  # a real IPU system reserves a power of 2 (or a multiple of 64) IPUs
        below, held = 1 << (s.bit_length() - 1), 1 << s.bit_length()
        parser.error(f"--stages {s}: an IPU system reserves a power of 2 or a multiple of 64 IPUs, so {s} stages "
                     f"would hold {held} IPUs with {held - s} idle (PopTorch refuses it); use {below} or {held}")
    poptorch = import_poptorch(args.emulator)
    tolerance = 1e-6 if getattr(poptorch, "IS_EMULATOR", False) else 1e-3
    s, b, d = args.stages, args.batch_size, max(args.device_iterations, args.stages)
    g = 2 * s - 1  # the smallest gradient accumulation a training pipeline of S stages accepts
    torch.manual_seed(0)
    start = Tower(layers=max(4, s))
    total = b * d * g * args.calls
    x, t = torch.randn(total, 16), torch.randint(0, 16, (total,))

    # 1. the pipeline trains to the unsplit model's weights ------------------------------------------
    piped = train_ipu(poptorch, split(copy.deepcopy(start), s, poptorch), x, t, b=b, d=d, g=g, lr=0.1,
                      calls=args.calls)
    host = train_host(copy.deepcopy(start), x, t, rows_per_update=b * g, updates=d * args.calls, lr=0.1)
    diff = max_diff(piped, host)
    assert diff <= tolerance, diff
    print(f"1. {s} pipelined stages (IPUs 0..{s - 1}), gradientAccumulation {g} = 2 x {s} - 1, deviceIterations "
          f"{d}: the weights of plain host SGD (max difference {diff:.1e}, tolerance {tolerance:g})")

    # 2. too little accumulation for the pipeline ------------------------------------------------------
    try:
        train_ipu(poptorch, split(copy.deepcopy(start), s, poptorch), x, t, b=b, d=d, g=s - 1 or 1, lr=0.1,
                  calls=1)
        raise AssertionError("a pipeline with too little gradient accumulation was accepted")
    except poptorch.Error as exc:
        message = getattr(exc, "message", "") or str(exc)
        assert "must be greater than or equal to the number of pipeline stages" in message, message
        print(f"\n2. gradientAccumulation {s - 1 or 1} is refused:\n   {message}")

    # 3. sharded: the same stages run one after the other, any accumulation; pipelined inference --------
    sharded = train_ipu(poptorch, split(copy.deepcopy(start), s, poptorch), x, t, b=b * g, d=d, g=1, lr=0.1,
                        calls=args.calls, strategy=poptorch.ShardedExecution())
    diff = max_diff(sharded, host)
    assert diff <= tolerance, diff
    print(f"\n3. ShardedExecution with gradientAccumulation 1 (micro batch {b * g}): the same weights "
          f"(max difference {diff:.1e})")
    model = split(copy.deepcopy(host), s, poptorch)
    inference = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(d))
    scores, _ = inference(x[:b * d], t[:b * d])
    inference.destroy()
    with torch.no_grad():
        diff = float((scores - host(x[:b * d], t[:b * d])[0]).abs().max())
    assert diff <= tolerance, diff
    print(f"   inference pipeline, deviceIterations {d} >= {s} stages: the host model's scores "
          f"(max difference {diff:.1e})")


if __name__ == "__main__":
    main()

"""Tutorial 3: replication and gradient accumulation.

    python examples/ipu/03_replication_and_gradient_accumulation.py [--batch-size 2 --replication-factor 2
        --gradient-accumulation 4 --device-iterations 2]

* ``Options.replicationFactor(R)``: R copies of the model, each fed its own micro-batch (data
  parallelism); their gradients are combined before each weight update.
* ``Options.Training.gradientAccumulation(G)``: each replica runs G micro-batches, accumulating gradients,
  before one weight update.
* ``Options.Training.accumulationAndReplicationReductionType``: ``Mean`` (default) divides the accumulated
  gradient by G x R, ``Sum`` does not.

One host call therefore takes batch_size x D x R x G rows (the combined batch), laid out as [D, G, R, b]:
D weight updates, each over G x R micro-batches. With a mean loss and the Mean reduction, an update is
exactly plain SGD on the mean loss over its G x R x b rows, whatever the split; with Sum it is G x R times
larger, so halve the learning rate when you double G to keep the same training. The script checks:

1. the full plan against a plain-torch SGD loop on the host (same weights);
2. PopTorch's gradient-accumulation vectors: L1 mean loss, Mean reduction: G=1 and G=2 give the same
   weights at the same lr; Sum reduction: G=1 at lr 0.02 equals G=2 at lr 0.01.
"""

from __future__ import annotations

import argparse
import copy

import torch
from accelbatch.backends.ipu import MAX_IPUS
from poptorch_or_emulator import import_poptorch  # examples/ipu/poptorch_or_emulator.py

from accelbatch.plan import ExecutionPlan, reserved_ipus


class L1Model(torch.nn.Module):
    """A linear layer trained with an L1 loss (mean over rows): returns (output, loss)."""

    def __init__(self, features: int = 4):
        super().__init__()
        self.lin = torch.nn.Linear(features, features)

    def forward(self, x, target):
        out = self.lin(x)
        return out, torch.nn.functional.l1_loss(out, target)


def train_ipu(poptorch, model, x, t, *, b, d, r, g, lr, reduction, calls):
    """``calls`` host calls of a trainingModel with the given D, R, G and reduction; returns the model."""
    opts = poptorch.Options().deviceIterations(d).replicationFactor(r)
    opts.Training.gradientAccumulation(g)
    opts.Training.accumulationAndReplicationReductionType(getattr(poptorch.ReductionType, reduction))
    training = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
    rows = b * d * r * g
    for c in range(calls):
        training(x[c * rows:(c + 1) * rows], t[c * rows:(c + 1) * rows])
    training.copyWeightsToHost()  # a no-op on the emulator; on an IPU, fetch the trained weights
    training.destroy()
    return model


def train_host(model, x, t, *, rows_per_update, updates, lr, scale=1.0):
    """Plain SGD on the host: each update uses the mean L1 loss over its rows (times ``scale``)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for u in range(updates):
        rows = slice(u * rows_per_update, (u + 1) * rows_per_update)
        opt.zero_grad()
        (torch.nn.functional.l1_loss(model.lin(x[rows]), t[rows]) * scale).backward()
        opt.step()
    return model


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--device-iterations", type=int, default=2)
    parser.add_argument("--replication-factor", type=int, default=2)
    parser.add_argument("--gradient-accumulation", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3, help="host calls (each D weight updates)")
    parser.add_argument("--emulator", action="store_true", help="use the CPU emulator even if poptorch exists")
    args = parser.parse_args(argv)
    for name in ("batch_size", "device_iterations", "replication_factor", "gradient_accumulation", "calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    b, d, r, g = args.batch_size, args.device_iterations, args.replication_factor, args.gradient_accumulation
    if r > MAX_IPUS:  # one IPU per replica
        parser.error(f"--replication-factor {r}: {r} replicas need {r} IPUs, and PopTorch drives at most "
                     f"{MAX_IPUS} from one process (more need distributed execution); use {MAX_IPUS} or fewer")
    if reserved_ipus(r) != r:
        below, held = 1 << (r.bit_length() - 1), reserved_ipus(r)
        parser.error(f"--replication-factor {r}: an IPU system reserves a power of 2 or a multiple of 64 IPUs, so "
                     f"{r} replicas would hold {held} IPUs with {held - r} idle (PopTorch refuses it); use "
                     f"{below} or {held}")
    poptorch = import_poptorch(args.emulator)
    plan = ExecutionPlan(micro_batch=b, device_iterations=d, replication_factor=r, gradient_accumulation=g)
    print(plan.describe())
    print(f"host layout of one call: [D={d}, G={g}, R={r}, b={b}]; each of the {d} updates uses G x R x b = "
          f"{g * r * b} rows")

    torch.manual_seed(0)
    start = L1Model()
    total = plan.combined_batch * args.calls
    x, t = torch.randn(total, 4), torch.randn(total, 4)

    # 1. the whole plan vs plain SGD on the host ----------------------------------------------------
    ipu = train_ipu(poptorch, copy.deepcopy(start), x, t, b=b, d=d, r=r, g=g, lr=0.05, reduction="Mean",
                    calls=args.calls)
    host = train_host(copy.deepcopy(start), x, t, rows_per_update=g * r * b, updates=d * args.calls, lr=0.05)
    diff = max_diff(ipu, host)
    assert diff < 1e-5, diff
    print(f"\n1. D={d} R={r} G={g}, Mean: weights equal plain host SGD over {g * r * b}-row updates "
          f"(max difference {diff:.1e})")
    sum_ipu = train_ipu(poptorch, copy.deepcopy(start), x, t, b=b, d=d, r=r, g=g, lr=0.05 / (g * r),
                        reduction="Sum", calls=args.calls)
    diff = max_diff(sum_ipu, host)
    assert diff < 1e-5, diff
    print(f"   Sum at lr / (G x R) = {0.05 / (g * r):g}: the same weights again (max difference {diff:.1e})")

    # 2. PopTorch's accumulation vectors ------------------------------------------------------------
    rows = 4
    x, t = torch.randn(4 * rows, 4), torch.randn(4 * rows, 4)
    g1 = train_ipu(poptorch, copy.deepcopy(start), x, t, b=2 * rows, d=1, r=1, g=1, lr=0.01,
                   reduction="Mean", calls=2)
    g2 = train_ipu(poptorch, copy.deepcopy(start), x, t, b=rows, d=1, r=1, g=2, lr=0.01, reduction="Mean",
                   calls=2)
    diff = max_diff(g1, g2)
    assert diff < 1e-6, diff
    print(f"\n2. Mean: G=1 (micro batch {2 * rows}) and G=2 (micro batch {rows}) at lr 0.01: same weights "
          f"(max difference {diff:.1e})")
    s1 = train_ipu(poptorch, copy.deepcopy(start), x, t, b=2 * rows, d=1, r=1, g=1, lr=0.02, reduction="Sum",
                   calls=2)
    s2 = train_ipu(poptorch, copy.deepcopy(start), x, t, b=rows, d=1, r=1, g=2, lr=0.01, reduction="Sum",
                   calls=2)
    diff = max_diff(s1, s2)
    assert diff < 1e-6, diff
    print(f"   Sum:  G=1 at lr 0.02 and G=2 at lr 0.01: same weights (max difference {diff:.1e})")


if __name__ == "__main__":
    main()

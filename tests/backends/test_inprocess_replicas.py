"""Replicas simulated in one process (the cpu engine without a process group, the library's default) add the
gradients as R real replicas do: each replica its own G micro-batches, then the replicas in replica order
(the all-reduce; the IPU emulator likewise). Adding every micro-batch of an update into one gradient in
layout order rounds differently, which showed as weight differences of 1e-4..4e-3 after a few steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelbatch.backends.cpu import CPUBackend
from accelbatch.backends.ipu import IPUBackend
from torch import nn

import accelbatch as ab
from accelbatch.cli import main
from accelbatch.opts import Opts
from accelbatch.plan import ExecutionPlan

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "ipu"


class Regressor(nn.Module):
    """A small MLP whose loss is the mean squared error over the micro-batch's rows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, batch):
        pred = self.net(batch["x"]).squeeze(-1)
        return {"loss": ((pred - batch["y"]) ** 2).mean(), "pred": pred.detach()}


def trained(backend, plan: ExecutionPlan, calls: int = 4) -> Regressor:
    model = Regressor()
    engine = backend.compile(model, torch.optim.SGD(model.parameters(), lr=0.05), plan)
    g = torch.Generator().manual_seed(1)
    for _ in range(calls):
        x = torch.randn(plan.combined_batch, 16, generator=g)
        engine.train_step({"x": x, "y": x.sum(1).sin() * 3})
    if hasattr(engine, "sync_to_host"):
        engine.sync_to_host()
    return model


def ipu_backend() -> IPUBackend:
    backend = IPUBackend()
    backend.setup(Opts(ipu_emulator=True, seed=0))
    return backend


# G x R a power of 2: the emulator's Mean reduction scales the summed gradient by 1 / (G x R), the cpu engine
# each micro-batch's loss; the two round alike only when that factor is a power of 2
@pytest.mark.parametrize("r, g, d", [(2, 2, 1), (2, 2, 2), (4, 2, 1), (2, 4, 1)])
def test_in_process_replicas_train_the_emulators_weights_exactly(r, g, d):
    plan = ExecutionPlan(micro_batch=3, replication_factor=r, gradient_accumulation=g, device_iterations=d)
    cpu, ipu = trained(CPUBackend(), plan), trained(ipu_backend(), plan)
    for (name, p), q in zip(cpu.named_parameters(), ipu.parameters()):
        assert torch.equal(p, q), f"{name}: max diff {(p - q).abs().max().item():.3g}"


def test_one_replica_is_unchanged_one_gradient_in_micro_batch_order():
    """R == 1 keeps the plain accumulation: the weights of plain torch adding the G micro-batches in turn."""
    plan = ExecutionPlan(micro_batch=3, gradient_accumulation=3)
    model = trained(CPUBackend(), plan, calls=2)
    ref = Regressor()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(9, 16, generator=g)
        y = x.sum(1).sin() * 3
        opt.zero_grad(set_to_none=True)
        for s in range(0, 9, 3):
            (((ref.net(x[s:s + 3]).squeeze(-1) - y[s:s + 3]) ** 2).mean() * (1 / 3)).backward()
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


GENERATOR = dict(task="reverse:600", model="transformer/generator", embedding_size=16, batchsize=4,
                 device_iterations=2, gradient_accumulation=2, replication_factor=2, loss_normalization="token",
                 text_truncate=8, label_truncate=8, learning_rate=0.003, max_train_steps=3, num_epochs=-1.0,
                 validation_every_n_epochs=-1.0, eval_splits="", progress=False, seed=1)


def library_weights(**extra) -> dict[str, torch.Tensor]:
    opts = ab.Opts(**{**GENERATOR, **extra})
    world = ab.create_world(opts)
    ab.run(world, opts)
    return {k: v.detach().clone() for k, v in world.get_model_agent().model.state_dict().items()}


def assert_equal_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key}: max diff {(a[key].float() - b[key].float()).abs().max():.3g}"


def test_library_replicas_train_the_emulators_weights():
    """``ab.run`` with -rf 2 -di 2 -ga 2 (replicas in this process) and the IPU emulator: the same weights."""
    assert_equal_weights(library_weights(device="cpu"), library_weights(device="ipu", ipu_emulator=True))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_library_replicas_train_the_weights_of_two_gloo_processes(tmp_path):
    """``accelbatch train -rf 2`` (two processes over gloo) and ``ab.run`` in one process: the same weights."""
    path = tmp_path / "m.pt"
    rc = main(["train", "-t", "reverse:600", "-m", "transformer/generator", "-esz", "16", "-bs", "4", "-di", "2",
               "-ga", "2", "-rf", "2", "--loss-normalization", "token", "-tr", "8", "--label-truncate", "8",
               "-lr", "0.003", "-tstep", "3", "-ne", "-1", "-veps", "-1", "--eval-splits", "", "--no-progress",
               "--seed", "1", "-mf", str(path)])
    assert rc == 0
    assert_equal_weights(torch.load(path, map_location="cpu", weights_only=True)["model"],
                         library_weights(device="cpu"))


def run_tutorial(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ACCELBATCH_IPU_EMULATOR", None)
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, args", [
    ("06_generator_on_ipu.py", ["-ne", "0.2"]),
    ("05_world_training_on_ipu.py", ["-ga", "2", "-opt", "adam", "-lr", "0.01", "-tstep", "40"]),
])
def test_tutorials_compare_cpu_with_two_replicas(name, args):
    """The tutorials' --compare-cpu with -rf 2: the cpu run (replicas in one process) gives the emulator's
    weights (they said 2.6e-4 and 3.9e-3, over their tolerance, and exited 1)."""
    proc = run_tutorial(name, "--compare-cpu", "-rf", "2", *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "largest weight difference ipu vs cpu: 0.00e+00" in proc.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["05_world_training_on_ipu.py", "06_generator_on_ipu.py"])
@pytest.mark.parametrize("args, said", [
    (["-tstep", "2", "-rf", "3"], "-rf/--replication-factor 3: an IPU system reserves a power of 2"),
    (["-nt", "2"], "--numthreads 2 (hogwild) runs on --device cpu only, not --device ipu"),
    (["--no-drop-last", "--dynamic-batching", "batchsort"],
     "--no-drop-last: --device ipu runs graphs of static shapes"),
], ids=["rf3", "nt2", "no-drop-last"])
def test_tutorials_5_and_6_refuse_bad_options_in_one_line(name, args, said):
    """As `accelbatch train` does: one line naming the option, exit 2 (they printed the PlanError's or
    OptionError's traceback)."""
    proc = run_tutorial(name, "--ipu-emulator", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-2000:]
    assert proc.stderr.startswith(f"{name}: error: {said}")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_tutorial_4_refuses_a_batch_of_one_in_one_line():
    """AsyncRebatched cannot re-form batches of 1 row (PopTorch's accessor asserts it): argparse's one line,
    exit 2, before any loader starts (it ended in that AssertionError's traceback)."""
    proc = run_tutorial("04_rebatched_iterable_datasets.py", "--emulator", "--batch-size", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("04_rebatched_iterable_datasets.py: error: --batch-size 1: "
                                                   "AsyncRebatched re-forms batches of at least 2 rows")

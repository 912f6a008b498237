"""CUDA measurements: staged prefetch against compute alone, host syncs per call, throughput against a
plain PyTorch loop, and cuda-vs-cpu weights.

Each function returns numbers measured in the same run (ratios, never absolute targets). They are meant
for a GPU; ``bench/cuda_check.py`` runs each in a process of its own (accelerate keeps one state per
process) and ``tests/backends/test_cuda.py`` asserts on its figures there. Every function also takes
``device="cpu"`` (the engine on ``Accelerator(cpu=True)``), which the CPU tests use to run this code with tiny
sizes; its timings mean nothing. Run alone: ``python bench/cuda_throughput.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import pathlib
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from accelbatch.backends.cpu import PlanEngine
from accelbatch.backends.cuda import CUDABackend, CUDAEngine
from accelbatch.backends.prefetch import count_host_syncs
from torch import nn

from accelbatch.opts import Opts
from accelbatch.plan import ExecutionPlan


class MLPRegressor(nn.Module):
    """forward(batch) -> {"loss": mean over rows, "pred": per row}; compute grows with ``hidden``."""

    def __init__(self, features: int, hidden: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.l1 = nn.Linear(features, hidden)
        self.l2 = nn.Linear(hidden, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1]) ** 0.5)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pred = self.l2(torch.relu(self.l1(batch["x"]))).squeeze(-1)
        return {"loss": ((pred - batch["y"]) ** 2).mean(), "pred": pred.detach()}


def make_batches(n: int, rows: int, features: int, seed: int = 0, pinned: bool = False) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        b = {"x": torch.randn(rows, features, generator=g), "y": torch.randn(rows, generator=g)}
        out.append({k: v.pin_memory() for k, v in b.items()} if pinned else b)
    return out


def _device(device: str | torch.device | None) -> torch.device:
    dev = torch.device(device if device is not None else "cuda")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _engine(model: nn.Module, plan: ExecutionPlan, dev: torch.device, lr: float = 1e-3,
            prefetch: bool = True, mixed_precision: str = "no") -> CUDAEngine:
    backend = CUDABackend(cpu=dev.type == "cpu", prefetch=prefetch)
    backend.setup(Opts(device="cuda", mixed_precision=mixed_precision))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return backend.compile(model, opt, plan)


def staged(engine: CUDAEngine, batches: list[dict], training: bool = True) -> None:
    """Step through ``batches``, staging batch k+1 before stepping batch k (as the loader world does)."""
    step = engine.train_step if training else engine.eval_step
    for k, batch in enumerate(batches):
        if k + 1 < len(batches):
            engine.stage(batches[k + 1])
        step(batch)


def _timed(fn: Callable[[], Any], dev: torch.device, repeats: int = 3) -> float:
    """Median wall time of ``fn`` (which must end synchronised) over ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --- same plan, same numbers ---------------------------------------------------------------------------

def weights_vs_cpu(d: int, g: int, b: int = 8, calls: int = 3, features: int = 16, hidden: int = 32,
                   device: str | None = None, mixed_precision: str = "no") -> float:
    """Largest |weight difference| after ``calls`` calls of the same plan on cuda (in ``mixed_precision``)
    and on the CPU engine (fp32). Mixed precision changes this process's accelerate state."""
    dev = _device(device)
    plan = ExecutionPlan(micro_batch=b, device_iterations=d, gradient_accumulation=g)
    cpu_model = MLPRegressor(features, hidden)
    gpu_model = copy.deepcopy(cpu_model)
    cpu = PlanEngine(cpu_model, torch.optim.SGD(cpu_model.parameters(), lr=0.05), plan)
    gpu = _engine(gpu_model.to(dev), plan, dev, lr=0.05, mixed_precision=mixed_precision)
    for batch in make_batches(calls, plan.combined_batch, features, seed=1):
        cpu.train_step(batch)
        gpu.train_step(batch)
    return max((a.detach().cpu() - c.detach()).abs().max().item()
               for a, c in zip(gpu_model.parameters(), cpu_model.parameters()))


# --- prefetch hides copies ------------------------------------------------------------------------------

@dataclass
class PrefetchTiming:
    compute_s: float         # per call, batches already on the GPU
    prefetch_s: float        # per call, pinned host batches, batch k+1 staged while batch k computes
    blocking_s: float        # per call, host batches copied in the step (.to(device), then compute)
    copy_mb: float

    @property
    def prefetch_ratio(self) -> float:
        return self.prefetch_s / self.compute_s

    @property
    def blocking_ratio(self) -> float:
        return self.blocking_s / self.compute_s


def measure_prefetch(rows: int = 8192, features: int = 2048, hidden: int = 4096, steps: int = 12,
                     device: str | None = None) -> PrefetchTiming:
    """A copy-heavy batch (rows x features fp32) on an MLP: staged vs compute alone vs a blocking copy."""
    dev = _device(device)
    plan = ExecutionPlan(micro_batch=rows)
    engine = _engine(MLPRegressor(features, hidden).to(dev), plan, dev)
    host = make_batches(4, rows, features, pinned=dev.type == "cuda")
    on_gpu = [{k: v.to(dev) for k, v in b.items()} for b in host]

    def feed(src: list[dict]) -> list[dict]:
        return [src[i % len(src)] for i in range(steps)]

    def compute_alone() -> None:
        staged(engine, feed(on_gpu))

    def prefetched() -> None:
        staged(engine, feed(host))

    def blocking() -> None:
        for b in feed(host):
            engine.train_step({k: v.to(dev) for k, v in b.items()})

    for fn in (compute_alone, prefetched, blocking):  # warm-up: allocator, kernels, pinned pools
        fn()
    copy_mb = sum(t.numel() * t.element_size() for t in host[0].values()) / 2**20
    return PrefetchTiming(compute_s=_timed(compute_alone, dev) / steps,
                          prefetch_s=_timed(prefetched, dev) / steps,
                          blocking_s=_timed(blocking, dev) / steps, copy_mb=copy_mb)


# --- host synchronisations ------------------------------------------------------------------------------

@dataclass
class SyncReport:
    counted: int             # by count_host_syncs (synchronize, item, tolist, .cpu() ... of device tensors)
    debug_mode: int          # by torch.cuda.set_sync_debug_mode("warn") warnings
    by_kind: dict[str, int]
    debug_sites: list[str] = field(default_factory=list)  # where each sync-debug warning came from


def _call_site(frames: int = 4) -> str:
    """Where torch flagged a synchronising operation: the innermost frames of the stack that warned, outside
    this file and the warnings machinery, innermost first."""
    stack = [f for f in traceback.extract_stack() if not f.filename.endswith(("warnings.py", __file__))]
    return " < ".join(f"{pathlib.Path(f.filename).name}:{f.lineno} {f.name}" for f in stack[::-1][:frames])


@contextlib.contextmanager
def sync_debug_sites(frames: int = 4) -> Iterator[list[str]]:
    """torch.cuda.set_sync_debug_mode("warn") over the block; yields a list that gets the call site
    (``frames`` innermost frames) of each host wait it flags. torch's own notice that the mode is on is none."""
    sites: list[str] = []

    def record(message: Any, *_: Any, **__: Any) -> None:
        if "synchroniz" in str(message).lower():
            sites.append(_call_site(frames))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            warnings.simplefilter("always")
            warnings.showwarning = record
            yield sites
        finally:
            warnings.simplefilter("ignore")
            torch.cuda.set_sync_debug_mode("default")


def syncs_per_call(d: int = 8, b: int = 64, features: int = 64, hidden: int = 256,
                   device: str | None = None, mixed_precision: str = "no") -> SyncReport:
    """Host waits in one training call with D device iterations (after a warm-up call); with fp16 the loss
    scaler's overflow checks too.

    On the CPU nothing waits for a device, so the count is of the host reads of results instead
    (``count_host_syncs(include_cpu_reads=True)``), and torch's sync-debug mode is not consulted.
    """
    dev = _device(device)
    on_cpu = dev.type == "cpu"
    plan = ExecutionPlan(micro_batch=b, device_iterations=d)
    engine = _engine(MLPRegressor(features, hidden).to(dev), plan, dev, mixed_precision=mixed_precision)
    batches = make_batches(2, plan.combined_batch, features, pinned=not on_cpu)
    engine.train_step(batches[0])
    _sync(dev)
    with count_host_syncs(include_cpu_reads=on_cpu) as syncs:
        engine.train_step(batches[1])
    if on_cpu:
        return SyncReport(counted=syncs.total, debug_mode=0, by_kind=dict(syncs.by_kind))
    engine.train_step(batches[0])
    _sync(dev)
    with sync_debug_sites() as sites:
        engine.train_step(batches[1])
    return SyncReport(counted=syncs.total, debug_mode=len(sites), by_kind=dict(syncs.by_kind), debug_sites=sites)


# --- throughput against a naive loop ----------------------------------------------------------------------

@dataclass
class Throughput:
    engine_exs: float        # examples/s, engine with D device iterations and staged prefetch
    naive_exs: float         # examples/s, DataLoader + .to(device) + .item() every step

    @property
    def ratio(self) -> float:
        return self.engine_exs / self.naive_exs


class _MicroBatches(torch.utils.data.Dataset):
    """Ready-made micro-batches (so the naive loop pays no per-row collate the engine does not pay)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, b: int):
        self.x, self.y, self.b = x, y, b

    def __len__(self) -> int:
        return len(self.x) // self.b

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = slice(i * self.b, (i + 1) * self.b)
        return {"x": self.x[s], "y": self.y[s]}


def measure_throughput(b: int = 1024, d: int = 8, features: int = 1024, hidden: int = 4096, calls: int = 12,
                       device: str | None = None) -> Throughput:
    """Examples/s of the same model and rows: engine (D=d, prefetch) vs a textbook loop.

    The sizes make a step's GPU time comparable to its host-side work and to its copy, the regime where
    a runtime that keeps the GPU queue full (no per-step wait, copies off the critical path) matters.
    """
    dev = _device(device)
    rows = b * d * calls
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(rows, features, generator=g), torch.randn(rows, generator=g)

    naive_model = MLPRegressor(features, hidden).to(dev)
    naive_opt = torch.optim.SGD(naive_model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_MicroBatches(x, y, b), batch_size=None, shuffle=False)

    def naive() -> None:
        total = 0.0
        for batch in loader:
            batch = {k: v.to(dev) for k, v in batch.items()}
            loss = naive_model(batch)["loss"]
            naive_opt.zero_grad()
            loss.backward()
            naive_opt.step()
            total += loss.item()

    plan = ExecutionPlan(micro_batch=b, device_iterations=d)
    engine = _engine(MLPRegressor(features, hidden).to(dev), plan, dev)
    combined = [{"x": x[i:i + plan.combined_batch], "y": y[i:i + plan.combined_batch]}
                for i in range(0, rows, plan.combined_batch)]

    def ours() -> None:   # the engine pins each staged call itself, after the previous call's kernels
        staged(engine, combined)

    naive()
    ours()
    return Throughput(engine_exs=rows / _timed(ours, dev), naive_exs=rows / _timed(naive, dev))


def main(argv: list[str] | None = None) -> int:
    # no options: parsed first all the same, so that --help or a typo measures nothing
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    if not torch.cuda.is_available():
        from accelbatch.backends.cuda import cuda_unavailable_reason
        print(f"cuda_throughput: {cuda_unavailable_reason()}; nothing to measure")
        return 0
    for d, g in ((1, 1), (4, 2)):
        print(f"weights cuda vs cpu, D={d} G={g}: max |diff| = {weights_vs_cpu(d, g):.2e}")
    p = measure_prefetch()
    print(f"prefetch ({p.copy_mb:.0f} MB per batch): compute alone {p.compute_s * 1e3:.2f} ms, "
          f"with prefetch {p.prefetch_s * 1e3:.2f} ms ({p.prefetch_ratio:.3f}x), "
          f"blocking copy {p.blocking_s * 1e3:.2f} ms ({p.blocking_ratio:.3f}x)")
    s = syncs_per_call()
    print(f"host syncs per call with D=8: counted {s.counted} {s.by_kind}, "
          f"sync-debug warnings {s.debug_mode}" + "".join(f"\n  at {site}" for site in s.debug_sites))
    t = measure_throughput()
    print(f"throughput: engine {t.engine_exs:,.0f} ex/s vs naive loop {t.naive_exs:,.0f} ex/s "
          f"= {t.ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

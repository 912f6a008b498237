"""Execution-plan overheads on the CPU backend, as ratios measured in one run.

1. Device iterations: one call with D=8 vs 8 calls with D=1 over the same rows (PlanEngine), and the
   engine vs a hand-written torch loop doing the same 8 updates (the engine's own overhead).
2. Replication: R=2 over gloo (2 processes x 1 thread) vs R=1 at the same combined batch, R=1 run both
   with 1 thread (same compute per process as a replica) and with 2 threads (same cores as R=2), for a
   compute-bound MLP and a tiny model (where the per-update all-reduce dominates).

    .venv/bin/python bench/plan_overheads.py [--calls 20] [--rounds 2] [--quick]

Timings are medians of per-call wall times after warm-up, measured round-robin (device iterations) or in
alternating rounds keeping each configuration's best (replication); all ratios come from this run only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from accelbatch.backends.cpu import CPUBackend, PlanEngine
from accelbatch.backends.distributed import spawn_replicas

from accelbatch.plan import ExecutionPlan

MODELS = {"mlp": (256, 512, 10), "tiny": (16, 16, 4)}


class MLP(torch.nn.Module):
    def __init__(self, d_in: int, hidden: int, classes: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, classes))

    def forward(self, batch):
        scores = self.net(batch["x"])
        return {"loss": torch.nn.functional.cross_entropy(scores, batch["y"]), "scores": scores}


def make_batch(rows: int, kind: str, seed: int = 0):
    d_in, _, classes = MODELS[kind]
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, d_in, generator=g), "y": torch.randint(0, classes, (rows,), generator=g)}


def new_model(kind: str) -> MLP:
    torch.manual_seed(0)
    return MLP(*MODELS[kind])


def median_time(fn, calls: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def interleaved(fns: dict, calls: int, warmup: int = 3) -> dict:
    """Median time of each function, measured round-robin so that load changes hit all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict = {k: [] for k in fns}
    for _ in range(calls):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


# --- 1. device iterations ------------------------------------------------------------------------------
def bench_device_iterations(calls: int, b: int = 32) -> None:
    kind = "mlp"
    torch.set_num_threads(1)  # the engine's overhead, not thread scheduling, is measured here
    batch = make_batch(8 * b, kind)
    parts = [{k: v[i * b:(i + 1) * b] for k, v in batch.items()} for i in range(8)]

    model = new_model(kind)
    e8 = PlanEngine(model, torch.optim.SGD(model.parameters(), lr=0.01),
                    ExecutionPlan(micro_batch=b, device_iterations=8))
    model1 = new_model(kind)
    e1 = PlanEngine(model1, torch.optim.SGD(model1.parameters(), lr=0.01), ExecutionPlan(micro_batch=b))
    plain = new_model(kind)
    opt = torch.optim.SGD(plain.parameters(), lr=0.01)

    def hand_loop():
        for p in parts:
            opt.zero_grad(set_to_none=True)
            plain(p)["loss"].backward()
            opt.step()

    t = interleaved({"d8": lambda: e8.train_step(batch), "d1": lambda: [e1.train_step(p) for p in parts],
                     "hand": hand_loop}, calls)
    t8, t1, th = t["d8"], t["d1"], t["hand"]
    print(f"[device iterations] MLP {MODELS[kind]}, b={b}, {torch.get_num_threads()} threads, 8 updates per "
          f"measurement")
    print(f"  one call D=8        {t8 * 1e3:8.2f} ms")
    print(f"  8 calls D=1         {t1 * 1e3:8.2f} ms")
    print(f"  hand-written loop   {th * 1e3:8.2f} ms")
    print(f"  ratio D=8 / 8xD=1 = {t8 / t1:.3f}   engine D=8 / hand loop = {t8 / th:.3f}")


# --- 2. replication ----------------------------------------------------------------------------------
def _replica_timing(rank: int, kind: str, plan_kw: dict, calls: int, threads: int):
    torch.set_num_threads(threads)
    plan = ExecutionPlan(**plan_kw)
    model = new_model(kind)
    engine = CPUBackend().compile(model, torch.optim.SGD(model.parameters(), lr=0.01), plan)
    full = make_batch(plan.combined_batch, kind)
    shard = plan.shard(full, rank)
    t_call = median_time(lambda: engine.train_step(shard), calls)
    if plan.replication_factor == 1:
        return t_call, 0.0
    import torch.distributed as dist

    flat = torch.zeros(sum(p.numel() for p in model.parameters()) + 2)
    return t_call, median_time(lambda: dist.all_reduce(flat), calls * 4)


def bench_replication(calls: int, rounds: int = 2, b: int = 32, g: int = 1, d: int = 4) -> None:
    print(f"[replication] same combined batch of {2 * b * g * d} rows per call (D={d} updates per call)")
    for kind in ("mlp", "tiny"):
        r2 = dict(micro_batch=b, device_iterations=d, replication_factor=2, gradient_accumulation=g)
        r1 = dict(micro_batch=2 * b, device_iterations=d, replication_factor=1, gradient_accumulation=g)
        best: dict = {}
        for _ in range(rounds):  # alternate the configurations; keep each one's best round
            both = spawn_replicas(_replica_timing, 2, kind, r2, calls, 1, timeout_s=600)
            runs = {"r2": max(t for t, _ in both), "ar": max(a for _, a in both),
                    "r1_1": spawn_replicas(_replica_timing, 1, kind, r1, calls, 1, timeout_s=600,
                                           init_process_group=False)[0][0],
                    "r1_2": spawn_replicas(_replica_timing, 1, kind, r1, calls, 2, timeout_s=600,
                                           init_process_group=False)[0][0]}
            for k, v in runs.items():
                best[k] = min(best.get(k, v), v)
        t_r2, t_r1_1, t_r1_2, t_ar = best["r2"], best["r1_1"], best["r1_2"], best["ar"]
        print(f"  {kind:4s} {MODELS[kind]!s:16s} R=2 gloo {t_r2 * 1e3:8.2f} ms | R=1 1 thread "
              f"{t_r1_1 * 1e3:8.2f} ms | R=1 2 threads {t_r1_2 * 1e3:8.2f} ms")
        print(f"       ratio R=2 / R=1(1 thread) = {t_r2 / t_r1_1:.3f}   R=2 / R=1(2 threads) = "
              f"{t_r2 / t_r1_2:.3f}")
        n_params = sum(p.numel() for p in new_model(kind).parameters())
        print(f"       gloo all_reduce of the {n_params}-float gradient bucket: {t_ar * 1e3:.3f} ms per update "
              f"x {d} updates = {d * t_ar / t_r2:.1%} of the R=2 call")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=None,
                        help="timed calls per configuration, after 3 of warm-up (default 20, --quick 5)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="alternating rounds of the replication runs (default 2, --quick 1)")
    parser.add_argument("--quick", action="store_true", help="5 calls, 1 round: a smoke run (explicit options win)")
    args = parser.parse_args(argv)
    for option, value in (("--calls", args.calls), ("--rounds", args.rounds)):
        if value is not None and value < 1:  # 0 calls has no median; 0 rounds measures no configuration
            parser.error(f"{option} {value}: give 1 or more")
    calls = args.calls if args.calls is not None else (5 if args.quick else 20)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 2)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"cpu cores: {os.cpu_count()}, load average {load} (other work on the machine skews timings), "
          f"torch {torch.__version__}, python {sys.version.split()[0]}")
    bench_device_iterations(calls)
    bench_replication(calls, rounds=rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

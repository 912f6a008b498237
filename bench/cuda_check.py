"""One call that checks the CUDA backend on this machine: conformance tests, then measurements, as ratios.

    python bench/cuda_check.py                  # tests + every check (a few minutes on a GPU)
    python bench/cuda_check.py --json out.json  # also write the environment, tests and figures to a file
    python bench/cuda_check.py --no-bench       # tests only
    python bench/cuda_check.py --no-tests --device cpu --only host_syncs_D8   # a smoke run on the CPU

Every check runs in a fresh process (accelerate keeps one state per process, so a cpu=True or bf16
Accelerator made by one check must not decide the next one's): cuda-vs-cpu weights for (D, G) = (1, 1),
(4, 2) and in bf16/fp16, host syncs per call with D=8 in fp32 and fp16 (the counter and
torch.cuda.set_sync_debug_mode), step time with staged prefetch vs compute alone, examples/s vs a plain
PyTorch loop, where the engine keeps weights and outputs, and ``accelbatch train`` (memnn on babi:1 for an
epoch; the transformer generator on reverse for 20 steps, decoding on the device) on the CPU and the GPU,
sync and async, from one seed, and on the GPU through every feed (workers, async, streamed, dynamic batching)
against the sync feed. Exits 1 when a test or a check's criterion fails. Without a GPU: says why,
runs the CPU-checkable tests (the GPU ones skip with their reason) and exits 0 when they pass.
``--check NAME --out PATH`` runs one check in this process and writes its figures (what the parent runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ["tests/backends/test_cuda.py", "tests/backends/test_prefetch.py", "tests/backends/test_engine.py",
         "tests/test_examples_ipu.py::test_06_the_same_script_on_cuda_or_skipped_without_it",
         "tests/test_generation.py::test_decoding_on_a_gpu_never_waits_for_the_host"]
GPU_CHECK_TEST = "tests/backends/test_cuda.py::test_gpu_check"
CPU_SIZES = {"syncs": {"b": 4, "features": 8, "hidden": 8},
             "prefetch": {"rows": 16, "features": 8, "hidden": 8, "steps": 3},
             "throughput": {"b": 8, "d": 2, "features": 8, "hidden": 8, "calls": 2}}


def _run(cmd: list[str], timeout: float | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, text=True, capture_output=True), except that a child an exception leaves behind
    (SIGTERM, Ctrl-C, the timeout) gets SIGTERM before SIGKILL, so that it removes its temporary folders."""
    with subprocess.Popen(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            except BaseException:
                proc.kill()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _ended_by(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: children get SIGTERM, the temporary folders are removed


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "gpus": []}
    try:
        import accelerate
        env["accelerate"] = accelerate.__version__
    except ImportError:
        env["accelerate"] = None
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    else:
        from accelbatch.backends.cuda import cuda_unavailable_reason
        env["no_gpu_reason"] = cuda_unavailable_reason()
    return env


# --- the checks: name -> (figures on a device, the failure it shows or None) ------------------------------

def _bench() -> Any:
    sys.path.insert(0, str(ROOT / "bench"))
    import cuda_throughput

    return cuda_throughput


def _weights(d: int, g: int, mixed_precision: str, limit: float) -> Callable[[str], dict[str, Any]]:
    def run(device: str) -> dict[str, Any]:
        diff = _bench().weights_vs_cpu(d, g, device=device, mixed_precision=mixed_precision)
        ok = math.isfinite(diff) and diff <= limit
        return {"max_abs_diff": diff, "limit": limit,
                "failure": None if ok else f"cuda ({mixed_precision}) vs cpu weights differ by {diff:.2e} "
                                           f"(D={d}, G={g}; limit {limit:g})"}
    return run


def _host_syncs(mixed_precision: str) -> Callable[[str], dict[str, Any]]:
    def run(device: str) -> dict[str, Any]:
        s = _bench().syncs_per_call(d=8, device=device, mixed_precision=mixed_precision,
                                    **(CPU_SIZES["syncs"] if device == "cpu" else {}))
        ok = s.counted == 1 and s.debug_mode <= 1
        return {"counted": s.counted, "sync_debug_warnings": s.debug_mode, "by_kind": s.by_kind,
                "sync_debug_sites": s.debug_sites,
                "failure": None if ok else f"host syncs per call with D=8 ({mixed_precision}): counted "
                                           f"{s.counted}, sync-debug {s.debug_mode} (want 1)"}
    return run


def _staged_prefetch(device: str) -> dict[str, Any]:
    p = _bench().measure_prefetch(device=device, **(CPU_SIZES["prefetch"] if device == "cpu" else {}))
    out = {"staged_over_compute": p.prefetch_ratio, "blocking_copy_over_compute": p.blocking_ratio,
           "compute_ms": p.compute_s * 1e3, "copy_mb": p.copy_mb, "failure": None}
    if device != "cpu" and p.blocking_ratio <= 1.05:
        out["failure"] = f"the batch is not copy-heavy enough to show anything ({p.blocking_ratio:.3f}x)"
    elif device != "cpu" and p.prefetch_ratio > 1.1:
        out["failure"] = f"staged step time is {p.prefetch_ratio:.3f}x compute alone (limit 1.1x)"
    return out


def _throughput(device: str) -> dict[str, Any]:
    t = _bench().measure_throughput(device=device, **(CPU_SIZES["throughput"] if device == "cpu" else {}))
    ok = device == "cpu" or t.ratio >= 1.0
    return {"engine_exs_per_s": t.engine_exs, "plain_loop_exs_per_s": t.naive_exs, "ratio": t.ratio,
            "failure": None if ok else f"the engine is slower than a plain PyTorch loop ({t.ratio:.2f}x)"}


def _placement(device: str) -> dict[str, Any]:
    import torch

    from accelbatch.plan import ExecutionPlan

    b = _bench()
    dev = b._device(device)
    model = b.MLPRegressor(8, 8)
    engine = b._engine(model, ExecutionPlan(micro_batch=4, device_iterations=2, output_mode="all"), dev)
    result = engine.train_step(b.make_batches(1, 8, 8)[0])
    params, outputs = next(model.parameters()).device.type, result.outputs["pred"].device.type
    ok = params == dev.type and outputs == "cpu" and tuple(result.outputs["pred"].shape) == (8,)
    finite = bool(torch.isfinite(result.outputs["pred"]).all())
    return {"weights_on": params, "outputs_on": outputs, "finite": finite,
            "failure": None if ok else f"weights on {params}, outputs on {outputs} (want {dev.type}, cpu)"}


def _train_runs(common: list[str], runs: dict[str, list[str]]) -> tuple[dict, dict]:
    """``accelbatch train`` with ``common`` plus each run's options: (weights, reports) by run name; a run that
    fails raises, which is the check's failure."""
    from accelbatch.checkpoint import load_checkpoint

    weights, reports = {}, {}
    with tempfile.TemporaryDirectory(prefix="cuda-check-train-") as tmp:
        for name, extra in runs.items():
            model, report = os.path.join(tmp, f"{name}.pt"), os.path.join(tmp, f"{name}.json")
            proc = _run([sys.executable, *common, "-mf", model, "--report-json", report, *extra],
                        cwd=ROOT, timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"accelbatch train {' '.join(extra)} exited with {proc.returncode}: "
                                   f"{(proc.stdout + proc.stderr)[-1500:]}")
            weights[name] = load_checkpoint(model).model_state
            reports[name] = json.loads(pathlib.Path(report).read_text())
    return weights, reports


NOISE_LIMIT = 1e-5   # weights apart allowed between runs of a workload the device does not repeat bit for bit


def judge_feeds(diff: dict[str, float], other_metrics: dict[str, list[str]], reference: dict[str, str],
                repeats: dict[str, str]) -> dict[str, str]:
    """Each feed's verdict against its ``reference`` run: "equal" (torch.equal weights, the same valid
    metrics); "within device noise" when the repeat of its reference (``repeats``: reference -> the run of the
    same options and seed again) was not equal either, so the device itself does not repeat that workload bit
    for bit, and the feed is as close as noise allows (weights within NOISE_LIMIT, only the valid loss's last
    digits apart); else "differs"."""
    noisy = {ref: diff[again] != 0.0 or bool(other_metrics[again]) for ref, again in repeats.items()}
    verdict = {}
    for name, apart in diff.items():
        if apart == 0.0 and not other_metrics[name]:
            verdict[name] = "equal"
        elif noisy.get(reference[name]) and apart <= NOISE_LIMIT and set(other_metrics[name]) <= {"loss"}:
            verdict[name] = "within device noise"
        else:
            verdict[name] = "differs"
    return verdict


def _train_feeds(device: str) -> dict[str, Any]:
    """Performance options never change results on ``device``: memnn on babi:1 trained from one seed through
    data workers, the async accessor (with and without workers), a streamed file and async dynamic batching
    (against sync dynamic batching) ends with the same weights (torch.equal) and valid metrics as the sync
    feed in the main process, every batch staged to the device one step ahead. Dynamic batching is run twice
    in sync: a GPU does not repeat it bit for bit (its varying shapes: an H200 gives 4e-7 apart from the first
    step on, the batches equal), so there a feed is judged against that noise (:func:`judge_feeds`)."""
    common = ["-m", "accelbatch", "train", "-t", "babi:1", "-m", "memnn", "--seed", "3", "--no-progress",
              "-tstep", "40" if device != "cpu" else "8", "-vme", "200", "--eval-splits", "valid",
              "--buffer-size", "1", "--device", device]
    feeds = {"sync": [], "workers_2": ["--num-workers", "2"], "async": ["--dataloader-mode", "async"],
             "async_workers_2": ["--dataloader-mode", "async", "--num-workers", "2"],
             "async_stream": ["--dataloader-mode", "async", "-dt", "train:stream"],
             "dynamic": ["--dynamic-batching", "full"],
             "dynamic_again": ["--dynamic-batching", "full"],   # is the device itself repeatable here?
             "async_dynamic": ["--dynamic-batching", "full", "--dataloader-mode", "async"]}
    reference = {name: "dynamic" if "dynamic" in name else "sync" for name in feeds}
    weights, reports = _train_runs(common, feeds)

    def metrics(name: str) -> dict[str, Any]:
        return {k: v for k, v in reports[name]["valid"].items() if k not in ("exs_per_s", "time_s")}

    compared = [name for name in feeds if reference[name] != name]
    diff = {name: max(float((v.float() - weights[reference[name]][k].float()).abs().max())
                      for k, v in weights[name].items()) for name in compared}
    other_metrics = {name: sorted(k for k, v in metrics(name).items() if metrics(reference[name]).get(k) != v)
                     for name in compared}
    verdict = judge_feeds(diff, other_metrics, reference, repeats={"dynamic": "dynamic_again"})
    out: dict[str, Any] = {"steps": reports["sync"]["train"]["steps"], "verdict": verdict,
                           "weights_max_abs_diff": diff, "other_valid_metrics": other_metrics,
                           "valid_accuracy": {name: r["valid"]["accuracy"] for name, r in reports.items()},
                           "failure": None}
    differ = [name for name, said in verdict.items() if said == "differs"]
    if differ:
        out["failure"] = (f"on {device}, {', '.join(differ)} trained other weights or reported other valid "
                          "metrics than the same options with the sync feed (beyond the device's own noise)")
    return out


def _train_cli(task_and_model: list[str], length: list[str], cpu_length: list[str]
               ) -> Callable[[str], dict[str, Any]]:
    """``accelbatch train`` end to end with one seed: on the CPU, on ``device``, and on ``device`` with
    ``--dataloader-mode async`` (a performance option: it must train exactly the same weights). On the CPU
    (a smoke run, every side the CPU, the device run being the cpu run) ``cpu_length`` keeps it short."""
    def run(device: str) -> dict[str, Any]:
        import torch

        common = ["-m", "accelbatch", "train", *task_and_model, "--seed", "3", "--no-progress",
                  *(length if device != "cpu" else cpu_length), "--eval-splits", "valid"]
        runs = {"cpu": ["--device", "cpu"], "device": ["--device", device],
                "device_async": ["--device", device, "--dataloader-mode", "async"]}
        if device == "cpu":  # the device run would be the cpu run again
            del runs["device"]
        weights, reports = _train_runs(common, runs)
        weights.setdefault("device", weights["cpu"])
        reports.setdefault("device", reports["cpu"])
        diff = max(float((weights["cpu"][k].float() - v.float()).abs().max()) for k, v in weights["device"].items())
        same_async = all(torch.equal(v, weights["device_async"][k]) for k, v in weights["device"].items())
        valid = {name: r["valid"] for name, r in reports.items()}
        accuracy = {name: v["accuracy"] for name, v in valid.items()}
        loss = {name: v["loss"] for name, v in valid.items()}
        out = {"steps": reports["device"]["train"]["steps"], "weights_max_abs_diff_vs_cpu": diff,
               "async_equals_sync": same_async, "valid_accuracy": accuracy, "valid_loss": loss,
               "train_exs_per_s": {name: r["train"]["exs_per_s"] for name, r in reports.items()},
               "failure": None}
        if not same_async:
            out["failure"] = f"--dataloader-mode async on {device} trained other weights than sync"
        elif (abs(accuracy["device"] - accuracy["cpu"]) > 0.01 or not diff <= 5e-2
              or not abs(loss["device"] - loss["cpu"]) <= 0.05 * abs(loss["cpu"])):
            out["failure"] = (f"{device} vs cpu after {out['steps']} steps: valid accuracy {accuracy['device']} "
                              f"vs {accuracy['cpu']} (limit 0.01 apart), valid loss {loss['device']:.4f} vs "
                              f"{loss['cpu']:.4f} (limit 5% apart), weights {diff:.2e} apart (limit 5e-2)")
        return out
    return run


CHECKS: dict[str, tuple[Callable[[str], dict[str, Any]], bool]] = {  # name -> (check, runs on the CPU too)
    "weights_D1_G1": (_weights(1, 1, "no", 1e-5), True),
    "weights_D4_G2": (_weights(4, 2, "no", 1e-5), True),
    "weights_bf16_D4_G2": (_weights(4, 2, "bf16", 5e-2), True),
    "weights_fp16_D4_G2": (_weights(4, 2, "fp16", 5e-2), False),
    "host_syncs_D8": (_host_syncs("no"), True),
    "host_syncs_fp16_D8": (_host_syncs("fp16"), False),
    "staged_prefetch": (_staged_prefetch, True),
    "throughput": (_throughput, True),
    "placement": (_placement, True),
    "train_memnn": (_train_cli(["-t", "babi:1", "-m", "memnn"], ["-ne", "1"], ["-tstep", "30"]), True),
    "train_generator": (_train_cli(["-t", "reverse", "-m", "transformer/generator", "-bs", "32"],
                                   ["-tstep", "20"], ["-tstep", "6"]), True),
    "train_feeds": (_train_feeds, True),
}


def run_one(name: str, device: str, out: str) -> int:
    """Run one check in this process; write its figures (or its error) to ``out``."""
    try:
        figures = CHECKS[name][0](device)
    except Exception as exc:  # noqa: BLE001 - reported as the check's failure
        figures = {"failure": f"{type(exc).__name__}: {exc}"}
    pathlib.Path(out).write_text(json.dumps(figures, indent=2, default=str))
    return 0


def run_isolated(name: str, device: str, timeout_s: float = 600.0) -> dict[str, Any]:
    """One check in a fresh Python process; its figures, with ``failure`` set when it failed or died."""
    with tempfile.TemporaryDirectory(prefix="cuda-check-") as tmp:
        out = os.path.join(tmp, "figures.json")
        cmd = [sys.executable, __file__, "--check", name, "--device", device, "--out", out]
        try:
            proc = _run(cmd, cwd=ROOT, timeout=timeout_s, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired:
            return {"failure": f"{name} did not finish within {timeout_s:g} s"}
        if not os.path.exists(out):
            return {"failure": f"{name} exited with {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}"}
        return json.loads(pathlib.Path(out).read_text())


def run_tests(extra: list[str]) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", *TESTS, "-q", "-rfEs", "-p", "no:cacheprovider", *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = _run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = proc.stdout + proc.stderr
    print(out.rstrip() if proc.returncode else out.rstrip()[-6000:], flush=True)
    summary = next((line for line in reversed(out.splitlines()) if " passed" in line or " failed" in line
                    or " error" in line), "")
    return proc.returncode, summary.strip("= ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the environment, test summary and figures here")
    parser.add_argument("--no-bench", action="store_true", help="run the tests only")
    parser.add_argument("--no-tests", action="store_true", help="run the checks only")
    parser.add_argument("--only", help="comma-separated check names (default: all)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: run the checks on Accelerator(cpu=True) with tiny sizes (a smoke run)")
    parser.add_argument("--check", choices=sorted(CHECKS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        parser.error(f"--only: unknown check {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    # a SIGTERM (a timeout, a job's end) unwinds like Ctrl-C: no /tmp/cuda-check-* folder is left behind
    previous = signal.signal(signal.SIGTERM, _ended_by)
    try:
        if args.check:
            return run_one(args.check, args.device, args.out)
        return _check(parser, args, names)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace, names: list[str]) -> int:
    """The tests, then the checks ``names``, as the options ask; the exit status."""
    start = time.monotonic()
    env = environment()
    gpu = bool(env["gpus"])
    checks_run = not args.no_bench and (gpu or args.device == "cpu")
    names = [name for name in names if args.device != "cpu" or CHECKS[name][1]]
    if args.no_tests and not (checks_run and names):  # say so rather than "what ran passed"
        if args.no_bench:
            parser.error("--no-tests with --no-bench: nothing to run; drop one of them")
        if not checks_run:
            parser.error(f"--no-tests: the checks need a GPU, so nothing would run ({env['no_gpu_reason']}); "
                         "add --device cpu for a smoke run of the checks on the CPU")
        parser.error(f"--only {args.only}: these checks need a GPU (--device cpu leaves them out), so nothing "
                     f"would run; choose from {', '.join(n for n, (_, on_cpu) in CHECKS.items() if on_cpu)}")
    print(f"cuda_check: torch {env['torch']} (CUDA {env['torch_cuda']}), accelerate {env['accelerate']}, "
          f"GPUs: {', '.join(env['gpus']) or 'none'}")
    result: dict[str, Any] = {"environment": env}
    failures: list[str] = []
    if not gpu:
        print(f"cuda_check: {env['no_gpu_reason']}")
    if not args.no_tests:
        if not gpu:
            print("cuda_check: running the CPU-checkable tests; the GPU tests skip with their reason")
        # test_gpu_check runs each check as a test: skipped here when this call runs the checks itself
        checks_run_here = gpu and not args.no_bench
        rc, summary = run_tests(args.pytest_args + (["--deselect", GPU_CHECK_TEST] if checks_run_here else []))
        result["tests"] = {"returncode": rc, "summary": summary}
        failures += [] if rc == 0 else [f"tests failed: {summary}"]
    if checks_run:
        print(f"cuda_check: checks on {args.device}, each in a fresh process (ratios measured in this run)")
        result["figures"] = {}
        for name in names:
            figures = run_isolated(name, args.device)
            result["figures"][name] = figures
            shown = {k: v for k, v in figures.items() if k != "failure"}
            print(f"  {name}: {json.dumps(shown, default=str)}", flush=True)
            if figures.get("failure"):
                failures.append(f"{name}: {figures['failure']}")
    result["failures"] = failures
    result["seconds"] = round(time.monotonic() - start, 1)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    if failures:
        print("cuda_check: FAILED\n  " + "\n  ".join(failures))
        return 1
    if gpu:
        print(f"cuda_check: all CUDA checks passed in {result['seconds']} s")
    else:
        print(f"cuda_check: no GPU here, so the GPU checks did not run; what ran passed in "
              f"{result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

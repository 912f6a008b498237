"""One call that checks the CUDA backend on this machine: conformance tests, then benchmarks, as ratios.

    python bench/cuda_check.py                  # tests + benchmarks (a few minutes on a GPU)
    python bench/cuda_check.py --json out.json  # also write the figures to a file
    python bench/cuda_check.py --no-bench       # tests only

On a GPU: runs tests/backends/test_cuda.py and tests/backends/test_prefetch.py (GPU tests included), then
prints cuda-vs-cpu weight differences, prefetch vs compute alone (must be <= 1.1x), host syncs per call with
D=8 (must be 1), and examples/s against a naive loop; exits 1 when a test or a criterion fails.
Without a GPU: says why, runs the CPU-checkable tests (the GPU ones skip with their reason) and exits 0 when
they pass.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ["tests/backends/test_cuda.py", "tests/backends/test_prefetch.py"]


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


def run_tests(extra: list[str]) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", *TESTS, "-q", "-rfEs", "-p", "no:cacheprovider", *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = proc.stdout + proc.stderr
    print(out.rstrip() if proc.returncode else out.rstrip()[-6000:], flush=True)
    summary = next((line for line in reversed(out.splitlines()) if " passed" in line or " failed" in line
                    or " error" in line), "")
    return proc.returncode, summary.strip("= ")


def run_benchmarks() -> tuple[dict[str, Any], list[str]]:
    sys.path.insert(0, str(ROOT / "bench"))
    import cuda_throughput as ct

    figures: dict[str, Any] = {}
    failures: list[str] = []
    for d, g in ((1, 1), (4, 2)):
        diff = ct.weights_vs_cpu(d, g)
        figures[f"weights_max_abs_diff_D{d}_G{g}"] = diff
        print(f"  same plan, same numbers (D={d}, G={g}): max |w_cuda - w_cpu| = {diff:.2e}")
        if diff > 1e-5:
            failures.append(f"cuda vs cpu weights differ by {diff:.2e} (D={d}, G={g}; limit 1e-5)")
    p = ct.measure_prefetch()
    figures.update(prefetch_ratio=p.prefetch_ratio, blocking_copy_ratio=p.blocking_ratio,
                   compute_ms=p.compute_s * 1e3, copy_mb=p.copy_mb)
    print(f"  prefetch ({p.copy_mb:.0f} MB/batch): with prefetch / compute alone = {p.prefetch_ratio:.3f}x "
          f"(limit 1.1x); blocking copy / compute alone = {p.blocking_ratio:.3f}x; "
          f"compute {p.compute_s * 1e3:.2f} ms/step")
    if p.prefetch_ratio > 1.1:
        failures.append(f"prefetch step time is {p.prefetch_ratio:.3f}x compute alone (limit 1.1x)")
    s = ct.syncs_per_call(d=8)
    figures.update(host_syncs_per_call_D8=s.counted, sync_debug_warnings_D8=s.debug_mode)
    print(f"  host syncs in one call with D=8: {s.counted} counted {s.by_kind}; "
          f"{s.debug_mode} flagged by torch.cuda.set_sync_debug_mode")
    if s.counted != 1 or s.debug_mode > 1:
        failures.append(f"host syncs per call with D=8: counted {s.counted}, sync-debug {s.debug_mode} "
                        "(want 1)")
    t = ct.measure_throughput()
    figures.update(engine_exs_per_s=t.engine_exs, naive_exs_per_s=t.naive_exs, throughput_ratio=t.ratio)
    print(f"  throughput: engine {t.engine_exs:,.0f} ex/s vs naive loop {t.naive_exs:,.0f} ex/s "
          f"= {t.ratio:.2f}x")
    if t.ratio < 1.0:
        failures.append(f"engine is slower than the naive loop ({t.ratio:.2f}x)")
    return figures, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the environment, test summary and figures here")
    parser.add_argument("--no-bench", action="store_true", help="run the tests only")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    env = environment()
    gpu = bool(env["gpus"])
    print(f"cuda_check: torch {env['torch']} (CUDA {env['torch_cuda']}), accelerate {env['accelerate']}, "
          f"GPUs: {', '.join(env['gpus']) or 'none'}")
    if not gpu:
        print(f"cuda_check: {env['no_gpu_reason']}")
        print("cuda_check: running the CPU-checkable parts; the GPU tests skip with their reason")
    rc, summary = run_tests(args.pytest_args)
    result: dict[str, Any] = {"environment": env, "tests": {"returncode": rc, "summary": summary}}
    failures = [] if rc == 0 else [f"tests failed: {summary}"]
    if gpu and not args.no_bench:
        print("cuda_check: benchmarks (ratios measured in this run)")
        figures, bench_failures = run_benchmarks()
        result["figures"] = figures
        failures += bench_failures
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
        print(f"cuda_check: no GPU here, so the GPU checks did not run; the CPU-checkable parts passed "
              f"({summary}) in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The IPU tutorials in examples/ipu run to completion at small size (on the poptorch emulator here).

Each script is run as a user runs it (``python examples/ipu/NN_name.py ...``) in a subprocess with a
timeout; the checks read what it prints. The scripts assert their own results (weights, item counts,
output values) and exit non-zero when one is wrong.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "ipu"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("[0-9][0-9]_*.py"))


def run_example(name: str, *args: str, timeout: float = 120) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ACCELBATCH_IPU_EMULATOR", None)
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_there_are_seven_tutorials_each_with_a_readme_section():
    assert len(SCRIPTS) == 7
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    for name in SCRIPTS:
        assert f"`{name}`" in readme, name


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, args, said", [
    ("01_efficient_data_loading.py", ["--items", "100"], "--items 100 is fewer than one combined batch (128 = "),
    ("01_efficient_data_loading.py", ["--device-iterations", "0"], "--device-iterations must be at least 1"),
    ("01_efficient_data_loading.py", ["--workers", "-1"], "--workers must be 0 or more"),
    ("01_efficient_data_loading.py", ["--buffer-size", "0"], "--buffer-size must be at least 1"),
    ("01_efficient_data_loading.py", ["--pause-s", "-1"], "--pause-s must be 0 or more"),
    ("01_efficient_data_loading.py", ["--max-batches", "-3"], "--max-batches must be at least 1"),
    ("02_device_iterations_and_output_modes.py", ["--period", "4", "--device-iterations", "6"],
     "--period 4 must divide --device-iterations 6"),
    ("03_replication_and_gradient_accumulation.py", ["--batch-size", "0"], "--batch-size must be at least 1"),
    ("03_replication_and_gradient_accumulation.py", ["--gradient-accumulation", "-1"],
     "--gradient-accumulation must be at least 1"),
    ("03_replication_and_gradient_accumulation.py", ["--calls", "0"], "--calls must be at least 1"),
    # R replicas hold R IPUs; 3 is not a power of 2: 4 would be held, 1 idle
    ("03_replication_and_gradient_accumulation.py", ["--replication-factor", "3"],
     "--replication-factor 3: an IPU system reserves a power of 2 or a multiple of 64 IPUs, so 3 replicas would "
     "hold 4 IPUs with 1 idle (PopTorch refuses it); use 2 or 4"),
    ("03_replication_and_gradient_accumulation.py", ["--replication-factor", "128"],
     "--replication-factor 128: 128 replicas need 128 IPUs, and PopTorch drives at most 64 from one process"),
    ("04_rebatched_iterable_datasets.py", ["--workers", "0"], "--workers must be at least 1"),
    ("04_rebatched_iterable_datasets.py", ["--batch-size", "0"], "--batch-size must be at least 1"),
    ("04_rebatched_iterable_datasets.py", ["--items", "3", "--skip-async"],
     "--items 3 is fewer than one batch (--batch-size 4): no mode has a batch to deliver"),
    # ceil(10 / 7) = 2 items per worker, below a batch of 4: Async has nothing to deliver
    ("04_rebatched_iterable_datasets.py", ["--items", "10"],
     "--items 10 split among --workers 7 gives each worker at most 2 items, fewer than --batch-size 4"),
    ("07_pipelining.py", ["--stages", "1"], "--stages 1: a pipeline needs at least 2 stages (one IPU each)"),
    ("07_pipelining.py", ["--stages", "5"],
     "--stages 5: an IPU system reserves a power of 2 or a multiple of 64 IPUs, so 5 stages would hold 8 IPUs "
     "with 3 idle (PopTorch refuses it); use 4 or 8"),
    ("07_pipelining.py", ["--stages", "128"], "--stages 128: 128 stages need 128 IPUs, and PopTorch drives at most 64"),
    ("07_pipelining.py", ["--batch-size", "0"], "--batch-size must be at least 1"),
    ("07_pipelining.py", ["--device-iterations", "0"], "--device-iterations must be at least 1"),
    ("07_pipelining.py", ["--calls", "0"], "--calls must be at least 1"),
])
def test_a_tutorial_refuses_arguments_it_cannot_run_in_one_line(name, args, said):
    """Arguments a tutorial cannot run with end in argparse's one line before any work (they ended in a bare
    StopIteration, an assertion, or the emulator's or torch's traceback)."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), "--emulator", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and said in proc.stderr.splitlines()[-1] and "Traceback" not in proc.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, args, said", [
    ("05_world_training_on_ipu.py", ["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    ("05_world_training_on_ipu.py", ["--tolerance", "-1"], "argument --tolerance: -1 is below 0"),
    ("06_generator_on_ipu.py", ["-lr", "abc"], "argument -lr/--learning-rate: invalid float value: 'abc'"),
    ("06_generator_on_ipu.py", ["--tolerance", "-1"], "argument --tolerance: -1 is below 0"),
])
def test_the_world_tutorials_refuse_a_bad_option_in_one_line(name, args, said):
    """Tutorials 5 and 6 take every option of accelbatch train: argparse's usage of them ran to 68 lines."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and said in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_01_efficient_data_loading():
    out = run_example("01_efficient_data_loading.py", "--emulator", "--items", "96", "--features", "8",
                      "--hidden", "8", "--batch-size", "2", "--device-iterations", "3", "--workers", "1",
                      "--max-batches", "3", "--buffer-size", "2", "--pause-s", "0")
    assert "= 6 rows per call; 16 calls per epoch of 96 items" in out
    assert "model alone (Options.enableSyntheticData, 16 calls = one epoch):" in out
    assert "poptorch.DataLoader batch: x[6, 8] y[6]" in out and "torch DataLoader batch:    x[2, 8]" in out
    assert "Invalid batch dimension: In the input torch.Size([2, 8]), the batch dimension (2) must be a " \
           "multiple of Options.deviceIterations(3)" in out
    for mode in ("Sync, 0 workers", "Sync, 1 workers", "Async, 1 workers"):
        line = next(text for text in out.splitlines() if mode in text)
        assert line.count("it/s") == 2 and ("data loading" in line or "the model" in line)
    for options in ("defaults", "early_preload=True", "buffer_size=1, miss_sleep_time_in_ms=50"):
        line = next(text for text in out.splitlines() if text.strip().startswith(options))
        assert line.count(" ms") == 1 and line.count("it/s") == 1, line
    assert re.search(r"start of a 2nd epoch with 1 workers: [\d.]+ ms, with persistent_workers=True [\d.]+ ms", out)
    # 6 rows per call as batch_size x deviceIterations, for the D tried (1, 2, 4, 3) that divide 6
    table = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+[\d,]+ it/s$", out, re.M)
    assert [tuple(map(int, row)) for row in table] == [(2, 3, 3, 2), (3, 2, 2, 3), (6, 1, 1, 6)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_02_device_iterations_and_output_modes():
    out = run_example("02_device_iterations_and_output_modes.py", "--emulator", "--batch-size", "1",
                      "--device-iterations", "6", "--period", "3")
    assert "pred[6] loss[6] out" in out
    assert "EveryN(3)      [2]     [2]   2, 5                  [2, 5]" in out
    assert "every mode matches the host's predictions" in out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_03_replication_and_gradient_accumulation():
    out = run_example("03_replication_and_gradient_accumulation.py", "--emulator", "--batch-size", "1",
                      "--device-iterations", "2", "--replication-factor", "2", "--gradient-accumulation", "2",
                      "--calls", "2")
    assert "micro batch 1 x D 2 x R 2 x G 2 = 8 rows per call" in out
    assert out.count("same weights") == 3 and "weights equal plain host SGD over 4-row updates" in out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_04_rebatched_iterable_datasets_7_workers_80_vs_100():
    out = run_example("04_rebatched_iterable_datasets.py", "--emulator", "--skip-async")
    lines = {line.split()[0]: line for line in out.splitlines() if "distinct items used" in line}
    assert "20 batches of 4:   80 distinct items used (expected 80)" in lines["Sync"]
    assert "25 batches of 4:  100 distinct items used (expected 100)" in lines["AsyncRebatched"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_05_world_training_on_ipu_matches_cpu():
    out = run_example("05_world_training_on_ipu.py", "--ipu-emulator", "-bs", "4", "-di", "2", "-rf", "2",
                      "--max-train-steps", "4", "--eval-splits", "", "--compare-cpu")
    assert "device: ipu" in out and "ran on poptorch-emulator" in out
    assert "largest weight difference ipu vs cpu" in out and "(tolerance 1e-05)" in out


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_05_via_the_cli():
    out = run_example("05_world_training_on_ipu.py", "--via-cli", "--ipu-emulator", "-bs", "4",
                      "--max-train-steps", "2", "--eval-splits", "")
    assert "accelbatch train " in out and "--device ipu" in out and "--ipu-emulator" in out
    assert "device: ipu" in out


SMALL_GENERATOR = ("-t", "reverse:400", "-ne", "1", "-esz", "16", "-bs", "4", "--reply", "abc", "gamble")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_06_generator_on_ipu_matches_cpu_and_generates():
    out = run_example("06_generator_on_ipu.py", "--ipu-emulator", *SMALL_GENERATOR, "--compare-cpu")
    assert "device: ipu" in out and "ran on poptorch-emulator" in out
    # texts pad to 8 tokens, labels (a word + the end token) to 8 or 16: at most two training graphs; eval:
    # whole micro-batches and a remainder graph
    compiled = re.search(r"graphs compiled: (\d+) \((\d+) training, (\d+) inference", out)
    assert compiled is not None and 1 <= int(compiled[2]) <= 2 and int(compiled[3]) == 2
    assert out.count("reply: ") == 2 and "reply: abc -> " in out and "reply: gamble -> " in out
    diff = float(out.split("largest weight difference ipu vs cpu: ")[1].split()[0])
    assert diff <= 1e-4


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_06_the_same_script_on_cuda_or_skipped_without_it():
    import torch

    out = run_example("06_generator_on_ipu.py", "--device", "cuda", *SMALL_GENERATOR)
    if torch.cuda.is_available():
        assert "device: cuda" in out and out.count("reply: ") == 2
    else:
        assert out.strip() == "--device cuda: no CUDA device here; skipped (the same script runs unchanged on a GPU)"


def test_tutorials_1_and_4_import_no_accelbatch_when_poptorch_exists():
    # what both READMEs say: with the SDK's poptorch these two need only torch (accelbatch is the fallback)
    import ast

    def imported(path: Path, top_level_only: bool) -> set[str]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nodes = tree.body if top_level_only else list(ast.walk(tree))
        names = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
        return names

    for name in ("01_efficient_data_loading.py", "04_rebatched_iterable_datasets.py"):
        assert "accelbatch" not in imported(EXAMPLES / name, top_level_only=False), name
    assert "accelbatch" not in imported(EXAMPLES / "poptorch_or_emulator.py", top_level_only=True)
    for name in ("02_device_iterations_and_output_modes.py", "05_world_training_on_ipu.py"):
        assert "accelbatch" in imported(EXAMPLES / name, top_level_only=False), name


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stages", [2, 4])
def test_07_pipelining_trains_to_the_unsplit_weights_and_shows_the_accumulation_rule(stages):
    out = run_example("07_pipelining.py", "--emulator", "--stages", str(stages))
    g = 2 * stages - 1
    assert f"1. {stages} pipelined stages (IPUs 0..{stages - 1}), gradientAccumulation {g} = 2 x {stages} - 1" in out
    assert (f"must be greater than or equal to the number of pipeline stages ({g}) when using "
            f"poptorch.PipelinedExecution. Please note that a model with {stages} pipeline stages") in out
    diffs = [float(v) for v in re.findall(r"max difference ([\d.e+-]+)", out)]
    assert len(diffs) == 3 and max(diffs) <= 1e-6

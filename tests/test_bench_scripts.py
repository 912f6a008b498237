"""The benchmark scripts' argument handling: bad input is one line and exit 2 before anything is measured, and
nothing prints a result for work that did not run. In-process (the scripts' main() with argv lists)."""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import re
import runpy
import signal
import subprocess
import sys
from typing import Any

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench(monkeypatch):
    """bench/<name>.py loaded as a module (bench/ is no package; framework_overhead imports throughput)."""
    monkeypatch.syspath_prepend(str(BENCH))

    def load(name: str) -> Any:
        spec = importlib.util.spec_from_file_location(f"bench_script_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    return load


def _usage_error(capsys, fn, *args: Any) -> str:
    """Run ``fn(*args)``, which must end in argparse's exit 2; its error line (the one after the usage)."""
    with pytest.raises(SystemExit) as exit_info:
        fn(*args)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if ": error: " in line]
    assert len(errors) == 1, captured.err
    return errors[0]


# --- 1. cuda_throughput parses its arguments before measuring -------------------------------------------

def test_cuda_throughput_help_and_unknown_options_measure_nothing(bench, monkeypatch, capsys):
    module = bench("cuda_throughput")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU: main would measure

    def measured(*_: Any, **__: Any) -> None:
        raise AssertionError("measured")
    for name in ("weights_vs_cpu", "measure_prefetch", "syncs_per_call", "measure_throughput"):
        monkeypatch.setattr(module, name, measured)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0 and "usage:" in capsys.readouterr().out
    assert "--bogus" in _usage_error(capsys, module.main, ["--bogus"])


# --- 2. train_profile prints nothing of a run that did not happen ------------------------------------------

def test_train_profile_without_a_gpu_prints_no_profile(bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = bench("train_profile")
    assert module.main(["--device", "cuda", "--", "-t", "dialogues:10", "-m", "trivial", "-tstep", "2"]) == 2
    out, err = capsys.readouterr()
    assert "--device cuda" in err and len(err.strip().splitlines()) == 1
    assert "under cProfile" not in out and "function calls" not in out
    line = _usage_error(capsys, module.main, ["--device", "cuda", "--syncs", "--", "-t", "babi:1"])
    assert "--syncs" in line and "GPU" in line


# --- 3. cuda_check: unknown check names, a call where nothing would run, SIGTERM restored ---------------------

def test_cuda_check_refuses_unknown_checks_and_runs_where_nothing_runs(bench, monkeypatch, capsys):
    module = bench("cuda_check")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = signal.getsignal(signal.SIGTERM)
    line = _usage_error(capsys, module.main, ["--no-tests", "--device", "cpu", "--only", "bogus"])
    assert "--only" in line and "bogus" in line and all(name in line for name in module.CHECKS)
    line = _usage_error(capsys, module.main, ["--no-tests"])  # the checks need a GPU; the tests are off
    assert "--no-tests" in line and "nothing would run" in line and "--device cpu" in line
    assert "--no-bench" in _usage_error(capsys, module.main, ["--no-tests", "--no-bench"])
    assert signal.getsignal(signal.SIGTERM) is before


# --- 4. framework_overhead: modes, explicit options over --quick, per-example time of the rows run ------------

def test_framework_overhead_refuses_unknown_modes(bench, capsys):
    module = bench("framework_overhead")
    line = _usage_error(capsys, module.main, ["--modes", "sync,bogus"])
    assert "--modes" in line and "bogus" in line and "sync, async" in line
    assert "--steps" in _usage_error(capsys, module.main, ["--steps", "0"])


def test_framework_overhead_explicit_steps_and_repeats_win_over_quick(bench, monkeypatch, capsys):
    module = bench("framework_overhead")
    calls = []

    def fake_round(opts, warmup, steps, now, interleave=False, parts=None, rows=None):
        calls.append(steps)
        if rows is not None:
            rows.append(steps * 32)
        return 1.0, 1.0, 0.0
    monkeypatch.setattr(module, "one_round", fake_round)
    module.main(["--quick", "--steps", "7", "--repeats", "2", "--modes", "sync"])
    assert calls == [7, 7, 7, 7]  # bag and conv, 2 rounds each, of the steps asked for
    assert "(7 steps of bs 32, 2 rounds)" in capsys.readouterr().out


def test_framework_overhead_time_per_example_counts_the_rows_the_world_ran(bench, monkeypatch, capsys):
    """5 episodes: the world runs -bs 5 (it says so), so a step is 5 examples, not 32."""
    module = bench("framework_overhead")
    real_round, plain = module.one_round, []

    def recording_round(*args: Any, **kwargs: Any):
        result = real_round(*args, **kwargs)
        plain.append(result[1])
        return result
    monkeypatch.setattr(module, "one_round", recording_round)
    module.main(["--unique-texts", "5", "--modes", "sync", "--steps", "3", "--warmup", "1", "--repeats", "1"])
    out, err = capsys.readouterr()
    fitted = [int(n) for n in re.findall(r"using -bs (\d+)", err)]
    shown = [float(x) for x in re.findall(r"plain loop\s+([\d.]+) us/example", out)]
    assert fitted == [5, 5] and len(shown) == len(plain) == 2
    for us, seconds in zip(shown, plain):
        assert us == pytest.approx(seconds / (3 * 5) * 1e6, abs=0.06)


# --- 5. bad values are one line each --------------------------------------------------------------------

@pytest.mark.parametrize("argv, option", [(["--examples", "0"], "--examples"), (["--batchsize", "0"], "--batchsize"),
                                          (["--buckets", "0"], "--buckets"),
                                          (["--text-truncate", "0"], "--text-truncate")])
def test_padding_refuses_values_below_one(bench, monkeypatch, capsys, argv, option):
    module = bench("padding")
    monkeypatch.setattr(sys, "argv", ["padding.py", *argv])
    assert option in _usage_error(capsys, module.main)


@pytest.mark.parametrize("argv, option", [(["--children", "0"], "--children"), (["--rounds", "0"], "--rounds")])
def test_process_start_refuses_values_below_one_before_starting_a_process(bench, monkeypatch, capsys, argv, option):
    module = bench("process_start")
    monkeypatch.setattr(module, "start_round", lambda *a: pytest.fail("a process was started"))
    monkeypatch.setattr(sys, "argv", ["process_start.py", *argv])
    assert option in _usage_error(capsys, module.main)


class _FakeWorld:
    """Enough of a world for hogwild_scaling's loop: counts parleys and its shutdown calls."""

    def __init__(self, worlds: list[_FakeWorld]):
        self.exs = self.shutdowns = 0
        worlds.append(self)

    def parley(self) -> None:
        self.exs += 4

    def report(self) -> dict:
        return {}

    def get_total_exs(self) -> int:
        return self.exs

    def get_model_agent(self) -> Any:
        return type("Agent", (), {"model": torch.nn.Linear(2, 2)})()

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def fake_worlds(monkeypatch) -> list[_FakeWorld]:
    import accelbatch.build

    worlds: list[_FakeWorld] = []
    monkeypatch.setattr(accelbatch.build, "create_world", lambda *a, **k: _FakeWorld(worlds))
    monkeypatch.setattr(accelbatch.build, "create_hogwild_world", lambda *a, **k: _FakeWorld(worlds))
    return worlds


@pytest.mark.parametrize("argv, option", [(["--rounds", "0"], "--rounds"), (["--numthreads", "0"], "--numthreads"),
                                          (["--numthreads", "1"], "--numthreads")])
def test_hogwild_scaling_refuses_bad_values_before_making_worlds(bench, fake_worlds, capsys, argv, option):
    module = bench("hogwild_scaling")
    assert option in _usage_error(capsys, module.main, argv)
    assert fake_worlds == []


# --- 6. hogwild_scaling: distinct configurations, every world shut down -----------------------------------

def test_hogwild_scaling_compares_distinct_worlds_and_shuts_each_down(bench, fake_worlds, capsys):
    module = bench("hogwild_scaling")
    ratios = module.main(["--rounds", "1", "--seconds", "0.001", "--warmup", "0"])
    assert len(fake_worlds) == 3 and [w.shutdowns for w in fake_worlds] == [1, 1, 1]
    assert set(ratios) == {"vs_single", "vs_hogwild_1", "cpu_efficiency"}
    assert "ratio hogwild-2 / hogwild-1" in capsys.readouterr().out


def test_hogwild_scaling_measures_a_window_the_scheduler_skipped(bench, fake_worlds, monkeypatch):
    """A loaded machine can let the whole window pass before the first parley: it still measures one."""
    module = bench("hogwild_scaling")
    clock = iter(range(10_000))  # each reading a second after the last: every window is over at once
    monkeypatch.setattr(module.time, "perf_counter", lambda: float(next(clock)))
    ratios = module.main(["--rounds", "1", "--seconds", "0.5", "--warmup", "0"])
    assert ratios["vs_single"] > 0 and all(w.exs == 4 for w in fake_worlds)


def test_hogwild_scaling_shuts_down_the_worlds_made_before_one_failed(bench, fake_worlds, monkeypatch):
    import accelbatch.build

    def failing(*_: Any, **__: Any) -> None:
        raise RuntimeError("the hogwild world did not start")
    monkeypatch.setattr(accelbatch.build, "create_hogwild_world", failing)
    with pytest.raises(RuntimeError, match="did not start"):
        bench("hogwild_scaling").main(["--rounds", "1"])
    assert len(fake_worlds) == 1 and fake_worlds[0].shutdowns == 1


def test_host_allocator_refuses_unknown_workloads_and_no_rounds(bench, capsys):
    module = bench("host_allocator")
    line = _usage_error(capsys, module.main, ["--workloads", "bag,foo"])
    assert "--workloads" in line and "foo" in line and "memnn" in line
    assert "--rounds" in _usage_error(capsys, module.main, ["--rounds", "0"])


def test_throughput_refuses_bad_batch_sizes_and_names_a_missing_task_file(bench, monkeypatch, capsys, tmp_path):
    module = bench("throughput")
    line = _usage_error(capsys, module.main, ["--parts", "overhead", "--batchsizes", "8,0", "--episodes", "20",
                                              "--repeats", "1", "--min-seconds", "0.01"])
    assert "--batchsizes" in line
    missing = tmp_path / "missing.jsonl"
    monkeypatch.setattr(sys, "argv", ["throughput.py", "--parts", "overhead", "--task", f"jsonl:{missing}",
                                      "--repeats", "1", "--min-seconds", "0.01", "--batchsizes", "4"])
    with pytest.raises(SystemExit) as exit_info:  # the script as run from the command line
        runpy.run_path(str(BENCH / "throughput.py"), run_name="__main__")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(missing) in err[0] and "no such file" in err[0]


def test_poptorch_tests_timeout_is_one_line_and_removes_the_copy(bench, monkeypatch, capsys, tmp_path):
    module = bench("poptorch_tests")
    for name in module.TEST_FILES + module.SUPPORT_FILES:
        (tmp_path / "src" / "tests").mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / "tests" / name).write_text("")
    workdirs = []

    def timing_out(cmd, cwd=None, timeout=None, **_: Any):  # as subprocess.run once pytest passed --timeout
        workdirs.append(pathlib.Path(cwd))
        raise subprocess.TimeoutExpired(cmd, timeout)
    monkeypatch.setattr(module.subprocess, "run", timing_out)
    before = signal.getsignal(signal.SIGTERM)
    assert module.main(["--poptorch-src", str(tmp_path / "src"), "--timeout", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--timeout" in err[0] and "2 s" in err[0]
    assert len(workdirs) == 1 and not workdirs[0].exists()
    assert signal.getsignal(signal.SIGTERM) is before


# --- 8. feeding: a warm-up batch, then --batches full batches --------------------------------------------

def test_feeding_data_holds_a_warm_up_batch_and_the_full_timed_batches(bench):
    module = bench("feeding")
    from accelbatch.data import make_loader

    batches, bs = 3, 4
    messages = module.make_messages(module.rows_for(batches, bs))
    with make_loader(messages, collate=module.CostlyCollate(0.0), training=False, batch_size=bs,
                     num_workers=0) as loader:
        rows = [batch.num_real for batch in loader]
    assert rows == [bs] * (1 + batches)  # the warm-up batch, then the timed ones, all full
    assert module.epoch_time([{}] * len(rows), 0.0, "sleep")[1] == batches  # the steps timed: the bound's


def test_feeding_ratio_below_the_bound_is_not_met(bench):
    module = bench("feeding")
    assert module.verdict(0.97).startswith("below the bound") and "rerun" in module.verdict(0.97)
    assert module.verdict(1.0) == module.verdict(1.10) == "met" and module.verdict(1.11) == "NOT met"


# --- 9. throughput: the overhead part on data smaller than a batch ------------------------------------------

def test_throughput_overhead_runs_the_batch_size_the_world_runs_on_data_smaller_than_a_batch(bench, capsys):
    """10 episodes (22 examples) at -bs 32: the world runs -bs 10; the bare loops count and score the rows
    they ran (they took 32 for a count and broke Metrics on a shorter slice)."""
    module = bench("throughput")
    results = module.main(["--episodes", "10", "--parts", "overhead", "--batchsizes", "32", "--repeats", "1",
                           "--min-seconds", "0.02"])
    out = capsys.readouterr().out
    assert "(the world runs -bs 10: the data holds fewer episodes than 32)" in out
    assert results["overhead_bs32"] > 0 and results["overhead_metrics_only_bs32"] > 0


# --- 10. throughput's metrics part: its task, its episodes, an exact check that can fail -------------------

def _metrics_argv(*extra: str) -> list[str]:
    return ["--parts", "metrics", "--repeats", "1", "--min-seconds", "0.01", *extra]


def test_throughput_metrics_part_scores_the_task_asked_for(bench, capsys, tmp_path):
    data = tmp_path / "three.jsonl"
    data.write_text("".join('{"text": "q%d", "labels": ["a %d"], "episode_done": true}\n' % (i, i) for i in range(3)))
    module = bench("throughput")
    assert module.main(_metrics_argv("--task", f"jsonl:{data}"))["metrics_identical"] == 1.0
    assert f"over the 3 turns of 3 episodes of -t jsonl:{data}'s valid split" in capsys.readouterr().out


def test_throughput_metrics_part_refuses_an_unknown_task(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["throughput.py", *_metrics_argv("--task", "nosuchtask", "--quick")])
    with pytest.raises(SystemExit) as exit_info:  # the script as run from the command line
        runpy.run_path(str(BENCH / "throughput.py"), run_name="__main__")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nosuchtask" in err[0]


def test_throughput_explicit_eval_episodes_win_over_quick(bench, capsys):
    bench("throughput").main(_metrics_argv("--quick", "--eval-episodes", "700"))
    assert "700 episodes of the generated dialogues' valid split" in capsys.readouterr().out


def test_throughput_metrics_check_is_exact_and_a_difference_exits_1(bench, monkeypatch, capsys):
    """A one-pass F1 one float step off the exact reference is DIFFERENT (a tolerance called it identical),
    printed with the rest, and the script then exits 1."""
    module = bench("throughput")

    class OffByOneStep(module.Metrics):
        def report(self) -> dict:
            out = super().report()
            out["f1"] = math.nextafter(out["f1"], 2.0)
            return out
    monkeypatch.setattr(module, "Metrics", OffByOneStep)
    with pytest.raises(SystemExit) as exit_info:
        module.main(_metrics_argv("--eval-episodes", "20"))
    assert exit_info.value.code == 1
    out, err = capsys.readouterr()
    assert "values compared exactly (==)" in out and "-> DIFFERENT" in out
    assert "total " in out and "DIFFERENT" in err


# --- 11. framework_overhead: --unique-texts checked and its -bs said; different weights exit 1 ----------------

@pytest.mark.parametrize("argv, option", [(["--unique-texts", "0"], "--unique-texts"),
                                          (["--unique-texts", "-3"], "--unique-texts"),
                                          (["--unique-texts", "5", "--task", "babi:1"], "--unique-texts"),
                                          (["--episodes", "50", "--task", "babi:1"], "--episodes")])
def test_framework_overhead_refuses_bad_unique_texts_before_measuring(bench, monkeypatch, capsys, argv, option):
    module = bench("framework_overhead")
    monkeypatch.setattr(module, "measure", lambda args: pytest.fail("measured"))
    assert option in _usage_error(capsys, module.main, argv)


def test_framework_overhead_header_says_the_batch_size_the_world_ran(bench, capsys):
    """One episode: the world runs -bs 1, and the header says so (it said bs 32)."""
    module = bench("framework_overhead")
    module.main(["--unique-texts", "1", "--modes", "sync", "--steps", "2", "--warmup", "1", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "(2 steps of bs 1, 1 rounds)" in out and "bs 32" not in out


def test_framework_overhead_different_weights_exit_1_after_every_row(bench, monkeypatch, capsys):
    module = bench("framework_overhead")

    def fake_round(opts, warmup, steps, now, interleave=False, parts=None, rows=None):
        if rows is not None:
            rows.append(steps * 32)
        return 1.0, 1.0, 0.5 if opts.model == module.BAG else 0.0  # bag's plain loop ends elsewhere
    monkeypatch.setattr(module, "one_round", fake_round)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--steps", "3", "--repeats", "1", "--modes", "sync"])
    assert exit_info.value.code == 1
    out, err = capsys.readouterr()
    assert "!! the plain loop did not train the same weights" in out and "conv  sync" in out  # printed first
    assert "bag sync" in err and "conv" not in err


# --- 12. bad sizes are one line naming the option, before anything runs ------------------------------------

@pytest.mark.parametrize("argv, option", [(["--repeats", "-1"], "--repeats"), (["--repeats", "0"], "--repeats"),
                                          (["--min-seconds", "-1"], "--min-seconds"),
                                          (["--min-seconds", "0"], "--min-seconds"),
                                          (["--episodes", "0"], "--episodes"),
                                          (["--episodes", "50", "--task", "babi:1"], "--episodes"),
                                          (["--eval-episodes", "0"], "--eval-episodes")])
def test_throughput_refuses_bad_sizes_before_measuring(bench, monkeypatch, capsys, argv, option):
    module = bench("throughput")
    monkeypatch.setattr(module, "PARTS", {name: lambda args: pytest.fail("measured") for name in module.PARTS})
    assert option in _usage_error(capsys, module.main, ["--parts", "metrics", *argv])


@pytest.mark.parametrize("argv, option", [(["--calls", "0"], "--calls"), (["--calls", "-3"], "--calls"),
                                          (["--rounds", "0", "--calls", "2"], "--rounds")])
def test_plan_overheads_refuses_bad_sizes_before_measuring(bench, monkeypatch, capsys, argv, option):
    module = bench("plan_overheads")
    for name in ("bench_device_iterations", "bench_replication"):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("measured"))
    assert option in _usage_error(capsys, module.main, argv)


def test_plan_overheads_explicit_calls_and_rounds_win_over_quick(bench, monkeypatch, capsys):
    module = bench("plan_overheads")
    ran = []
    monkeypatch.setattr(module, "bench_device_iterations", lambda calls: ran.append(("device", calls)))
    monkeypatch.setattr(module, "bench_replication", lambda calls, rounds: ran.append(("replication", calls, rounds)))
    assert module.main(["--quick", "--calls", "50"]) == 0
    assert module.main(["--quick", "--rounds", "3"]) == 0
    assert module.main(["--quick"]) == 0 and module.main([]) == 0
    assert ran == [("device", 50), ("replication", 50, 1), ("device", 5), ("replication", 5, 3),
                   ("device", 5), ("replication", 5, 1), ("device", 20), ("replication", 20, 2)]
    assert "[--calls 20]" in module.__doc__


@pytest.mark.parametrize("argv, option", [(["--big-mb", "-5", "--small-mb", "1"], "--big-mb"),
                                          (["--big-mb", "0"], "--big-mb"), (["--small-mb", "0"], "--small-mb"),
                                          (["--big-mb", "2", "--small-mb", "3"], "--big-mb"),
                                          (["--batch-sort-cache-size", "-1"], "--batch-sort-cache-size"),
                                          (["--batch-sort-cache-size", "0"], "--batch-sort-cache-size")])
def test_streaming_memory_refuses_bad_sizes_before_starting_a_child(bench, monkeypatch, capsys, argv, option):
    module = bench("streaming_memory")
    monkeypatch.setattr(module, "run_child", lambda *a: pytest.fail("a child was started"))
    assert option in _usage_error(capsys, module.main, argv)


def test_streaming_memory_says_a_failed_childs_own_last_line(bench, monkeypatch):
    module = bench("streaming_memory")

    def failing(cmd, **_: Any) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback (most recent call last):\n  ...\nValueError: boom\n")
    monkeypatch.setattr(module.subprocess, "run", failing)
    with pytest.raises(SystemExit) as exit_info:
        module.run_child("/data/small.jsonl", module.argparse.Namespace(batch_sort_cache_size=8,
                                                                        dynamic_batching="none"))
    message = str(exit_info.value.code)
    assert "ValueError: boom" in message and "/data/small.jsonl" in message and "\n" not in message


def test_streaming_memory_bytes_per_example_of_the_file_written(bench, monkeypatch, capsys):
    """--big-mb 1.5 writes two whole blocks (about 2 MB): the figure is the file's, not 1.5 MB's."""
    module = bench("streaming_memory")
    sizes = {}

    def fake_child(path, args):
        if path is None:
            return {"rss_mb": 100.0}
        sizes[path] = os.path.getsize(path)
        return {"rss_mb": 110.0 + len(sizes), "examples": 1000 * len(sizes), "batches": 1, "seconds": 0.1}
    monkeypatch.setattr(module, "run_child", fake_child)
    module.main(["--big-mb", "1.5", "--small-mb", "0.5"])
    big = max(sizes.values())
    assert big > 1.9 * (1 << 20)
    assert f"(the file written: {big / 2000:.0f} bytes per example)" in capsys.readouterr().out


# --- 13. generation: every ratio names its baseline -------------------------------------------------------

def test_generation_ratios_name_their_baselines(bench, monkeypatch, capsys):
    module = bench("generation")
    speeds = iter([100.0, 250.0, None, 40.0, 10.0])  # training none, full; the model's training; greedy, loss only

    def fake_run(args):
        speed = next(speeds) or 1.0
        return {"train": {"exs": 10, "exs_per_s": speed}, "valid": {"exs": 10, "time_s": 10 / speed}}, 50.0
    monkeypatch.setattr(module, "run", fake_run)
    module.main(["--steps", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert "ratio vs" in lines[0]
    assert "1.00x --dynamic-batching none" in lines[1] and "2.50x --dynamic-batching none" in lines[2]
    assert "1.00x greedy decoding" in lines[3] and "0.25x greedy decoding" in lines[4]


# --- 14. what the scripts say matches what they do ------------------------------------------------------------

@pytest.mark.slow  # four conv worlds: about 4 s
def test_throughput_dynamic_part_counts_the_baselines_padding_too(bench, monkeypatch, capsys):
    """none's pad fraction was nan (its world keeps no count): every strategy's is counted from the tensors."""
    module = bench("throughput")
    monkeypatch.setattr(module, "PADDING_STEPS", 4)
    results = module.main(["--episodes", "40", "--parts", "dynamic", "--repeats", "1", "--min-seconds", "0.01"])
    pads = [results[f"dynamic_{s}_pad"] for s in ("none", "batchsort", "full", "buckets")]
    assert all(0 <= pad < 1 for pad in pads), pads
    out = capsys.readouterr().out
    assert "nan" not in out and "(of 4 untimed steps after the timed ones)" in out


def test_text_padding_counts_zeros_of_the_text_tensors_and_restores_the_step(bench):
    module = bench("throughput")
    steps = []
    engine = type("Engine", (), {"train_step": lambda self, batch: steps.append(batch)})()

    class World:
        def get_model_agent(self) -> Any:
            return type("Agent", (), {"engine": engine})()

        def parley(self) -> None:
            engine.train_step({"text_vec": torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]])})
    assert module.text_padding(World(), 3) == 5 / 8 and len(steps) == 3
    assert "train_step" not in vars(engine)


def test_throughput_overhead_says_why_the_trivial_agents_metrics_are_0(bench, capsys):
    bench("throughput").main(["--episodes", "10", "--parts", "overhead", "--batchsizes", "4", "--repeats", "1",
                              "--min-seconds", "0.01"])
    assert "accuracy 0.000 f1 0.000: its one reply, 'i do not know the answer', shares no word with the labels" \
        in capsys.readouterr().out


def test_hogwild_scaling_docstrings_name_the_default_optimizer(bench):
    module = bench("hogwild_scaling")
    assert "sgd by default" in module.__doc__
    assert "Adam" not in module.__doc__ and "Adam" not in module.WideMLPAgent.__doc__

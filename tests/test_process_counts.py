"""Sizes a machine cannot run are refused in one line before anything starts: --num-workers 10**12 started
workers until the machine stalled, -rf 10**12 on cpu and -di / -ga 10**12 ended in a MemoryError traceback."""

from __future__ import annotations

import pytest
from accelbatch.backends.distributed import spawn_replicas

import accelbatch.cores as cores
from accelbatch.cli import main
from accelbatch.opts import OptionError, Opts
from accelbatch.plan import ExecutionPlan, PlanError


@pytest.mark.parametrize("usable, most", [(1, 16), (2, 16), (4, 16), (5, 20), (64, 256)])
def test_the_most_processes_are_four_a_core_and_at_least_sixteen(monkeypatch, usable, most):
    monkeypatch.setattr(cores, "usable_cores", lambda: usable)
    cores.check_process_count("--num-workers", most, "data processes")
    with pytest.raises(OptionError) as err:
        cores.check_process_count("--num-workers", most + 1, "data processes")
    assert str(err.value) == (f"--num-workers {most + 1}: starts {most + 1:,} data processes, more than the {most} "
                              f"this process's {usable} cores can run (4 a core, at least 16); give at most {most}")


def test_replica_processes_are_refused_before_any_starts(monkeypatch):
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    with pytest.raises(OptionError, match="-rf/--replication-factor 17: starts 17 replica processes, more than the 16"):
        spawn_replicas(print, 17)


@pytest.mark.parametrize("args", [["--num-workers", str(10 ** 12)], ["-rf", str(10 ** 12)],
                                  ["-nt", str(10 ** 12)], ["-di", str(10 ** 12)], ["-ga", str(10 ** 12)]])
def test_the_command_line_refuses_them_in_one_line(args, capsys):
    assert main(["train", "-t", "babi:1", "-m", "bag", "-tstep", "1", "--no-progress", "--eval-splits", "",
                 *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{10 ** 12:,}" in err, err


def test_a_call_of_more_micro_batches_than_a_layout_holds_is_refused():
    ExecutionPlan(device_iterations=2 ** 12, gradient_accumulation=2 ** 6, replication_factor=2 ** 6)  # 2**24
    with pytest.raises(PlanError, match=r"--device-iterations 4096 x --gradient-accumulation 64 x "
                                        r"--replication-factor 128 = 33,554,432 micro-batches a call"):
        ExecutionPlan(device_iterations=2 ** 12, gradient_accumulation=2 ** 6, replication_factor=2 ** 7)


@pytest.mark.parametrize("args, says", [
    (["-nt", "17"], "-nt/--numthreads 17: starts 17 hogwild processes, more than the 16 this process's 2 cores can "
                    "run (4 a core, at least 16); give at most 16"),
    (["-nt", "4", "--num-workers", "4"], "-nt/--numthreads 4 with --num-workers 4: starts 4 data processes in each "
                                         "of the 4 hogwild processes, 20 processes in all, more than the 16 this "
                                         "process's 2 cores can run (4 a core, at least 16); give fewer, at most 16 "
                                         "processes in all"),
    (["-rf", "4", "--num-workers", "4"], "-rf/--replication-factor 4 with --num-workers 4: starts 4 data processes "
                                         "in each of the 4 replica processes, 20 processes in all"),
    (["-rf", "4", "--num-workers", "3", "--dataloader-mode", "async"],
     "-rf/--replication-factor 4 with --num-workers 3: starts 3 data processes and an async loader in each of the 4 "
     "replica processes, 20 processes in all"),
], ids=["nt", "nt-workers", "rf-workers", "rf-async-workers"])
def test_hogwild_and_replica_processes_count_with_their_data_workers(monkeypatch, capsys, args, says):
    """Each hogwild process and each replica starts its own --num-workers: the processes in all are refused
    before any starts (-nt had no limit at all)."""
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    assert main(["train", "-t", "babi:1", "-m", "bag", "-tstep", "1", "--no-progress", "--eval-splits", "",
                 *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_within_the_limit_they_start(monkeypatch):
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    for numthreads, replicas, workers in ((16, 1, 0), (4, 1, 3), (1, 8, 1), (1, 16, 0)):
        cores.check_processes(Opts(numthreads=numthreads, replication_factor=replicas, num_workers=workers))
    cores.check_processes(Opts(device="ipu", replication_factor=64, num_workers=8))  # IPU replicas: no processes
    cores.check_processes(Opts(device="cuda", numthreads=100))  # refused as hogwild on cuda, not counted

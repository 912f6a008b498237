"""The non-IPU examples run to completion at small size."""

from __future__ import annotations

import runpy
import sys

import pytest


@pytest.mark.timeout(180)
def test_custom_agent_example_runs_with_a_plan(monkeypatch):
    module = runpy.run_path("examples/custom_agent.py", run_name="example")
    report = module["main"](["--no-progress", "-tstep", "20", "-di", "2", "-rf", "2", "-bs", "4",
                             "--eval-splits", "valid", "-veps", "-1"])
    assert report["train"]["steps"] == 20 and report["train"]["exs"] == 20 * 4 * 2 * 2
    assert report["valid"]["exs"] == 1000
    assert sys.modules.get("accelbatch") is not None


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_custom_agent_eval_loss_is_the_same_on_cpu_and_emulated_ipu():
    """Its loss is the mean over all the rows it is given: the IPU's padding rows must not enter it."""
    module = runpy.run_path("examples/custom_agent.py", run_name="example")
    args = ["--no-progress", "-tstep", "30", "--eval-splits", "valid", "-veps", "-1"]
    cpu = module["main"](args)
    ipu = module["main"](args + ["--device", "ipu", "--ipu-emulator"])
    assert ipu["valid"]["exs"] == cpu["valid"]["exs"] == 1000
    assert ipu["valid"]["loss"] == pytest.approx(cpu["valid"]["loss"], abs=1e-4)
    assert ipu["valid"]["accuracy"] == cpu["valid"]["accuracy"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hogwild_example_runs_and_evaluates_exactly_once():
    module = runpy.run_path("examples/hogwild_cpu.py", run_name="example")
    out = module["main"](["--no-progress", "-tstep", "30", "--eval-splits", "", "-veps", "-1"])
    assert out["run"]["train"]["steps"] == 30
    assert out["test"]["exs"] == 1000


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", ["custom_agent.py", "hogwild_cpu.py"])
@pytest.mark.parametrize("args, said", [(["-bs", "0"], "-bs/--batchsize: must be at least 1, got 0"),
                                        (["-t", "nosuch"], "nosuch")])
def test_an_example_given_a_bad_option_says_so_in_one_line(script, args, said, monkeypatch, capsys):
    """As `accelbatch train` does: the option named, exit 2, no traceback (the script's own __main__ block)."""
    monkeypatch.setattr(sys, "argv", [f"examples/{script}", *args])
    with pytest.raises(SystemExit) as end:
        runpy.run_path(f"examples/{script}", run_name="__main__")
    assert end.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: ") and said in lines[0], lines

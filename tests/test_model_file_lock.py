"""One training run at a time per -mf: a second run writing the same model file is refused in one line
before it trains (two such runs deleted each other's checkpoint staging mid-save: a traceback for one, a
mixed-up model file for both); the lock goes with the run that held it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accelbatch.cli import main

ROOT = str(Path(__file__).resolve().parent.parent)
TRAIN = ["train", "-t", "babi:1", "-m", "memnn", "-bs", "8", "--no-progress", "-veps", "-1", "--eval-splits", ""]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_second_run_on_the_same_model_file_is_refused_while_the_first_trains(tmp_path, capsys):
    model_file = tmp_path / "m.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "accelbatch", *TRAIN, "-ne", "1000", "-mf", str(model_file),
                              "--save-every-n-secs", "0.2"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        lock = Path(str(model_file) + ".lock")
        deadline = time.monotonic() + 120
        while not (lock.exists() and lock.read_text().startswith("pid")):
            assert first.poll() is None, first.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the first run took no lock within 120 s"
            time.sleep(0.05)
        assert main([*TRAIN, "-tstep", "2", "-mf", str(model_file)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"another training run (pid {first.pid}) is writing it now" in err and "give another -mf" in err
        assert first.poll() is None  # untouched
    finally:
        first.terminate()
        first.communicate(timeout=60)
    assert not Path(str(model_file) + ".lock").exists()  # the run that held it removed it as it stopped


def test_the_lock_goes_with_the_run_that_held_it(tmp_path):
    model_file = tmp_path / "m.pt"
    for _ in range(2):  # the second run is not refused: nothing of the first one's lock is left
        assert main([*TRAIN, "-tstep", "2", "-mf", str(model_file)]) == 0
    assert not Path(str(model_file) + ".lock").exists()

"""The files kept beside a model file (PATH.opt, PATH.trainstats): one that cannot be read is an error naming it,
before anything runs, never silently ignored."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "accelbatch", *args, "--no-progress"], env=ENV, text=True,
                          capture_output=True, timeout=120)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_unreadable_file_beside_the_model_file_is_named_and_nothing_runs(tmp_path):
    model = tmp_path / "m.pt"
    trained = _cli("train", "-t", "babi:1", "-m", "bag", "-tstep", "3", "-esz", "8", "-mf", str(model),
                   "-veps", "0.01", "-vme", "32", "--eval-splits", "")
    assert trained.returncode == 0, trained.stderr
    opt, stats = tmp_path / "m.pt.opt", tmp_path / "m.pt.trainstats"
    assert opt.exists() and stats.exists()
    good_opt, weights = opt.read_text(), model.read_bytes()
    for path, text in ((opt, "{bad"), (opt, ""), (opt, "[1, 2]"), (stats, "{oops"), (stats, '{"metric": "accuracy"}')):
        opt.write_text(good_opt)
        path.write_text(text)
        verb = ["eval", "-t", "babi:1"] if path == opt else ["train", "-t", "babi:1", "-tstep", "3"]
        got = _cli(*verb, "-mf", str(model))
        lines = got.stderr.strip().splitlines()
        assert got.returncode == 2, got.stderr
        assert "Traceback" not in got.stderr, got.stderr
        assert lines[-1].startswith(f"accelbatch: error: {path}: cannot be read"), lines[-1]
        assert "train " not in got.stdout and model.read_bytes() == weights

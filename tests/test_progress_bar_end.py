"""The train progress bar ends at the examples the report counts, also with hogwild processes, whose last
parleys are still in flight when the loop ends (the bar stopped at 32/40 while the report said 40)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
ROOT = str(Path(__file__).resolve().parent.parent)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", ["1", pytest.param("2", marks=pytest.mark.slow)])
def test_the_bar_ends_at_the_reported_examples(tmp_path, threads):
    rows = [{"text": f"hello {i}", "labels": [f"a{i % 3}"], "label_candidates": ["a0", "a1", "a2"],
             "episode_done": True} for i in range(40)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "accelbatch", "train", "-t", f"jsonl:{data}", "-m", "bag",
                           "-nt", threads, "-bs", "4", "-ne", "1", "--eval-splits", "", "--progress",
                           "--report-json", str(tmp_path / "r.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    reported = json.loads((tmp_path / "r.json").read_text())["train"]["exs"]
    shown = re.findall(r"train:.*?(\d+)/(\d+) \[", done.stderr)
    assert reported == 40 and shown, done.stderr
    assert int(shown[-1][0]) == reported, shown[-3:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_stopped_by_its_step_limit_ends_its_bar_full(tmp_path):
    """-tstep 3 of 4 rows: the bar ended at 12/25000 (its total is -ne's) where it says training ended."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "accelbatch", "train", "-m", "bag", "-esz", "8", "-bs", "4",
                           "-tstep", "3", "--eval-splits", "", "-veps", "-1", "--progress"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert re.findall(r"train:.*?(\d+)/(\d+) \[", done.stderr)[-1] == ("12", "12"), done.stderr[-500:]


@pytest.mark.parametrize("given, terminal, drawn", [(None, True, True), (None, False, False), (True, False, True),
                                                    (False, True, False)])
def test_the_bar_option_against_whether_stderr_is_a_terminal(monkeypatch, given, terminal, drawn):
    from accelbatch.opts import Opts
    from accelbatch.progress_bar import progress_bar

    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal, raising=False)
    bar = progress_bar(Opts(progress=given), 100)
    assert (bar is not None) == drawn
    if bar is not None:
        bar.close()

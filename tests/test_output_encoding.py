"""Text the data holds, printed where the output cannot encode it, shows as escapes instead of failing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}  # as a redirected Windows console's code page would
    return subprocess.run([sys.executable, "-m", "accelbatch", *args], env=env, capture_output=True, timeout=200)


@pytest.mark.timeout(240)
def test_non_ascii_text_and_task_names_print_to_an_ascii_output(tmp_path):
    data = tmp_path / "caf\u00e9.jsonl"
    rows = [{"text": f"caf\u00e9 \u65e5\u672c {i}", "labels": [f"\u00e9t\u00e9 {i % 2}"]} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    shown = _cli("display-data", "-t", f"jsonl:{data}", "-n", "2")
    assert shown.returncode == 0, shown.stderr.decode()
    assert b"caf\\xe9 \\u65e5\\u672c 0" in shown.stdout and b"\\xe9t\\xe9 0" in shown.stdout
    other = tmp_path / "日本.jsonl"
    other.write_text(data.read_text(encoding="utf-8"), encoding="utf-8")
    trained = _cli("train", "-t", f"jsonl:{data},jsonl:{other}", "-m", "repeat_label", "-tstep", "2", "-bs", "2",
                   "--no-progress", "--eval-splits", "valid")
    assert trained.returncode == 0, trained.stderr.decode()
    assert b"caf\\xe9.jsonl" in trained.stdout and b"\\u65e5\\u672c.jsonl" in trained.stdout  # per-task rows

"""--report-json and --metrics-log given /dev/stdout while stdout is redirected to a file: written through
stdout, in order, never by replacing the file (which deleted what it held, earlier content and the report
table) or by opening it anew (whose writes landed over stdout's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

EVAL = [sys.executable, "-m", "accelbatch", "eval", "-m", "repeat_label", "--no-progress"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["a", "w"], ids=[">>", ">"])
def test_report_json_to_a_redirected_stdout_keeps_the_files_content(tmp_path, mode):
    out = tmp_path / "out.txt"
    out.write_text("EARLIER LINE\n")
    with open(out, mode) as handle:
        ran = subprocess.run([*EVAL, "--report-json", "/dev/stdout"], stdout=handle, stderr=subprocess.PIPE,
                             text=True, timeout=100)
    assert ran.returncode == 0, ran.stderr
    text = out.read_text()
    assert text.startswith("EARLIER LINE\n") == (mode == "a"), text
    body = text.split("EARLIER LINE\n", 1)[-1]
    report = json.loads(body[:body.index("\n}\n") + 3])  # the JSON, then the table printed after it
    assert report["valid"]["exs"] == 1000 and "valid           1000" in body


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_metrics_log_to_a_redirected_stdout_is_not_written_over(tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "w") as handle:
        ran = subprocess.run([*EVAL, "--metrics-log", "/dev/stdout"], stdout=handle, stderr=subprocess.PIPE,
                             text=True, timeout=100)
    assert ran.returncode == 0, ran.stderr
    lines = out.read_text().splitlines()
    assert json.loads(lines[0])["exs"] == 1000 and lines[1].startswith("split"), lines

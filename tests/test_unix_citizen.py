"""The command line among other Unix programs: a -mf that is a FIFO or a device is refused, not replaced; a
closed stderr; a listing whose reader left stops; a stdout that cannot be written (a full disk) is exit 1; a
SIGTERM while the run starts is one line and exit 130; the -mf lock is held by one run only."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accelbatch import run_control, verbs
from accelbatch.cli import main
from accelbatch.opts import OptionError, Opts
from accelbatch.stdout_guard import guarded_stdout

ROOT = str(Path(__file__).resolve().parent.parent)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
QUIET = ["--no-progress", "-veps", "-1", "--eval-splits", ""]


def _write_jsonl(path: Path, n: int, candidates: int = 3) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        for i in range(n):
            row = {"text": f"q{i}", "labels": [f"a{i}"], "episode_done": True}
            if candidates:
                row["label_candidates"] = [f"a{i}"] + [f"c{j}" for j in range(candidates - 1)]
            handle.write(json.dumps(row) + "\n")
    return path


# 1. -mf naming a FIFO (or a link to one): a save would replace it with a regular file
@pytest.mark.parametrize("through_link", [False, True], ids=["fifo", "link-to-fifo"])
def test_a_model_file_that_is_a_fifo_is_refused_and_left_a_fifo(tmp_path, capsys, through_link):
    data = _write_jsonl(tmp_path / "tiny.jsonl", 8)
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    named = fifo
    if through_link:
        named = tmp_path / "link.pt"
        named.symlink_to(fifo)
    code = main(["train", "-t", f"jsonl:{data}", "-m", "bag", "-tstep", "2", "-mf", str(named), *QUIET])
    err = capsys.readouterr().err
    assert code == 2
    # a link is followed (its side files go beside the file a save writes): the error names that file
    assert err.count("\n") == 1 and err.startswith(f"accelbatch: error: -mf/--model-file {fifo}: "), err
    assert "FIFO" in err and "not a regular file" in err
    assert fifo.is_fifo()  # still the FIFO, not a 12 MB file


def test_a_report_json_fifo_is_still_written_in_place(tmp_path):
    """--report-json is opened and written in place (not replaced): a FIFO or /dev/stdout there stays usable."""
    fifo = tmp_path / "r.json"
    os.mkfifo(fifo)
    run_control.check_output_paths(Opts(task="babi:1", datatype="valid", report_json=str(fifo)))  # no error


# 2. a closed stderr (2>&-): the run goes on, its notes go nowhere (not into stdout)
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_closed_stderr_runs_and_keeps_stdout_for_the_report(tmp_path):
    data = _write_jsonl(tmp_path / "tiny.jsonl", 8)
    run = subprocess.run(["bash", "-c", f'"$0" -m accelbatch train -t jsonl:{data} -m bag -tstep 2 -mf m.pt 2>&-',
                          sys.executable], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, text=True, timeout=150)
    assert run.returncode == 0, run.stdout
    assert (tmp_path / "m.pt").is_file()
    lines = run.stdout.splitlines()
    assert lines[0].split()[:2] == ["split", "exs"], run.stdout  # the report, and nothing said on stderr
    assert not [line for line in lines if line.startswith("accelbatch:")], run.stdout


# 3. a listing whose reader left stops
class _ReaderLeavesAfter(io.StringIO):
    """A stdout whose reader reads ``lines`` lines and leaves: the next write is a broken pipe."""

    def __init__(self, lines: int):
        super().__init__()
        self.left = lines

    def write(self, text: str) -> int:
        if self.left <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.left -= text.count("\n")
        return super().write(text)


def test_display_data_stops_formatting_once_its_reader_left(tmp_path, monkeypatch):
    data = _write_jsonl(tmp_path / "many.jsonl", 2000)
    formatted: list[int] = []
    real_display = verbs.display
    monkeypatch.setattr(verbs, "display", lambda acts: formatted.append(1) or real_display(acts))
    monkeypatch.setattr(sys, "stdout", _ReaderLeavesAfter(1))
    assert main(["display-data", "-t", f"jsonl:{data}", "-n", "2000", "--no-progress"]) == 0
    assert len(formatted) <= 3, len(formatted)  # not the 2000 asked for


@pytest.mark.slow
def test_display_model_stops_parleying_once_its_reader_left(tmp_path, monkeypatch):
    data = _write_jsonl(tmp_path / "many.jsonl", 400)
    monkeypatch.setattr(sys, "stdout", _ReaderLeavesAfter(1))
    with guarded_stdout():  # as the command line runs it
        report = verbs.display_model(Opts(task=f"jsonl:{data}", model="repeat_label", datatype="valid",
                                          batchsize=1, progress=False), 400)
    assert report["exs"] <= 3, report  # not the 400 asked for


# 4. stdout that cannot be written (a full disk): the run ends, saved, and exits 1
FULL = "/dev/full"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.skipif(not os.path.exists(FULL), reason="no /dev/full here")
@pytest.mark.parametrize("verb", [pytest.param("train", marks=pytest.mark.slow), "display-data", "tasks",
                                  "broken-pipe", "version", "help"])
def test_a_stdout_on_a_full_disk_exits_1_after_the_work(tmp_path, verb):
    data = _write_jsonl(tmp_path / "tiny.jsonl", 8)
    argv = {"train": ["train", "-t", f"jsonl:{data}", "-m", "bag", "-tstep", "2", "-mf", "m.pt", *QUIET],
            "display-data": ["display-data", "-t", f"jsonl:{data}", "-n", "3"], "tasks": ["tasks"],
            "broken-pipe": ["display-data", "-t", f"jsonl:{data}", "-n", "8"], "version": ["-V"],
            "help": ["train", "--help"]}[verb]
    if verb == "broken-pipe":  # a reader that left is no error: `| head` stays exit 0
        read, write = os.pipe()
        os.close(read)
        with open(write, "w") as stdout:
            run = subprocess.run([sys.executable, "-m", "accelbatch", *argv], cwd=tmp_path, env=ENV, stdout=stdout,
                                 stderr=subprocess.PIPE, text=True, timeout=200)
        assert (run.returncode, run.stderr) == (0, "")
        return
    with open(FULL, "w") as full:
        run = subprocess.run([sys.executable, "-m", "accelbatch", *argv], cwd=tmp_path, env=ENV, stdout=full,
                             stderr=subprocess.PIPE, text=True, timeout=200)
    assert run.returncode == 1, run.stderr
    assert run.stderr.splitlines()[-1] == ("accelbatch: error: the standard output could not be written (No space "
                                           "left on device): what was printed there is incomplete"), run.stderr
    if verb == "train":
        assert (tmp_path / "m.pt").is_file()  # the work was done


# 5. SIGTERM while starting
SLOW_TEACHER = '''
import os, time
import accelbatch as ab

class SlowTeacher(ab.FixedTeacher):
    def setup_data(self):
        open(os.environ["READY_FILE"], "w").close()
        time.sleep(60)
        return [[{"text": "q", "labels": ["a"], "episode_done": True}]]
'''


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_sigterm_while_the_data_loads_is_one_line_and_exit_130(tmp_path):
    (tmp_path / "slow_teacher.py").write_text(SLOW_TEACHER)
    ready = tmp_path / "ready"
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV["PYTHONPATH"]]), "READY_FILE": str(ready)}
    proc = subprocess.Popen([sys.executable, "-m", "accelbatch", "train", "-t", "slow_teacher:SlowTeacher", "-m",
                             "repeat_label", "-mf", "m.pt", *QUIET], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the teacher's setup_data never ran"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err  # it was -15: killed silently (143 in a shell)
    assert err.splitlines()[-1] == "accelbatch: interrupted: SIGTERM received", err
    assert out == ""


SIGTERM_IN_IMPORT = '''
import os, signal, sys

class TermOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == "accelbatch.cli":
            os.kill(os.getpid(), signal.SIGTERM)
        return None

sys.meta_path.insert(0, TermOnImport())
from accelbatch.__main__ import main
sys.exit(main(["tasks"]))
'''


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_sigterm_while_the_command_is_imported_is_one_line_and_exit_130(tmp_path):
    run = subprocess.run([sys.executable, "-c", SIGTERM_IN_IMPORT], cwd=tmp_path, env=ENV, capture_output=True,
                         text=True, timeout=100)
    assert (run.returncode, run.stderr, run.stdout) == (
        130, "accelbatch: interrupted by SIGTERM while starting: nothing was run\n", "")


# 6. the -mf lock: a run that locked a lock file removed under it must not hold the model file too
def test_a_lock_file_removed_as_it_is_locked_is_not_held_beside_a_new_one(tmp_path, monkeypatch):
    model_file = str(tmp_path / "m.pt")
    first = run_control.ModelFileLock(model_file)
    real_open = open
    interleaved: list[str] = []

    def open_then_first_releases(path, *args, **kwargs):
        """The second run opens PATH.lock, then the first run ends (removing it) before the second locks it."""
        handle = real_open(path, *args, **kwargs)
        if not interleaved:
            interleaved.append(path)
            first.release()
        return handle

    monkeypatch.setattr(run_control, "open", open_then_first_releases, raising=False)
    second = run_control.ModelFileLock(model_file)
    monkeypatch.undo()
    assert interleaved == [model_file + ".lock"]
    try:
        with pytest.raises(OptionError, match=f"another training run \\(pid {os.getpid()}\\) is writing it"):
            run_control.ModelFileLock(model_file)  # the third run: the second one holds the model file
    finally:
        second.release()
    assert not os.path.exists(model_file + ".lock")


# 7. display-data shows the label candidates
def test_display_data_shows_the_label_candidates_cut_with_a_count(tmp_path, capsys):
    few = _write_jsonl(tmp_path / "few.jsonl", 1)
    many = _write_jsonl(tmp_path / "many.jsonl", 1, candidates=12)
    assert main(["display-data", "-t", f"jsonl:{few}", "-n", "1", "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == [f"[jsonl:{few}]: q0  (labels: a0)",
                                                        "    [label_candidates: a0|c0|c1]"]
    assert main(["display-data", "-t", f"jsonl:{many}", "-n", "1", "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "    [label_candidates: a0|c0|c1|c2|c3| ...and 7 more]"


def test_display_data_names_each_acts_task_and_shows_its_reward(tmp_path, capsys):
    """As ParlAI's display: a teacher's act is headed by its task (the teacher's id), each task of a multitask
    run by its own, and a reward the data gives is shown under the act."""
    rewarded = tmp_path / "r.txt"
    rewarded.write_text("text:hello\tlabels:hi\treward:1\tepisode_done:True\n")
    plain = _write_jsonl(tmp_path / "few.jsonl", 1)
    assert main(["display-data", "-t", f"parlai:{rewarded},jsonl:{plain}", "-n", "2", "--no-progress"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[:2] == [f"[parlai:{rewarded}]: hello  (labels: hi)", "    [reward: 1]"], shown
    assert f"[jsonl:{plain}]: q0  (labels: a0)" in shown and sum("reward" in line for line in shown) == 1, shown


def test_display_data_shows_a_null_text_as_none_and_hides_a_zero_reward(tmp_path, capsys):
    """A JSONL turn with "text": null (read as no text by every model) was shown as the word None; a numeric
    zero reward is not shown, as ParlAI's display leaves it out (the ParlAI format's reward:0 is text, shown)."""
    data = tmp_path / "n.jsonl"
    data.write_text('{"text": null, "labels": ["b"], "reward": 0}\n{"text": "c", "labels": ["d"], "reward": 2}\n')
    assert main(["display-data", "-t", f"jsonl:{data}", "-n", "2", "--no-progress"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[:4] == [f"[jsonl:{data}]:   (labels: b)", "- " * 20 + "-", f"[jsonl:{data}]: c  (labels: d)",
                         "    [reward: 2]"], shown


def test_display_model_shows_the_teachers_label_candidates(tmp_path, capsys):
    few = _write_jsonl(tmp_path / "few.jsonl", 1)
    assert main(["display-model", "-t", f"jsonl:{few}", "-dt", "valid", "-m", "repeat_label", "-n", "1",
                 "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    teacher = next(i for i, line in enumerate(lines) if line.startswith(f"[jsonl:{few}]: q0"))
    assert lines[teacher + 1] == "    [label_candidates: a0|c0|c1]"

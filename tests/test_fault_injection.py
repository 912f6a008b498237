"""Fault injection: each bad input and each fault a user can meet, run the way a user runs it.

Every case runs ``python -m accelbatch train|eval ...`` (in a subprocess; the pure bad-input cases, which
start no process, call ``cli.main`` in this process to keep the suite fast) and checks three things:

* the exit code and a clear message: one line naming the file:line, option or what to do for bad input,
  never a traceback; for a crash in a worker, replica or hogwild process, *that* process's traceback;
* no process left: every process of the run carries ``ACCELBATCH_TEST_TAG`` in its environment, and
  none may be alive once the run has ended (orphans included);
* nothing left in /dev/shm that the run made (named after one of its processes, or mapped by one).

The misbehaving agents live in ``faulty.py``, written into a temporary folder put on PYTHONPATH, and are
named on the command line as ``-m faulty:Class``, as a user names their own agent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import TAG_ENV, live_children, shm_left, shm_mapped, tagged_pids

from accelbatch.cli import main

pytestmark = pytest.mark.multiprocess
ROOT = str(Path(__file__).resolve().parent.parent)

FAULTY = textwrap.dedent('''
    """Agents that go wrong on purpose: FAULT says what, WHERE in which process, AT at which call."""
    import multiprocessing
    import os
    import signal
    import time

    import torch
    from torch import nn

    from accelbatch.agents import TorchAgent


    def here(where):
        """True in the process ``where`` names: any, rank1, hogwild-1 or data-worker."""
        name = multiprocessing.current_process().name
        if where == "data-worker":
            return torch.utils.data.get_worker_info() is not None or name == "accelbatch-async-data"
        if where == "rank1":
            return os.environ.get("RANK") == "1"
        return where == "any" or name == where


    def go_wrong(fault):
        if fault == "crash":
            raise RuntimeError(f"injected crash in {multiprocessing.current_process().name}")
        if fault == "die":
            os.kill(os.getpid(), 9)
        if fault == "hang":
            time.sleep(3600)
        if fault == "sigint":  # a stop signal that reaches this process alone
            os.kill(os.getpid(), signal.SIGINT)


    def mark_busy():
        """Create the file $FAULTY_BUSY names (once): the run is in a forward, the test may signal it."""
        path = os.environ.get("FAULTY_BUSY")
        if path and not os.path.exists(path):
            open(path, "w").close()


    class Toy(nn.Module):
        """Loss mean((w * x - 1)^2) over the rows; the agent's fault hits training forwards."""

        def __init__(self, fault, where, at):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(()))
            self.fault, self.where, self.at, self.calls = fault, where, at, 0

        def forward(self, batch):
            if self.fault == "sleepy":  # every forward, training or not: a long evaluation
                mark_busy()
                time.sleep(0.2)
            per_row = (self.w * batch["x"] - 1) ** 2
            out = {"pred": per_row.detach()}
            if self.fault == "noloss":
                return out
            out["loss"] = per_row.mean()
            if self.training and here(self.where):
                self.calls += 1
                if self.fault == "nan" and self.calls % self.at == 0:
                    out["loss"] = out["loss"] * float("nan")
                elif self.calls == self.at and self.fault == "slow":  # a step that takes an hour
                    mark_busy()
                    time.sleep(3600)
                elif self.calls == self.at:
                    go_wrong(self.fault)
            return out


    class Toy_(TorchAgent):
        FAULT, WHERE, AT = "none", "any", 3

        def build_model(self):
            return Toy(self.FAULT, self.WHERE, self.AT)

        def vectorize(self, obs):
            if self.FAULT.startswith("data-") and here("data-worker"):
                go_wrong(self.FAULT[5:])
            obs["x"] = float(len(obs.get("text", "")) % 7)
            return obs

        def batchify(self, observations):
            return {"x": torch.tensor([o["x"] for o in observations])}

        def replies(self, outputs, observations):
            return [{"text": "?"} for _ in observations]


    def _agent(name, fault, where="any", at=3):
        return type(name, (Toy_,), {"FAULT": fault, "WHERE": where, "AT": at, "__module__": __name__})


    Fine = _agent("Fine", "none")
    NoLoss = _agent("NoLoss", "noloss")
    NaNEvery3 = _agent("NaNEvery3", "nan")
    DataWorkerCrash = _agent("DataWorkerCrash", "data-crash")
    DataWorkerHang = _agent("DataWorkerHang", "data-hang")
    ReplicaCrash = _agent("ReplicaCrash", "crash", "rank1", at=2)
    ReplicaHang = _agent("ReplicaHang", "hang", "rank1", at=2)
    ReplicaDies = _agent("ReplicaDies", "die", "rank1", at=2)
    HogwildCrash = _agent("HogwildCrash", "crash", "hogwild-1", at=1)
    ReplicaSignalled = _agent("ReplicaSignalled", "sigint", "rank1", at=3)
    SlowStep = _agent("SlowStep", "slow", at=2)
    Sleepy = _agent("Sleepy", "sleepy")
''')

QUICK = ["--no-progress", "-veps", "-1", "--eval-splits", ""]  # no validation, no final evaluation


@dataclass
class Ran:
    """How a run ended, and what it left behind."""

    rc: int
    out: str
    err: str
    processes_left: set[int]
    shm_left: set[str]

    def assert_clean(self) -> None:
        assert self.processes_left == set(), f"processes left by the run: {self.processes_left}\n{self.err}"
        assert self.shm_left == set(), f"/dev/shm entries left by the run: {self.shm_left}"

    def assert_one_line_error(self, *fragments: str, rc: int = 2) -> None:
        """Bad input: exit ``rc``, one line on stderr holding every fragment, no traceback."""
        err = self.err.strip()
        assert self.rc == rc, (self.rc, err)
        assert len(err.splitlines()) == 1, err
        assert "Traceback" not in err
        for fragment in fragments:
            assert fragment in err, (fragment, err)


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Path:
    """A folder with faulty.py (the misbehaving agents) and small data files."""
    root = tmp_path_factory.mktemp("faults")
    (root / "faulty.py").write_text(FAULTY)
    for n in (1, 10):
        (root / f"qa{n}.jsonl").write_text("".join(json.dumps({"text": f"q{i}", "labels": [f"a{i}"]}) + "\n"
                                                   for i in range(n)))
    (root / "qa60.jsonl").write_text("".join(json.dumps({"text": f"question {i}", "labels": [f"a{i % 5}"]}) + "\n"
                                             for i in range(60)))
    return root


class _Sampler(threading.Thread):
    """Collects the pids of a tagged process tree while it runs, and the /dev/shm entries they map, to
    tell the run's entries from those of other programs on the machine."""

    def __init__(self, tag: str):
        super().__init__(daemon=True)
        self.tag, self.pids, self.shm, self.done = tag, set(), set(), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            pids = tagged_pids(self.tag)
            self.pids |= pids
            self.shm |= shm_mapped(pids)


def _env(lab: Path, tag: str) -> dict[str, str]:
    path = os.pathsep.join([ROOT, str(lab), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", TAG_ENV: tag}


def _leftovers(tag: str, grace_s: float = 5.0) -> set[int]:
    """Tagged processes still alive after ``grace_s``; they are killed (the test fails on them anyway)."""
    deadline = time.monotonic() + grace_s
    left = tagged_pids(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = tagged_pids(tag)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def start(lab: Path, *argv: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, _Sampler, set[str]]:
    """Start ``python -m accelbatch argv`` with a fresh tag (and ``env``), in a session (and process group) of
    its own; return it with what :func:`finish` needs."""
    tag = uuid.uuid4().hex
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, "-m", "accelbatch", *argv], cwd=str(lab),
                            env={**_env(lab, tag), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    sampler = _Sampler(tag)
    sampler.start()
    return proc, tag, sampler, shm_before


def finish(proc: subprocess.Popen, tag: str, sampler: _Sampler, shm_before: set[str],
           timeout: float = 60) -> Ran:
    """Wait for the run and collect what it left behind."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        sampler.done.set()
        sampler.join()
    left = _leftovers(tag)
    return Ran(proc.returncode, out, err, left, shm_left(shm_before, sampler.pids | {proc.pid}, seen=sampler.shm))


def cli(lab: Path, *argv: str, timeout: float = 60) -> Ran:
    """``python -m accelbatch argv`` in a subprocess, as a user runs it."""
    return finish(*start(lab, *argv), timeout=timeout)


def in_process(lab: Path, capsys, monkeypatch, *argv: str) -> Ran:
    """``cli.main(argv)`` here: for bad input, which must end before any process is started."""
    monkeypatch.syspath_prepend(str(lab))
    shm_before, children = set(os.listdir("/dev/shm")), {pid for pid, _ in live_children()}
    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse
        rc = exc.code
    out, err = capsys.readouterr()
    left = {pid for pid, _ in live_children()} - children  # new processes (one that was there and changed state is not)
    # this process's entries alone: the other pytest worker's runs make and hold their own meanwhile
    return Ran(rc, out, err, left, shm_left(shm_before, {os.getpid()}, settle_s=0.0, seen=shm_mapped({os.getpid()})))


def _report(ran: Ran, path: Path) -> dict:
    assert ran.rc == 0, ran.err
    return json.loads(path.read_text())


# --- bad input: one line, exit 2 ----------------------------------------------------------------------
BAD_FILES = {
    "bad-json-line": ("jsonl", '{"text": "ok", "labels": ["a"]}\n{"text": "broken"\n', ":2: not valid JSON"),
    "parlai-line-no-text": ("parlai", "text:a\tlabels:b\tepisode_done:True\nepisode_done:True\n",
                            ":2: no text: and no labels: field"),
    "parlai-field-not-key-value": ("parlai", "text:a\tlabels:b\nhello\tlabels:c\n", ":2: field 1 'hello'"),
    "parlai-bad-episode-done": ("parlai", "text:a\tlabels:b\tepisode_done:True\ntext:oops\tepisode_done:maybe\n",
                                ":2:"),
    "empty": ("jsonl", "\n\n", ": the file holds no examples"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_malformed_or_empty_data_file_is_one_line_naming_file_and_line(lab, capsys, monkeypatch, tmp_path,
                                                                         case):
    kind, content, fragment = BAD_FILES[case]
    path = tmp_path / f"data.{kind}"
    path.write_text(content)
    ran = in_process(lab, capsys, monkeypatch, "eval", "-t", f"{kind}:{path}", "-m", "repeat_label",
                     "--no-progress")
    ran.assert_one_line_error(f"{path}{fragment}")
    ran.assert_clean()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", [["-dt", "train:stream", "--num-workers", "1"], ["-dt", "train:stream", "-nt", "2"]],
                         ids=["read-by-a-data-worker", "read-by-a-hogwild-process"])
@pytest.mark.slow
def test_a_malformed_line_met_in_another_process_is_still_one_line(lab, tmp_path, where):
    """Streamed, the file is read where the batches are made; the error is the same one line."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok", "labels": ["a"]}\n{"text": \n')
    ran = cli(lab, "train", "-t", f"jsonl:{path}", "-m", "faulty:Fine", "-tstep", "3", *where, *QUICK)
    ran.assert_one_line_error(f"{path}:2: not valid JSON", "each line must be one JSON object")
    ran.assert_clean()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv, fragments", [
    (["eval", "-t", "jsonl:/no/such/file.jsonl"], ["/no/such/file.jsonl: no such file", "-t"]),
    (["train", "-bs", "abc"], ["-bs/--batchsize: invalid int value: 'abc'", "--help"]),
    (["train", "--learning-rate", "x"], ["-lr/--learning-rate: invalid float value: 'x'"]),
    (["train", "-rf", "two"], ["-rf/--replication-factor: invalid int value: 'two'"]),
    (["train", "-bs", "0"], ["-bs/--batchsize: must be at least 1, got 0"]),
    (["train", "--learning-rate", "-1"], ["-lr/--learning-rate: must be a positive number"]),
    (["train", "--replica-timeout-s", "0"], ["--replica-timeout-s: must be a positive number"]),
    (["train", "--device", "tpu"], ["--device: invalid choice: 'tpu'", "'cpu', 'cuda', 'ipu'"]),
    (["train", "-t", "nosuchtask"], ["unknown task 'nosuchtask'", "known tasks: babi:1"]),
    (["train", "-m", "nosuchmodel"], ["unknown model 'nosuchmodel'", "known models: memnn"]),
    (["train", "-t", "nosuchmodule:Teacher"], ["no module named 'nosuchmodule'"]),
    (["train", "-m", "faulty:NoSuchAgent"], ["module 'faulty' has no 'NoSuchAgent'"]),
    (["train", "--output-mode", "everyn", "--output-return-period", "3", "-di", "4"],
     ["--output-return-period 3", "not a multiple of 3", "--device-iterations"]),
    (["train", "-m", "faulty:NoLoss"], ["must return a dict with 'loss'"]),
    (["train", "-mf", "/proc/nope/model.pt"], ["-mf/--model-file: cannot write /proc/nope/model.pt", "/proc/nope"]),
    (["train", "--report-json", "/proc/nope/r.json"], ["--report-json: cannot write /proc/nope/r.json"]),
    (["train", "--metrics-log", "/proc/nope/m.jsonl"], ["--metrics-log: cannot write /proc/nope/m.jsonl"]),
    (["train", "--tensorboard-logdir", "/proc/nope"], ["--tensorboard-logdir: cannot write /proc/nope"]),
    (["train", "-mf", "/"], ["-mf/--model-file: / exists and is not a file"]),
    (["train", "--report-json", "/proc/version"], ["its folder /proc: no file can be made there"]),
], ids=["missing-file", "bs-abc", "lr-x", "rf-two", "bs-0", "lr-negative", "replica-timeout-0", "device-tpu",
        "unknown-task", "unknown-model", "unknown-module", "unknown-class", "impossible-plan", "no-loss",
        "model-file-unwritable", "report-json-unwritable", "metrics-log-unwritable", "tensorboard-unwritable",
        "model-file-a-folder", "report-json-in-proc"])
def test_bad_options_and_unknown_names_are_one_line(lab, capsys, monkeypatch, argv, fragments):
    verb, *options = argv  # a -t in the case's options overrides the default one before it
    quick = ["-tstep", "2", *QUICK] if verb == "train" else ["--no-progress"]  # eval takes no training option
    ran = in_process(lab, capsys, monkeypatch, verb, "-t", f"jsonl:{lab}/qa10.jsonl", "-bs", "2", *options, *quick)
    ran.assert_one_line_error(*fragments)
    ran.assert_clean()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", [["--dynamic-batching", "batchsort"], ["--num-workers", "1"],
                                  ["--dataloader-mode", "async"], ["-nt", "2"], ["-rf", "2"]],
                         ids=["loader", "workers", "async", "hogwild", "replicas"])
@pytest.mark.parametrize("bad, fragment", [
    (["--context-length", "-5"], "--context-length: must be at least 1, or -1 (all of the history), got -5"),
    (["--embedding-size", "-5"], "-esz/--embedding-size: must be at least 1, got -5"),
    (["--batch-sort-cache-size", "0"], "--batch-sort-cache-size: must be at least 1, got 0"),
    (["--num-workers", "-1"], "--num-workers: must be 0 or more, got -1"),
    (["--buffer-size", "0"], "--buffer-size: must be at least 1, got 0"),
], ids=["context-length", "embedding-size", "batch-sort-cache-size", "num-workers", "buffer-size"])
def test_a_bad_value_is_one_line_before_any_work_on_every_path(lab, capsys, monkeypatch, path, bad, fragment):
    """Options are checked when they are read, before a loader, worker, replica or hogwild process starts
    (in_process fails on any process started). Before: --embedding-size -5 was a traceback from torch,
    --batch-sort-cache-size 0 a ValueError traceback from data/batching.py."""
    ran = in_process(lab, capsys, monkeypatch, "train", "-t", f"jsonl:{lab}/qa10.jsonl", "-bs", "2", *path, *bad,
                     "-tstep", "2", *QUICK)
    ran.assert_one_line_error(fragment)
    ran.assert_clean()


@pytest.mark.timeout(30)
def test_an_unusable_device_is_one_line_listing_the_usable_ones(lab, capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    ran = in_process(lab, capsys, monkeypatch, "train", "--device", "cuda", "--no-progress")
    ran.assert_one_line_error("--device cuda", "Usable here: cpu")
    ran.assert_clean()


# --- a batch larger than the data ---------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("examples, extra", [(10, []), (10, ["--num-workers", "1"]), (1, ["-rf", "2"])],
                         ids=["world", "data-workers", "replicas-one-example"])
@pytest.mark.slow
def test_eval_with_a_batch_larger_than_the_split_serves_every_example_once(lab, tmp_path, capsys, monkeypatch,
                                                                           examples, extra):
    """With one example and two replicas, replica 1's shard is empty. (Gradient accumulation in eval is
    refused: tests/test_run_cli.py.)"""
    report = tmp_path / "r.json"
    argv = ["eval", "-t", f"jsonl:{lab}/qa{examples}.jsonl", "-m", "repeat_label", "-bs", "64", *extra,
            "--no-progress", "--report-json", str(report)]
    starts_processes = "--num-workers" in extra or "-rf" in extra
    ran = cli(lab, *argv) if starts_processes else in_process(lab, capsys, monkeypatch, *argv)
    valid = _report(ran, report)["valid"]
    assert valid["exs"] == examples and valid["accuracy"] == 1.0  # each once: a repeat would be counted
    ran.assert_clean()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, rows", [([], 10), (["-ga", "3"], 12), (["-nt", "2"], 5)],
                         ids=["world", "grad-accumulation", "hogwild"])
def test_training_with_a_batch_larger_than_the_split_takes_the_rows_the_data_fills(lab, tmp_path, capsys,
                                                                                   monkeypatch, extra, rows):
    """Each row serves whole episodes: rows past the 10 episodes would repeat them in the same step (a teacher
    and agent clone each). -bs comes down to what the data fills, said in one line: 10 rows; with -ga 3 the
    rows come in threes (-bs 4, 12 rows); each of two hogwild processes serves 5 episodes. The same with a
    data worker building the steps (a performance option changes nothing)."""
    report = tmp_path / "r.json"
    common = ["train", "-t", f"jsonl:{lab}/qa10.jsonl", "-m", "faulty:Fine", "-bs", "64", "-ne", "1", *QUICK,
              "--report-json", str(report), *extra]
    ran = cli(lab, *common) if extra[:1] == ["-nt"] else in_process(lab, capsys, monkeypatch, *common)
    fitted = rows // 3 if "-ga" in extra else rows
    said = (f"accelbatch: -bs 64: a step of {64 * (3 if '-ga' in extra else 1)} rows is more than the "
            f"{10 if '-nt' not in extra else 5} episodes of -t jsonl:{lab}/qa10.jsonl (train)")
    assert said in ran.err and f"using -bs {fitted} ({rows} rows)" in ran.err, ran.err
    assert ("the fewest, in multiples of D x R x G = 3, that serve every episode in one step" in ran.err) \
        == ("-ga" in extra), ran.err
    train = _report(ran, report)["train"]
    assert train["steps"] == (2 if "-nt" in extra else 1), train  # hogwild: one parley per process
    assert train["exs"] == (10 if "-nt" in extra else rows), train
    ran.assert_clean()
    if not extra:
        ran = cli(lab, *common, "--num-workers", "1")
        assert _report(ran, report)["train"]["exs"] == rows
        ran.assert_clean()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("task, said", [("babi:9", "choose one of babi:1, babi:2"),
                                        ("reverse:0", "'reverse:N' with N >= 1"),
                                        ("dialogues:x", "'dialogues:N' with N >= 1")])
def test_a_generated_task_with_an_argument_it_cannot_take_is_one_line(lab, capsys, monkeypatch, task, said):
    ran = in_process(lab, capsys, monkeypatch, "train", "-t", task, "-tstep", "1", *QUICK)
    ran.assert_one_line_error(f"-t {task}", said)
    ran.assert_clean()


@pytest.mark.timeout(60)
def test_a_batch_already_the_fewest_rows_that_serve_every_episode_is_kept_without_a_note(lab, tmp_path, capsys,
                                                                                          monkeypatch):
    """-bs 4 -ga 3 on 10 episodes: 12 rows, more than the episodes, but -bs 3 (9 rows) would leave one out
    of the step, so -bs stays 4 and nothing is said."""
    report = tmp_path / "r.json"
    ran = in_process(lab, capsys, monkeypatch, "train", "-t", f"jsonl:{lab}/qa10.jsonl", "-m", "faulty:Fine",
                     "-bs", "4", "-ga", "3", "-ne", "1", *QUICK, "--report-json", str(report))
    assert "using -bs" not in ran.err and "can fill" not in ran.err, ran.err
    assert _report(ran, report)["train"]["exs"] == 12
    ran.assert_clean()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_huge_batch_costs_no_more_memory_than_the_data(tmp_path):
    """Peak RSS of a run with -bs 100000 on babi:1 (1000 training episodes) within 2x of one with -bs 32
    (before: a teacher and agent clone per row, 820 MB at -bs 20000 against 340 MB at -bs 32)."""
    # a fresh parent per run: its RUSAGE_CHILDREN peak is that run's alone (this process's holds every test's)
    measure = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss if code == 0 else -code)")
    peaks = {}
    for bs in (32, 100000):
        proc = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "accelbatch", "train", "-t",
                               "babi:1", "-bs", str(bs), "-tstep", "2", *QUICK], cwd=str(tmp_path),
                              capture_output=True, text=True, timeout=240,
                              env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
        peaks[bs] = int(proc.stdout.split()[-1])  # KiB
        assert peaks[bs] > 0, proc.stderr
    assert peaks[100000] <= 2 * peaks[32], peaks


@pytest.mark.timeout(60)
def test_training_a_batch_plan_with_no_full_batch_says_why_in_one_line(lab, capsys, monkeypatch):
    ran = in_process(lab, capsys, monkeypatch, "train", "-t", f"jsonl:{lab}/qa10.jsonl", "-m", "faulty:Fine",
                     "-bs", "64", "-ne", "1", *QUICK, "--dynamic-batching", "batchsort")
    ran.assert_clean()
    ran.assert_one_line_error("no full batch of 64 rows", "--batchsize", "--no-drop-last")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_training_more_replicas_than_examples_fits_the_batch_and_trains(lab, tmp_path):
    """Replicas read their rows of one schedule, whose rows go on into the next epoch: one episode feeds two
    replicas; -bs 4 (8 rows) comes down to -bs 1 (2 rows, one per replica)."""
    report = tmp_path / "r.json"
    ran = cli(lab, "train", "-t", f"jsonl:{lab}/qa1.jsonl", "-m", "faulty:Fine", "-bs", "4", "-rf", "2",
              "-tstep", "2", *QUICK, "--report-json", str(report))
    assert "using -bs 1 (2 rows)" in ran.err, ran.err
    assert _report(ran, report)["train"]["exs"] == 4  # 2 steps x 2 rows
    ran.assert_clean()


# --- NaN losses ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_nan_loss_stops_naming_skip_nan_and_skip_nan_counts_and_goes_on(lab, tmp_path, capsys, monkeypatch):
    argv = ["train", "-t", f"jsonl:{lab}/qa60.jsonl", "-m", "faulty:NaNEvery3", "-bs", "4", "-tstep", "7", *QUICK]
    ran = cli(lab, *argv)
    ran.assert_one_line_error("non-finite training loss", "--skip-nan", rc=1)
    ran.assert_clean()
    report = tmp_path / "r.json"
    ran = in_process(lab, capsys, monkeypatch, *argv, "--skip-nan", "--report-json", str(report))
    train = _report(ran, report)["train"]
    assert train["steps"] == 7 and train["skipped_updates"] == 2  # calls 3 and 6
    ran.assert_clean()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_nan_loss_in_replicas_is_the_same_one_line(lab):
    """Under -rf 2 the replica's NonFiniteLoss ends the run as in one process: one line naming --skip-nan."""
    ran = cli(lab, "train", "-t", f"jsonl:{lab}/qa60.jsonl", "-m", "faulty:NaNEvery3", "-bs", "4", "-tstep", "7",
              "-rf", "2", *QUICK)
    ran.assert_one_line_error("non-finite training loss", "--skip-nan", rc=1)
    ran.assert_clean()


# --- crashes and hangs in other processes -------------------------------------------------------------
def _assert_child_traceback(ran: Ran, *fragments: str) -> None:
    """Exit 1; the failing process's traceback (down to the injected fault) is shown, the main process's
    own stack is not."""
    assert ran.rc == 1, ran.err
    assert ran.err.startswith("accelbatch: error: "), ran.err
    assert "in go_wrong" in ran.err and "faulty.py" in ran.err
    assert ran.err.count("Traceback (most recent call last)") == 1, ran.err  # not the main process's too
    for fragment in fragments:
        assert fragment in ran.err, (fragment, ran.err)


DATA_PROCESSES = [["--num-workers", "1"], ["--dataloader-mode", "async"],
                  ["--dataloader-mode", "async", "--num-workers", "2"]]
DATA_PROCESS_IDS = ["workers", "async", "async-workers"]


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", DATA_PROCESSES, ids=DATA_PROCESS_IDS)
def test_a_crashing_data_worker_shows_its_traceback(lab, mode):
    ran = cli(lab, "train", "-t", f"jsonl:{lab}/qa60.jsonl", "-m", "faulty:DataWorkerCrash", "-bs", "4",
              "-tstep", "5", *mode, *QUICK)
    _assert_child_traceback(ran, "a data worker", "RuntimeError: injected crash in", "in vectorize")
    ran.assert_clean()


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", DATA_PROCESSES, ids=DATA_PROCESS_IDS)
def test_a_hanging_data_worker_times_out_naming_the_option(lab, mode):
    ran = cli(lab, "train", "-t", f"jsonl:{lab}/qa60.jsonl", "-m", "faulty:DataWorkerHang", "-bs", "4",
              "-tstep", "5", "--data-timeout-s", "0.5", *mode, *QUICK)
    ran.assert_one_line_error("--data-timeout-s", rc=1)
    ran.assert_clean()


def _two_replicas(lab: Path, model: str, *extra: str) -> Ran:
    """Six training steps of ``faulty:<model>`` on two gloo replicas, through the CLI."""
    return cli(lab, "train", "-t", f"jsonl:{lab}/qa60.jsonl", "-m", f"faulty:{model}", "-bs", "2", "-rf", "2",
               "-tstep", "6", *extra, *QUICK)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_crashing_replica_ends_the_run_with_its_traceback(lab):
    ran = _two_replicas(lab, "ReplicaCrash")
    _assert_child_traceback(ran, "replica 1 of 2", "raised first", "RuntimeError: injected crash in")
    ran.assert_clean()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_replica_killed_mid_run_is_a_clear_error_not_a_hang(lab):
    begun = time.monotonic()
    ran = _two_replicas(lab, "ReplicaDies", "--replica-timeout-s", "30")
    assert ran.rc == 1 and "Traceback" not in ran.err, ran.err
    first = ran.err.splitlines()[0]
    assert first.startswith("accelbatch: error: replica 1 of 2") and "was killed by SIGKILL" in first, ran.err
    assert time.monotonic() - begun < 25  # the survivor did not wait out --replica-timeout-s
    ran.assert_clean()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_hanging_replica_is_named_after_replica_timeout_s(lab):
    begun = time.monotonic()
    ran = _two_replicas(lab, "ReplicaHang", "--replica-timeout-s", "2")
    assert ran.rc == 1, ran.err
    first = ran.err.splitlines()[0]
    assert first.startswith("accelbatch: error: replica 1 of 2") and "is stuck" in first, first
    assert "--replica-timeout-s=2 s" in first and "raise --replica-timeout-s" in first
    assert "Where replica 1 is" in ran.err and "in go_wrong" in ran.err  # its stack: where it hangs
    assert time.monotonic() - begun < 40
    ran.assert_clean()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_crashing_hogwild_process_shows_its_traceback(lab):
    ran = cli(lab, "train", "-t", f"jsonl:{lab}/qa60.jsonl", "-m", "faulty:HogwildCrash", "-bs", "2", "-nt", "2",
              "-tstep", "6", *QUICK)
    _assert_child_traceback(ran, "hogwild process 1", "RuntimeError: injected crash in hogwild-1")
    ran.assert_clean()


# --- signals --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_stop_signal_reaching_one_replica_stops_all_at_the_same_step(lab, tmp_path):
    """Only replica 1 gets SIGINT (a signal sent to one process, or one delivered a step later than the other's):
    the replicas still agree to save and stop at one step, instead of one waiting alone in the next step."""
    model = tmp_path / "model.pt"
    begun = time.monotonic()
    ran = _two_replicas(lab, "ReplicaSignalled", "-mf", str(model), "--save-every-n-secs", "1000")
    assert ran.rc == 130, ran.err
    assert f"checkpoint saved to {model}.ckpt; continue with --resume -mf {model}" in ran.err.strip().splitlines()[-1]
    assert "Traceback" not in ran.err and (tmp_path / "model.pt.ckpt" / "MANIFEST.json").exists()
    assert time.monotonic() - begun < 60
    ran.assert_clean()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how, to_group, extra", [
    ("SIGINT", True, ["-rf", "2"]),
    ("SIGTERM", False, ["--dataloader-mode", "async", "--num-workers", "1"]),
    ("SIGTERM", True, ["--num-workers", "2"]),
    ("SIGTERM", True, ["-nt", "2"]),  # as timeout(1) and job schedulers send it: hogwild processes died of it
], ids=["ctrl-c-in-a-terminal-replicas", "SIGTERM-async-loader-with-a-worker", "SIGTERM-to-the-group-with-workers",
        "SIGTERM-to-the-group-hogwild"])
@pytest.mark.slow
def test_a_signal_saves_a_checkpoint_and_exits_130_leaving_nothing(lab, tmp_path, how, to_group, extra):
    """A terminal's Ctrl-C reaches every process of the foreground group; ``kill`` the main one only."""
    model = tmp_path / "model.pt"
    manifest = tmp_path / "model.pt.ckpt" / "MANIFEST.json"
    run = start(lab, "train", "-t", f"jsonl:{lab}/qa60.jsonl", "-m", "faulty:Fine", "-bs", "2", "-ne", "-1",
                "-mf", str(model), "--save-every-n-secs", "0.2", *extra, *QUICK)
    proc = run[0]
    deadline = time.monotonic() + 60
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    time.sleep(0.3)  # mid-training, between checkpoints
    if to_group:
        os.killpg(proc.pid, getattr(signal, how))  # the run is a session of its own (start())
    else:
        proc.send_signal(getattr(signal, how))
    ran = finish(*run)
    assert ran.rc == 130, ran.err
    last = ran.err.strip().splitlines()[-1]
    assert last == (f"accelbatch: interrupted: {how}: checkpoint saved to {model}.ckpt; continue with --resume -mf "
                    f"{model} ({model} itself: not written yet: it is written at a validation or when training "
                    "ends)"), ran.err  # no validation ran (-veps -1): the model file does not exist yet
    assert "Traceback" not in ran.err and manifest.exists()
    ran.assert_clean()


SLOW = ["train", "-t", "jsonl:{lab}/qa60.jsonl", "-m", "faulty:SlowStep", "-bs", "2", "-tstep", "6", *QUICK]
SIGNAL_CASES = {  # where: (argv, when to signal, what stderr's last line says)
    # when: "start" 0.3 s after the start, "children" once its processes exist (they are starting up),
    # "busy" once the run is in a forward
    "startup": (["train", "-t", "jsonl:{lab}/qa60.jsonl", "-m", "faulty:Fine", "-ne", "-1", *QUICK], "start", ""),
    "startup-hogwild": ([*SLOW, "-nt", "2"], "children", ""),
    "startup-replicas": ([*SLOW, "-rf", "2", "--device", "cpu"], "children", ""),
    "mid-step": (SLOW, "busy", "the step had not ended 5 s after the signal; stopped at once, nothing saved"),
    "eval": (["eval", "-t", "jsonl:{lab}/qa60.jsonl", "-m", "faulty:Sleepy", "-bs", "1", "--no-progress"], "busy",
             "the valid evaluation stopped after"),
    "hogwild": ([*SLOW, "-nt", "2"], "busy", "stopped at once, nothing saved"),
    "replicas": ([*SLOW, "-rf", "2", "--device", "cpu"], "busy", "stopped at once, nothing saved"),
}


@pytest.mark.slow
@pytest.mark.timeout(120)
# SIGTERM takes SIGINT's path once a run has started (one handler for both): checked where they part, before
# the run starts and in a step, and SIGINT everywhere
@pytest.mark.parametrize("where, how", [
    pytest.param(where, how, id=f"{where}-{how}") for where in sorted(SIGNAL_CASES) for how in ("SIGINT", "SIGTERM")
    if how == "SIGINT" or where in ("startup", "mid-step")])
def test_a_stop_signal_ends_the_run_within_10_s_leaving_nothing(lab, tmp_path, where, how):
    """One signal, wherever the run is: at start-up (its own, or its processes'), in a step that would take
    an hour (the next safe point is too far: the run stops at once 5 s later), in an evaluation (it stops at
    its next step, saying how many examples it saw), with hogwild processes or replicas (their steps are the
    slow ones)."""
    argv, when, said = SIGNAL_CASES[where]
    busy = tmp_path / "busy"
    run = start(lab, *[a.format(lab=lab) for a in argv], env={"FAULTY_BUSY": str(busy)})
    proc, sampler = run[0], run[2]
    deadline = time.monotonic() + 90
    while proc.poll() is None and time.monotonic() < deadline and (
            when == "busy" and not busy.exists() or when == "children" and len(sampler.pids) < 3):
        time.sleep(0.05)
    time.sleep(0.3)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(getattr(signal, how))
    sent = time.monotonic()
    ran = finish(*run, timeout=30)
    took = time.monotonic() - sent
    assert took < 10, (took, ran.err)
    if when == "busy":  # past start-up the signal is handled: exit 130, one line saying what happened
        assert ran.rc == 130, ran.err
        last = ran.err.strip().splitlines()[-1]
        assert last.startswith(f"accelbatch: interrupted: {how}: ") and said in last, ran.err
        assert "Traceback" not in ran.err
    else:
        assert ran.rc != 0, ran.err
    ran.assert_clean()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_signal_to_a_run_without_model_file_says_nothing_was_saved(lab):
    run = start(lab, "train", "-t", f"jsonl:{lab}/qa60.jsonl", "-m", "faulty:Sleepy", "-bs", "2", "-ne", "-1",
                *QUICK, env={"FAULTY_BUSY": str(lab / "busy-no-mf")})
    proc = run[0]
    deadline = time.monotonic() + 60
    while not (lab / "busy-no-mf").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    ran = finish(*run)
    assert ran.rc == 130, ran.err
    assert ran.err.strip().splitlines()[-1] == "accelbatch: interrupted: SIGINT: nothing was saved (no --model-file)"
    assert "None" not in ran.err and "checkpoint saved" not in ran.err
    ran.assert_clean()

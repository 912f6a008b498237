"""Signals and dying processes at awkward moments, through the CLI.

* A run started with SIGINT ignored (a background job of a non-interactive shell: ``accelbatch ... &`` in a
  script) still stops on SIGINT at any moment with exit 130, also in its set-up (between the import and the
  run), where a model that builds slowly (here: one that waits for a file) keeps it.
* A data worker of ``--num-workers`` killed by SIGKILL ends the run with one line naming the worker and
  the signal, not torch's traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import TAG_ENV, tagged_pids

pytestmark = pytest.mark.multiprocess
ROOT = str(Path(__file__).resolve().parent.parent)

AGENTS = '''
import os, signal, time
import torch.utils.data
from accelbatch.models.bag import BagAgent

class SlowSetup(BagAgent):
    """Says it is being built (a file named by its pid), then waits up to 90 s for a file that never comes."""
    def __init__(self, *args, **kwargs):
        folder = os.environ["SLOW_SETUP_DIR"]
        open(os.path.join(folder, f"building_{os.getpid()}"), "w").close()
        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
            time.sleep(0.05)
        super().__init__(*args, **kwargs)

class KillsItsWorker(BagAgent):
    """A torch DataLoader worker kills itself by SIGKILL on the example "hello 37"."""
    def vectorize(self, obs):
        if obs.get("text") == "hello 37" and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().vectorize(obs)
'''


def _start(tmp_path: Path, args: list[str], ignore_sigint: bool = False) -> tuple[subprocess.Popen, str]:
    """``python -m accelbatch`` with the agents above importable, in a session of its own, tagged."""
    (tmp_path / "s31agents.py").write_text(AGENTS, encoding="utf-8")
    rows = [{"text": f"hello {i}", "labels": [f"a{i % 3}"], "label_candidates": ["a0", "a1", "a2"],
             "episode_done": True} for i in range(200)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "SLOW_SETUP_DIR": str(tmp_path), TAG_ENV: tag}

    def before_exec() -> None:  # as a non-interactive shell starts a background job
        signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.SIG_DFL)

    proc = subprocess.Popen([sys.executable, "-m", "accelbatch", "train", "--no-progress", "-t",
                             f"jsonl:{tmp_path / 'd.jsonl'}", *args], cwd=str(tmp_path), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=before_exec)
    return proc, tag


def _finish(proc: subprocess.Popen, tag: str, timeout_s: float) -> tuple[int | None, str, set[int]]:
    """(exit code or None when it did not end within ``timeout_s``, stderr, tagged processes left)."""
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        err = ""
    code = proc.poll()
    deadline = time.monotonic() + 10
    while tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = tagged_pids(tag)
    for pid in left | ({proc.pid} if code is None else set()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if code is None:
        err = proc.communicate()[1]
    return code, err, left


def _wait_building(folder: Path, count: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(list(folder.glob("building_*"))) < count and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None and len(list(folder.glob("building_*"))) >= count, proc.communicate()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("options, building", [([], 1), (["-rf", "2"], 2)], ids=["one-process", "replicas"])
def test_sigint_during_setup_of_a_run_started_with_sigint_ignored_exits_130(tmp_path, options, building):
    proc, tag = _start(tmp_path, ["-m", "s31agents:SlowSetup", "-ne", "1", "-bs", "4", *options],
                       ignore_sigint=True)
    _wait_building(tmp_path, building, proc)  # the model is being built: the set-up, before the run
    proc.send_signal(signal.SIGINT)  # to the main process only (as `kill -INT $!`)
    code, err, left = _finish(proc, tag, timeout_s=45)  # the model would wait 90 s
    assert code == 130, (code, err)
    assert err.strip().splitlines()[-1].startswith("accelbatch: interrupted"), err
    assert "Traceback" not in err and left == set(), (err, left)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("options, said", [
    (["--dataloader-mode", "sync"], ""),
    (["--dataloader-mode", "async"], ""),
    # inside a hogwild process or a replica the workers fork from it, as from a run's main process: their
    # death is seen at once (it was seen at --data-timeout-s, their own forkserver outliving the process)
    (["-nt", "2"], ""),
    (["-rf", "2"], r"replica \d of 2 \(pid \d+\): "),
], ids=["sync", "async", "hogwild", "replicas"])
def test_a_data_worker_killed_by_sigkill_ends_the_run_with_one_line_naming_it(tmp_path, options, said):
    proc, tag = _start(tmp_path, ["-m", "s31agents:KillsItsWorker", "-ne", "1", "-bs", "4", "--num-workers", "2",
                                  "--data-timeout-s", "200", *options])
    code, err, left = _finish(proc, tag, timeout_s=150)
    assert code == 1, (code, err)
    last = err.strip().splitlines()[-1]
    assert re.match(r"accelbatch: error: " + said + r"a data worker \(--num-workers: worker ", last), err
    assert "was killed by signal 9 (SIGKILL)" in last and "out of memory" in last, err
    assert "Traceback" not in err and left == set(), (err, left)

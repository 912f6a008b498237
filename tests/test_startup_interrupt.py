"""Ctrl-C while a run's processes start: a terminal sends SIGINT to the whole foreground process group, so it
reaches the replicas, hogwild processes and the async loader's worker while they still import torch and read
their work. The run must end as at any other moment: the main process's one line, exit 130, no traceback of
a child on the terminal, no process and no /dev/shm entry left.

Each run is ``python -m accelbatch train ...`` in a session of its own (its own process group), tagged through
its environment so that its processes are told from those of other programs on the machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from helpers import TAG_ENV, shm_left, shm_mapped, tagged_pids

pytestmark = pytest.mark.multiprocess
ROOT = str(Path(__file__).resolve().parent.parent)

# where: (options, how many of the run's own processes must have started before the signal; 0: the signal
# comes once the forkserver, which replicas, hogwild processes and the async loader's worker are forked from,
# is there: it imports torch; the processes it forks start in milliseconds)
CASES = {
    "replicas": (["-rf", "2"], 0),
    "hogwild": (["-nt", "2"], 0),
    "async-loader": (["--dataloader-mode", "async", "--num-workers", "2"], 1),
    "async-loader-forkserver": (["--dataloader-mode", "async", "--num-workers", "2"], 0),
}


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _started(tag: str) -> set[int]:
    """The run's own child processes (spawned ones, and those a forkserver forked), not multiprocessing's
    helpers (the resource tracker, the forkserver itself)."""
    return {pid for pid in tagged_pids(tag)
            if b"spawn_main" in _cmdline(pid)
            or b"forkserver" in _cmdline(pid) and b"forkserver" in _cmdline(_parent(pid))}


def _forkserver(tag: str) -> set[int]:
    return {pid for pid in tagged_pids(tag) if b"forkserver" in _cmdline(pid)}


class _Sampler(threading.Thread):
    """The pids of the tagged process tree while it runs, and the /dev/shm entries they map."""

    def __init__(self, tag: str):
        super().__init__(daemon=True)
        self.tag, self.pids, self.shm, self.done = tag, set(), set(), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            pids = tagged_pids(self.tag)
            self.pids |= pids
            self.shm |= shm_mapped(pids)


def _left(tag: str, grace_s: float = 10.0) -> set[int]:
    """Tagged processes still alive after ``grace_s`` (killed: the test fails on them anyway)."""
    deadline = time.monotonic() + grace_s
    while tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = tagged_pids(tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where, after_s", [("replicas", 0.0), ("replicas", 0.7), ("hogwild", 0.0),
                                            ("async-loader", 0.0), ("async-loader-forkserver", 0.2)])
def test_ctrl_c_while_the_processes_start_is_one_line_exit_130_leaving_nothing(tmp_path, where, after_s):
    options, processes = CASES[where]
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", TAG_ENV: tag}
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, "-m", "accelbatch", "train", "-ne", "50", "-mf", str(tmp_path / "x.pt"),
                             "--no-progress", *options], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    sampler = _Sampler(tag)
    sampler.start()
    try:
        deadline = time.monotonic() + 90
        ready = (lambda: len(_started(tag)) >= processes) if processes else (lambda: bool(_forkserver(tag)))
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None and ready(), proc.communicate()
        time.sleep(after_s)  # the forkserver is still importing torch (seconds)
        os.killpg(proc.pid, signal.SIGINT)  # the run is a session of its own: as a terminal's Ctrl-C
        sent = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        sampler.done.set()
        sampler.join()
    lines = err.strip().splitlines()
    assert proc.returncode == 130, err
    assert len(lines) == 1 and lines[0].startswith("accelbatch: interrupted"), err
    assert "Traceback" not in err and took < 30, (took, err)
    assert _left(tag) == set()
    assert shm_left(shm_before, sampler.pids | {proc.pid}, seen=sampler.shm) == set()



SIGINT_ON_IMPORT = """
import os, signal, sys

class SignalOnImport:
    # sends this process a SIGINT as the module named by SIGINT_ON_IMPORT starts importing, once
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("SIGINT_ON_IMPORT"):
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, SignalOnImport())
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry", ["python -m accelbatch", "console script"])
@pytest.mark.parametrize("module", ["numpy", "torch", "accelbatch.opts"])
def test_a_ctrl_c_while_the_program_imports_ends_it_with_one_line(tmp_path, entry, module):
    """A SIGINT while torch and the package import (the first second or so of every run) ends the program with
    one line and exit 130. "numpy" lands inside torch's own import, whose C code clears a KeyboardInterrupt
    raised there: the run then went on training (here for ever: -ne -1)."""
    (tmp_path / "sitecustomize.py").write_text(SIGINT_ON_IMPORT)
    command = ["-m", "accelbatch"] if entry == "python -m accelbatch" else \
        ["-c", "import sys; from accelbatch.__main__ import main; sys.exit(main())"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT]), "SIGINT_ON_IMPORT": module}
    ran = subprocess.run([sys.executable, *command, "train", "-t", "babi:1", "-m", "repeat_label", "-ne", "-1",
                          "--no-progress"], capture_output=True, text=True, timeout=60, env=env)
    assert (ran.returncode, ran.stderr, ran.stdout) == (
        130, "accelbatch: interrupted while starting: nothing was run\n", "")

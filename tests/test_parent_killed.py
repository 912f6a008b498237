"""A run killed by SIGKILL (the OOM killer, ``kill -9``, a scheduler's hard limit) leaves no child behind:
the kernel ends its data workers, hogwild processes, async accessor and replicas with it, within a second or
two. Without that a data worker lived on for torch's 5-second parent check, or for ever when it was blocked
writing a batch to a pipe nobody read, and hogwild processes trained on to their end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import TAG_ENV, process_table, tagged_pids, wait_for_first_checkpoint

pytestmark = pytest.mark.multiprocess
ROOT = str(Path(__file__).resolve().parent.parent)
SPAWNING = "spawning script"
SPAWNING_SCRIPT = """
import multiprocessing
import sys

if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    from accelbatch.cli import main

    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args", [
    ["--num-workers", "2"],
    ["--dataloader-mode", "async", "--num-workers", "1"],
    pytest.param(["-nt", "2"], marks=pytest.mark.slow),
    pytest.param(["-rf", "2", "--device", "cpu"], marks=pytest.mark.slow),
    # a hogwild process's data workers: they fork from it (a server of their own outlived it)
    pytest.param(["-nt", "2", "--num-workers", "1"], marks=pytest.mark.slow),
    # a script that chose the spawn start method: its data workers cannot tell which thread started them
    pytest.param([SPAWNING, "--num-workers", "2"], marks=pytest.mark.slow),
], ids=["workers", "async-accessor", "hogwild", "replicas", "hogwild-workers", "spawned-workers"])
def test_a_run_killed_by_sigkill_leaves_no_child(tmp_path: Path, args: list[str]) -> None:
    rows = [{"text": f"hello {i}", "labels": [f"a{i % 3}"], "label_candidates": ["a0", "a1", "a2"],
             "episode_done": True} for i in range(400)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", TAG_ENV: tag}
    launcher = ["-m", "accelbatch"]
    if args[0] == SPAWNING:
        (tmp_path / "spawning.py").write_text(SPAWNING_SCRIPT)
        launcher, args = [str(tmp_path / "spawning.py")], args[1:]
    proc = subprocess.Popen([sys.executable, *launcher, "train", "--no-progress", "-m", "bag", "-bs", "4",
                             "-t", f"jsonl:{tmp_path / 'd.jsonl'}", "-ne", "1000", "-vtim", "1000000",
                             "-mf", str(tmp_path / "m.pt"), "--save-every-n-secs", "0.5", *args],
                            cwd=str(tmp_path), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        wait_for_first_checkpoint(proc, tmp_path / "m.pt", max_delay_s=0.5)  # its children are at work
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        gone_by = time.monotonic() + 3.0  # torch's own check of a worker's parent runs every 5 s
        while tagged_pids(tag) and time.monotonic() < gone_by:
            time.sleep(0.05)
        left = tagged_pids(tag)
        table = process_table()
        described = {pid: (table[pid][0], table[pid][2][:120]) for pid in left if pid in table}  # parent, cmd
    finally:
        for pid in tagged_pids(tag) | ({proc.pid} if proc.poll() is None else set()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait(timeout=30)
    assert not left, f"processes {described} (parent pid, command) outlived the killed run by 3 s"


STARTS_A_SERVER = """
import sys
from multiprocessing import forkserver

from accelbatch.procs import ChildSpec, Supervisor

if __name__ == "__main__":
    with Supervisor(ChildSpec(role="child", start_method="forkserver"), print, 1) as children:  # the server is up
        while not children.wait(30):
            pass
    print(forkserver._forkserver._forkserver_pid, flush=True)
    sys.stdin.read()  # until killed
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_forkserver_ends_at_once_with_the_process_that_started_it(tmp_path: Path) -> None:
    """Children fork from the run's forkserver and end with it; the server itself, left to notice that the run
    is gone, then tore down an interpreter with torch loaded (0.9-1.5 s on a quiet machine, over 3 s under load)
    while every child lived on. It ends with the run at once (PDEATHSIG)."""
    script = tmp_path / "starts_a_server.py"
    script.write_text(STARTS_A_SERVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script)], cwd=str(tmp_path), env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(2)]  # the child's print (its index), the server's pid
        assert lines[0].strip() == "0" and lines[1].strip().isdigit(), (lines, proc.stderr.read())
        server = int(lines[1])
        assert not _gone(server)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        killed = time.monotonic()
        while not _gone(server) and time.monotonic() - killed < 10:
            time.sleep(0.01)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < 0.5, f"the forkserver outlived the process that started it by {took:.2f} s"


THREAD_STARTS_SPAWNED_WORKERS = """
import multiprocessing
import threading

import accelbatch as ab
from accelbatch.data.loader import make_loader

if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    data = [[ab.Message(text=f"hello {i}", labels=["a"], episode_done=True)] for i in range(64)]
    loader = make_loader(data, batch_size=4, num_workers=2, shuffle=False, training=False)  # built in main
    passes = []
    helper = threading.Thread(target=lambda: passes.append(sum(1 for _ in loader)))  # starts the workers
    helper.start()
    helper.join()
    passes.append(sum(1 for _ in loader))  # the helper thread has ended: the workers must not have
    print(passes, flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_spawned_workers_outlive_the_thread_that_started_them(tmp_path: Path) -> None:
    """The kernel's end-with-parent signal fires when the starting thread ends: spawned workers started by a
    helper thread must not ask for it (they were told the pid of the thread that built the loader)."""
    (tmp_path / "threads.py").write_text(THREAD_STARTS_SPAWNED_WORKERS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    ran = subprocess.run([sys.executable, str(tmp_path / "threads.py")], capture_output=True, text=True,
                         timeout=100, env=env, cwd=str(tmp_path))
    assert ran.returncode == 0 and ran.stdout.strip() == "[16, 16]", ran.stderr[-2000:]

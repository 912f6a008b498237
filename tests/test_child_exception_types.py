"""A performance option never changes which exception a script catches: the user's ``vectorize`` raising a
ValueError ends ``ab.run`` with that ValueError in one process, with data workers, with the async accessor and
with hogwild processes (the child's traceback as a note, the failure naming the process as its cause), and no
process is left behind. A KeyboardInterrupt raised by user code in a child (children ignore SIGINT, so it is
not a Ctrl-C) ends the run at once with an error naming the process, its traceback kept: no stall, no bare
"exited with code 130"."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
from helpers import live_children, shm_left

import accelbatch as ab
from accelbatch.models.bag import BagAgent
from accelbatch.proc_errors import ProcessFailure, ProcessRaised

pytestmark = [pytest.mark.multiprocess]

BAD = "q13 w"  # the one example whose vectorize raises
VALUE_MESSAGE = "the user's vectorize refuses 'q13 w'"
INTERRUPT_MESSAGE = "the user's vectorize stops at 'q13 w'"


def _pid_dir(opts) -> Path:
    """Where each process that vectorized leaves a file named by its pid: beside the task's data file."""
    return Path(opts.task.split(":", 1)[1]).parent / "pids"


class _Raising(BagAgent):
    """vectorize raises ``error`` on the example BAD; every process that vectorizes records its pid."""

    error: type[BaseException] = ValueError
    message = VALUE_MESSAGE

    def vectorize(self, obs):
        mark = _pid_dir(self.opts) / str(os.getpid())
        if not mark.exists():
            mark.touch()
        if obs.get("text") == BAD:
            raise self.error(self.message)
        return super().vectorize(obs)


class ValueErrorAgent(_Raising):
    error, message = ValueError, VALUE_MESSAGE


class InterruptAgent(_Raising):
    error, message = KeyboardInterrupt, INTERRUPT_MESSAGE


MODES = {"sync": {}, "num_workers": {"num_workers": 2}, "async": {"dataloader_mode": "async"},
         "numthreads": {"numthreads": 2}}
NAMES = {"num_workers": "a data worker (--num-workers", "async": "AsyncDataAccessor",
         "numthreads": "hogwild process"}


def _opts(tmp_path: Path, mode: str) -> ab.Opts:
    rows = [{"text": f"q{i} w", "labels": [f"a{i % 3}"], "label_candidates": ["a0", "a1", "a2"],
             "episode_done": True} for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp_path / "pids").mkdir()
    return ab.Opts(task=f"jsonl:{tmp_path / 'd.jsonl'}", datatype="train", batchsize=4, num_epochs=1,
                   eval_splits="", validation_every_n_epochs=-1, progress=False, data_timeout_s=120.0,
                   **MODES[mode])


def _assert_nothing_left(tmp_path: Path, shm_before: set[str]) -> None:
    """No child of this process, no process that vectorized (other than this one), no torch /dev/shm entry
    of theirs is left once the run has raised."""
    ran = {int(p.name) for p in (tmp_path / "pids").iterdir()} - {os.getpid()}
    assert ran or (tmp_path / "pids" / str(os.getpid())).exists()  # vectorize ran, here or in children
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (multiprocessing.active_children() or live_children()
                                           or any(os.path.exists(f"/proc/{pid}") for pid in ran)):
        time.sleep(0.1)
    assert multiprocessing.active_children() == [] and live_children() == []
    assert [pid for pid in ran if os.path.exists(f"/proc/{pid}")] == []
    assert shm_left(shm_before, ran | {os.getpid()}, seen=set()) == set()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m == "numthreads" else m for m in MODES])
def test_the_users_value_error_is_raised_as_itself_whatever_the_performance_option(tmp_path, mode):
    opts = _opts(tmp_path, mode)
    shm_before = set(os.listdir("/dev/shm"))
    with pytest.raises(ValueError) as info:
        ab.run(ab.create_world(opts, agent=ValueErrorAgent), opts)
    assert type(info.value) is ValueError and str(info.value) == VALUE_MESSAGE
    if mode != "sync":  # the process that raised it is named by the cause, its traceback is a note
        cause = info.value.__cause__
        assert isinstance(cause, ProcessRaised) and NAMES[mode] in str(cause), repr(cause)
        assert any("in vectorize" in note for note in getattr(info.value, "__notes__", ())), info.value
    _assert_nothing_left(tmp_path, shm_before)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["num_workers", "async", pytest.param("numthreads", marks=pytest.mark.slow)])
def test_a_keyboard_interrupt_raised_in_a_child_ends_the_run_at_once_naming_it(tmp_path, mode):
    opts = _opts(tmp_path, mode)
    shm_before = set(os.listdir("/dev/shm"))
    began = time.monotonic()
    with pytest.raises(ProcessFailure) as info:  # not a KeyboardInterrupt here: that would be a Ctrl-C
        ab.run(ab.create_world(opts, agent=InterruptAgent), opts)
    assert time.monotonic() - began < 30  # not --data-timeout-s (120 s)
    text = str(info.value)
    assert isinstance(info.value, ProcessRaised) and NAMES[mode] in text, text
    assert f"KeyboardInterrupt: {INTERRUPT_MESSAGE}" in text and "in vectorize" in text, text
    _assert_nothing_left(tmp_path, shm_before)

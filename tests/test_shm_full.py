"""Hogwild (-nt 2) with /dev/shm full, too small or read-only: one usage-error line naming -nt, no traceback."""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch
from helpers import live_children

from accelbatch.cli import main

TRAIN = ["train", "-t", "babi:1", "-m", "bag", "-bs", "8", "-tstep", "10", "-nt", "2"]
# what torch 2.x raises when /dev/shm is full or too small for a tensor
TORCH_ENOSPC = RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2_3>: "
                            "No space left on device (28)")


def _failing_share(monkeypatch, error: BaseException) -> list[int]:
    """Make moving a module to shared memory (what HogwildWorld does first) raise ``error``; count the calls."""
    calls: list[int] = []

    def share_memory(self):
        calls.append(1)
        raise error

    monkeypatch.setattr(torch.nn.Module, "share_memory", share_memory)
    return calls


def _no_children_left(before: list[tuple[int, str]]) -> bool:
    deadline = time.monotonic() + 10
    while live_children() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    return live_children() == before


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("error, reason", [
    (TORCH_ENOSPC, os.strerror(errno.ENOSPC)),
    (OSError(errno.EROFS, os.strerror(errno.EROFS)), os.strerror(errno.EROFS)),
], ids=["torch-no-space", "oserror-read-only"])
def test_no_shared_memory_for_the_model_is_one_line_naming_numthreads(monkeypatch, tmp_path, capsys, error, reason):
    monkeypatch.chdir(tmp_path)
    before = live_children()
    calls = _failing_share(monkeypatch, error)
    assert main(TRAIN) == 2
    err = capsys.readouterr().err
    assert calls, "the hogwild world never moved the model to shared memory"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("accelbatch: error: -nt/--numthreads 2: ")
    assert f"(/dev/shm: {reason})" in lines[0]
    assert "--shm-size" in lines[0] and "(-nt 1)" in lines[0]
    assert _no_children_left(before)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_another_runtime_error_while_sharing_keeps_its_traceback(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    before = live_children()
    _failing_share(monkeypatch, RuntimeError("a bug in the model"))
    with pytest.raises(RuntimeError, match="a bug in the model"):
        main(TRAIN)
    assert _no_children_left(before)

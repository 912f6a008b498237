"""Stack-file folders: made per supervisor, and those of parents killed without cleanup removed later."""

from __future__ import annotations

import os
import tempfile

from accelbatch import stack_files

NO_SUCH_PID = 4194305  # above Linux's largest pid_max (2**22): no process can have it


def test_folders_of_parents_that_no_longer_run_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / f"{stack_files.PREFIX}{NO_SUCH_PID}-abc"
    running = tmp_path / f"{stack_files.PREFIX}{os.getppid()}-abc"  # pytest's parent runs
    unnamed = tmp_path / f"{stack_files.PREFIX}abc"  # not one of ours by name: left alone
    for folder in (dead, running, unnamed):
        folder.mkdir()
        (folder / "0.txt").write_text("replica 0 (pid 1):\n")
    made = stack_files.make_folder(2)
    assert not dead.exists() and running.exists() and unnamed.exists()
    assert os.path.dirname(made) == str(tmp_path)
    assert os.path.basename(made).startswith(f"{stack_files.PREFIX}{os.getpid()}-")
    assert sorted(os.listdir(made)) == ["0.txt", "1.txt"]
    assert all(os.path.getsize(os.path.join(made, name)) == 0 for name in os.listdir(made))

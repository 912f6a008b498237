"""What the OS refuses while a run reads or writes files: a full device under a log, a folder made read-only
under a checkpoint, a link to a model file, data paths that are not readable regular files, a streamed file
changed mid-run, and an output folder that is a file. Each is one line, or a run that goes on."""

from __future__ import annotations

import errno
import json
import os
import types

import pytest
import torch

import accelbatch.checkpoint as ck
import accelbatch.tasks.files as files
from accelbatch.cli import main
from accelbatch.data.datasets import FileStore
from accelbatch.opts import OptionError
from accelbatch.report_table import MetricsLog
from accelbatch.run_control import check_output_paths
from accelbatch.tasks.files import DataFileError, FileIndex, load_episodes

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes (POSIX)")


# --- 1. a log that cannot be written ---------------------------------------------------------------------
@needs_dev_full
def test_metrics_log_on_a_full_device_warns_once_and_stops_writing(capsys):
    log = MetricsLog("/dev/full")
    for step in range(3):
        log.write({"split": "train", "step": step, "loss": 1.0})
    log.close()
    log.close()  # twice: still nothing raised
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert lines == [f"accelbatch: --metrics-log /dev/full: cannot write ({os.strerror(errno.ENOSPC)}); the run "
                     "goes on without it"]
    assert log.handle is None


class _FailingBoard:
    """A TensorBoard log whose disk is full: every write and close fails."""

    log_dir = "tb"

    def __init__(self) -> None:
        self.writes = 0

    def write(self, record: dict) -> None:
        self.writes += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_tensorboard_log_that_fails_warns_once_and_the_file_log_goes_on(tmp_path, capsys):
    board, path = _FailingBoard(), tmp_path / "m.jsonl"
    log = MetricsLog(str(path), tensorboard=board)
    records = [{"split": "train", "step": step, "loss": 0.5} for step in range(3)]
    for record in records:
        log.write(record)
    log.close()
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert err == ["accelbatch: --tensorboard-logdir tb: cannot write (No space left on device); the run goes "
                   "on without it"]
    assert board.writes == 1  # left off after its first failure
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{**r, "run": log.run} for r in records]


@needs_dev_full
def test_training_with_a_full_metrics_log_still_saves_the_model(tmp_path, capsys):
    model_file = tmp_path / "m.pt"
    code = main(["train", "-t", "babi:1", "-tstep", "3", "-bs", "8", "--metrics-log", "/dev/full",
                 "-mf", str(model_file), "--no-progress"])
    assert code == 0
    assert model_file.is_file()
    assert capsys.readouterr().err.count("--metrics-log /dev/full: cannot write") == 1


# --- 2. checkpoints ------------------------------------------------------------------------------------------
def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(2, 2)


def test_checkpoint_folder_refused_is_one_line_error(tmp_path, monkeypatch):
    def refuse(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(ck.os, "makedirs", refuse)
    with pytest.raises(ck.CheckpointError, match=r"m\.pt\.ckpt: cannot be written \(Permission denied\)") as exc:
        ck.save_checkpoint(tmp_path / "m.pt", model=_tiny_model())
    assert "\n" not in str(exc.value) and exc.value.__suppress_context__


def test_checkpoint_folder_unlistable_mid_run_is_one_line_error(tmp_path, monkeypatch):
    ck.save_checkpoint(tmp_path / "m.pt", model=_tiny_model())  # the folder exists: the next save lists it

    def refuse(path="."):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(ck.os, "listdir", refuse)
    with pytest.raises(ck.CheckpointError, match=r"cannot be written \(Permission denied\)"):
        ck.save_checkpoint(tmp_path / "m.pt", model=_tiny_model())
    monkeypatch.undo()
    assert ck.load_checkpoint(tmp_path / "m.pt").generation == 1  # the last good save is untouched


def test_json_file_beside_a_linked_model_file_updates_the_link_target(tmp_path):
    target, link = tmp_path / "real" / "m.pt.opt", tmp_path / "link.pt.opt"
    target.parent.mkdir()
    target.write_text(json.dumps({"old": True}))
    link.symlink_to(target)
    ck.write_json_file(str(link), {"new": 1})
    assert link.is_symlink() and os.path.realpath(link) == str(target)
    assert json.loads(target.read_text()) == {"new": 1}
    assert sorted(os.listdir(tmp_path)) == ["link.pt.opt", "real"]  # no temporary file left beside the link


# --- 3. data files ---------------------------------------------------------------------------------------------
def test_data_file_in_a_link_loop_is_one_line_error(tmp_path):
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    one.symlink_to(two)
    two.symlink_to(one)
    with pytest.raises(DataFileError) as exc:
        load_episodes(str(one), "jsonl")
    assert str(exc.value) == (f"{one}: cannot be read ({os.strerror(errno.ELOOP)}); check the file and the path "
                              "given to -t")


def test_data_file_refused_by_permissions_is_one_line_error(write_jsonl, monkeypatch):
    path = write_jsonl([{"text": "a", "labels": ["b"]}])

    def refuse(name, *args, **kwargs):  # root reads any file: the refusal is simulated
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)

    monkeypatch.setattr(files, "open", refuse, raising=False)
    with pytest.raises(DataFileError, match=r"cannot be read \(Permission denied\); check the file"):
        load_episodes(path, "jsonl")


@needs_fifo
@pytest.mark.timeout(20)  # a pipe opened to read waits for a writer: a regression hangs, not fails
@pytest.mark.parametrize("stream", [False, True])
def test_named_pipe_as_data_is_refused_not_waited_on(tmp_path, stream):
    pipe = tmp_path / "pipe.jsonl"
    os.mkfifo(pipe)  # opening it to read would wait for a writer forever
    with pytest.raises(DataFileError) as exc:
        FileIndex.build(str(pipe), "jsonl") if stream else load_episodes(str(pipe), "jsonl")
    assert str(exc.value) == f"{pipe}: not a regular file (a pipe or device); give a file of the data"


@pytest.mark.parametrize("end", ["", "\n", "\r\n"])  # an unterminated string: json says "... starting at"
def test_json_error_message_says_at_once(tmp_path, end):
    """The same message whatever ends the line (json.loads of the line with its break said "Invalid control
    character" at the break)."""
    line = '{"text": "ok", "labels": ["unterminated' + end
    with pytest.raises(json.JSONDecodeError) as parsed:
        json.loads(line.rstrip("\r\n"))
    assert parsed.value.msg == "Unterminated string starting at"  # json's own message ends with its "at"
    path = tmp_path / "bad.jsonl"
    path.write_text(line)
    with pytest.raises(DataFileError) as exc:
        load_episodes(str(path), "jsonl")
    assert f"{path}:1: not valid JSON ({parsed.value.msg} column {parsed.value.colno});" in str(exc.value)
    assert "at at" not in str(exc.value)


ROWS = [{"text": f"t{i}", "labels": [f"l{i}"]} for i in range(4)]


def _changed(path: str, how: str) -> None:
    """Change ``path`` as an editor or a copy would: append, rewrite in place (same size), or replace."""
    before = os.stat(path)
    data = open(path, encoding="utf-8").read()
    if how == "append":
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"text": "new", "labels": ["x"]}) + "\n")
    elif how == "rewrite":
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(data.replace("t0", "T0"))
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    else:  # another file, same size and time, moved over it: only the inode tells
        with open(path + ".new", "w", encoding="utf-8") as handle:
            handle.write(data.replace("t0", "T0"))
        os.utime(path + ".new", ns=(before.st_atime_ns, before.st_mtime_ns))
        os.replace(path + ".new", path)
    assert os.path.getsize(path) >= before.st_size


@pytest.mark.parametrize("how", ["append", "rewrite", "replace"])
def test_streamed_file_changed_mid_run_is_refused(write_jsonl, how):
    path = write_jsonl(ROWS)
    store = FileStore(FileIndex.build(path, "jsonl"), "t", True)
    assert store.episode(0)[0]["text"] == "t0"  # unchanged: read as indexed
    _changed(path, how)
    with pytest.raises(DataFileError) as exc:
        store.index.read(1)
    assert str(exc.value) == (f"{path} changed while the run read it (size/modified time differ from when it was "
                              "indexed); keep a run's data file unchanged until the run ends")


def test_streamed_file_unchanged_reads_every_episode(write_jsonl):
    path = write_jsonl(ROWS)
    index = FileIndex.build(path, "jsonl")
    assert [index.read(i)[0]["text"] for i in range(len(ROWS))] == [r["text"] for r in ROWS]


# --- 4. an output folder that is a file ----------------------------------------------------------------------
def _opts(**paths: str) -> types.SimpleNamespace:
    outputs = dict.fromkeys(("model_file", "report_json", "metrics_log", "tensorboard_logdir"))
    return types.SimpleNamespace(datatype="train", **{**outputs, **paths})


@pytest.mark.parametrize("option, flag, below", [("model_file", "-mf/--model-file", "m.pt"),
                                                 ("report_json", "--report-json", "sub/r.json")])
def test_output_folder_that_is_a_file_is_said_so(tmp_path, option, flag, below):
    afile = tmp_path / "afile"
    afile.write_text("")
    path = str(afile / below)
    with pytest.raises(OptionError) as exc:
        check_output_paths(_opts(**{option: path}))
    assert str(exc.value) == (f"{flag} {path}: its folder {afile} is a file, not a folder; give a path in a "
                              "folder, or move that file away")


@pytest.mark.parametrize("name", ["run.ckpt", "run.ckpt/"])
def test_a_model_file_named_as_a_checkpoint_folder_is_refused_before_training(tmp_path, name):
    """PATH.ckpt is where a run's checkpoints go: training into it wrote them there and then failed to write the
    model file over that folder, after the whole run."""
    path = str(tmp_path / name)
    with pytest.raises(OptionError) as exc:
        check_output_paths(_opts(model_file=path))
    assert str(exc.value).startswith(f"-mf/--model-file {path}: a training run writes its checkpoints to PATH.ckpt")
    assert str(exc.value).endswith(f"give the model file's own path ({tmp_path / 'run'})")
    check_output_paths(types.SimpleNamespace(**{**vars(_opts(model_file=path)), "datatype": "valid"}))  # reads it


# --- 5. two outputs that are one file -------------------------------------------------------------------------
@pytest.mark.parametrize("other, name", [("--report-json", "m.pt"), ("--metrics-log", "m.pt"),
                                         ("--metrics-log", "m.pt.trainstats"), ("--report-json", "m.pt.opt")])
def test_two_outputs_writing_one_file_are_refused_before_the_run(tmp_path, capsys, other, name):
    """-mf m.pt --report-json m.pt ended with exit 0 and the report in place of the trained model."""
    model_file, given = tmp_path / "m.pt", str(tmp_path / name)
    model_file.write_bytes(b"an earlier model")
    quiet = ["--no-progress", "--eval-splits", "", "-veps", "-1"]
    assert main(["train", "-t", "babi:1", "-m", "bag", "-tstep", "1", "-mf", str(model_file), other, given,
                 *quiet]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert err == (f"accelbatch: error: {other} {given} and -mf/--model-file {model_file} both write {given}, so "
                   "one would replace the other; give them different paths"), err
    assert model_file.read_bytes() == b"an earlier model"


def test_an_ipu_cache_dir_that_cannot_be_made_is_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(OptionError) as exc:
        check_output_paths(_opts(ipu_cache_dir=str(afile / "cache")))
    assert str(exc.value) == (f"--ipu-cache-dir {afile / 'cache'}: its folder {afile} is a file, not a folder; give "
                              "a path in a folder, or move that file away")


def test_outputs_written_in_place_or_folders_may_be_shared(tmp_path):
    # a device or pipe is written in place, and a folder holds each output's own files: nothing is replaced
    check_output_paths(_opts(report_json=os.devnull, metrics_log=os.devnull))
    check_output_paths(_opts(tensorboard_logdir=str(tmp_path / "out"), ipu_cache_dir=str(tmp_path / "out")))
    with pytest.raises(OptionError, match="both write"):  # a regular file is replaced by each
        check_output_paths(_opts(report_json=str(tmp_path / "r"), metrics_log=str(tmp_path / "r")))

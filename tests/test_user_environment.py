"""What a user's shell and file system do around a run: a `~` the shell left, a -mf reached through a link, a
path ending with / or too long for its companion files, an output that a reader left (`| head -1`) or a full
disk refuses, a locale that cannot encode the data, a closed standard input."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from accelbatch.cli import main
from accelbatch.opts import OptionError, build_parser
from accelbatch.run_control import ModelFileLock

QUIET = ["--no-progress", "--eval-splits", "", "-veps", "-1"]
TINY = ["train", "-t", "babi:1", "-m", "bag", "-esz", "8", "-bs", "4", "-tstep", "2"]


def test_a_home_folder_the_shell_left_unexpanded_is_expanded(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    parsed = build_parser().parse_args(["--model-file=~/m.pt", "--metrics-log", "~/log.jsonl", "-dp", "~/data"])
    assert (parsed.model_file, parsed.metrics_log, parsed.datapath) == \
        tuple(str(tmp_path / "home" / name) for name in ("m.pt", "log.jsonl", "data"))
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--model-file=~/m.pt", "--report-json", "~/r.json", *QUIET]) == 0  # was a traceback
    assert (tmp_path / "home" / "m.pt").is_file() and (tmp_path / "home" / "r.json").is_file()
    assert not (tmp_path / "~").exists()


def test_a_second_run_reaching_the_model_file_through_a_link_is_refused(tmp_path):
    (tmp_path / "m.pt").write_bytes(b"")
    (tmp_path / "link.pt").symlink_to(tmp_path / "m.pt")
    first = ModelFileLock(str(tmp_path / "m.pt"))
    try:
        with pytest.raises(OptionError, match=r"link\.pt: another training run \(pid \d+\) is writing it now"):
            ModelFileLock(str(tmp_path / "link.pt"))
    finally:
        first.release()


def test_a_model_file_ending_with_a_slash_or_too_long_for_its_companions_is_refused_before_training(tmp_path,
                                                                                                    capsys):
    assert main([*TINY, "-mf", f"{tmp_path}/newdir/", *QUIET]) == 2  # was FileNotFoundError: 'newdir/.lock'
    assert capsys.readouterr().err == (f"accelbatch: error: -mf/--model-file {tmp_path}/newdir/: names a folder "
                                       "(it ends with /); give the path of a file in it\n")
    assert main([*TINY, "--metrics-log", f"{tmp_path}/logs/", *QUIET]) == 2
    assert "--metrics-log" in capsys.readouterr().err
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    name = "m" * (limit - 3) + ".pt"  # fits, but PATH.trainstats would not: it failed after the training
    assert main([*TINY, "-mf", str(tmp_path / name), *QUIET]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"is too long: with the files written beside it (.trainstats.tmp-4194304) it " \
        f"passes the {limit} bytes a file name may have here" in err[0], err
    assert not list(tmp_path.glob("m*"))


class _ReaderGone(io.StringIO):
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


class _DiskFull(io.StringIO):
    def write(self, text):
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("stream, said", [(_ReaderGone, ""), (_DiskFull, "accelbatch: the standard output cannot "
                                          "be written (No space left on device); the run goes on without it\n")])
def test_an_output_that_cannot_be_written_never_stops_the_run(stream, said, tmp_path, monkeypatch, capsys):
    """`accelbatch train ... --display-examples | head -1` died at the first step, unsaved (BrokenPipeError)."""
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", stream())
    model = tmp_path / "m.pt"
    assert main([*TINY, "--display-examples", "-mf", str(model), *QUIET]) == 0
    assert model.is_file()
    assert capsys.readouterr().err == said


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_reader_that_stops_reading_ends_the_listing_quietly(tmp_path):
    listing = subprocess.run(f"{sys.executable} -m accelbatch display-data -t babi:1 -n 2000 | head -1",
                             shell=True, capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert listing.stdout.count("\n") == 1 and listing.stderr == ""


def test_text_a_locale_cannot_encode_is_printed_as_escapes(tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "café 中文", "labels": ["oui"], "episode_done": true}\n', encoding="utf-8")
    raw = io.BytesIO()
    latin = io.TextIOWrapper(raw, encoding="ascii", errors="surrogateescape")  # a C locale without UTF-8 mode
    monkeypatch.setattr(sys, "stdout", latin)
    assert main(["display-data", "-t", f"jsonl:{data}", "-n", "1", "--no-progress"]) == 0  # a UnicodeEncodeError
    latin.flush()
    assert "caf\\xe9 \\u4e2d\\u6587" in raw.getvalue().decode("ascii")


def test_interactive_with_its_input_closed_says_so(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["interactive", "-t", "babi:1", "-m", "repeat_label", "--no-progress"]) == 2  # an AttributeError
    assert capsys.readouterr().err == ("accelbatch: error: interactive reads the messages from standard input, which "
                                       "is closed; give it a terminal or a file (accelbatch interactive ... < "
                                       "messages.txt)\n")


@pytest.mark.parametrize("where", ["stderr", "both"])
def test_a_standard_error_that_cannot_be_written_never_stops_the_run(where, tmp_path, monkeypatch):
    """`accelbatch train ... > log 2>&1` on a full disk, or `2>&1 | head`: the notes and the bar failed."""
    monkeypatch.setattr(sys, "stderr", _DiskFull())
    if where == "both":
        monkeypatch.setattr(sys, "stdout", _ReaderGone())
    model = tmp_path / "m.pt"
    assert main([*TINY, "--progress", "--display-examples", "-mf", str(model), "--eval-splits", "", "-veps",
                 "-1"]) == 0
    assert model.is_file()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_training_piped_to_head_with_its_errors_saves_its_model(tmp_path):
    run = subprocess.run(f"{sys.executable} -m accelbatch {' '.join(TINY)} -tstep 30 --progress --display-examples "
                         f"-mf {tmp_path}/m.pt --eval-splits '' 2>&1 | head -c 100", shell=True, capture_output=True,
                         text=True, timeout=100, cwd=tmp_path)
    assert len(run.stdout) == 100 and (tmp_path / "m.pt").is_file()

"""An option given that the run's other options leave unread is said in one line (it ran identically, with
no word); the same option where it is read is not."""

from __future__ import annotations

import json

import pytest

from accelbatch.cli import main
from accelbatch.opts import Opts
from accelbatch.unused_options import READERS, unused_option_notes

BASE = ["-t", "babi:1", "-m", "bag", "-tstep", "4", "-bs", "4", "--no-progress", "--eval-splits", "valid",
        "-vme", "20", "-veps", "-1", "-ltim", "-1"]
SCORES = ("accuracy", "f1", "loss", "exs")


def _train(tmp_path, capsys, *extra: str) -> tuple[dict, list[str]]:
    capsys.readouterr()
    report = tmp_path / "r.json"
    assert main(["train", *BASE, "--report-json", str(report), *extra]) == 0
    got = json.loads(report.read_text())
    notes = [line for line in capsys.readouterr().err.splitlines() if "not used by this run" in line]
    return {split: {k: got[split][k] for k in SCORES} for split in ("train", "valid")}, notes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, flag", [
    (["--num-buckets", "3"], "--num-buckets"),
    (["--max-batch-tokens", "50"], "--max-batch-tokens"),
    (["--batch-sort-cache-size", "10"], "--batch-sort-cache-size"),
    (["--buffer-size", "7"], "--buffer-size"),
    (["--data-timeout-s", "5"], "--data-timeout-s"),
    (["--beam-size", "3"], "--beam-size"),
    (["-vp", "3"], "-vp/--validation-patience"),
    (["-vcut", "0.5"], "-vcut/--validation-cutoff"),
    (["--replica-timeout-s", "5"], "--replica-timeout-s"),
    (["--beam-min-length", "3"], "--beam-min-length"),  # -m bag ranks candidates: it generates nothing
    (["--skip-generation"], "--skip-generation"),
])
def test_an_option_the_run_does_not_read_is_said_and_changes_nothing(extra, flag, tmp_path, capsys):
    plain, notes = _train(tmp_path, capsys)
    assert notes == []
    given, notes = _train(tmp_path, capsys, *extra)
    assert given == plain  # not read: the run is the same
    said = f"accelbatch: {flag}: not used by this run: it is read only with "
    assert len(notes) == 1 and notes[0].startswith(said), notes


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_option_read_by_the_run_is_not_said(tmp_path, capsys):
    _, notes = _train(tmp_path, capsys, "-dynb", "buckets", "--num-buckets", "3", "--max-batch-tokens", "80",
                      "--dataloader-mode", "async", "--buffer-size", "2", "--data-timeout-s", "30")
    assert notes == []


@pytest.mark.parametrize("name", sorted(READERS))
def test_each_reader_reads_where_its_note_says(name):
    """The conditions, option by option: unread at the defaults, read under the options the note names."""
    generator = {"model": "transformer/generator"}
    reading = {"num_buckets": {"dynamic_batching": "buckets"}, "max_batch_tokens": {"dynamic_batching": "full"},
               "batch_sort_cache_size": {"dynamic_batching": "batchsort"}, "buffer_size": {"dataloader_mode": "async"},
               "data_timeout_s": {"num_workers": 1}, "beam_size": {"inference": "beam", **generator},
               "replica_timeout_s": {"replication_factor": 2}, "validation_patience": {"validation_every_n_secs": 5},
               "validation_cutoff": {"validation_every_n_epochs": 0.5}, "inference": generator,
               "beam_min_length": generator, "skip_generation": generator, "beam_block_ngram": generator}[name]
    unread = Opts(validation_every_n_epochs=-1)  # -m memnn: a ranker
    assert len(unused_option_notes(unread, {name})) == 1
    assert unused_option_notes(unread.replace(**reading), {name}) == []


def test_a_replica_other_than_rank_0_says_nothing(tmp_path, capsys, monkeypatch):
    """torchrun runs the command in every replica: the notes are said once, by rank 0."""
    monkeypatch.setattr("accelbatch.cli._first_replica", lambda: False)
    _, notes = _train(tmp_path, capsys, "--num-buckets", "3")
    assert notes == []


@pytest.mark.parametrize("env, first", [({}, True), ({"RANK": "1"}, True), ({"RANK": "0", "WORLD_SIZE": "2"}, True),
                                        ({"RANK": "1", "WORLD_SIZE": "2"}, False)])
def test_the_first_replica_is_torchruns_rank_0_or_a_plain_run(env, first, monkeypatch):
    from accelbatch.cli import _first_replica

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _first_replica() is first  # RANK alone (no WORLD_SIZE) is not torchrun's: a plain run

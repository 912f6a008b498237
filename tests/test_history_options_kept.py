"""The history a model reads (--context-length, ParlAI's -histsz, and --include-labels) is kept in PATH.opt as
ParlAI keeps history_size in MODEL.opt: eval, display-model and interactive given only -mf read it as the model
was trained (they read the default, silently, and scored another model); their help says what the numbers
mean; ParlAI's -histsz and --truncate are answered; display-data, which adds no history, refuses them."""

from __future__ import annotations

import io
import json

import pytest
from helpers import eval_valid

from accelbatch.agents import History
from accelbatch.cli import main
from accelbatch.data.squash import histories
from accelbatch.messages import Message
from accelbatch.opts import build_parser

QUIET = ["--no-progress"]
SCORES = ("accuracy", "f1", "loss", "exs")  # a report's metrics, not its timings


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[str, dict]:
    """A bag model trained 20 steps on babi:1 reading two utterances of history, texts only; its final valid
    report (scored by the training run, with the options it trained with)."""
    folder = tmp_path_factory.mktemp("hist")
    path, report = str(folder / "m.pt"), folder / "train.json"
    assert main(["train", "-t", "babi:1", "-m", "bag", "-tstep", "20", "--context-length", "2",
                 "--no-include-labels", "-mf", path, "--eval-splits", "valid", "-veps", "-1",
                 "--report-json", str(report), *QUIET]) == 0
    return path, json.loads(report.read_text())["valid"]




def test_eval_given_only_mf_reads_the_history_the_model_was_trained_with(trained, tmp_path, capsys):
    """eval -mf alone scored the model with the whole history, labels included (the defaults): valid loss
    1.9723 where the training's own valid report said 1.9003."""
    path, valid = trained
    scores, err = eval_valid(path, tmp_path, capsys)
    assert scores == {k: valid[k] for k in SCORES}
    assert json.loads(open(f"{path}.opt").read())["context_length"] == 2
    assert (f"accelbatch: -mf {path} was trained with -m bag -histsz 2 --no-include-labels ({path}.opt); using "
            "them (give them to override)") in err
    # given on the command line, an option wins and is not said taken; --no-/-histsz forms count as given
    given, err = eval_valid(path, tmp_path, capsys, "-m", "bag", "-histsz", "2", "--no-include-labels")
    assert given == scores and "was trained with" not in err
    other, err = eval_valid(path, tmp_path, capsys, "-m", "bag", "--include-labels", "--history-size", "-1")
    assert other != scores and "was trained with" not in err


def test_display_model_and_interactive_given_only_mf_read_the_kept_history(trained, monkeypatch, capsys):
    path, _ = trained
    capsys.readouterr()
    shown = []
    for given in ([], ["-m", "bag", "--context-length", "2", "--no-include-labels"],
                  ["-m", "bag", "--context-length", "-1", "--include-labels"]):
        assert main(["display-model", "-mf", path, "-n", "64", *given, *QUIET]) == 0
        shown.append(capsys.readouterr().out)
    assert shown[0] == shown[1] != shown[2]
    kept: list[tuple[int, bool]] = []  # the history settings of the agent that answers
    add = History.add
    monkeypatch.setattr(History, "add", lambda self, *a: kept.append((self.context_length, self.include_labels))
                        or add(self, *a))
    replies = []
    for given in ([], ["-m", "bag", "--context-length", "2", "--no-include-labels"]):
        monkeypatch.setattr("sys.stdin", io.StringIO("Mary went to the garden.\nWhere is Mary?\n"))
        assert main(["interactive", "-mf", path, *given, *QUIET]) == 0
        replies.append(capsys.readouterr().out)
    assert kept == [(2, False)] * 4 and replies[0] == replies[1]


def test_the_help_says_what_a_context_length_keeps_as_the_history_does(capsys):
    """It said 'episode squashing: previous turns kept in the text', one off (1 keeps no earlier turn), and said
    squashing in interactive's --help, where nothing is squashed."""
    for verb in ("train", "eval", "interactive", "display-model"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "squashing" not in text, verb
        assert ("1 keeps it alone, 2 adds the utterance before it (the previous label; the previous text with "
                "--no-include-labels) (-1: all)") in text, verb
    episode = [Message(text="x1", labels=["y1"]), Message(text="x2", labels=["y2"], episode_done=True)]
    assert histories(episode, 1) == ["x1", "x2"]  # the current text alone
    assert histories(episode, 2) == ["x1", "y1\nx2"]  # the previous label and the current text
    assert histories(episode, 2, include_labels=False) == ["x1", "x1\nx2"]  # the previous text


def test_parlai_history_size_is_the_context_length_and_truncate_is_answered(capsys):
    """-histsz 2 was 'argument -h/--help: ignored explicit argument 'istsz'' (naming -h); --truncate was
    'unrecognized arguments'."""
    assert build_parser().parse_args(["-histsz", "2"]).context_length == 2
    assert build_parser().parse_args(["--history-size", "3"]).context_length == 3
    for argv, said in ((["--truncate", "64"], "--truncate: ParlAI's truncation of text and label together (its "
                        "-tr); accelbatch truncates them apart: give -tr/--text-truncate N (the text only) and "
                        "--label-truncate N"),
                       (["-hxyz"], "unrecognized option -hxyz: no option is named so")):
        with pytest.raises(SystemExit):
            main(["train", *argv, "-tstep", "1"])
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0] and "-h/--help" not in err[0], err


@pytest.mark.parametrize("argv", [["--context-length", "1"], ["--no-include-labels"], ["-histsz", "2"]])
def test_display_data_refuses_the_history_options_it_would_ignore(argv, capsys):
    """display-data shows each turn as the teacher serves it (its output was the same for every history):
    the history options are refused as its other unread options are."""
    assert main(["display-data", "-t", "babi:1", "-n", "3", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("accelbatch: error: ") and \
        "display-data prints a task's examples as its teacher serves them" in err[0], err
    assert main(["display-data", "-t", "babi:1", "-n", "3", *QUIET]) == 0


def test_python_opts_from_model_file_scores_the_model_as_eval_mf_does(trained, tmp_path, capsys):
    """From Python, Opts(model_file=PATH) read nothing from PATH.opt: a bag model built with the defaults failed
    to load the saved weights. ab.opts_from_model_file takes what -mf alone takes on the command line."""
    import accelbatch as ab
    from accelbatch.opts import OptionError

    path, valid = trained
    capsys.readouterr()
    opts = ab.opts_from_model_file(path, datatype="valid", progress=False)
    assert (opts.model, opts.context_length, opts.include_labels) == ("bag", 2, False)
    assert "was trained with -m bag -histsz 2 --no-include-labels" in capsys.readouterr().err
    report = ab.evaluate(ab.create_world(opts))
    assert {k: report[k] for k in SCORES} == {k: valid[k] for k in SCORES}
    # a change given wins and is not said taken
    assert ab.opts_from_model_file(path, datatype="valid", context_length=-1).context_length == -1
    with pytest.raises(OptionError, match="no model file .*missing.pt"):
        ab.opts_from_model_file(str(tmp_path / "missing.pt"))

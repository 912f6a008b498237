"""display-data, display-model and interactive: ParlAI's everyday verbs, through the CLI and the library."""

from __future__ import annotations

import io

import pytest

from accelbatch.cli import main
from accelbatch.opts import Opts
from accelbatch.verbs import EPISODE_END, display_data, display_model, interactive


def _rows(n_episodes: int = 3, turns: int = 2) -> list[dict]:
    return [{"text": f"e{e} t{t}", "labels": [f"a{e}{t}"], "label_candidates": [f"a{e}{t}", "other"],
             "episode_done": t == turns - 1} for e in range(n_episodes) for t in range(turns)]


def test_display_data_shows_the_first_examples_in_order_with_episode_ends(write_jsonl):
    path = write_jsonl(_rows())
    out = io.StringIO()
    shown = display_data(Opts(task=f"jsonl:{path}", datatype="train:ordered"), 5, out)
    text = out.getvalue()
    assert shown == 5
    texts = [line.split("]: ", 1)[1].split("  (labels")[0] for line in text.splitlines() if "(labels: " in line]
    assert texts == [r["text"] for r in _rows()][:5]
    assert text.count(EPISODE_END) == 2  # after e0 t1 and e1 t1


def test_display_data_of_several_tasks_shows_them_as_training_serves_them(write_jsonl):
    """Ordered multitask data serves one episode of each task in turn (ParlAI's MultiTaskTeacher): shown so,
    not all of the first task; the footer counts the examples and episodes of the split, as ParlAI's does."""
    first = write_jsonl(_rows(3, 2), "first.jsonl")
    second = write_jsonl([{**row, "text": "s" + row["text"]} for row in _rows(2, 3)], "second.jsonl")
    out = io.StringIO()
    assert display_data(Opts(task=f"jsonl:{first},jsonl:{second}", datatype="train:ordered"), 11, out) == 11
    texts = [line.split("]: ", 1)[1].split("  (labels")[0] for line in out.getvalue().splitlines()
             if "(labels: " in line]
    assert texts == ["e0 t0", "e0 t1", "se0 t0", "se0 t1", "se0 t2", "e1 t0", "e1 t1", "se1 t0", "se1 t1", "se1 t2",
                     "e2 t0"]
    assert out.getvalue().splitlines()[-1].endswith("which holds 12 examples in 5 episodes]")


def test_display_data_stops_at_the_end_of_a_small_split(write_jsonl):
    path = write_jsonl(_rows(1, 2))
    out = io.StringIO()
    assert display_data(Opts(task=f"jsonl:{path}", datatype="valid"), 10, out) == 2


@pytest.mark.slow
def test_display_model_prints_each_example_with_the_reply_and_scores_them():
    out = io.StringIO()
    report = display_model(Opts(task="babi:1", datatype="valid", batchsize=2), 4, out)
    text = out.getvalue()
    assert report["exs"] == 4
    assert text.count("  (eval_labels: ") == 4 and text.count("[MemNNAgent]: ") == 4


def test_interactive_replies_to_each_message_from_the_candidates_and_resets_on_done():
    stdin = io.StringIO("Mary went to the kitchen.\nWhere is Mary?\n[DONE]\nWhere is John?\n[EXIT]\nnot read\n")
    out = io.StringIO()
    replies = interactive(Opts(task="babi:1"), None, stdin, out)
    lines = out.getvalue().splitlines()
    assert replies == 3
    answers = [line.split("]: ", 1)[1] for line in lines if line.startswith("[MemNNAgent]: ")]
    babi_places = {"bathroom", "hallway", "garden", "office", "bedroom", "kitchen"}
    assert len(answers) == 3 and set(answers) <= babi_places
    assert lines.count(EPISODE_END) == 1 and "Enter Your Message" not in out.getvalue()  # piped: no prompt


def test_interactive_reads_done_and_new_lines_in_a_message_as_parlais_local_human():
    """A message holding [DONE] is the last of its conversation (the model replies to it, without the
    marker); a typed \\n is a new line of the message."""
    from recording_agent import ConversationRecorder

    ConversationRecorder.seen.clear()
    stdin = io.StringIO("Mary went home.\\nWhere is Mary? [DONE]\nWhere is John?\nand [DONE]Paul?\n[DONE][DONE]\n"
                        "last\\n[DONE]\\nline\nbye [EXIT]\nnot read\n")
    out = io.StringIO()
    assert interactive(Opts(model="recording_agent:ConversationRecorder"), None, stdin, out) == 4
    assert ConversationRecorder.seen == [("Mary went home.\nWhere is Mary?", True), ("Where is John?", False),
                                         ("and Paul?", True), ("last\n\nline", True)]
    assert out.getvalue().splitlines() == ["[recorder]: 1", EPISODE_END, "[recorder]: 1", "[recorder]: 2",
                                           EPISODE_END, EPISODE_END, "[recorder]: 1", EPISODE_END]


def test_interactive_single_turn_makes_every_message_a_conversation_of_its_own(monkeypatch, capsys):
    from recording_agent import ConversationRecorder

    ConversationRecorder.seen.clear()
    monkeypatch.setattr("sys.stdin", io.StringIO("one\ntwo\n"))
    assert main(["interactive", "-m", "recording_agent:ConversationRecorder", "--single-turn"]) == 0
    assert ConversationRecorder.seen == [("one", True), ("two", True)]
    assert capsys.readouterr().out.splitlines() == ["[recorder]: 1", EPISODE_END, "[recorder]: 1", EPISODE_END]


def test_interactive_takes_the_candidates_given(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Where is Mary?\n"))
    assert main(["interactive", "-t", "babi:1", "--candidates", "moon|sun", "--no-progress"]) == 0
    reply = capsys.readouterr().out.strip().splitlines()[-1]
    assert reply in ("[MemNNAgent]: moon", "[MemNNAgent]: sun")


@pytest.mark.parametrize("verb", ["display-data", "display-model"])
def test_a_count_below_one_is_one_line(verb, capsys):
    assert main([verb, "-t", "babi:1", "-n", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "-n/--num-examples" in err


def test_display_data_shows_training_data_once_however_many_are_asked(write_jsonl):
    path = write_jsonl(_rows(3, 2))
    assert display_data(Opts(task=f"jsonl:{path}", datatype="train"), 100, io.StringIO()) == 6  # not round again


@pytest.mark.parametrize("verb", ["display-model", "interactive"])
def test_a_model_file_that_is_not_there_is_refused_not_replaced_by_a_fresh_model(verb, tmp_path, capsys,
                                                                                 monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Where is Mary?\n"))
    for path, problem in ((tmp_path / "missing.pt", "no such file"), (tmp_path, "a directory, not a model file")):
        assert main([verb, "-t", "babi:1", "-mf", str(path), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"-mf/--model-file {path}: {problem}" in err, err


def test_interactive_reads_input_that_is_not_utf8(monkeypatch, capsys):
    stdin = io.TextIOWrapper(io.BytesIO(b"\xff\xfe bad\nWhere is Mary?\n"), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["interactive", "-t", "babi:1", "--no-progress"]) == 0
    assert capsys.readouterr().out.count("[MemNNAgent]: ") == 2  # the bad bytes read as U+FFFD


def test_interactive_refuses_skip_generation_which_would_reply_nothing(capsys):
    assert main(["interactive", "-m", "transformer/generator", "-t", "reverse:20", "--skip-generation"]) == 2
    assert capsys.readouterr().err == ("accelbatch: error: --skip-generation: interactive answers with generated "
                                       "replies; leave it out\n")


@pytest.mark.parametrize("verb", ["display-data", "display-model", "interactive"])
@pytest.mark.parametrize("flag", ["--report-json", "--metrics-log", "--tensorboard-logdir"])
def test_the_printing_verbs_refuse_output_files_they_would_not_write(verb, flag, tmp_path, capsys):
    target = tmp_path / "out"
    assert main([verb, "-t", "babi:1", "-m", "repeat_label", flag, str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"accelbatch: error: {flag}: {verb} prints to the terminal and writes no report or log; leave it "
                   "out (accelbatch eval writes them)"]
    assert not target.exists()


def test_display_data_help_lists_only_what_it_reads(capsys):
    with pytest.raises(SystemExit):
        main(["display-data", "--help"])
    listed = {word.strip(",[]") for word in capsys.readouterr().out.split() if word.startswith(("-", "[-"))}
    assert {"-t", "-dt", "-dp", "-n", "--seed"} <= listed and not listed & {"-bs", "-m", "--device", "-rf", "-mcs"}
    assert main(["display-data", "-t", "babi:1", "-n", "1", "-m", "memnn"]) == 2  # the default -m, given
    assert capsys.readouterr().err.startswith("accelbatch: error: -m/--model: display-data prints a task's examples")


def test_display_data_refuses_the_options_it_would_ignore(capsys):
    assert main(["display-data", "-t", "babi:1", "-n", "1", "-mf", "/nonexistent.pt", "-bs", "4", "--device",
                 "cuda", "-di", "3", "--num-workers", "2", "--mixed-precision", "fp16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("accelbatch: error: -mf/--model-file, -bs/--batchsize, --num-workers, "
                                               "--device, -di/--device-iterations, --mixed-precision: display-data")
    assert main(["display-data", "-t", "babi:1", "-n", "1", "-dt", "train", "--seed", "3", "--no-progress"]) == 0
    assert "[shown 1 example of -t babi:1 (train), which holds 5000 examples in 1000 episodes]" \
        in capsys.readouterr().out


@pytest.mark.parametrize("verb", ["train", "eval", "display-data"])
def test_an_unknown_short_option_is_not_read_as_a_known_one_with_a_glued_value(verb, capsys):
    # argparse would read an unknown -mxe (say, a ParlAI option accelbatch lacks) as -m xe: a model named "xe"
    with pytest.raises(SystemExit) as exited:
        main([verb, "-t", "babi:1", "-mxe", "1,3"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unrecognized option -mxe: no option is named so (see --help); a value is not read glued to -m: " \
           "if -m xe is meant, write `-m xe`" in err


def test_parlai_short_forms_are_read_and_an_option_value_is_never_judged_as_an_option(tmp_path, capsys):
    from accelbatch.opts import build_parser

    parsed = build_parser().parse_args(["-mcs", "all", "-im", "w.pt", "-dynb", "full"])
    assert (parsed.metrics, parsed.init_model, parsed.dynamic_batching) == ("all", "w.pt", "full")
    # a value that begins with a dash is argparse's to judge, not read as a misspelt option
    with pytest.raises(SystemExit):
        main(["train", "--report-json", "-my report.json"])
    err = capsys.readouterr().err
    assert "--report-json: expected one argument" in err and "glued" not in err
    parser = build_parser()
    parser.add_argument("-k", type=int)  # a script's own one-letter option takes a glued value as argparse does
    assert parser.parse_args(["-k5", "-bs", "4"]).k == 5
    optional = build_parser()  # a script's option whose value is optional takes none before another option
    optional.add_argument("--o", nargs="?", const="C")
    assert optional.parse_known_args(["--o", "-lr=0.1"])[0].o == "C"
    parsed = build_parser().parse_args(["-lr", "-1e-3", "-vcut", "-inf", "--seed", "-2"])  # argparse: -5, -.5 only
    assert (parsed.learning_rate, parsed.validation_cutoff, parsed.seed) == (-1e-3, float("-inf"), -2)


@pytest.mark.parametrize("argv, said", [
    (["-tstep5"], "a value is not read glued to -tstep: if -tstep 5 is meant, write `-tstep 5`"),
    (["-mfm1.pt"], "a value is not read glued to -mf: if -mf m1.pt is meant, write `-mf m1.pt`"),
    (["-mf", "-x.pt"], "-mf: expected one argument; a value that begins with '-' is written -mf=-x.pt"),
])
def test_a_misread_option_is_said_naming_the_option_meant(argv, said, capsys):
    with pytest.raises(SystemExit):
        main(["train", *argv])
    assert said in capsys.readouterr().err


def test_plain_babi_is_refused_naming_the_tasks_and_eval_examples_show_eval_labels(capsys):
    assert main(["display-data", "-t", "babi", "-n", "1"]) == 2  # ParlAI's plain babi is every task
    assert capsys.readouterr().err == "accelbatch: error: -t babi: name a task, one of babi:1, babi:2\n"
    assert main(["display-data", "-t", "babi:1", "-dt", "valid", "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "  (eval_labels: " in out and "(labels: " not in out


@pytest.mark.parametrize("verb, argv, refused", [
    ("display-model", ["-lr", "0.5"], "-lr/--learning-rate: a training option"),
    ("display-model", ["--resume"], "--resume/--no-resume: a training option"),
    ("display-model", ["-nt", "2"], "-nt/--numthreads: display-model does not take it"),
    ("display-model", ["--no-display-examples"], "--display-examples: display-model does not take it"),
    ("interactive", ["-ne", "3"], "-ne/-eps/--num-epochs: a training option"),
    ("interactive", ["-bs", "8"], "-bs/--batchsize: interactive does not take it"),
    ("interactive", ["-dt", "test"], "-dt/--datatype: interactive does not take it"),
    ("interactive", ["--num-workers", "2"], "--num-workers: interactive does not take it"),
    ("interactive", ["--dataloader-mode", "async"], "--dataloader-mode: interactive does not take it"),
    ("interactive", ["-rf", "2"], "-rf/--replication-factor: interactive does not take it: it runs in this process"),
    ("interactive", ["-di", "4"], "-di/--device-iterations: interactive does not take it"),
    ("interactive", ["--num-buckets", "4"], "--num-buckets: interactive does not take it"),
    ("interactive", ["--max-batch-tokens", "99"], "--max-batch-tokens: interactive does not take it"),
    ("interactive", ["-mcs", "all"], "-mcs/--metrics: interactive prints to the terminal"),
])
def test_the_model_verbs_refuse_the_options_they_would_not_read(verb, argv, refused, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main([verb, "-t", "babi:1", "-m", "repeat_label", "-n" if verb == "display-model" else "-t", "1"
                 if verb == "display-model" else "babi:1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"accelbatch: error: {refused}"), err


@pytest.mark.parametrize("verb, hidden", [("display-model", ["-nt", "--report-json", "--metrics-log", "-lr"]),
                                          ("interactive", ["-bs", "-dt", "--num-workers", "--report-json", "-ne"])])
def test_the_model_verbs_help_lists_no_option_they_refuse(verb, hidden, capsys):
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    listed = {word.rstrip(",") for word in capsys.readouterr().out.split() if word.startswith("-")}
    assert "-t" in listed and not listed & set(hidden)


def test_display_model_checks_and_applies_metrics_as_eval_does(capsys):
    argv = ["display-model", "-t", "babi:1", "-m", "repeat_label", "-n", "2", "-bs", "2"]
    assert main([*argv, "--metrics", "token_acc"]) == 2
    assert capsys.readouterr().err.startswith("accelbatch: error: --metrics: no report of this run has token_acc")
    assert main(argv) == 0
    assert capsys.readouterr().out.strip().splitlines()[-3].split() == ["split", "exs", "accuracy", "f1"]
    assert main([*argv, "--metrics", "f1"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-3].split() == ["split", "exs", "f1"]


@pytest.mark.parametrize("verb, argv, message", [
    ("train", ["-es", "16"], "unrecognized option -es (options are not abbreviated; -es begins -esz)"),
    ("train", ["-vep", "1"], "unrecognized option -vep (options are not abbreviated; -vep begins -veps)"),
    ("display-data", ["-vti", "5"], "unrecognized arguments: -vti"),
    ("eval", ["-n", "3"], "unrecognized option -n (options are not abbreviated; -n begins -nt)"),
    ("display-model", ["-es", "16"], "unrecognized option -es (options are not abbreviated; -es begins -esz)"),
])
def test_a_single_dash_prefix_of_an_option_is_refused_not_completed(verb, argv, message, capsys):
    # argparse before Python 3.12 completes single-dash prefixes even with allow_abbrev=False
    with pytest.raises(SystemExit) as exited:
        main([verb, "-t", "babi:1", *argv])
    assert exited.value.code == 2
    assert f"accelbatch {verb}: error: {message} (see `accelbatch {verb} --help`)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        Opts.from_args(["-es", "16"])

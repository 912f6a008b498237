"""What the command line writes where: the report on stdout whatever happens to --report-json (written whole or
not at all), ``--report-json -`` as JSON alone on stdout, no verb and empty paths refused (usage on stderr,
exit 2), and an error class marked ``usage_error = True`` told in one line."""

from __future__ import annotations

import importlib
import json
import resource

import pytest

from accelbatch.cli import error_message, main
from accelbatch.models.bag import BagAgent
from accelbatch.procs import ProcessFailure

RUN = importlib.import_module("accelbatch.run")  # the module (accelbatch.run is the function run)
ROWS = 8  # examples in the data file: one episode each
STEPS, BATCH = 2, 4  # -tstep and -bs: the train row counts STEPS * BATCH examples


def _data(tmp_path) -> str:
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps({"text": f"what is {i % 5} plus zero", "labels": [f"n{i % 5}"],
                                        "label_candidates": ["n0", "n1", "n2", "n3", "n4"], "episode_done": True})
                            + "\n" for i in range(ROWS)), encoding="utf-8")
    return str(path)


def _train(tmp_path, *extra: str) -> list[str]:
    return ["train", "-t", f"jsonl:{_data(tmp_path)}", "-m", "bag", "-tstep", str(STEPS), "-bs", str(BATCH),
            "--no-progress", *extra]


def _table_rows(text: str) -> dict[str, list[str]]:
    """The report table's rows by split: {"train": ["8", accuracy, ...], ...}."""
    return {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.split() and line.split()[0] in ("train", "valid", "test")}


def _when_the_run_ends(monkeypatch, act) -> None:
    """Call ``act()`` once the run has its report, just before --report-json is written."""
    select = RUN.select_metrics

    def selecting(report, metrics):
        act()
        return select(report, metrics)

    monkeypatch.setattr(RUN, "select_metrics", selecting)


# --- 1. an unwritable --report-json: the report is still printed, the JSON written whole or not at all -------
def test_a_report_json_that_cannot_be_written_still_prints_the_report(tmp_path, capsys, monkeypatch):
    """A path that became a folder while the run trained: the table on stdout, then one line, exit 2."""
    report = tmp_path / "r.json"
    _when_the_run_ends(monkeypatch, report.mkdir)
    assert main(_train(tmp_path, "-mf", str(tmp_path / "m.pt"), "--report-json", str(report))) == 2
    out, err = capsys.readouterr()
    assert _table_rows(out)["train"][0] == str(STEPS * BATCH) and _table_rows(out)["valid"][0] == str(ROWS)
    assert err.splitlines()[-1].startswith(f"accelbatch: error: --report-json {report}: cannot be written (")
    assert "Traceback" not in err and (tmp_path / "m.pt").is_file()


def test_an_earlier_report_survives_a_write_that_fails(tmp_path, capsys, monkeypatch):
    """A disk that fills as the report is written (a file size limit of 64 bytes, EFBIG): the earlier report
    is left as it was, no temporary file stays beside it, and the new report is on stdout."""
    report = tmp_path / "r.json"
    earlier = json.dumps({"earlier": "report", "kept": True}) + "\n"
    report.write_text(earlier, encoding="utf-8")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    _when_the_run_ends(monkeypatch, lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard)))
    try:
        code = main(_train(tmp_path, "--report-json", str(report)))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out, err = capsys.readouterr()
    assert code == 2 and report.read_text(encoding="utf-8") == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "tiny.jsonl"]
    assert _table_rows(out)["train"][0] == str(STEPS * BATCH)
    assert err.splitlines()[-1].startswith(f"accelbatch: error: --report-json {report}: cannot be written (")


def test_a_report_written_over_an_earlier_one_replaces_it_whole(tmp_path, capsys):
    report = tmp_path / "r.json"
    report.write_text("{\"earlier\": true}\n", encoding="utf-8")
    assert main(_train(tmp_path, "--report-json", str(report))) == 0
    written = json.loads(report.read_text(encoding="utf-8"))
    assert (written["train"]["exs"], written["train"]["steps"], written["valid"]["exs"]) == (STEPS * BATCH, STEPS,
                                                                                              ROWS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "tiny.jsonl"]
    assert _table_rows(capsys.readouterr().out)["train"][0] == str(STEPS * BATCH)


# --- 2. --report-json -: the JSON alone on stdout, the table on stderr ---------------------------------------
@pytest.mark.parametrize("given", [["--report-json", "-"], ["--report-json=-"]])
def test_report_json_dash_prints_the_json_alone_on_stdout(tmp_path, capsys, monkeypatch, given):
    monkeypatch.chdir(tmp_path)
    assert main(_train(tmp_path, *given)) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)  # stdout is the JSON and nothing else
    assert (report["train"]["exs"], report["train"]["steps"], report["test"]["exs"]) == (STEPS * BATCH, STEPS, ROWS)
    assert _table_rows(err)["train"][0] == str(STEPS * BATCH)  # the table, for a person, on stderr
    assert not (tmp_path / "-").exists()


# --- 3. no verb: usage on stderr, exit 2; --help on stdout, exit 0 -------------------------------------------
def test_no_verb_is_usage_on_stderr_and_exit_2(capsys):
    with pytest.raises(SystemExit) as ended:
        main([])
    out, err = capsys.readouterr()
    assert (ended.value.code, out) == (2, "")
    assert err.startswith("usage: accelbatch") and err.splitlines()[-1].startswith("accelbatch: error: no verb given")
    with pytest.raises(SystemExit) as ended:
        main(["--help"])
    out, err = capsys.readouterr()
    assert (ended.value.code, err) == (0, "") and out.startswith("usage: accelbatch")


# --- 4. an empty path is refused, naming the option -------------------------------------------------------
@pytest.mark.parametrize("verb, given, flag", [
    ("train", ["-mf", ""], "-mf/--model-file"),
    ("train", ["--report-json", ""], "--report-json"),
    ("train", ["--report-json="], "--report-json"),
    ("train", ["--metrics-log", ""], "--metrics-log"),
    ("train", ["--tensorboard-logdir", ""], "--tensorboard-logdir"),
    ("train", ["--init-model", ""], "-im/--init-model"),
    ("train", ["-dp", ""], "-dp/--datapath"),
    ("train", ["--ipu-cache-dir", ""], "--ipu-cache-dir"),
    ("eval", ["--model-file", ""], "-mf/--model-file"),
    ("eval", ["--report-json", ""], "--report-json"),
    ("display-model", ["-mf", ""], "-mf/--model-file"),
    ("display-data", ["-dp", ""], "-dp/--datapath"),
    ("interactive", ["-mf", ""], "-mf/--model-file"),
])
def test_an_empty_path_is_refused_naming_the_option(tmp_path, capsys, monkeypatch, verb, given, flag):
    """`-mf "$MODEL"` with MODEL unset trained and saved nothing, exit 0."""
    monkeypatch.chdir(tmp_path)
    argv = [verb, "-t", f"jsonl:{_data(tmp_path)}", "-m", "bag", "--no-progress", *given]
    if verb == "display-data":
        argv.remove("-m"), argv.remove("bag")
    if verb == "train":
        argv += ["-tstep", "1"]
    with pytest.raises(SystemExit) as ended:
        main(argv)
    out, err = capsys.readouterr()
    assert (ended.value.code, out) == (2, "")
    assert err == (f"accelbatch {verb}: error: argument {flag}: an empty path (an unset shell variable?); give a "
                   f"path, or leave the option out (see `accelbatch {verb} --help`)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.jsonl"]


@pytest.mark.parametrize("verb, given, flag", [
    ("train", ["-mf", "-"], "-mf/--model-file"),
    ("train", ["--metrics-log", "-"], "--metrics-log"),
    ("train", ["--init-model", "-"], "-im/--init-model"),
    ("eval", ["-mf", "-"], "-mf/--model-file"),
])
def test_a_lone_dash_is_refused_where_only_report_json_means_stdout(tmp_path, capsys, monkeypatch, verb, given,
                                                                     flag):
    """`-mf -` trained and wrote a 12 KB file named '-' in the current directory."""
    monkeypatch.chdir(tmp_path)
    argv = [verb, "-t", f"jsonl:{_data(tmp_path)}", "-m", "bag", "--no-progress", *given]
    with pytest.raises(SystemExit) as ended:
        main(argv + (["-tstep", "1"] if verb == "train" else []))
    out, err = capsys.readouterr()
    assert (ended.value.code, out) == (2, "")
    assert err.startswith(f"accelbatch {verb}: error: argument {flag}: '-' (standard input or output) is not a "
                          "path this option can use; give a file's path (./- for a file named '-')")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.jsonl"]


@pytest.mark.parametrize("given, flag", [(["", "-o", "x.png"], "RUN_DIR"), ([".", "-o", ""], "-o/--out")])
def test_report_refuses_an_empty_path(tmp_path, capsys, monkeypatch, given, flag):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        main(["report", *given])
    assert ended.value.code == 2
    assert capsys.readouterr().err.startswith(f"accelbatch report: error: argument {flag}: an empty path")


# --- 5. an error class marked usage_error = True: one line, exit 2 -----------------------------------------
class AgentContractError(Exception):
    """As the agent contract's own error will be: marked as bad input by its class."""

    usage_error = True


class ContractBreaker(BagAgent):
    def build_model(self):
        raise AgentContractError("ContractBreaker: build_model() must return an nn.Module; define it")


def test_an_error_marked_usage_error_is_one_line_and_exit_2(tmp_path, capsys):
    argv = _train(tmp_path, "-mf", str(tmp_path / "m.pt"))
    argv[argv.index("bag")] = f"{__name__}:ContractBreaker"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == ("accelbatch: error: ContractBreaker: build_model() must return an nn.Module; "
                                    "define it")
    assert "Traceback" not in err


def test_a_marked_error_raised_in_another_process_is_bad_input_too():
    """A replica's or hogwild process's error reaches the parent as a ProcessFailure holding it."""
    child = AgentContractError("ContractBreaker: define batchify")
    failure = ProcessFailure("replica 1 failed", role="replica", index=1, error_message=str(child),
                             error_types=[f"{__name__}.AgentContractError"], child_exception=child)
    assert error_message(failure) == (2, "ContractBreaker: define batchify")
    assert error_message(AgentContractError("x")) == (2, "x")
    assert error_message(NotImplementedError("x")) is None  # unmarked: a bug, its traceback kept

"""A resume from Python: ``Opts(model_file=PATH, resume=True)`` takes no option from the checkpoint (the
command line takes them), so a run stopped on its way to ``-ne 0.6`` went on to the default ``-ne 5``
silently; now one line says where the interrupted run was to end and what to give."""

from __future__ import annotations

import json

import accelbatch as ab
from accelbatch.cli import main
from accelbatch.state import untold_limits


def _tiny(folder) -> str:
    for split in ("train", "valid", "test"):
        (folder / f"{split}.jsonl").write_text("".join(
            json.dumps({"text": f"say {w}", "labels": [w], "label_candidates": ["a", "b", "c"]}) + "\n"
            for w in "abcab"))
    return f"jsonl:{folder}"


def test_the_line_names_the_interrupted_run_s_limits_only_when_none_is_given():
    then = {"num_epochs": 0.6, "max_train_steps": -1, "max_train_time": -1.0}
    said = untold_limits(ab.Opts(), then)
    assert said == ("the interrupted run was to end at -ne 0.6; this one goes on to the defaults (Opts made in "
                    "Python take no option from the checkpoint: give num_epochs=0.6 to end where it would have)")
    assert untold_limits(ab.Opts(num_epochs=2), then) is None  # a limit given: the user's end
    assert untold_limits(ab.Opts(), {**then, "num_epochs": 5}) is None  # the same end


def test_a_python_resume_says_it_while_the_command_line_s_takes_the_limits(tmp_path, capsys):
    task, path = _tiny(tmp_path), str(tmp_path / "m.pt")
    common = ["-t", task, "-m", "bag", "-esz", "8", "-mf", path, "--no-progress", "--eval-splits", ""]
    assert main(["train", *common, "-ne", "2", "-veps", "-1"]) == 0
    capsys.readouterr()
    assert main(["train", *common, "--resume"]) == 0
    assert "--resume: the interrupted run" not in capsys.readouterr().err
    opts = ab.Opts(task=task, model="bag", embedding_size=8, model_file=path, resume=True, eval_splits="",
                   validation_every_n_epochs=-1, progress=False)
    report = ab.run(ab.create_world(opts), opts)
    assert "accelbatch: --resume: the interrupted run was to end at -ne 2" in capsys.readouterr().err
    assert report["train"]["epochs"] == 5.0  # the default end, as said


def test_a_limit_given_to_a_resume_ends_the_run_alone(tmp_path):
    """A run of -ne 4 -tstep 3 (5 examples, -bs 1) resumed with -tstep 30 alone trains to step 30: -ne is
    lifted with the other limits, not put back to its default 5 (25 steps) nor kept at the checkpoint's 4."""
    task, path, report = _tiny(tmp_path), str(tmp_path / "m.pt"), tmp_path / "r.json"
    common = ["-t", task, "-m", "bag", "-esz", "8", "-bs", "1", "-mf", path, "--no-progress", "--eval-splits", "",
              "-veps", "-1", "--report-json", str(report)]
    assert main(["train", *common, "-ne", "4", "-tstep", "3"]) == 0
    assert main(["train", *common, "--resume", "-tstep", "30"]) == 0
    train = json.loads(report.read_text())["train"]
    assert (train["steps"], train["stopped_by"], train["epochs"]) == (30, "max_train_steps", 6.0)

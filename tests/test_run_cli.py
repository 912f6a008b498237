import json
import subprocess
import sys

import pytest
import torch

from accelbatch.build import create_world
from accelbatch.cli import main
from accelbatch.models.memnn import MemNNAgent
from accelbatch.opts import Opts
from accelbatch.run import run


@pytest.mark.slow
def test_demo_defaults_train_the_bundled_task_past_95_percent(tmp_path, capsys):
    """`accelbatch train` with no task or model: the README's demo."""
    report_path = tmp_path / "report.json"
    log_path = tmp_path / "metrics.jsonl"
    rc = main(["train", "--no-progress", "--report-json", str(report_path), "--metrics-log", str(log_path),
               "-ltim", "0.5"])
    assert rc == 0
    report = json.loads(report_path.read_text())
    assert report["valid"]["accuracy"] >= 0.95 and report["valid"]["exs"] == 1000
    assert report["test"]["exs"] == 1000
    assert report["train"]["epochs"] >= 5.0
    assert report["device"] == "cpu"
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert {r["split"] for r in records} >= {"train", "valid", "test"}
    shares = [r["data_wait_share"] for r in records if r["split"] == "train"]
    assert shares and all(0.0 < share < 1.0 for share in shares)  # teacher acts + vectorize: some, not all
    out = capsys.readouterr().out
    assert "valid" in out and "accuracy" in out


def test_eval_of_a_single_jsonl_file_serves_every_example(write_jsonl, capsys):
    path = write_jsonl([{"text": f"q{i}", "labels": [f"a{i}"]} for i in range(37)])
    for datatype in ("valid", "test"):
        opts = Opts(task=f"jsonl:{path}", model="repeat_label", datatype=datatype, batchsize=8,
                    progress=False)
        report = run(create_world(opts), opts)
        assert report[datatype]["exs"] == 37 and report[datatype]["accuracy"] == 1.0
    assert main(["eval", "-t", f"jsonl:{path}", "-m", "repeat_label", "--no-progress"]) == 0
    assert " 37 " in capsys.readouterr().out


def test_random_candidate_scores_near_chance():
    opts = Opts(task="babi:1", model="random_candidate", datatype="valid", progress=False)
    report = run(create_world(opts), opts)["valid"]
    assert report["exs"] == 1000 and 0.08 < report["accuracy"] < 0.26  # 6 candidates -> ~1/6


def test_module_class_paths_work_for_task_and_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "mytask.py").write_text(
        "from accelbatch.teachers import FixedTeacher\n"
        "from accelbatch.messages import Message\n"
        "class Squares(FixedTeacher):\n"
        "    def setup_data(self):\n"
        "        return [[Message(text=str(i), labels=[str(i * i)], episode_done=True)] for i in range(9)]\n"
        "class Echo:\n"
        "    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["eval", "-t", "mytask:Squares", "-m", "accelbatch.models.utility:RepeatLabelAgent",
                 "--no-progress", "--report-json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["valid"]["exs"] == 9


def test_model_file_round_trip_and_refusal_of_a_bad_file(tmp_path):
    path = str(tmp_path / "model.pt")
    opts = Opts(task="babi:1", max_train_steps=5, model_file=path, progress=False, eval_splits="",
                validation_every_n_epochs=-1)
    trained = create_world(opts)
    run(trained, opts)
    loaded = MemNNAgent(opts)
    for p, q in zip(trained.get_model_agent().model.parameters(), loaded.model.parameters()):
        assert torch.equal(p, q)
    with open(path, "r+b") as handle:
        handle.truncate(100)
    with pytest.raises(ValueError, match="--model-file .*cannot load"):
        MemNNAgent(opts)


@pytest.mark.multiprocess
def test_python_dash_m_lists_tasks():
    out = subprocess.run([sys.executable, "-m", "accelbatch", "tasks"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "babi:1" in out and "repeat_label" in out


@pytest.mark.slow
def test_mixed_precision_on_the_cpu_changes_the_run(tmp_path):
    """`--mixed-precision` on --device cpu runs autocast (bf16; fp16 with a loss scaler where torch has it):
    the valid loss differs from fp32's after the same steps, and stays close to it."""
    from accelbatch.backends.cpu import fp16_on_cpu_supported

    losses = {}
    for mp in ("no", "bf16") + (("fp16",) if fp16_on_cpu_supported() else ()):
        path = tmp_path / f"{mp}.json"
        assert main(["train", "-t", "babi:1", "-m", "memnn", "-bs", "8", "--max-train-steps", "4", "-veps", "-1",
                     "--eval-splits", "valid", "--no-progress", "--mixed-precision", mp,
                     "--report-json", str(path)]) == 0
        losses[mp] = json.loads(path.read_text())["valid"]["loss"]
    for mp, loss in losses.items():
        if mp != "no":
            assert loss != losses["no"] and loss == pytest.approx(losses["no"], rel=0.05), (mp, losses)

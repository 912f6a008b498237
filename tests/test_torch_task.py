"""-t torch:pkg.mod:make_dataset -m torch:pkg.mod:Model: a user's torch Dataset and PopTorch-style module run
with the plan, exactly-once evaluation and the report, like any task (tests/torch_task.py is the user's code)."""

from __future__ import annotations

import json

import pytest
import torch
import torch_task

from accelbatch.cli import main
from accelbatch.opts import OptionError, Opts
from accelbatch.tasks import torch_data
from accelbatch.tasks.torch_data import TorchDatasetTeacher

TASK, MODEL = "torch:torch_task:make_dataset", "torch:torch_task:Classifier"
LR = 0.5


def _train(tmp_path, name, *extra):
    model_file, report = tmp_path / f"{name}.pt", tmp_path / f"{name}.json"
    rc = main(["train", "-m", MODEL, "-opt", "sgd", "-lr", str(LR), "--no-progress", "-mf", str(model_file),
               "--report-json", str(report), "-veps", "-1", "-t", TASK, *extra])
    assert rc == 0
    weights = torch.load(model_file, weights_only=True)["model"]
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in weights.items()}, \
        json.loads(report.read_text())


@pytest.mark.slow
def test_training_equals_a_plain_loop_over_the_same_batches(tmp_path):
    weights, report = _train(tmp_path, "run", "-dt", "train:ordered", "-bs", "4", "-tstep", "9",
                             "--eval-splits", "")
    torch.manual_seed(Opts().seed)
    model = torch_task.Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = torch_task.tensors("train")
    losses = []
    for start in range(0, 36, 4):
        optimizer.zero_grad()
        _, loss = model(x[start:start + 4], y[start:start + 4])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=1e-6)
    assert report["train"]["exs"] == 36
    assert report["train"]["loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-6)


@pytest.mark.parametrize("plan", [["-bs", "4"], ["-bs", "3", "-di", "2", "--device", "ipu", "--ipu-emulator"]],
                         ids=["cpu", "ipu-di2"])
def test_evaluation_scores_every_item_once_with_the_models_predictions(tmp_path, plan):
    weights, report = _train(tmp_path, "run", "-tstep", "6", "--eval-splits", "valid,test", *plan)
    model = torch_task.Classifier()
    model.load_state_dict(weights)
    for split in ("valid", "test"):
        x, y = torch_task.tensors(split)
        with torch.no_grad():
            out, loss = model(x, y)
        assert report[split]["exs"] == torch_task.SIZES[split]
        assert report[split]["accuracy"] == pytest.approx((out.argmax(1) == y).sum().item() / len(y), abs=1e-12)
        assert report[split]["loss"] == pytest.approx(float(loss), abs=1e-5)


def test_the_same_plan_gives_the_same_weights_on_cpu_and_the_emulated_ipu(tmp_path):
    plan = ["-bs", "2", "-di", "2", "-ga", "2", "-tstep", "5", "--eval-splits", ""]
    cpu, _ = _train(tmp_path, "cpu", *plan)
    ipu, _ = _train(tmp_path, "ipu", *plan, "--device", "ipu", "--ipu-emulator")
    for key in cpu:
        torch.testing.assert_close(cpu[key], ipu[key], rtol=1e-5, atol=1e-6)


def test_an_iterable_dataset_trains_as_the_map_style_one(tmp_path):
    args = ["-bs", "4", "-tstep", "8", "--eval-splits", "valid"]
    mapped, first = _train(tmp_path, "map", *args)
    streamed, second = _train(tmp_path, "iter", *args[:-2], "--eval-splits", "valid", "-t",
                              "torch:torch_task:make_stream")
    for key in mapped:
        assert torch.equal(mapped[key], streamed[key]), key
    assert first["valid"] == {**second["valid"], "time_s": first["valid"]["time_s"]}


def test_an_item_that_cannot_be_batched_is_named_in_one_line(capsys):
    rc = main(["train", "-t", "torch:torch_task:make_ragged", "-m", MODEL, "-bs", "37", "-tstep", "1",
               "--no-progress", "--eval-splits", "", "-veps", "-1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "item 5 cannot be batched" in err and "(6,)" in err


@pytest.mark.parametrize("model, says", [("torch:torch_task:tensors", "calling it with no arguments failed"),
                                         ("torch:torch_task:SIZES", "not a model class"),
                                         ("torch:torch_task:NotAModule", "not a torch.nn.Module")], ids=str)
def test_a_model_path_that_makes_no_module_is_one_line(capsys, model, says):
    rc = main(["train", "-t", TASK, "-m", model, "--no-progress", "-tstep", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and says in err


def test_a_collate_function_batches_what_default_collate_cannot(tmp_path, capsys):
    """Items of different lengths: refused by default_collate (one line), batched by --collate."""
    common = ["train", "-t", "torch:torch_task:make_ragged_sequences", "-m", MODEL, "-bs", "4", "-tstep", "3",
              "--no-progress", "--eval-splits", "valid", "-veps", "-1"]
    assert main(common) == 2 and "cannot be batched" in capsys.readouterr().err
    report = tmp_path / "r.json"
    assert main([*common, "--collate", "torch_task:pad_collate", "--report-json", str(report)]) == 0
    assert json.loads(report.read_text())["valid"]["exs"] == torch_task.SIZES["valid"]
    assert main([*common, "--collate", "torch_task:broken_collate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--collate torch_task:broken_collate failed on the batch of items" in err


def naming_collate(items: list) -> tuple:
    """A user's collate that fails, saying the first input feature of each item it was given."""
    xs, _ = zip(*items)
    raise KeyError(" ".join(f"{x[0].item():.6f}" for x in xs))


def test_a_failing_collate_names_the_items_of_its_batch_and_where_it_raised(capsys):
    """The shuffled batch's items, each (it named the first and last index as a range: 6..9 for 6, 7, 24, 9),
    and the line of the collate that raised."""
    assert main(["train", "-t", TASK, "-m", MODEL, "-bs", "4", "--no-progress", "--eval-splits", "",
                 "--collate", f"{__name__}:naming_collate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    named = err.split("failed on the batch of items ")[1].split(":")[0]
    given = err.split("KeyError: '")[1].split("'")[0].split()
    first_features = [f"{v:.6f}" for v in torch_task.tensors("train")[0][:, 0].tolist()]
    assert [int(i) for i in named.split(", ")] == [first_features.index(v) for v in given]
    assert named != "0, 1, 2, 3"  # a shuffled batch: the indices are its own, not a range
    assert f"at test_torch_task.py:{naming_collate.__code__.co_firstlineno + 3}; fix the collate function" in err


@pytest.mark.slow
def test_a_resumed_run_ends_with_the_weights_of_one_run(tmp_path):
    """A checkpoint after 4 of 8 steps and --resume: the user's dataset and model end as if never stopped."""
    plan = ["-bs", "4", "-di", "2", "--eval-splits", ""]
    whole, _ = _train(tmp_path, "whole", *plan, "-tstep", "8")
    _train(tmp_path, "cut", *plan, "-tstep", "4", "-stim", "1000")
    resumed, report = _train(tmp_path, "cut", *plan, "-tstep", "8", "-stim", "1000", "--resume")
    assert report["train"]["steps"] == 8
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), key


def _one_line_error(capsys, argv: list[str]) -> str:
    """The run of ``argv`` ends with exit code 2 and one line on stderr: that line."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("factory, says", [
    ("make_failing", ["(valid): calling the dataset factory with 'valid' raised FileNotFoundError: "
                      "data/valid.pt: no such file at torch_task.py:"]),
    ("make_faulty", [f"(valid): item {torch_task.FAULTY_ITEM}: __getitem__ raised KeyError: "
                     f"'row {torch_task.FAULTY_ITEM} missing from the index' at torch_task.py:"]),
    ("make_overcounted", [f"(valid): item {torch_task.SIZES['valid']}: __getitem__ raised IndexError",
                          f"__len__ (which gives {torch_task.SIZES['valid'] + 3})"]),
], ids=str)
def test_a_dataset_that_cannot_be_read_is_one_line_naming_the_split_and_item(capsys, factory, says):
    err = _one_line_error(capsys, ["eval", "-t", f"torch:torch_task:{factory}", "-m", MODEL, "-bs", "4"])
    assert err.startswith(f"accelbatch: error: -t torch:torch_task:{factory} (valid): ")
    for text in says:
        assert text in err


@pytest.mark.parametrize("factory, cause", [("make_failing", FileNotFoundError), ("make_faulty", KeyError)])
def test_the_users_exception_is_the_cause_of_the_usage_error(factory, cause):
    with pytest.raises(OptionError) as caught:
        TorchDatasetTeacher(Opts(task=f"torch:torch_task:{factory}", datatype="valid"))
    assert type(caught.value.__cause__) is cause


def test_a_split_the_factory_does_not_have_is_refused_naming_the_way_out(tmp_path, capsys):
    """None for valid: one line naming the split and how to leave it out; leaving it out trains."""
    task = "torch:torch_task:make_train_only"
    err = _one_line_error(capsys, ["eval", "-t", task, "-m", MODEL, "-bs", "4"])
    assert f"-t {task} (valid): the dataset factory returned None for 'valid'" in err
    assert "--eval-splits" in err and "-veps -1" in err and "-dt" in err
    report = tmp_path / "r.json"
    assert main(["train", "-t", task, "-m", MODEL, "-bs", "4", "-tstep", "2", "--no-progress", "-veps", "-1",
                 "--eval-splits", "", "--report-json", str(report)]) == 0
    assert json.loads(report.read_text())["train"]["exs"] == 8


def test_an_endless_iterable_is_refused_past_the_bound_in_one_line(monkeypatch, capsys):
    """Reading stops at MAX_STREAMED_ITEMS (made small here) instead of filling the memory; a finite stream of
    exactly that many items is read whole."""
    monkeypatch.setattr(torch_data, "MAX_STREAMED_ITEMS", torch_task.SIZES["valid"], raising=False)
    monkeypatch.setattr(torch_task.Endless, "safety", 1000)  # without a bound: the user's stream fails the test
    err = _one_line_error(capsys, ["train", "-t", "torch:torch_task:make_endless", "-m", MODEL, "-tstep", "1",
                                   "--no-progress"])
    assert (f"-t torch:torch_task:make_endless (train): the iterable dataset yielded more than "
            f"{torch_task.SIZES['valid']} items") in err and "map-style" in err
    teacher = TorchDatasetTeacher(Opts(task="torch:torch_task:make_stream", datatype="valid"))
    assert teacher.num_examples() == torch_task.SIZES["valid"]


def test_a_regression_target_is_not_scored_as_a_class(tmp_path, capsys):
    """Float targets: no accuracy or f1 in any split (they would read 0.0), the loss as the model's own."""
    task, model = "torch:torch_task:make_regression", "torch:torch_task:Regressor"
    model_file, report_file = tmp_path / "reg.pt", tmp_path / "reg.json"
    common = ["train", "-t", task, "-m", model, "-opt", "sgd", "-lr", "0.05", "-bs", "4", "--no-progress",
              "-mf", str(model_file)]
    assert main([*common, "-tstep", "6", "-veps", "-1", "--report-json", str(report_file)]) == 0
    report = json.loads(report_file.read_text())
    regressor = torch_task.Regressor()
    weights = torch.load(model_file, weights_only=True)["model"]
    regressor.load_state_dict({k[len("module."):]: v for k, v in weights.items()})
    for split in ("train", "valid", "test"):
        assert "accuracy" not in report[split] and "f1" not in report[split], report[split]
        assert "loss" in report[split]
    for split in ("valid", "test"):
        with torch.no_grad():
            _, loss = regressor(*torch_task.regression_tensors(split))
        assert report[split]["exs"] == torch_task.SIZES[split]
        assert report[split]["loss"] == pytest.approx(float(loss), abs=1e-5)
    # the replies are not class indices: display-model shows none
    capsys.readouterr()
    assert main(["display-model", "-t", task, "-m", model, "-mf", str(model_file), "-n", "3"]) == 0
    replies = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[TorchModelAgent]:")]
    assert replies and all(line == "[TorchModelAgent]: " for line in replies), replies
    # with no accuracy to validate on, the default -vmt is refused at the first validation, naming loss
    err = _one_line_error(capsys, [*common[:-2], "-tstep", "20", "-veps", "0.5"])
    assert "-vmt/--validation-metric accuracy" in err and "loss" in err


def test_items_without_a_target_are_not_scored(tmp_path):
    report_file = tmp_path / "r.json"
    assert main(["eval", "-t", "torch:torch_task:make_inputs_only", "-m", MODEL, "-bs", "4",
                 "--report-json", str(report_file)]) == 0
    report = json.loads(report_file.read_text())["valid"]
    assert report["exs"] == torch_task.SIZES["valid"]
    assert not {"accuracy", "f1", "loss"} & set(report), report


def test_a_model_trained_without_targets_returns_its_loss_with_the_outputs(tmp_path):
    """Items of one tensor and forward(x) -> (outputs, loss), PopTorch's unsupervised form: it trains as a plain
    loop over the same batches does, and evaluation reports its loss."""
    model_file, report_file = tmp_path / "ae.pt", tmp_path / "ae.json"
    assert main(["train", "-t", "torch:torch_task:make_inputs_only", "-m", "torch:torch_task:AutoEncoder",
                 "-dt", "train:ordered", "-opt", "sgd", "-lr", "0.1", "-bs", "4", "-tstep", "9", "-veps", "-1",
                 "-vmt", "loss", "--no-progress", "-mf", str(model_file), "--report-json", str(report_file)]) == 0
    torch.manual_seed(Opts().seed)
    model = torch_task.AutoEncoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch_task.make_inputs_only("train").tensors[0]
    for start in range(0, 36, 4):
        optimizer.zero_grad()
        model(x[start:start + 4])[1].backward()
        optimizer.step()
    weights = torch.load(model_file, weights_only=True)["model"]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(weights["module." + key], value, rtol=0, atol=1e-6)
    with torch.no_grad():
        valid_loss = float(model(torch_task.make_inputs_only("valid").tensors[0])[1])
    assert json.loads(report_file.read_text())["valid"]["loss"] == pytest.approx(valid_loss, abs=1e-5)


def test_training_without_targets_on_outputs_alone_is_one_line(capsys):
    err = _one_line_error(capsys, ["train", "-t", "torch:torch_task:make_inputs_only", "-m", MODEL, "-bs", "4",
                                   "-vmt", "loss", "-tstep", "2", "--no-progress"])
    assert "have no target" in err and "(outputs, loss)" in err

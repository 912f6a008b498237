"""A plain PyTorch user's mistakes with -t torch:... -m torch:...: each is one line naming the option (-t, -m,
--collate, --dynamic-batching) and what to do, never a traceback or silently wrong numbers
(tests/torch_task.py is the user's code)."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
import torch_task
from accelbatch.backends.engine import loss_of

from accelbatch.cli import main
from accelbatch.opts import build_parser
from accelbatch.plan import PlanError

TASK, MODEL = "torch:torch_task:make_dataset", "torch:torch_task:Classifier"
COMMON = ["-t", TASK, "--no-progress", "-veps", "-1", "--eval-splits", ""]


def _one_line_error(capsys, argv: list[str]) -> str:
    """The run of ``argv`` ends with exit code 2 and one line on stderr: that line."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("mode", ["full", "buckets", "batchsort"])
def test_dynamic_batching_of_a_torch_task_is_refused_before_any_step(tmp_path, capsys, mode):
    """Its items have no text: batching by the placeholder text would size batches by nothing the model sees."""
    report = tmp_path / "r.json"
    err = _one_line_error(capsys, ["train", *COMMON, "-m", MODEL, "-bs", "4", "-tstep", "3",
                                   "--dynamic-batching", mode, "--report-json", str(report)])
    assert f"--dynamic-batching {mode}: -t {TASK}'s items" in err and "leave --dynamic-batching out" in err
    assert not report.exists()  # no step ran


@pytest.mark.parametrize("verb, model, task, says", [
    ("train", "TupleOutputs", TASK, "forward(*inputs, target) returned (outputs, loss) with outputs a tuple"),
    ("train", "DictOutputs", TASK, "forward(*inputs, target) returned (outputs, loss) with outputs a dict"),
    ("eval", "DictOutputs", TASK, "forward(*inputs, target) returned (outputs, loss) with outputs a dict"),
    ("eval", "TupleOutputs", "torch:torch_task:make_inputs_only", "forward(*inputs) returned a tuple"),
], ids=str)
def test_outputs_that_are_not_one_tensor_of_rows_are_one_line_naming_m(capsys, verb, model, task, says):
    argv = [verb, "-t", task, "-m", f"torch:torch_task:{model}", "-bs", "4"]
    err = _one_line_error(capsys, argv + (["-tstep", "2", "--no-progress", "-veps", "-1"] if verb == "train" else []))
    assert f"-m {model}: {says}; the outputs must be one tensor with a row per item (dim 0: 4 rows here)" in err


@pytest.mark.parametrize("verb", ["train", "eval"])
def test_an_empty_dataset_is_one_line_saying_what_to_do(capsys, verb):
    err = _one_line_error(capsys, [verb, "-t", "torch:torch_task:make_empty", "-m", MODEL, "--no-progress"]
                          + (["-veps", "-1"] if verb == "train" else []))
    split = "train" if verb == "train" else "valid"
    assert (f"-t torch:torch_task:make_empty ({split}): the task holds no examples; give its {split} data at "
            "least one (its Dataset: at least one item)") in err


@pytest.mark.parametrize("verb", ["train", "eval"])
def test_a_collate_giving_other_rows_than_items_is_one_line_naming_collate(capsys, verb):
    """Training would take padding rows into the loss, evaluation score rows against the wrong items."""
    bs = 4
    argv = [verb, "-t", TASK, "-m", MODEL, "-bs", str(bs), "--collate", "torch_task:short_collate"]
    err = _one_line_error(capsys, argv + (["-tstep", "2", "--no-progress", "-veps", "-1"] if verb == "train" else []))
    assert (f"--collate torch_task:short_collate returned {bs - 1} rows (a tensor of shape ({bs - 1}, 4)) for the "
            f"{bs} items ") in err and "return one row per item" in err
    if verb == "eval":  # evaluation serves the items in order: the first batch
        assert f"items 0..{bs - 1} of -t {TASK}" in err


def test_loss_of_refuses_a_number_for_the_loss():
    with pytest.raises(PlanError, match=r"'loss' is a float, not a tensor: return the loss tensor itself"):
        loss_of({"loss": 0.25})
    loss = torch.tensor(0.25, requires_grad=True)
    assert loss_of({"loss": loss}) is loss


@pytest.mark.parametrize("verb", ["train", "eval"])
def test_a_loss_returned_as_a_float_is_one_line_naming_m(capsys, verb):
    argv = [verb, "-t", TASK, "-m", "torch:torch_task:FloatLoss", "-bs", "4"]
    err = _one_line_error(capsys, argv + (["-tstep", "2", "--no-progress", "-veps", "-1"] if verb == "train" else []))
    assert "-m FloatLoss: forward(*inputs, target) returned (outputs, loss) with loss a float, not a tensor" in err


def test_interactive_refuses_a_torch_model_in_one_line(tmp_path, monkeypatch, capsys):
    model_file = tmp_path / "m.pt"
    assert main(["train", *COMMON, "-m", MODEL, "-bs", "4", "-tstep", "1", "-mf", str(model_file)]) == 0
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    err = _one_line_error(capsys, ["interactive", "-t", TASK, "-m", MODEL, "-mf", str(model_file)])
    assert f"-m {MODEL}: interactive types text to the model" in err and "display-model" in err


def _train_exs(tmp_path, capsys, *extra: str) -> int:
    report = tmp_path / "r.json"
    assert main(["train", *COMMON, "-m", MODEL, "-dt", "train:ordered", "-bs", "4", "--report-json", str(report),
                 *extra]) == 0, capsys.readouterr().err
    return json.loads(report.read_text())["train"]["exs"]


def test_drop_last_help_tells_what_an_ordered_pass_ends_with(tmp_path, capsys):
    """The help's claims, checked: with train:ordered a pass of 37 items ends in a partial batch, trained with
    D=1 either way; with D=2 (8 rows a call, 5 left) --no-drop-last runs it as a tail, --drop-last refuses it."""
    text = next(a.help for a in build_parser()._actions if "--drop-last" in a.option_strings)
    assert "train:ordered ends a pass with partial steps" in text and "--no-drop-last runs them as tails" in text
    items = torch_task.SIZES["train"]
    steps = math.ceil(items / 4)
    assert _train_exs(tmp_path, capsys, "-tstep", str(steps), "--drop-last") == items
    assert _train_exs(tmp_path, capsys, "-tstep", str(steps), "--no-drop-last") == items
    calls = math.ceil(items / 8)
    assert _train_exs(tmp_path, capsys, "-di", "2", "-tstep", str(calls), "--no-drop-last") == items
    err = _one_line_error(capsys, ["train", *COMMON, "-m", MODEL, "-dt", "train:ordered", "-bs", "4", "-di", "2",
                                   "-tstep", str(calls), "--drop-last"])
    assert f"a step of {items % 8} rows" in err and "add --no-drop-last" in err  # before the first step


def test_items_whose_target_dtypes_differ_are_one_line_naming_the_item(capsys):
    """A float target among class indices (default_collate would make every target of its batch a float, and
    the loss fail deep in torch whichever batch it fell in) is named when the data is read."""
    err = _one_line_error(capsys, ["train", *COMMON, "-t", "torch:torch_task:make_mixed_dtypes", "-m", MODEL,
                                   "-bs", "4", "-tstep", "2"])
    assert ("-t torch:torch_task:make_mixed_dtypes (train): item 3's part 1 is torch.float32, item 0's "
            "torch.int64; give every item's part the same dtype") in err


def test_a_module_without_parameters_is_refused_for_training_naming_m(capsys):
    err = _one_line_error(capsys, ["train", *COMMON, "-m", "torch:torch_task:NoParameters", "-bs", "4",
                                   "-tstep", "2"])
    assert "-m torch:torch_task:NoParameters: the module has no parameter that requires grad" in err
    assert main(["eval", "-t", TASK, "-m", "torch:torch_task:NoParameters", "-bs", "4", "--no-progress"]) == 0


def test_python_and_numpy_numbers_become_tensors_as_python_numbers_do():
    """README: an item's Python float gives float32 (torch's default_collate would give float64), an int int64;
    numpy's scalars give what the Python number they hold does (numpy's int64 and float32 were refused)."""
    import numpy as np

    from accelbatch.tasks.torch_data import items_of

    given = [1.5, np.float64(2.5), np.float32(0.5), 3, np.int64(4), np.int32(5)]
    items = items_of([(torch.zeros(2), t) for t in given], "t", "train")
    assert [item[1].dtype for item in items] == [torch.float32] * 3 + [torch.int64] * 3
    assert [item[1].item() for item in items] == [1.5, 2.5, 0.5, 3, 4, 5]


@pytest.mark.parametrize("task, says", [
    ("make_ragged_valid", "(valid): item 22 cannot be batched with item 0: part 0 has shape (6,) against (4,)"),
    ("make_extra_part", "(train): item 6 has 3 parts, item 0 2; every item needs the same parts"),
], ids=["shape", "parts"])
def test_items_default_collate_cannot_batch_are_named_with_their_split_before_any_step(tmp_path, capsys, task, says):
    """Checked when the data is read: an odd item alone in its batch, or whose extra part has the dtype of
    another, would otherwise fail in the user's model after a whole epoch (or be batched wrongly)."""
    assert len(torch_task.make_ragged_valid("valid")) == 23  # the odd item is alone in the last batch of 11
    report = tmp_path / "r.json"
    err = _one_line_error(capsys, ["train", "-t", f"torch:torch_task:{task}", "-m", MODEL, "-bs", "11", "-ne", "1",
                                   "--no-progress", "--report-json", str(report)])
    assert f"-t torch:torch_task:{task} {says}" in err
    assert not report.exists()


def test_a_getitem_raising_stopiteration_is_named_with_the_users_message_and_line(capsys):
    err = _one_line_error(capsys, ["train", *COMMON, "-t", "torch:torch_task:make_stops_reading", "-m", MODEL,
                                   "-bs", "4", "-tstep", "2"])
    assert (f"item {torch_task.FAULTY_ITEM}: __getitem__ raised StopIteration: record {torch_task.FAULTY_ITEM} "
            "truncated at torch_task.py:") in err


def test_items_of_several_lengths_train_one_a_batch(tmp_path, capsys):
    """default_collate meets one item a call at -bs 1: items of several lengths are no error there."""
    report = tmp_path / "r.json"
    args = ["-t", "torch:torch_task:make_ragged_sequences", "-m", "torch:torch_task:PooledClassifier"]
    assert main(["train", *args, "-bs", "1", "-ne", "1", "--no-progress", "--report-json", str(report)]) == 0
    assert json.loads(report.read_text())["test"]["exs"] == torch_task.SIZES["test"]
    err = _one_line_error(capsys, ["train", *args, "-bs", "2", "-ne", "1", "--no-progress"])
    assert "(train): item 1 cannot be batched with item 0: part 0 has shape (2,) against (1,)" in err
    # -bs 1 with -di 2: a call's items are batched together (poptorch.DataLoader's combined batch), as said
    err = _one_line_error(capsys, ["train", *args, "-bs", "1", "-di", "2", "-ne", "1", "--no-progress"])
    assert ("(train): item 1 cannot be batched with item 0 (-bs 1 x -di 2 = 2 items are batched together, as "
            "poptorch.DataLoader's combined batch): part 0 has shape (2,) against (1,)") in err

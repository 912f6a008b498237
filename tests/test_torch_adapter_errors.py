"""The user's own torch Dataset and model (-t torch:pkg.mod:make_dataset -m torch:pkg.mod:Model) meeting the
calling convention: a forward that cannot take an item's parts is one line naming -m and -t (not a TypeError
from inside the step); items of more than 100 parts reach forward in their order; a mistyped submodule of an
importable package is named as such (not with the current-folder advice). Each test writes its own package
in tmp_path, under a name no other test imports."""

from __future__ import annotations

import sys
import textwrap

import pytest

from accelbatch.cli import main

DATA = '''
import torch
from torch.utils.data import TensorDataset


def make_dataset(split):
    """16 items (x, idx, y): two inputs and a class target."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(16, 4, generator=g), torch.arange(16), torch.randint(0, 2, (16,), generator=g))


def make_inputs_only(split):
    """16 items of one tensor each: no target."""
    return TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)))


PARTS = 102  # inputs per item of make_wide: past 100, where "input100" sorts before "input11" as text


def make_wide(split):
    """8 items of PARTS inputs (input i of item n holds n * 1000 + i) and a class target."""
    return [tuple(torch.tensor([float(n * 1000 + i)]) for i in range(PARTS)) + (torch.tensor(n % 2),)
            for n in range(8)]


class Base(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)


class TwoArg(Base):  # the tester's model: one input and the target, on items of two inputs and the target
    def forward(self, x, target=None):
        out = self.lin(x)
        return out if target is None else (out, torch.nn.functional.cross_entropy(out, target))


class OneArg(Base):
    def forward(self, x):
        return self.lin(x)


class NeedsMask(Base):  # inputs-only items: forward(x) is called, this one needs a second input
    def forward(self, x, mask):
        return self.lin(x * mask)


class InnerTypeError(Base):  # fits the items; its own body raises a TypeError, which is the user's to see
    def forward(self, x, idx, target):
        raise TypeError("raised inside forward")


class Wide(Base):
    """Takes every part; records the inputs it was given (first row's values), in the order given."""
    seen: list = []

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(PARTS, 2)

    def forward(self, *parts):
        *inputs, target = parts
        Wide.seen.append([int(t[0, 0]) for t in inputs])
        out = self.lin(torch.cat(inputs, dim=1))
        return out, torch.nn.functional.cross_entropy(out, target)
'''


def _package(tmp_path, monkeypatch, name: str) -> str:
    """Package ``name`` (DATA as ``name.data``) in tmp_path, importable and in the current folder."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "data.py").write_text(textwrap.dedent(DATA))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _one_line_error(capsys, argv: list[str]) -> str:
    """The run of ``argv`` ends with exit code 2 and one line on stderr: that line."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    return err


def _argv(verb: str, task: str, model: str) -> list[str]:
    train = ["-tstep", "2", "-veps", "-1", "--eval-splits", ""] if verb == "train" else []
    return [verb, "-t", task, "-m", model, "-bs", "4", "--no-progress", *train]


@pytest.mark.parametrize("verb", ["train", "eval"])
@pytest.mark.parametrize("model, signature", [("TwoArg", "(x, target=None)"), ("OneArg", "(x)")])
def test_a_forward_that_cannot_take_the_items_parts_is_one_line_naming_m_and_t(tmp_path, monkeypatch, capsys,
                                                                               verb, model, signature):
    pkg = _package(tmp_path, monkeypatch, f"fit_{verb}_{model.lower()}")
    task, module = f"torch:{pkg}.data:make_dataset", f"torch:{pkg}.data:{model}"
    err = _one_line_error(capsys, _argv(verb, task, module))
    assert (f"-m {module}: {model}.forward{signature} cannot take the 2 inputs and the target of -t {task}'s "
            "items (3 parts: the inputs, then the target last) (too many positional arguments); accelbatch calls "
            "forward(*inputs, target) with them: give forward one parameter per input, then the target (e.g. def "
            "forward(self, x0, x1, target=None))") in err


def test_a_forward_needing_more_than_inputs_only_items_give_is_one_line(tmp_path, monkeypatch, capsys):
    pkg = _package(tmp_path, monkeypatch, "fit_mask")
    task, module = f"torch:{pkg}.data:make_inputs_only", f"torch:{pkg}.data:NeedsMask"
    err = _one_line_error(capsys, _argv("eval", task, module))
    assert (f"-m {module}: NeedsMask.forward(x, mask) cannot take the 1 input of -t {task}'s items (no target: one "
            "part each) (missing a required argument: 'mask'); accelbatch calls forward(*inputs) with them") in err


def test_a_type_error_inside_a_fitting_forward_is_not_reworded(tmp_path, monkeypatch, capsys):
    """Only the call's misfit is the option error: the user's own TypeError keeps its traceback."""
    pkg = _package(tmp_path, monkeypatch, "fit_inner")
    with pytest.raises(TypeError, match="raised inside forward"):
        main(_argv("eval", f"torch:{pkg}.data:make_dataset", f"torch:{pkg}.data:InnerTypeError"))


def test_items_of_more_than_100_inputs_reach_forward_in_their_order(tmp_path, monkeypatch, capsys):
    pkg = _package(tmp_path, monkeypatch, "wide_order")
    assert main(_argv("eval", f"torch:{pkg}.data:make_wide", f"torch:{pkg}.data:Wide")) == 0
    data = sys.modules[f"{pkg}.data"]
    items = data.make_wide("valid")
    assert data.Wide.seen  # every batch's first item, its inputs in the order forward got them
    for seen in data.Wide.seen:
        n = seen[0] // 1000  # the item (its first input holds n * 1000)
        assert seen == [int(part[0]) for part in items[n][:-1]]


def test_a_mistyped_submodule_of_an_importable_package_is_named_without_the_folder_advice(tmp_path, monkeypatch,
                                                                                         capsys):
    """The package imports (it is on the path): the advice to add the current folder would be followed already."""
    pkg = _package(tmp_path, monkeypatch, "typo_pkg")
    err = _one_line_error(capsys, ["train", "-t", f"torch:{pkg}.dta:make_dataset", "-m", f"torch:{pkg}.data:TwoArg",
                                   "-tstep", "1", "--no-progress"])
    assert (f"no module named '{pkg}.dta' (the package {pkg}, in {tmp_path / pkg}, has no module 'dta'; did you "
            f"mean '{pkg}.data'?)") in err
    assert "current folder" not in err

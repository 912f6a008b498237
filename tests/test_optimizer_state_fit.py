"""A saved optimizer state must fit the parameters it is loaded for: torch's load_state_dict pairs states with
parameters by position and checks only their number, so a state of other shapes (a model whose layers were
declared in another order, an edited file) failed at the first step with a traceback. It is refused in one
line naming the file, the state and the parameter."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from accelbatch.checkpoint import CheckpointError
from accelbatch.cli import main
from accelbatch.optimizers import state_misfit
from accelbatch.state import _check_optimizer_kind


def _two_layers(first_wide: bool) -> nn.Module:
    """Layers a (3x5) and b (5x2), declared in one order or the other (the same names and weights)."""
    model = nn.Module()
    layers = {"a": nn.Linear(5, 3, bias=False), "b": nn.Linear(2, 5, bias=False)}
    for name in ("a", "b") if first_wide else ("b", "a"):
        model.add_module(name, layers[name])
    return model


def _stepped_state(model: nn.Module, kind=torch.optim.Adam) -> dict:
    optimizer = kind(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return optimizer.state_dict()


def test_a_state_saved_for_the_parameters_in_another_order_does_not_fit():
    saved = _stepped_state(_two_layers(first_wide=True))
    same, reordered = _two_layers(first_wide=True), _two_layers(first_wide=False)
    assert state_misfit(saved, torch.optim.Adam(same.parameters()), same) is None
    assert state_misfit(saved, torch.optim.Adam(reordered.parameters()), reordered) == \
        "its exp_avg of b.weight is [3, 5], the parameter [5, 2]"


def test_factored_and_scalar_states_fit():
    # Adafactor keeps a row and a column variance per matrix (they broadcast to it); every step count is 0-d
    model = _two_layers(first_wide=True)
    saved = _stepped_state(model, torch.optim.Adafactor)
    shapes = {tuple(v.shape) for s in saved["state"].values() for v in s.values() if torch.is_tensor(v)}
    assert (3, 1) in shapes and (1, 5) in shapes and () in shapes, shapes
    assert state_misfit(saved, torch.optim.Adafactor(model.parameters()), model) is None


class RowFactored(torch.optim.Optimizer):
    """Not one of torch's: keeps a per-row second moment of each matrix, [rows] (fairseq's Adafactor layout)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                row = self.state[p].setdefault("exp_avg_sq_row", torch.zeros(p.shape[:-1]))
                row.add_(p.grad.pow(2).mean(-1))
                p.data.add_(-group["lr"] * p.grad / (row.unsqueeze(-1).sqrt() + 1e-8))


def test_another_optimizers_own_state_layout_is_not_checked():
    model = _two_layers(first_wide=True)
    saved = _stepped_state(model, RowFactored)
    assert {tuple(s["exp_avg_sq_row"].shape) for s in saved["state"].values()} == {(3,), (5,)}
    assert state_misfit(saved, RowFactored(model.parameters()), model) is None


def test_an_elementwise_state_of_another_shape_does_not_fit_even_where_it_broadcasts():
    wide, narrow = nn.Linear(4, 4, bias=False), nn.Linear(4, 1, bias=False)  # [4, 4] and [1, 4]
    saved = _stepped_state(narrow)
    assert state_misfit(saved, torch.optim.Adam(wide.parameters()), wide) == \
        "its exp_avg of weight is [1, 4], the parameter [4, 4]"


def test_resuming_a_checkpoint_whose_state_does_not_fit_is_one_line():
    saved = _stepped_state(_two_layers(first_wide=True))
    reordered = _two_layers(first_wide=False)
    ckpt = types.SimpleNamespace(optimizer_state=saved, path="run/m.pt.ckpt")
    with pytest.raises(CheckpointError) as err:
        _check_optimizer_kind(ckpt, torch.optim.Adam(reordered.parameters()), types.SimpleNamespace(optimizer="adam"),
                              reordered)
    assert str(err.value) == ("--resume: run/m.pt.ckpt: its Adam state does not fit this model's parameters (its "
                              "exp_avg of b.weight is [3, 5], the parameter [5, 2]); start afresh without --resume")


@pytest.mark.timeout(120)
def test_continuing_a_model_file_whose_state_does_not_fit_is_one_line(tmp_path, capsys):
    path = str(tmp_path / "m.pt")
    quiet = ["--no-progress", "--eval-splits", "", "-veps", "-1", "-bs", "4", "-esz", "16"]
    assert main(["train", "-t", "babi:1", "-m", "bag", "-tstep", "2", "-mf", path, *quiet]) == 0
    state = torch.load(path, weights_only=True)
    states = state["optimizer"]["state"]
    states[1], states[2] = states[2], states[1]  # text_emb [8192, 16] and proj [16, 16] swap their moments
    torch.save(state, path)
    capsys.readouterr()
    assert main(["train", "-t", "babi:1", "-m", "bag", "-tstep", "4", "-mf", path, *quiet]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert err.startswith(f"accelbatch: error: --model-file {path}: its Adam state does not fit this BagAgent's "
                          "parameters (its exp_avg of text_emb.weight is [16, 16], the parameter [8192, 16]); "), err
    assert err.endswith(f"start from its weights alone: --init-model {path} -mf ANOTHER_PATH"), err

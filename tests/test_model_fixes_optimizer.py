"""bag and conv build the optimizer ``--optimizer`` names at ``--learning-rate``, as every TorchAgent does (they
always built SGD), and their defaults (Adam, 0.01) learn a task they can learn."""

from __future__ import annotations

import pytest
import torch

import accelbatch as ab
from accelbatch.names import resolve_agent_class
from accelbatch.run import run


@pytest.mark.parametrize("model", ["bag", "conv"])
def test_bag_and_conv_honour_the_optimizer_option(model):
    for name, kind in (("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)):
        agent = resolve_agent_class(model)(ab.Opts(model=model, optimizer=name, learning_rate=0.03, embedding_size=8))
        assert type(agent.optimizer) is kind, name
        assert [g["lr"] for g in agent.optimizer.param_groups] == [0.03]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["bag", "conv"])
def test_the_default_optimizer_learns_dialogues(model):
    # chance is about 1 in 10; SGD at the default -lr 0.01 reached 0.14 (bag) and 0.11 (conv) valid accuracy,
    # Adam at 0.01 reaches 0.65 and 0.58 (2 epochs of dialogues:1000)
    torch.set_num_threads(1)
    opts = ab.Opts(task="dialogues:1000", model=model, num_epochs=2, eval_splits="valid", progress=False)
    report = run(ab.create_world(opts), opts)
    assert report["valid"]["accuracy"] > 0.4


def test_an_ipu_trained_model_file_continued_on_another_device_says_its_optimizer_starts_afresh(tmp_path, capsys):
    """The IPU keeps Adam's moments in its own format, which a torch optimizer cannot take: a -mf trained there
    and continued on the cpu started Adam afresh without a word (cpu -> ipu and --resume said so)."""
    from accelbatch.cli import main

    model = tmp_path / "m.pt"
    args = ["train", "-t", "babi:1", "-m", "bag", "-esz", "16", "-bs", "8", "-opt", "adam", "-veps", "-1",
            "--eval-splits", "", "--no-progress", "-mf", str(model)]
    assert main([*args, "-tstep", "3", "--device", "ipu", "--ipu-emulator"]) == 0
    capsys.readouterr()
    assert main([*args, "-tstep", "6", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert f"--model-file {model}: its Adam state was kept by an IPU (the device's format); --device cpu cannot " \
           "read it: it starts afresh" in err, err

"""A script of yours that reads its options with ``Opts.from_args`` (as examples/custom_agent.py does): its
errors and usage name the script, and a -m that the agent it builds replaces is said, not ignored in silence."""

from __future__ import annotations

import sys

import pytest

from accelbatch.models.bag import BagAgent
from accelbatch.names import say_unused_model
from accelbatch.opts import Opts


def test_a_scripts_option_errors_and_usage_name_the_script(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["/somewhere/my_script.py"])
    with pytest.raises(SystemExit) as info:
        Opts.from_args(["--bogus"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        "my_script.py: error: unrecognized arguments: --bogus (see `my_script.py --help`)")
    with pytest.raises(SystemExit):
        Opts.from_args(["--help"])
    assert capsys.readouterr().out.startswith("usage: my_script.py ")


@pytest.mark.parametrize("model, said", [("no_such_agent", True), ("seq2seq", True), ("bag", False),
                                         ("memnn", False)])
def test_a_model_name_the_given_agent_class_replaces_is_said(capsys, model, said):
    say_unused_model(model, BagAgent, default="memnn")  # memnn: the default, given or not
    err = capsys.readouterr().err
    assert (f"-m/--model {model!r} is not used: create_world(agent=BagAgent) builds the agent given" in err) == said
    say_unused_model(model, BagAgent(Opts(model="bag")), default="memnn")  # an agent made: a validation world's
    assert capsys.readouterr().err == ""

"""What the command line says about options: help texts per verb, and the flag a refusal names."""

from __future__ import annotations

import pytest

from accelbatch.cli import main


def _help(capsys: pytest.CaptureFixture, verb: str) -> str:
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("verb", ["eval", "display-model", "interactive"])
def test_verbs_that_only_load_a_model_do_not_promise_to_save_it(capsys: pytest.CaptureFixture, verb: str) -> None:
    text = _help(capsys, verb)
    assert "the model to load" in text
    assert "save the model here" not in text


def test_train_help_says_model_file_is_saved(capsys: pytest.CaptureFixture) -> None:
    assert "save the model here after training" in _help(capsys, "train")


def test_drop_last_help_says_where_it_acts(capsys: pytest.CaptureFixture) -> None:
    assert "with --dynamic-batching" in _help(capsys, "train")


def test_eval_refusal_names_the_no_form_of_a_switch_as_given(capsys: pytest.CaptureFixture) -> None:
    assert main(["eval", "--no-drop-last"]) == 2
    err = capsys.readouterr().err
    assert "--no-drop-last" in err and "a training option" in err

"""A command ported from ParlAI: its flag for the epochs (-eps) is taken; its flags accelbatch does not take are
refused in one line naming what to give here, where argparse said only "unrecognized arguments"; ParlAI's
factories are named with accelbatch's way."""

from __future__ import annotations

import pytest

import accelbatch as ab
from accelbatch.cli import main
from accelbatch.models.bag import BagAgent
from accelbatch.opts import Opts, build_parser
from accelbatch.parlai_flags import PARLAI_ONLY

QUIET = ["--no-progress", "-veps", "-1", "--eval-splits", ""]


def test_parlais_eps_is_the_number_of_epochs():
    assert Opts.from_args(["-eps", "2.5"]).num_epochs == 2.5
    assert Opts.from_args(["-eps", "2"]) == Opts.from_args(["-ne", "2"]) == Opts(num_epochs=2.0)


@pytest.mark.parametrize("flag, instead", [(flag, instead) for flags, instead in PARLAI_ONLY.items() for flag in flags])
def test_each_parlai_only_flag_is_refused_in_one_line_saying_what_to_give(capsys, flag, instead):
    with pytest.raises(SystemExit) as stop:
        main(["train", "-t", "babi:1", flag, "1", *QUIET])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{flag}: {instead}" in err
    assert "unrecognized" not in err


def test_parlais_eval_ne_is_refused_naming_its_meaning_there(capsys):
    assert main(["eval", "-t", "babi:1", "-m", "repeat_label", "-ne", "100", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ParlAI's -ne of eval and display is its count of examples" in err


@pytest.mark.parametrize("name", ["create_agent", "create_task"])
def test_parlais_factories_name_accelbatchs_way(name):
    with pytest.raises(AttributeError, match=rf"no attribute '{name}' \(ParlAI's; here ab.create_world"):
        getattr(ab, name)
    with pytest.raises(AttributeError, match=r"no attribute 'nothing_here'$"):
        ab.nothing_here  # noqa: B018


class DictBag(BagAgent):
    """An agent declaring ParlAI's -df/--dict-file itself: its option, not accelbatch's refusal."""

    @classmethod
    def add_cmdline_args(cls, parser, partial_opt=None):
        parser.add_argument("-df", "--dict-file", type=str, default="my.dict", help="the agent's dictionary")
        return parser


def test_a_refused_parlai_flag_an_agent_or_a_script_declares_is_theirs(tmp_path):
    assert Opts.from_args(["-m", f"{__name__}:DictBag", "-df", "x.dict"],
                          agent=DictBag).agent_args == {"dict_file": "x.dict"}
    parser = build_parser(prog="myscript.py")
    parser.add_argument("-o", "--out", default="result.json")  # a script's own -o
    assert parser.parse_args(["-t", "babi:1", "-o", "summary.json"]).out == "summary.json"
    with pytest.raises(SystemExit):  # not declared: still refused
        build_parser().parse_args(["-o", "summary.json"])


@pytest.mark.parametrize("argv, display, progress", [(["--display-examples", "true"], True, None),
                                                     (["--display-examples", "False"], False, None),
                                                     (["--progress", "0"], False, False),
                                                     (["--no-progress", "no"], False, True)], ids=str)
def test_parlais_value_after_a_switch_is_read_as_the_switch_or_its_no_form(argv, display, progress):
    """ParlAI's type='bool' flags take a value (`--display-examples true`): it was 'unrecognized arguments'."""
    opts = Opts.from_args(argv)
    assert (opts.display_examples, opts.progress) == (display, progress)


def test_a_word_after_a_switch_is_a_positional_where_the_parser_has_one():
    """report's RUN_DIR (a run folder named 1) and a script's own positional keep their word."""
    parser = build_parser(prog="sweep.py")
    parser.add_argument("trial", nargs="?", default="0")
    args = parser.parse_args(["--progress", "1"])
    assert (args.trial, args.progress) == ("1", True)


def test_a_declared_option_of_a_refused_name_is_read_in_its_equals_form_too():
    assert Opts.from_args(["-m", f"{__name__}:DictBag", "--dict-file=x.dict"],
                          agent=DictBag).agent_args == {"dict_file": "x.dict"}

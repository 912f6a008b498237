"""An agent's own options, declared by ParlAI's ``add_cmdline_args``: on the command line (and --help) of the
verbs that build it, kept in PATH.opt for eval -mf, read as ``opts["hidden"]`` (ParlAI's ``opt["hidden"]``);
through the Python API as ``Opts(agent_args=...)``. Before, a ParlAI agent reading ``opts["hidden"]`` failed
with KeyError and ``--hidden 7`` was an unrecognized argument."""

from __future__ import annotations

import json

import pytest
import torch

import accelbatch as ab
from accelbatch.cli import main
from accelbatch.models.bag import BagAgent
from accelbatch.opts import OptionError

ME = __name__


class WideBag(BagAgent):
    """A bag agent whose embedding width is ``--width``, its own option, as a ParlAI agent declares one."""

    @classmethod
    def add_cmdline_args(cls, parser, partial_opt=None):
        super().add_cmdline_args(parser, partial_opt=partial_opt)
        group = parser.add_argument_group("WideBag Arguments")
        group.add_argument("--width", type=int, default=16, help="the embedding width")
        group.add_argument("--tag", type=str, default="plain", hidden=True)
        group.add_argument("--shout", type="bool", default=False, help="upper-case the tag")
        group.add_argument("-esz", "--embedding-size", type=int, default=99)  # accelbatch's own: it serves
        return parser

    def __init__(self, opts, shared=None):
        if shared is None:
            opts = opts.replace(embedding_size=opts["width"])
        super().__init__(opts, shared)
        self.seen = {k: opts.get(k) for k in ("width", "tag", "shout")}


class OldStyle(BagAgent):
    """ParlAI's older signature: a staticmethod taking the parser alone."""

    @staticmethod
    def add_cmdline_args(argparser):
        argparser.add_argument("--depth", type=int, default=2)


def _embedding_width(path) -> int:
    state = torch.load(path, weights_only=True)
    weights = state.get("model", state)
    return next(t.shape[1] for name, t in weights.items() if name.endswith("weight") and t.dim() == 2)


def _agent(opts: ab.Opts, cls=WideBag):
    return ab.create_world(opts, agent=cls).get_model_agent()


def test_help_lists_the_agent_s_own_options_with_their_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "-m", f"{ME}:WideBag", "--help"])
    out = capsys.readouterr().out
    assert "WideBag Arguments (-m WideBag's own options):" in out
    assert "--width WIDTH" in out and "the embedding width (default: 16)" in out
    assert "--shout" in out and "--tag" not in out  # ParlAI's hidden=True: left out of --help
    assert "-esz" not in out.split("WideBag Arguments")[1]  # accelbatch's own -esz serves: not declared again


def test_given_options_train_the_agent_and_are_kept_for_eval(tmp_path, capsys):
    path = tmp_path / "m.pt"
    assert main(["train", "-m", f"{ME}:WideBag", "--width", "8", "--shout", "true", "-tstep", "2", "-mf", str(path),
                 "--no-progress", "--eval-splits", ""]) == 0
    assert _embedding_width(path) == 8  # the default would give 16
    kept = json.loads((tmp_path / "m.pt.opt").read_text())
    assert kept["agent_args"] == {"width": 8, "shout": True, "tag": "plain"}  # as the agent was built
    capsys.readouterr()
    report = tmp_path / "r.json"
    assert main(["eval", "-mf", str(path), "--tag", "loud", "--no-progress", "-dt", "valid",
                 "--report-json", str(report)]) == 0  # -m, --width 8 and --shout from PATH.opt; --tag given
    assert "the agent's width=8, shout=True (" in capsys.readouterr().err  # the given --tag is not said
    assert json.loads(report.read_text())["valid"]["exs"] == 1000
    agent = _agent(ab.Opts(model=f"{ME}:WideBag", model_file=str(path), datatype="valid",
                           agent_args={**kept["agent_args"], "tag": "loud"}))
    assert main(["train", "--init-model", str(path), "-mf", str(tmp_path / "n.pt"), "--width", "8", "-tstep", "1",
                 "--no-progress", "--eval-splits", ""]) == 0  # -m and the agent's options from the file's .opt
    assert _embedding_width(tmp_path / "n.pt") == 8
    assert agent.seen == {"width": 8, "tag": "loud", "shout": True}


def test_a_misspelt_agent_option_is_still_refused(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["train", "-m", f"{ME}:WideBag", "--widht", "8", "-tstep", "1"])
    assert ended.value.code == 2
    assert "unrecognized arguments: --widht 8" in capsys.readouterr().err


def test_the_api_fills_the_defaults_and_refuses_an_undeclared_option():
    agent = _agent(ab.Opts(model=f"{ME}:WideBag", agent_args={"width": 4}))
    assert agent.seen == {"width": 4, "tag": "plain", "shout": False}
    assert agent.opts["width"] == 4 and "width" in agent.opts and agent.opts.get("depth", 3) == 3
    with pytest.raises(OptionError, match="WideBag declares no option 'depth'"):
        _agent(ab.Opts(agent_args={"depth": 4}))
    with pytest.raises(OptionError, match="has no add_cmdline_args of its own"):
        _agent(ab.Opts(agent_args={"depth": 4}), cls=BagAgent)


def test_the_older_static_signature_is_read():
    assert _agent(ab.Opts(agent_args={"depth": 5}), cls=OldStyle).opts["depth"] == 5
    assert _agent(ab.Opts(), cls=OldStyle).opts["depth"] == 2


def test_opts_without_agent_options_read_as_before():
    opts = ab.Opts()
    assert opts["batchsize"] == opts.batchsize and "hidden" not in opts and opts.get("hidden", 7) == 7
    with pytest.raises(KeyError):
        opts["hidden"]
    with pytest.raises(OptionError, match="agent_args"):
        ab.Opts(agent_args=["width"])


class Ranker(WideBag):
    """Declares ParlAI's TorchRankerAgent -cands/--candidates, a flag interactive has itself, and -n."""

    @classmethod
    def add_cmdline_args(cls, parser, partial_opt=None):
        super().add_cmdline_args(parser, partial_opt=partial_opt)
        parser.add_argument("-cands", "--candidates", type=str, default="inline", choices=["batch", "inline"])
        parser.add_argument("-n", "--n-things", type=int, default=1, help="things, %(default)s of them")


class StoresToBatchsize(BagAgent):
    @classmethod
    def add_cmdline_args(cls, parser, partial_opt=None):
        parser.add_argument("--my-bs", dest="batchsize", type=int, default=4)


class ParlAIOnly(BagAgent):
    @classmethod
    def add_cmdline_args(cls, parser, partial_opt=None):
        parser.add_parlai_data_path()


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 2 and "Traceback" not in "".join(err), err
    return err[-1]


def test_a_flag_the_verb_has_itself_is_the_verb_s(tmp_path, capsys):
    """interactive's --candidates and display-model's -n: an argparse conflict traceback, --help included."""
    path = tmp_path / "r.pt"
    assert main(["train", "-m", f"{ME}:Ranker", "--candidates", "batch", "-tstep", "1", "-mf", str(path),
                 "--no-progress", "--eval-splits", ""]) == 0
    for verb in ("interactive", "display-model"):
        with pytest.raises(SystemExit):
            main([verb, "-mf", str(path), "--help"])
        out = capsys.readouterr().out
        assert "--width WIDTH" in out and ("things, 1 of them" in out) == (verb == "interactive")
    assert main(["display-model", "-mf", str(path), "-n", "1", "--no-progress"]) == 0


def test_declarations_and_values_accelbatch_cannot_keep_are_refused_in_one_line(tmp_path, capsys):
    assert "--my-bs stores to 'batchsize', the name of an option of accelbatch's own" in _error(
        capsys, ["train", "-m", f"{ME}:StoresToBatchsize", "-tstep", "1"])
    assert "ParlAIOnly.add_cmdline_args failed: AttributeError: add_cmdline_args: the parser accelbatch gives " \
           "has no add_parlai_data_path()" in _error(capsys, ["train", "-m", f"{ME}:ParlAIOnly", "--help"])
    with pytest.raises(OptionError, match="agent_args: width = PosixPath.* is not JSON data"):
        ab.Opts(agent_args={"width": tmp_path})


def test_an_agent_that_is_not_found_is_said_before_its_options_are_called_unknown(capsys):
    assert main(["train", "-m", f"{ME}:WideBg", "--width", "3", "-tstep", "1"]) == 2
    assert "has no 'WideBg'" in capsys.readouterr().err


def test_a_model_file_s_stale_or_malformed_agent_options_are_named(tmp_path, capsys):
    path = tmp_path / "m.pt"
    assert main(["train", "-m", f"{ME}:WideBag", "-tstep", "1", "-mf", str(path), "--no-progress",
                 "--eval-splits", ""]) == 0
    opt_file = tmp_path / "m.pt.opt"
    kept = json.loads(opt_file.read_text())
    opt_file.write_text(json.dumps({**kept, "agent_args": {"wdth": 3}}))
    capsys.readouterr()
    assert main(["eval", "-mf", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "declares no option 'wdth'" in err and f"remove it from {path}.opt" in err, err
    opt_file.write_text(json.dumps({**kept, "agent_args": [1]}))
    assert main(["eval", "-mf", str(path), "--no-progress"]) == 2
    assert "its agent_args are [1], not an object" in capsys.readouterr().err


def test_a_resume_before_the_model_file_is_written_takes_the_agent_s_options(tmp_path, capsys):
    """The checkpoint names the agent when -mf PATH is not written yet (a run stopped before its first save)."""
    path = tmp_path / "m.pt"
    assert main(["train", "-m", f"{ME}:WideBag", "--width", "8", "-tstep", "1", "-mf", str(path), "-veps", "-1",
                 "--no-progress", "--eval-splits", ""]) == 0
    path.unlink()
    (tmp_path / "m.pt.opt").unlink()
    assert main(["train", "-mf", str(path), "--resume", "--shout", "true", "-tstep", "2", "--no-progress",
                 "--eval-splits", ""]) == 0
    assert _embedding_width(path) == 8


def test_run_refuses_agent_options_other_than_its_world_s_agent_was_built_with():
    opts = ab.Opts(model=f"{ME}:WideBag", agent_args={"width": 4}, max_train_steps=1, num_epochs=-1,
                   validation_every_n_epochs=-1, eval_splits="", progress=False)
    world = ab.create_world(opts)
    with pytest.raises(OptionError, match="the agent's option width=12, but the world's agent was built with 4"):
        ab.run(world, opts.replace(agent_args={"width": 12}))


class Chooser(BagAgent):
    """An agent with a choice, a number and a switch of its own."""

    @classmethod
    def add_cmdline_args(cls, parser, partial_opt=None):
        parser.add_argument("--mode", choices=["sum", "mean"], default="sum")
        parser.add_argument("--scale", type=float, default=1.0)
        parser.add_argument("--width", type=int, default=16)
        parser.add_argument("--fast", type="bool", default=False)


def test_python_values_are_read_and_checked_as_the_command_line_reads_them(tmp_path):
    """From Python, agent_args={"width": "8"} reached the agent as the text '8' (torch failed later, deep in
    the model) and a value outside the declared choices was taken: now a text is read through the declared
    type, as the command line reads it, and a value the declaration refuses is one line naming the option."""
    agent = _agent(ab.Opts(agent_args={"width": "8", "scale": "0.5", "fast": "yes"}), cls=Chooser)
    assert {k: agent.opts[k] for k in ("width", "scale", "fast", "mode")} == \
        {"width": 8, "scale": 0.5, "fast": True, "mode": "sum"}
    assert type(_agent(ab.Opts(agent_args={"scale": 2}), cls=Chooser).opts["scale"]) is int  # a number stays
    for bad, said in (({"mode": "max"}, r"'mode' is 'max': choose from 'sum', 'mean'"),
                      ({"width": "wide"}, r"'width' is 'wide', not an integer"),
                      ({"width": 2.5}, r"'width' is 2.5, not an integer"),
                      ({"scale": [1]}, r"'scale' is \[1\], not a number"),
                      ({"fast": 3}, r"'fast' is 3, not true or false")):
        with pytest.raises(OptionError, match=f"Chooser's option {said}"):
            _agent(ab.Opts(agent_args=bad), cls=Chooser)
    # an undeclared option is said to be kept by PATH.opt only when PATH.opt keeps it
    path = tmp_path / "m.pt"
    with pytest.raises(OptionError) as refused:
        _agent(ab.Opts(model_file=str(path), agent_args={"depth": 1}), cls=Chooser)
    assert "declares no option 'depth'" in str(refused.value) and "m.pt.opt" not in str(refused.value)
    (tmp_path / "m.pt.opt").write_text(json.dumps({"agent_args": {"depth": 1}}))
    with pytest.raises(OptionError, match="remove it from .*m.pt.opt, which keeps it"):
        _agent(ab.Opts(model_file=str(path), agent_args={"depth": 1}), cls=Chooser)


class LateDefaults(WideBag):
    """ParlAI's pattern: a subclass changes an inherited option's default by set_defaults after declaring."""

    @classmethod
    def add_cmdline_args(cls, parser, partial_opt=None):
        super().add_cmdline_args(parser, partial_opt=partial_opt)
        parser.set_defaults(width=24)


def test_help_shows_a_default_set_after_the_argument(capsys):
    """--help said "(default: 16)" for a width the agent was built with at 24: the help text was fixed when
    the argument was added, before the subclass's set_defaults."""
    with pytest.raises(SystemExit):
        main(["train", "-m", f"{ME}:LateDefaults", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "the embedding width (default: 24)" in out and "(default: 16)" not in out
    assert _agent(ab.Opts(), cls=LateDefaults).seen["width"] == 24


def test_a_script_s_command_line_takes_its_agent_s_options(capsys):
    """``Opts.from_args(argv, agent=cls)``, a script's own command line, reads cls's options as ``accelbatch
    train -m`` does (typed, ParlAI's 'bool', --help under the agent's name) and the agent is built with them."""
    opts = ab.Opts.from_args(["--width", "8", "--shout", "yes", "-bs", "4"], agent=WideBag, task="babi:1")
    assert opts.agent_args == {"width": 8, "shout": True} and (opts.batchsize, opts.task) == (4, "babi:1")
    assert _agent(opts).seen == {"width": 8, "tag": "plain", "shout": True}
    assert ab.Opts.from_args([], agent=WideBag).agent_args == {}   # the agent fills its defaults when built
    with pytest.raises(SystemExit):
        ab.Opts.from_args(["--help"], agent=WideBag)
    assert "the embedding width (default: 16)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as ended:   # without agent=, its options are not the script's
        ab.Opts.from_args(["--width", "8"])
    assert ended.value.code == 2 and "unrecognized arguments: --width 8" in capsys.readouterr().err


def test_python_opts_from_model_file_merges_the_agent_s_options_one_by_one(tmp_path, capsys):
    """``ab.opts_from_model_file(PATH, agent_args={...})`` keeps PATH.opt's other agent options, the given ones
    winning, as ``eval -mf PATH --tag loud`` does (it took the given dict alone: the rest fell to defaults)."""
    path = tmp_path / "m.pt"
    assert main(["train", "-m", f"{ME}:WideBag", "--width", "8", "--shout", "true", "-tstep", "1", "-mf", str(path),
                 "--no-progress", "--eval-splits", ""]) == 0
    capsys.readouterr()
    opts = ab.opts_from_model_file(str(path), datatype="valid", agent_args={"tag": "loud"})
    assert opts.agent_args == {"width": 8, "shout": True, "tag": "loud"}
    assert "the agent's width=8, shout=True (" in capsys.readouterr().err
    assert _agent(opts).seen == {"width": 8, "tag": "loud", "shout": True}


def test_agent_options_kept_for_a_class_the_file_could_not_record_name_m_module_class(tmp_path, capsys):
    """PATH.opt of an agent defined in __main__ keeps its options but not its class: eval -mf PATH builds the
    default agent, and the line says to give -m module:Class (it said to remove the option from the file)."""
    path = tmp_path / "m.pt"
    assert main(["train", "-m", f"{ME}:WideBag", "--width", "8", "-tstep", "1", "-mf", str(path), "--no-progress",
                 "--eval-splits", ""]) == 0
    kept = json.loads((tmp_path / "m.pt.opt").read_text())
    del kept["model"]  # as a training of a class in __main__ writes it
    (tmp_path / "m.pt.opt").write_text(json.dumps(kept))
    capsys.readouterr()
    assert main(["eval", "-mf", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "keeps it for an agent whose class it could not record" in err and "give -m module:Class" in err, err
    assert "remove it from" not in err


def test_help_lists_an_option_s_choices(capsys):
    """A declared choices= option reads {sum,mean} in usage and --help, as argparse writes it (it read MODE)."""
    with pytest.raises(SystemExit):
        ab.Opts.from_args(["--help"], agent=Chooser)
    out = capsys.readouterr().out
    assert "--mode {sum,mean}" in out and "--mode MODE" not in out and "[--mode MODE]" not in out


@pytest.mark.parametrize("after", [["-mcs", "accuracy"], ["-mtw", "1"], ["-mcs=accuracy"]], ids=str)
def test_parlai_flags_beginning_with_m_after_m_leave_the_agent_named(tmp_path, capsys, after):
    """argparse before Python 3.12 read -mcs after -m as -m cs: the agent's options were then unknown."""
    from accelbatch.agent_args import agent_named_in

    assert agent_named_in(["-m", f"{ME}:WideBag", "--width", "8", *after], lambda path: None) == f"{ME}:WideBag"
    path = tmp_path / "m.pt"
    assert main(["train", "-m", f"{ME}:WideBag", "--width", "8", *after, "-tstep", "1", "-mf", str(path),
                 "--no-progress", "--eval-splits", ""]) == 0
    assert _embedding_width(path) == 8


@pytest.mark.parametrize("flag", ["-m", "-mf", "--init-model"])
def test_a_naming_flag_without_its_value_is_one_line(capsys, flag):
    with pytest.raises(SystemExit) as ended:
        main(["train", flag])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1 and "expected one argument" in err, err


def test_an_agents_defaults_for_accelbatchs_own_options_are_the_command_lines(capsys, tmp_path):
    """As ParlAI's parser takes an agent's set_defaults: -esz and -opt default to the agent's (they were dropped
    without a word), an option given wins, and --help shows the agent's defaults."""
    from accelbatch.cli import main

    common = ["train", "-t", "babi:1", "-m", "recording_agent:WiderBag", "-tstep", "1", "-veps", "-1",
              "--eval-splits", "", "--no-progress"]
    assert main(common) == 0
    assert "built: esz 24 opt sgd width 7" in capsys.readouterr().err
    assert main([*common, "-esz", "16", "--width", "5"]) == 0
    assert "built: esz 16 opt sgd width 5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "-m", "recording_agent:WiderBag", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--embedding-size EMBEDDING_SIZE embedding size of reference models (default: 24)" in shown

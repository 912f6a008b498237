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
    assert kept["agent_args"] == {"width": 8, "shout": True}
    capsys.readouterr()
    report = tmp_path / "r.json"
    assert main(["eval", "-mf", str(path), "--tag", "loud", "--no-progress", "-dt", "valid",
                 "--report-json", str(report)]) == 0  # -m, --width 8 and --shout from PATH.opt; --tag given
    assert "--width 8 --shout" in capsys.readouterr().err  # said as the other options taken from PATH.opt
    assert json.loads(report.read_text())["valid"]["exs"] == 1000
    agent = _agent(ab.Opts(model=f"{ME}:WideBag", model_file=str(path), datatype="valid",
                           agent_args={**kept["agent_args"], "tag": "loud"}))
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

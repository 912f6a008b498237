import pytest

from accelbatch.opts import OptionError, Opts, build_parser


def test_parlai_short_flags_parse_into_the_dataclass():
    opts = Opts.from_args(["-t", "babi:2", "-m", "repeat_label", "-bs", "7", "-dt", "valid", "-ne", "2.5",
                           "-nt", "2", "--device", "cpu", "--no-progress"])
    assert (opts.task, opts.model, opts.batchsize, opts.datatype) == ("babi:2", "repeat_label", 7, "valid")
    assert opts.num_epochs == 2.5 and opts.numthreads == 2 and opts.progress is False


def test_defaults_of_parser_and_dataclass_agree():
    assert Opts.from_args([]) == Opts()


def test_parlai_dict_access():
    opts = Opts(batchsize=4)
    assert opts["batchsize"] == 4 and opts.get("missing", 3) == 3 and "task" in opts
    with pytest.raises(KeyError):
        opts["missing"]


@pytest.mark.parametrize("changes, fragment", [
    ({"batchsize": 0}, "-bs"),
    ({"batchsize": "8"}, "--batchsize: expected an integer"),
    ({"device": "tpu"}, "--device: 'tpu' is not one of cpu, cuda, ipu"),
    ({"progress": "yes"}, "--progress: expected true/false"),
    ({"learning_rate": -1.0}, "--learning-rate"),
])
def test_bad_values_name_the_option(changes, fragment):
    with pytest.raises(OptionError, match=fragment.replace("(", r"\(")):
        Opts(**changes)


def test_unknown_device_on_the_command_line_lists_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--device", "tpu"])
    assert exc.value.code == 2
    assert "cpu,cuda,ipu" in capsys.readouterr().err


def test_replace_returns_a_copy():
    opts = Opts()
    other = opts.replace(datatype="valid")
    assert opts.datatype == "train" and other.datatype == "valid"

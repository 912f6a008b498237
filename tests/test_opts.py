from __future__ import annotations

import re

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
    err = capsys.readouterr().err
    assert "invalid choice: 'tpu' (choose from 'cpu', 'cuda', 'ipu')" in err and err.count("\n") == 1, err


def test_replace_returns_a_copy():
    opts = Opts()
    other = opts.replace(datatype="valid")
    assert opts.datatype == "train" and other.datatype == "valid"


@pytest.mark.parametrize("changes, fragment", [
    ({"num_epochs": -5.0}, "-ne/-eps/--num-epochs: must be positive, or -1 for no limit, got -5.0"),
    ({"validation_every_n_epochs": 0.0}, "-veps/--validation-every-n-epochs: must be positive, or -1 for only at "
                                         "the end, got 0.0"),
    ({"num_epochs": 0.0}, "-ne/-eps/--num-epochs: must be positive"),
    ({"max_train_steps": 0}, "-tstep/--max-train-steps: must be positive"),
    ({"validation_max_exs": -2}, "-vme/--validation-max-exs: must be positive"),
    ({"embedding_size": 0}, "-esz/--embedding-size: must be at least 1"),
    ({"resume": True}, "--resume: checkpoints live next to --model-file"),
    ({"save_every_n_secs": 5.0}, "-stim/--save-every-n-secs: checkpoints live next to --model-file"),
    ({"metrics": " , "}, "--metrics: give 'default', 'all'"),
    ({"validation_metric_mode": "up"}, "-vmm/--validation-metric-mode: 'up' is not one of max, min"),
    ({"ddp_static_graph": True}, "--ddp-static-graph: applies to --device cuda"),
    ({"ddp_static_graph": True, "device": "ipu"}, "--ddp-static-graph: applies to --device cuda"),
    ({"learning_rate": float("nan")}, "-lr/--learning-rate: expected a finite number, got nan"),
    ({"learning_rate": 0.0}, "-lr/--learning-rate: must be a positive number, got 0.0"),
    ({"text_truncate": 0}, "-tr/--text-truncate: must be at least 1, or -1 (all of the text), got 0"),
    ({"label_truncate": -2}, "--label-truncate: must be at least 1, or -1 (the model's own), got -2"),
    ({"max_batch_tokens": 0}, "--max-batch-tokens: must be at least 1, or -1 (ParlAI's budget), got 0"),
    ({"numthreads": 2, "replication_factor": 2}, "-nt/--numthreads 2 with -rf/--replication-factor 2: hogwild"),
    ({"validation_patience": 0}, "-vp/--validation-patience: must be positive, or -1 for never, got 0"),
    ({"validation_patience": -2}, "-vp/--validation-patience: must be positive, or -1 for never, got -2"),
    ({"save_every_n_secs": 0.0, "model_file": "m.pt"}, "-stim/--save-every-n-secs: must be positive, or -1 for "
                                                      "only at the end, got 0.0"),
    ({"log_every_n_secs": -2.0}, "-ltim/--log-every-n-secs: must be 0 (every step) or more, or -1 (only at the "
                                 "end), got -2.0"),
])
def test_values_that_cannot_work_are_refused(changes, fragment):
    with pytest.raises(OptionError, match=re.escape(fragment)):
        Opts(**changes)


def test_ddp_static_graph_is_a_cuda_option():
    assert Opts.from_args(["--device", "cuda", "--ddp-static-graph"]).ddp_static_graph


def test_no_limit_and_checkpoint_options_with_a_model_file_are_accepted():
    opts = Opts(num_epochs=-1, max_train_steps=-1, resume=True, save_every_n_secs=5.0, model_file="m.pt")
    assert opts.num_epochs == -1 and opts.resume


@pytest.mark.parametrize("argv", [["--learning-rat", "0.1"], ["--num-ep", "2"], ["--batch", "4"]])
def test_abbreviated_option_names_are_refused(argv, capsys):
    from accelbatch.cli import main

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["train", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"unrecognized arguments: {argv[0]}" in err
    assert err.startswith("accelbatch train: error:") and "(see `accelbatch train --help`)" in err  # the verb's


def test_parlai_names_of_the_new_options():
    opts = Opts.from_args(["-vtim", "30", "-vmm", "min", "-vme", "100", "-stim", "60", "-mf", "m.pt",
                           "--metrics", "accuracy,loss", "--init-model", "init.pt"])
    assert (opts.validation_every_n_secs, opts.validation_metric_mode, opts.validation_max_exs) == (30, "min", 100)
    assert (opts.save_every_n_secs, opts.metrics, opts.init_model) == (60, "accuracy,loss", "init.pt")


def test_on_off_options_parse_without_argparse_boolean_optional_action(monkeypatch):
    """Python 3.8 (the Poplar SDK's) has no argparse.BooleanOptionalAction: --x / --no-x still parse."""
    import argparse

    from accelbatch.opts import add_arguments

    monkeypatch.delattr(argparse, "BooleanOptionalAction")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)
    assert parser.parse_args([]).progress is None  # by default: whether stderr is a terminal
    assert parser.parse_args(["--no-progress"]).progress is False
    assert parser.parse_args(["--no-progress", "--progress"]).progress is True
    assert "--no-progress" in parser.format_help()


FLOAT_OPTIONS = [f.name for f in __import__("dataclasses").fields(Opts) if f.type in ("float", "float | None")]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", FLOAT_OPTIONS)
def test_a_non_finite_number_is_refused_for_every_float_option(name, value):
    # nan passes every range test (nan <= 0 and nan != -1 are both false): -ne nan trained forever
    with pytest.raises(OptionError, match=r"expected a finite number") as refused:
        Opts(**{name: value})
    field = next(f for f in __import__("dataclasses").fields(Opts) if f.name == name)
    # the hint about -1 only where -1 means something (-lr nan pointed to it)
    assert ("what -1 means" in str(refused.value)) == ("-1:" in field.metadata["help"])
    if name == "learning_rate":
        assert str(refused.value) == f"-lr/--learning-rate: expected a finite number, got {value}"


IPU_SETTINGS = {"ipu_loss_scaling": 64.0, "ipu_cache_dir": "cache", "ipu_available_memory_proportion": 0.5,
                "ipu_synthetic_data": True, "ipu_input_replica_grouping": 2,
                "ipu_input_replica_grouping_type": "orthogonal"}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", sorted(IPU_SETTINGS))
def test_the_ipus_own_options_are_refused_on_another_device(name, device):
    """--ipu-synthetic-data, --ipu-loss-scaling, --ipu-cache-dir ... were silently unused on cpu and cuda (a
    run 'timing the model alone' on real data)."""
    grouping = {"replication_factor": 2} if "grouping" in name else {}
    with pytest.raises(OptionError, match=r"applies to --device ipu only") as refused:
        Opts(device=device, **grouping, **{name: IPU_SETTINGS[name]})
    flag = next(f for f in __import__("dataclasses").fields(Opts) if f.name == name).metadata["flags"][0]
    assert str(refused.value).startswith(flag) and f"--device {device}" in str(refused.value)
    settings = dict(IPU_SETTINGS, mixed_precision="fp16", replication_factor=2)
    assert Opts(device="ipu", **settings).ipu_synthetic_data  # all of them together on the IPU


@pytest.mark.parametrize("seed, ok", [(0, True), (2**64 - 1, True), (-1, False), (2**64, False)])
def test_seed_range_is_what_torch_and_numpy_take(seed, ok):
    if ok:
        assert Opts(seed=seed).seed == seed
    else:  # a negative seed failed deep in numpy (generated tasks), one past 2**64 in torch.manual_seed
        with pytest.raises(OptionError, match=r"--seed: must be between 0 and 2\*\*64 - 1"):
            Opts(seed=seed)


@pytest.mark.parametrize("given, read", [("train:ordered:stream", "train:stream:ordered"),
                                         ("train:evalmode:ordered", "train:evalmode"),
                                         ("train:evalmode:stream:ordered", "train:evalmode:stream"),
                                         ("train:evalmode:ordered:stream", "train:evalmode:stream"),
                                         ("train:stream:ordered", "train:stream:ordered")])
def test_parlais_datatype_spellings_in_any_order_of_their_modes_are_read(given, read):
    assert Opts.from_args(["-dt", given]).datatype == read
    assert Opts(datatype=given).datatype == read  # the Python API (Opts, a dict to create_world) as -dt
    assert Opts(eval_splits=f"valid, {given}").eval_splits == f"valid,{read}"
    assert Opts.from_args(["--eval-splits", given]).eval_splits == read


def test_a_datatype_with_a_mode_twice_or_unknown_is_still_refused(capsys):
    for given in ("train:ordered:ordered", "train:shuffled", "valid:ordered"):
        with pytest.raises(SystemExit):
            Opts.from_args(["-dt", given])
        assert f"invalid choice: '{given}'" in capsys.readouterr().err


@pytest.mark.parametrize("name, flag", [("data_timeout_s", "--data-timeout-s"),
                                        ("replica_timeout_s", "--replica-timeout-s")])
def test_a_timeout_beyond_what_poll_waits_is_refused(name, flag):
    """--data-timeout-s 3000000 (35 days) ended in an OverflowError traceback from the data workers' wait."""
    longest = (2 ** 31 - 1) // 1000
    assert getattr(Opts(**{name: longest}), name) == longest
    with pytest.raises(OptionError, match=f"{flag}: must be a positive number of seconds, at most 2,147,483 "):
        Opts(**{name: longest + 1})

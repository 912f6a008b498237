"""An option given that the run's other options leave unread is said in one line (it ran identically, with
no word); the same option where it is read is not."""

from __future__ import annotations

import json

import pytest

from accelbatch.cli import main
from accelbatch.ipu_opts import IPU_ONLY
from accelbatch.opts import Opts
from accelbatch.unused_options import READERS, unused_option_notes

BASE = ["-t", "babi:1", "-m", "bag", "-tstep", "4", "-bs", "4", "--no-progress", "--eval-splits", "valid",
        "-veps", "-1", "-ltim", "-1"]
SCORES = ("accuracy", "f1", "loss", "exs")


def _train(tmp_path, capsys, *extra: str, base: list[str] = BASE) -> tuple[dict, list[str]]:
    capsys.readouterr()
    report = tmp_path / "r.json"
    assert main(["train", *base, "--report-json", str(report), *extra]) == 0
    got = json.loads(report.read_text())
    notes = [line for line in capsys.readouterr().err.splitlines() if "not used by this run" in line]
    return {split: {k: got[split].get(k) for k in SCORES} for split in ("train", "valid")}, notes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, flag", [
    (["--num-buckets", "3"], "--num-buckets"),
    (["--max-batch-tokens", "50"], "--max-batch-tokens"),
    (["--batch-sort-cache-size", "10"], "--batch-sort-cache-size"),
    (["--buffer-size", "7"], "--buffer-size"),
    (["--data-timeout-s", "5"], "--data-timeout-s"),
    (["--beam-size", "3"], "--beam-size"),
    (["-vp", "3"], "-vp/--validation-patience"),
    (["-vcut", "0.5"], "-vcut/--validation-cutoff"),
    (["--replica-timeout-s", "5"], "--replica-timeout-s"),
    (["--beam-min-length", "3"], "--beam-min-length"),  # -m bag ranks candidates: it generates nothing
    (["--skip-generation"], "--skip-generation"),
    (["-vme", "10"], "-vme/--validation-max-exs"),  # no validation while training, one task, no -mf
    (["-vmt", "loss"], "-vmt/--validation-metric"),
    (["-vmm", "min"], "-vmm/--validation-metric-mode"),
    (["--reduction", "sum"], "--reduction"),  # G = R = D = 1: each update is one micro-batch, weighted 1
    (["-di", "2", "--reduction", "sum"], "--reduction"),  # D = 2 in whole calls: each micro-batch its update
    (["--loss-normalization", "token"], "--loss-normalization"),
    (["-mtw", "1,3"], "-mtw/--multitask-weights"),  # one task: nothing is drawn
])
def test_an_option_the_run_does_not_read_is_said_and_changes_nothing(extra, flag, tmp_path, capsys):
    plain, notes = _train(tmp_path, capsys)
    assert notes == []
    given, notes = _train(tmp_path, capsys, *extra)
    if extra[0] == "-di":  # the same run with -di 2 alone, which reads nothing of --reduction
        plain, _ = _train(tmp_path, capsys, *extra[:2])
    assert given == plain  # not read: the run is the same
    said = f"accelbatch: {flag}: not used by this run: it is read only with "
    assert len(notes) == 1 and notes[0].startswith(said), notes


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_option_read_by_the_run_is_not_said(tmp_path, capsys):
    _, notes = _train(tmp_path, capsys, "-dynb", "buckets", "--num-buckets", "3", "--max-batch-tokens", "80",
                      "--dataloader-mode", "async", "--buffer-size", "2", "--data-timeout-s", "30")
    assert notes == []


GENERATOR = {"model": "transformer/generator"}
TORCH_MODEL = {"model": "torch:torch_task:Classifier", "task": "torch:torch_task:make_dataset"}
THEIRS = {"model": "tests.counting_agent:CountingLine"}  # an agent of the user's: it may read any option
MODEL_READS = ([{"model": "repeat_label"}, {"model": "random_candidate"}], [{}, GENERATOR, THEIRS])
BEAMS_READ = ([{}, {**GENERATOR, "skip_generation": True}], [GENERATOR, {**THEIRS, "skip_generation": True}])
VALIDATED = [{"validation_every_n_epochs": 0.5}, {"validation_every_n_secs": 5}, {"model_file": "m"},
             {"resume": True, "model_file": "m"}]
# name -> (where it is unread, where it is read), each on top of -veps -1
WHERE_READ: dict[str, tuple[list[dict], list[dict]]] = {
    "num_buckets": ([{}], [{"dynamic_batching": "buckets"}]),
    "datapath": ([{"task": "babi:1"}, {"task": "dialogues,reverse"}, {"task": "jsonl:/abs/data.jsonl"},
                  {"task": "babi:1,parlai:/abs/d.txt"}],
                 [{"task": "jsonl:data.jsonl"}, {"task": "babi:1,parlai:d.txt"}, {"task": "mypkg.tasks:MyTeacher"},
                  {"task": "torch:mypkg.data:make"}]),
    "log_every_n_secs": ([{"progress": False}], [{"progress": True}, {"metrics_log": "log.jsonl"},
                                                {"tensorboard_logdir": "board"}]),
    "max_batch_tokens": ([{}], [{"dynamic_batching": "full"}]),
    "batch_sort_cache_size": ([{}], [{"dynamic_batching": "batchsort"}]),
    "buffer_size": ([{}], [{"dataloader_mode": "async"}]),
    "data_timeout_s": ([{}], [{"num_workers": 1}]),
    "replica_timeout_s": ([{}], [{"replication_factor": 2}, {"numthreads": 2}]),
    **dict.fromkeys(("ipu_emulator", *IPU_ONLY, "pipeline"), ([{}], [{"device": "ipu"}])),
    "ipu_execution_strategy": ([{}, {"device": "ipu"}], [{"device": "ipu", "pipeline": "encoder"}]),
    "ddp_static_graph": ([{}, {"device": "ipu"}, {"device": "cuda"}], [{"device": "cuda", "replication_factor": 2}]),
    "validation_patience": ([{}, {"model_file": "m"}], [{"validation_every_n_secs": 5}]),
    "validation_cutoff": ([{}], [{"validation_every_n_epochs": 0.5}]),
    "skip_generation": ([{}], [GENERATOR, THEIRS]),
    "beam_size": ([{**GENERATOR, "skip_generation": True}, GENERATOR], [{**GENERATOR, "inference": "beam"}]),
    **dict.fromkeys(("inference", "beam_min_length", "beam_block_ngram"), BEAMS_READ),
    **dict.fromkeys(("validation_metric", "validation_metric_mode"), ([{}], VALIDATED)),
    "validation_max_exs": ([{}, {"task": "babi:1"}], [*VALIDATED, {"task": "babi:1,babi:2"}]),
    "multitask_weights": ([{}, {"task": "babi:1,babi:2", "datatype": "train:ordered"}],
                          [{"task": "babi:1,babi:2"}]),
    "reduction": ([{}, {"device_iterations": 2}],  # whole calls of D micro-batches: each one its update
                  [{"gradient_accumulation": 2}, {"replication_factor": 2}, {"loss_normalization": "token"},
                   {"device_iterations": 2, "drop_last": False}, {"device_iterations": 2, "numthreads": 2},
                   {"resume": True, "model_file": "m"}]),
    "loss_normalization": ([{}, {"device_iterations": 2, "drop_last": False}, GENERATOR],
                           [{"gradient_accumulation": 2}, {"replication_factor": 2}, {"reduction": "sum"},
                            {"resume": True, "model_file": "m"}, THEIRS]),
    **dict.fromkeys(("learning_rate", "optimizer", "compile", "mixed_precision", "skip_nan"),
                    (MODEL_READS[0], [*MODEL_READS[1], TORCH_MODEL])),
    **dict.fromkeys(("embedding_size", "text_truncate", "label_truncate"), ([*MODEL_READS[0], TORCH_MODEL],
                                                                            MODEL_READS[1])),
    **dict.fromkeys(("context_length", "include_labels"), ([TORCH_MODEL], [{}, GENERATOR, THEIRS])),
}


def test_every_reader_is_checked_here():
    assert set(WHERE_READ) == set(READERS)


@pytest.mark.parametrize("name", sorted(WHERE_READ))
def test_each_reader_reads_where_its_note_says(name):
    """The conditions, option by option: a note where it is unread (the code that reads it does not run or
    weighs alike), none under each of the options the note names."""
    unread, reading = WHERE_READ[name]
    base = Opts(validation_every_n_epochs=-1)  # -m memnn: a ranker with weights
    for where in unread:
        assert len(unused_option_notes(base.replace(**where), {name})) == 1, where
    for where in reading:
        assert unused_option_notes(base.replace(**where), {name}) == [], where


@pytest.mark.timeout(120)
def test_model_options_of_an_agent_without_a_model_are_said(tmp_path, capsys):
    """-m repeat_label builds no model, no optimizer and no batches: -esz, -tr, --label-truncate, -lr and -opt
    change nothing (same scores) and are said; -m bag reads them (other scores, no note)."""
    base = [*BASE, "-m", "repeat_label"]
    model = ["-esz", "8", "-tr", "3", "--label-truncate", "2", "-lr", "0.5", "-opt", "sgd"]
    plain, notes = _train(tmp_path, capsys, base=base)
    assert notes == []
    given, notes = _train(tmp_path, capsys, *model, base=base)
    assert given == plain
    assert [n.split(":")[1].strip() for n in notes] == ["-esz/--embedding-size", "-tr/--text-truncate",
                                                       "--label-truncate", "-lr/--learning-rate", "-opt/--optimizer"]
    bag, _ = _train(tmp_path, capsys)
    read, notes = _train(tmp_path, capsys, *model)
    assert notes == [] and read != bag


@pytest.mark.timeout(180)
def test_decoding_options_with_skip_generation_are_said(tmp_path, capsys):
    """--skip-generation: the generator scores the token loss alone and decodes nothing, so --inference and the
    beam options change nothing; without it they are read."""
    base = [*BASE, "-m", "transformer/generator", "-t", "reverse:8", "-esz", "16", "--label-truncate", "4"]
    beams = ["--inference", "beam", "--beam-size", "2", "--beam-min-length", "3", "--beam-block-ngram", "1"]
    plain, notes = _train(tmp_path, capsys, "--skip-generation", base=base)
    assert notes == []
    given, notes = _train(tmp_path, capsys, "--skip-generation", *beams, base=base)
    assert {k: v for k, v in given["valid"].items() if k in ("loss", "exs")} == \
        {k: v for k, v in plain["valid"].items() if k in ("loss", "exs")} and given["train"] == plain["train"]
    assert [n.split(":")[1].strip() for n in notes] == ["--beam-size", "--inference", "--beam-min-length",
                                                       "--beam-block-ngram"]
    _, notes = _train(tmp_path, capsys, *beams, base=base)
    assert notes == []


@pytest.mark.timeout(120)
def test_reduction_is_read_with_several_micro_batches_an_update(tmp_path, capsys):
    """-ga 2: MEAN weighs each micro-batch 1/2, SUM 1: another training, and no note."""
    mean, _ = _train(tmp_path, capsys, "-ga", "2")
    summed, notes = _train(tmp_path, capsys, "-ga", "2", "--reduction", "sum")
    assert notes == [] and summed["train"]["loss"] != mean["train"]["loss"]


@pytest.mark.parametrize("datatype, task, read", [("train:ordered", "babi:1", False), ("valid", "babi:1", False),
                                                  ("train", "babi:1", True), ("train:ordered", "reverse:8", True)])
def test_display_data_reads_the_seed_only_for_a_shuffled_order_or_a_generated_task(datatype, task, read):
    """display-data builds no model: --seed is read by a shuffled order and by the tasks generated from it."""
    import io

    from accelbatch.verbs import display_data

    def shown(seed: int) -> str:
        out = io.StringIO()
        display_data(Opts(task=task, datatype=datatype, seed=seed), 12, out)
        return out.getvalue()

    assert (shown(0) != shown(5)) is read
    opts = Opts(task=task, datatype=datatype, seed=5)
    assert len(unused_option_notes(opts, {"seed"}, verb="display-data")) == (0 if read else 1)
    assert unused_option_notes(opts, {"seed"}) == []  # the other verbs build a model from it


@pytest.mark.parametrize("verb", ["eval", "display-model"])
def test_eval_verbs_read_the_seed_only_without_a_model_file_or_with_seeded_data(verb):
    """eval -mf m.pt --seed 0 and --seed 5 scored alike without a note: the weights come from the file."""
    def notes(**changes):
        return unused_option_notes(Opts(**{"datatype": "valid", **changes}), {"seed", "datapath"}, verb=verb)

    assert [n.split(":")[1].strip() for n in notes(model_file="m.pt")] == ["-dp/--datapath", "--seed"]
    assert len(notes()) == 1  # no -mf: the seed draws the model's initial weights
    assert len(notes(model_file="m.pt", task="dialogues:20")) == 1  # data generated from the seed
    assert len(notes(model_file="m.pt", model="mypkg.agents:Mine")) == 1  # an agent of yours may read it


def test_display_data_says_an_unread_datapath():
    assert len(unused_option_notes(Opts(task="babi:2"), {"datapath"}, verb="display-data")) == 1
    assert unused_option_notes(Opts(task="jsonl:d.jsonl"), {"datapath"}, verb="display-data") == []


def test_a_replica_other_than_rank_0_says_nothing(tmp_path, capsys, monkeypatch):
    """torchrun runs the command in every replica: the notes are said once, by rank 0."""
    monkeypatch.setattr("accelbatch.cli._first_replica", lambda: False)
    _, notes = _train(tmp_path, capsys, "--num-buckets", "3")
    assert notes == []


@pytest.mark.parametrize("env, first", [({}, True), ({"RANK": "1"}, True), ({"RANK": "0", "WORLD_SIZE": "2"}, True),
                                        ({"RANK": "1", "WORLD_SIZE": "2"}, False)])
def test_the_first_replica_is_torchruns_rank_0_or_a_plain_run(env, first, monkeypatch):
    from accelbatch.cli import _first_replica

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _first_replica() is first  # RANK alone (no WORLD_SIZE) is not torchrun's: a plain run


@pytest.mark.timeout(120)
def test_text_options_of_a_torch_model_are_said_neither_kept_nor_compared_on_resume(tmp_path, capsys):
    """-m torch:... builds its module itself from its dataset's tensors: -esz, -tr, --label-truncate and
    --context-length change nothing (the same weights) and are said; PATH.opt does not keep them, and a
    --resume given another -esz goes on (it was refused: 'saved with other options: -esz')."""
    import torch

    base = ["-t", "torch:torch_task:make_dataset", "-m", "torch:torch_task:Classifier", "-bs", "4", "-tstep", "3",
            "--no-progress", "--eval-splits", "", "-veps", "-1"]
    text = ["-esz", "8", "-tr", "5", "--label-truncate", "3", "--context-length", "2"]
    capsys.readouterr()
    assert main(["train", *base, "-mf", str(tmp_path / "plain.pt")]) == 0
    assert "not used by this run" not in capsys.readouterr().err
    assert main(["train", *base, *text, "-mf", str(tmp_path / "text.pt"), "-stim", "0.0001"]) == 0
    notes = [line.split(":")[1].strip() for line in capsys.readouterr().err.splitlines() if "not used by" in line]
    assert notes == ["-esz/--embedding-size", "-tr/--text-truncate", "--label-truncate",
                     "-histsz/--history-size/--context-length"]
    plain, given = (torch.load(tmp_path / f"{name}.pt", weights_only=True)["model"] for name in ("plain", "text"))
    assert plain.keys() == given.keys() and all(torch.equal(plain[k], given[k]) for k in plain)
    kept = json.loads((tmp_path / "text.pt.opt").read_text())
    assert not {"embedding_size", "text_truncate", "label_truncate", "context_length"} & set(kept), kept
    assert main(["train", *base[:-7], "-tstep", "5", "--no-progress", "-mf", str(tmp_path / "text.pt"), "--resume",
                 "-esz", "64"]) == 0


def test_stream_given_to_tasks_that_hold_their_data_in_memory_is_said():
    """':stream' reads jsonl: and parlai: files lazily (a teacher of the user's may read it); accelbatch's
    generated tasks and torch: datasets hold their data either way."""
    for task, said in [("babi:1", True), ("dialogues:50,reverse:20", True), ("torch:torch_task:make_dataset", True),
                       ("jsonl:/data/x", False), ("babi:1,parlai:/data/y", False), ("tests.mine:Teacher", False)]:
        notes = unused_option_notes(Opts(task=task, datatype="train:stream"), {"datatype"})
        assert len(notes) == int(said), (task, notes)
        assert not said or notes[0] == (f"accelbatch: -dt/--datatype train:stream: ':stream' not used by this run: "
                                        f"-t {task} is held in memory (jsonl: and parlai: files stream, and a "
                                        "teacher of yours may)")
    assert unused_option_notes(Opts(task="babi:1", datatype="train"), {"datatype"}) == []

"""The files kept beside a model file (PATH.opt, PATH.trainstats): one that cannot be read is an error naming it,
before anything runs, never silently ignored."""

from __future__ import annotations

import pytest

from accelbatch.cli import main


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``accelbatch ARGS --no-progress`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main([*args, "--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_unreadable_file_beside_the_model_file_is_named_and_nothing_runs(tmp_path, capsys):
    """In this process (a traceback would be an exception that fails the test)."""
    model = tmp_path / "m.pt"
    code, _, err = _cli(capsys, "train", "-t", "babi:1", "-m", "bag", "-tstep", "3", "-esz", "8", "-mf",
                        str(model), "-veps", "0.01", "-vme", "32", "--eval-splits", "")
    assert code == 0, err
    opt, stats = tmp_path / "m.pt.opt", tmp_path / "m.pt.trainstats"
    assert opt.exists() and stats.exists()
    good_opt, weights = opt.read_text(), model.read_bytes()
    for path, text in ((opt, "{bad"), (opt, ""), (opt, "[1, 2]"), (stats, "{oops"), (stats, '{"metric": "accuracy"}')):
        opt.write_text(good_opt)
        path.write_text(text)
        verb = ["eval", "-t", "babi:1"] if path == opt else ["train", "-t", "babi:1", "-tstep", "3"]
        code, out, err = _cli(capsys, *verb, "-mf", str(model))
        lines = err.strip().splitlines()
        assert code == 2, err
        assert "Traceback" not in err, err
        assert lines[-1].startswith(f"accelbatch: error: {path}: cannot be read"), lines[-1]
        assert "train " not in out and model.read_bytes() == weights


@pytest.mark.parametrize("weights", [False, True], ids=["alone", "beside-the-weights"])
@pytest.mark.parametrize("saves", [True, False])
def test_resume_refuses_saves_without_a_manifest_and_keeps_them(tmp_path, capsys, saves, weights):
    """A checkpoint folder whose manifest is gone but whose saves are there is refused naming it (going on
    afresh would overwrite what may be all that is left of a run; resuming from the weights beside it, from
    the data's start and with the default course, passed over it silently); a folder with no save starts
    afresh."""
    from accelbatch.agents import TorchAgent
    from accelbatch.cli import main
    from accelbatch.models.bag import BagAgent
    from accelbatch.opts import Opts

    model = tmp_path / "m.pt"
    folder = tmp_path / "m.pt.ckpt"
    if weights:
        TorchAgent.save(BagAgent(Opts(model="bag", embedding_size=8)), str(model))
    before = model.read_bytes() if weights else None
    folder.mkdir()
    if saves:
        (folder / "gen-000001").mkdir()
        (folder / "gen-000001" / "state.json").write_text("{}")
    rc = main(["train", "-t", "babi:1", "-m", "bag", "-esz", "8", "-tstep", "2", "-mf", str(model), "--resume",
               "--eval-splits", "", "-veps", "-1", "--no-progress"])
    err = capsys.readouterr().err
    if saves:
        assert rc == 2 and f"{folder}: has no MANIFEST.json" in err, err
        assert (folder / "gen-000001" / "state.json").read_text() == "{}"
        assert (model.read_bytes() == before) if weights else not model.exists()
    else:
        afresh = f"no checkpoint at {model}; starting afresh with this command's options (-m bag, -t babi:1)"
        assert rc == 0 and ("holds weights only" if weights else afresh) in err, err


def test_resume_after_a_first_save_cut_short_says_so_and_names_the_options_it_starts_with(tmp_path, capsys):
    """Killed during its first save, a run leaves only the staging folder: --resume starts afresh, saying so
    and naming the -m and -t it starts with (a bare `-mf PATH --resume` would train the default model)."""
    from accelbatch.cli import main

    model, folder = tmp_path / "m.pt", tmp_path / "m.pt.ckpt"
    (folder / ".tmp-gen-000001-4242").mkdir(parents=True)
    assert main(["train", "-mf", str(model), "--resume", "-t", "babi:1", "-m", "bag", "-esz", "8", "-tstep", "1",
                 "--eval-splits", "", "-veps", "-1", "--no-progress"]) == 0
    assert (f"--resume: no checkpoint at {model} (a first save into {folder} was cut short); starting afresh with "
            "this command's options (-m bag, -t babi:1)") in capsys.readouterr().err


def test_a_resume_reads_no_option_from_a_changed_state_file(tmp_path, capsys):
    """A checkpoint's state.json edited after its save (-esz 16 made 32) is refused naming it: its options were
    read before the SHA-256 check, so the error blamed the intact model file and told to change -esz."""
    import glob

    from accelbatch.cli import main

    model = tmp_path / "m.pt"
    common = ["--eval-splits", "", "-veps", "-1", "--no-progress"]
    assert main(["train", "-t", "babi:1", "-m", "bag", "-esz", "16", "-tstep", "2", "-mf", str(model), *common]) == 0
    state = glob.glob(str(tmp_path / "m.pt.ckpt" / "gen-*" / "state.json"))[0]
    text = open(state).read()
    assert '"embedding_size": 16' in text
    with open(state, "w") as out:
        out.write(text.replace('"embedding_size": 16', '"embedding_size": 32'))
    capsys.readouterr()
    assert main(["train", "-mf", str(model), "--resume", *common]) == 2
    err = capsys.readouterr().err
    assert f"{state}: SHA-256 differs from" in err and "-esz" not in err, err


def test_a_resume_says_a_damaged_options_file_beside_the_model(tmp_path, capsys):
    """A finished run resumed (it only evaluates) passed over a truncated PATH.opt, which the next eval of the
    model then refused: said at the resume, naming the file."""
    from accelbatch.cli import main

    model = tmp_path / "m.pt"
    common = ["--eval-splits", "", "-veps", "-1", "--no-progress"]
    assert main(["train", "-t", "babi:1", "-m", "bag", "-esz", "8", "-tstep", "2", "-mf", str(model), *common]) == 0
    (tmp_path / "m.pt.opt").write_text('{"model": "bag", "embedd')
    capsys.readouterr()
    assert main(["train", "-mf", str(model), "--resume", *common]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"accelbatch: error: {model}.opt: ") and err.count("\n") == 1, err


def test_keys_of_an_options_file_that_name_no_option_are_said(tmp_path, capsys):
    """A misspelled key of PATH.opt (sed for seed) or another program's name (ParlAI's history_size) was passed
    over without a word, so eval ran on other data: each is named in one line."""
    import json

    from accelbatch.cli import main

    model = tmp_path / "m.pt"
    assert main(["train", "-t", "babi:1", "-m", "bag", "-esz", "8", "-tstep", "1", "-mf", str(model),
                 "--eval-splits", "", "-veps", "-1", "--no-progress"]) == 0
    kept = json.loads((tmp_path / "m.pt.opt").read_text())
    kept["sed"], kept["history_size"] = kept.pop("seed"), 1
    (tmp_path / "m.pt.opt").write_text(json.dumps(kept))
    capsys.readouterr()
    assert main(["eval", "-mf", str(model), "-dt", "valid", "--no-progress"]) == 0
    assert (f"accelbatch: -mf {model}: {model}.opt holds keys accelbatch does not read: history_size, sed "
            "(misspelled, or another program's names") in capsys.readouterr().err

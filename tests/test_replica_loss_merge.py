"""A ranker's evaluation loss averages over the rows it counts (those whose label is among their candidates), not
over exs: reports of parts of the rows (replicas, hogwild processes, log windows, a resumed run) merge into the
loss of one process that scored every row, which says those rows as ``loss_exs``."""

from __future__ import annotations

import json

import pytest
from helpers import TwoReplicas

from accelbatch.build import create_world
from accelbatch.cli import main
from accelbatch.hogwild import merge_metric_states, metric_states
from accelbatch.metrics import combine_reports
from accelbatch.opts import Opts
from accelbatch.report_merge import reduce_report
from accelbatch.run import evaluate

CANDIDATES = [f"answer {j}" for j in range(6)]


def _rows(first: int, count: int, every: int) -> list[dict]:
    """``count`` rows; every ``every``-th one's candidates leave its label out (0: none does)."""
    rows = []
    for i in range(first, first + count):
        label = CANDIDATES[i % 6]
        left_out = every and i % every == 0
        rows.append({"text": f"question {i} about {label} {i % 4}", "eval_labels": [label], "episode_done": True,
                     "label_candidates": [c for c in CANDIDATES if c != label] if left_out else CANDIDATES})
    return rows


def _write(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _counted(rows: list[dict]) -> int:
    """The rows the loss counts, by hand: those whose label is among their candidates."""
    return sum(r["eval_labels"][0] in r["label_candidates"] for r in rows)


def _same(got: dict, want: dict, rel: float = 1e-9) -> None:
    assert set(got) == set(want), (got, want)
    assert got == pytest.approx(want, rel=rel), (got, want)


@pytest.fixture
def parts(tmp_path):
    """Reports and metric states of a bag ranker's evaluations of rows A (every label among the candidates),
    B (a third of the labels left out) and all of them in one world, the same model throughout."""
    files = {"a": _rows(0, 12, 0), "b": _rows(12, 24, 3)}
    files["all"] = files["a"] + files["b"]
    out, agent = {}, None
    for name, rows in files.items():
        opts = Opts(task=f"jsonl:{_write(tmp_path / f'{name}.jsonl', rows)}", model="bag", datatype="valid",
                    batchsize=4, embedding_size=8, seed=3)
        world = create_world(opts, agent=agent)
        agent = agent or world.get_model_agent()  # its model for the other worlds
        out[name] = (evaluate(world), metric_states(world), _counted(rows))
        world.shutdown()
    return out


def test_a_split_of_the_rows_merges_into_the_one_process_loss(parts):
    (a, a_state, a_counted), (b, b_state, b_counted), (full, full_state, counted) = parts.values()
    for rep in (a, b, full):
        rep.pop("time_s")
    recorder = TwoReplicas()
    reduce_report(b, recorder)
    _same(reduce_report(a, TwoReplicas(recorder.sent)), full)  # replicas (was weighted by exs)
    _same(combine_reports(a, b), full)  # a resumed run: the rows before it, then since
    _same(combine_reports(full, a, sign=-1), b)  # a log window: the cumulative report less an earlier one
    _same(combine_reports(full, b, sign=-1), a)
    _same(merge_metric_states([a_state, b_state]), full)  # hogwild processes
    assert "loss_exs" not in a  # every row counted: nothing to say
    assert (b["exs"], b["loss_exs"]) == (24, b_counted) and (full["exs"], full["loss_exs"]) == (36, counted)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_cli_replicas_and_hogwild_report_the_one_process_loss(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    rows = _rows(0, 36, 4)
    for split in ("train", "valid", "test"):
        _write(folder / f"{split}.jsonl", rows)
    model = tmp_path / "bag.pt"
    common = ["--no-progress", "-mf", str(model)]
    assert main(["train", "-t", "dialogues:50", "-m", "bag", "-esz", "8", "-ne", "1", "--eval-splits", "valid",
                 *common]) == 0

    def valid(*args: str) -> dict:
        path = tmp_path / "report.json"
        assert main(["eval", "-t", f"jsonl:{folder}", *common, "--report-json", str(path), *args]) == 0
        report = json.loads(path.read_text())["valid"]
        report.pop("time_s")
        return report

    one = valid("-bs", "4")
    # a row's float32 loss moves by ~1e-8 with the shape of its batch (-bs 1 against 4); the defect was 5e-2
    _same(valid("-bs", "2", "-rf", "2", "--device", "cpu"), one, rel=1e-6)  # was weighted by exs
    _same(valid("-bs", "1", "-nt", "2"), one, rel=1e-6)
    assert (one["exs"], one["loss_exs"]) == (36, _counted(rows))


@pytest.mark.parametrize("seen", [5, 37, 120, 389])
def test_a_windows_accuracy_taken_from_two_cumulative_reports_is_exact(seen):
    """A metrics log's window is the cumulative report less the one before: its accuracy is a count of exact
    matches over the window's rows, so it comes out exactly (3 of 4 right: 0.75, not 0.7500000000000036)."""
    for rows in (1, 2, 3, 4):
        for right in range(rows + 1):
            for before in range(0, seen - rows + 1, 3):
                cumulative = {"exs": seen, "accuracy": (before + right) / seen}
                earlier = {"exs": seen - rows, "accuracy": before / (seen - rows)}
                assert combine_reports(cumulative, earlier, sign=-1)["accuracy"] == right / rows

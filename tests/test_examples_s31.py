"""Examples on inputs their first tests did not cover: ragged candidate lists, the tutorials' size flags."""

from __future__ import annotations

import os
import random
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelbatch.backends import poptorch_emulator
from accelbatch.backends.ipu import IPUBackend
from accelbatch.backends.ipu_pipeline import PipelineSettings
from accelbatch.backends.poptorch_emulator.blocks import block_annotations

from accelbatch.opts import Opts
from accelbatch.plan import ExecutionPlan, PlanError

WORDS = ["bird", "cat", "dog", "red", "blue", "green", "up", "down", "left", "right", "one", "two", "three"]


def _ragged_parlai_file(path: Path, rows: int = 24) -> Path:
    """A ParlAI text file whose examples have 2 to 6 label candidates, the label always among them."""
    rng = random.Random(0)
    lines = []
    for i in range(rows):
        cands = sorted(rng.sample(WORDS, 2 + i % 5))
        text = " ".join(rng.choice(WORDS) for _ in range(5))
        done = "\tepisode_done:True" if i % 3 == 2 else ""
        lines.append(f"text:{text}\tlabels:{rng.choice(cands)}\tlabel_candidates:{'|'.join(cands)}{done}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.timeout(180)
def test_custom_agent_masks_padded_candidates_so_valid_loss_does_not_depend_on_batch_size(tmp_path):
    """At -bs 1 no row is padded: that is the reference. At -bs 4 pad_2d adds id-0 columns to the rows with
    fewer candidates; they must neither be picked (an index past the row's candidates) nor enter the loss."""
    main = runpy.run_path("examples/custom_agent.py", run_name="example")["main"]
    data = _ragged_parlai_file(tmp_path / "ragged.txt")
    args = ["--no-progress", "-t", f"parlai:{data}", "-dt", "valid", "--seed", "2", "-esz", "4"]  # small scores
    reports = {bs: main(args + ["-bs", str(bs)]) for bs in (1, 4)}
    one, four = reports[1]["valid"], reports[4]["valid"]
    assert one["exs"] == four["exs"] == 24
    assert four["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert four["accuracy"] == one["accuracy"]


# --- --pipeline: an unknown name is the first thing reported ----------------------------------------------

class _Tower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b0, self.b1 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

    def forward(self, batch):
        return {"loss": self.b1(self.b0(batch["x"])).sum()}


def test_pipeline_names_are_all_checked_before_any_submodule_is_marked():
    """``b0,nosuch``: refused naming 'nosuch', and b0 (a good name before it) carries no BeginBlock."""
    model = _Tower()
    with pytest.raises(PlanError, match=r"^--pipeline: the model \(_Tower\) has no submodule 'nosuch'; its "
                                        r"top-level submodules are: b0, b1 "):
        PipelineSettings(("b0", "nosuch")).annotate(poptorch_emulator, model)
    assert block_annotations(model) == {}


def test_an_unknown_pipeline_name_is_reported_before_the_plan_rules_it_also_breaks():
    """G=1, D=1 break both pipelined-depth rules of 2 stages; the misspelt name is still what is said."""
    backend = IPUBackend()
    backend.setup(Opts(device="ipu", ipu_emulator=True, pipeline="nosuch"))
    model = _Tower()
    with pytest.raises(PlanError, match=r"^--pipeline: the model \(_Tower\) has no submodule 'nosuch'"):
        backend.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), ExecutionPlan())


@pytest.mark.timeout(120)
def test_the_cli_names_a_misspelt_pipeline_submodule_first_in_one_line(capsys):
    """The README's promise: an unknown NAME "is refused in one line before any step"."""
    from accelbatch.cli import main

    argv = ["train", "-t", "babi:1", "-m", "memnn", "-bs", "4", "-tstep", "3", "--no-progress", "--device", "ipu",
            "--ipu-emulator", "--pipeline", "nosuch"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no submodule 'nosuch'" in err, err


# --- tutorial 01 with gradient accumulation -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sizes, said", [
    # 2 rows of torch's loader against D x R x G = 3 x 2 x 2 = 12: PopTorch's "Invalid batch dimension"
    (["--batch-size", "2", "--device-iterations", "3", "--replication-factor", "2"],
     "Options.Training.gradientAccumulation(2) = 12"),
    # 4 rows against D x R x G = 1 x 1 x 2 = 2: accepted as 2 micro-batches of 2 rows
    (["--batch-size", "4", "--device-iterations", "1"], "works, but as 2 micro-batches of 2 rows"),
])
def test_01_efficient_data_loading_runs_with_gradient_accumulation(sizes, said):
    """Its "Invalid batch dimension" probe is a training model like the one it shows: an inference model
    refuses options with gradientAccumulation > 1."""
    script = Path("examples/ipu/01_efficient_data_loading.py")
    args = ["--emulator", "--items", "48", "--features", "4", "--hidden", "4", "--workers", "0", "--max-batches",
            "2", "--buffer-size", "1", "--pause-s", "0", "--gradient-accumulation", "2", *sizes]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and said in proc.stdout

"""Optimizers on --device ipu: --optimizer becomes poptorch.optim, the state comes back for checkpoints,
goes to the device on resume, and one state runs through every bucket graph.

References: the CPU engine with the torch optimizer of the same name (tested against plain torch in
test_cpu_engine.py), and an uninterrupted run of the same command.
"""

from __future__ import annotations

import pytest
import torch
from accelbatch.backends import poptorch_emulator
from accelbatch.backends.cpu import PlanEngine
from accelbatch.backends.ipu import EMULATOR_ENV, IPUBackend

import accelbatch as ab
from accelbatch.checkpoint import load_checkpoint
from accelbatch.opts import Opts
from accelbatch.plan import ExecutionPlan

from .test_ipu import data, fresh


def emulated(model, optimizer, plan):
    backend = IPUBackend()
    backend.setup(Opts(ipu_emulator=True, seed=0))
    return backend.compile(model, optimizer, plan)


@pytest.mark.parametrize("kind, hparams", [
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("Adam", {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6}),
    ("AdamW", {"lr": 0.02, "weight_decay": 0.05}),
    ("RMSprop", {"lr": 0.01, "alpha": 0.9, "momentum": 0.1}),
])
def test_torch_optimizers_become_poptorch_optim_with_their_hyperparameters(kind, hparams):
    model = fresh()
    torch_opt = getattr(torch.optim, kind)([{"params": [model.lin.weight]},
                                             {"params": [model.lin.bias], "lr": 0.5}], **hparams)
    engine = emulated(model, torch_opt, ExecutionPlan(micro_batch=4))
    opt = engine.host_optimizer()
    assert type(opt) is getattr(poptorch_emulator.optim, kind)
    for mine, theirs in zip(opt.param_groups, torch_opt.param_groups):
        assert mine["params"] == theirs["params"]
        assert {k: mine[k] for k in theirs if k != "params"} == {k: v for k, v in theirs.items() if k != "params"}
    assert opt.param_groups[1]["lr"] == 0.5


def test_an_optimizer_poptorch_cannot_run_is_refused_with_its_text():
    model = fresh()
    engine = emulated(model, torch.optim.Adagrad(model.parameters()), ExecutionPlan(micro_batch=4))
    with pytest.raises(AssertionError, match="^Unsupported optimizer type. Types supported _OptimizerType.SGD1"):
        engine.train_step(data(4))


def test_one_adam_state_runs_through_every_graph_and_reaches_the_checkpoint():
    """Calls of 16 and 24 rows alternate (two training graphs, as two buckets): the weights follow the CPU
    engine's single Adam, and state_dict() holds the device's moments (torch's Adam on the CPU as reference)."""
    plan = ExecutionPlan(micro_batch=2, device_iterations=2, replication_factor=2, gradient_accumulation=2,
                         output_mode="all")
    cpu_model, ipu_model = fresh(), fresh()
    cpu_opt = torch.optim.Adam(cpu_model.parameters(), lr=0.05)
    cpu = PlanEngine(cpu_model, cpu_opt, plan)
    ipu = emulated(ipu_model, torch.optim.Adam(ipu_model.parameters(), lr=0.05), plan)
    for step, rows in enumerate([16, 24, 16, 24, 16]):
        cpu.train_step(data(rows, seed=step))
        ipu.train_step(data(rows, seed=step))
    assert ipu.compilations == 2
    for p, q in zip(cpu_model.parameters(), ipu_model.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0)
    saved = ipu.state_dict()["optimizer"]
    names = dict(zip(("model.lin.weight", "model.lin.bias"), cpu_model.parameters()))
    assert set(saved["ipu_state"]) == set(names)
    for name, p in names.items():
        assert int(saved["ipu_state"][name]["step"]) == 10  # 5 calls x D = 2 updates
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(saved["ipu_state"][name][key], cpu_opt.state[p][key], atol=1e-6), (name, key)


def test_a_loaded_checkpoint_continues_the_saved_moments():
    plan = ExecutionPlan(micro_batch=4)
    a, b = fresh(0), fresh(1)
    ea = emulated(a, torch.optim.Adam(a.parameters(), lr=0.05), plan)
    eb = emulated(b, torch.optim.Adam(b.parameters(), lr=0.05), plan)
    for seed in range(3):
        ea.train_step(data(4, seed=seed))
    eb.train_step(data(8, seed=7))  # a graph of another shape, compiled with moments of its own
    eb.load_state_dict(ea.state_dict())
    for seed in (3, 4):
        ea.train_step(data(4, seed=seed))
        eb.train_step(data(4, seed=seed))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_a_cpu_checkpoints_optimizer_state_is_dropped_with_a_warning(caplog):
    """torch's format cannot be written to an IPU: the weights load, the device's moments start afresh."""
    cpu_model, ipu_model = fresh(0), fresh(1)
    cpu = PlanEngine(cpu_model, torch.optim.Adam(cpu_model.parameters(), lr=0.05), ExecutionPlan(micro_batch=4))
    cpu.train_step(data(4))
    ipu = emulated(ipu_model, torch.optim.Adam(ipu_model.parameters(), lr=0.05), ExecutionPlan(micro_batch=4))
    with caplog.at_level("WARNING", logger="accelbatch.ipu"):
        ipu.load_state_dict(cpu.state_dict())
    assert "starts afresh" in caplog.text
    for p, q in zip(cpu_model.parameters(), ipu_model.parameters()):
        assert torch.equal(p, q)
    assert ipu.host_optimizer().state_dict()["ipu_state"] is None




def _run(tmp_path, name, device, steps, resume=False):
    model_file = tmp_path / name / "model.pt"
    opts = Opts(task="babi:1", model="memnn", optimizer="adam", learning_rate=0.05, batchsize=8, embedding_size=8,
                dynamic_batching="buckets", num_buckets=3, device=device, ipu_emulator=device == "ipu",
                max_train_steps=steps, num_epochs=1, validation_every_n_epochs=-1, eval_splits="",
                progress=False, seed=0, model_file=str(model_file), resume=resume, save_every_n_secs=3600)
    world = ab.create_world(opts)
    ab.run(world, opts)
    agent = world.get_model_agent()
    weights = {k: v.detach().clone() for k, v in agent.model.state_dict().items()}
    graphs = sum(g["training"] for g in getattr(agent.engine, "compiled_graphs", []))
    return weights, model_file, graphs


@pytest.mark.slow
def test_an_adam_run_saved_mid_run_and_resumed_ends_with_the_uninterrupted_weights(tmp_path, monkeypatch):
    """Bucketed batches (several training graphs), Adam on the emulated IPU: 6 steps, saved, resumed to 12,
    against 12 steps in one go (torch.equal) and the CPU under the same plan (float tolerance)."""
    monkeypatch.setenv(EMULATOR_ENV, "1")
    whole, _, graphs = _run(tmp_path, "whole", "ipu", 12)
    assert graphs > 1  # the buckets' shapes: one Adam state runs through several graphs
    _, cut_file, _ = _run(tmp_path, "cut", "ipu", 6)
    saved = load_checkpoint(str(cut_file)).optimizer_state
    assert saved["ipu_state"] and all(st["exp_avg"].abs().sum() > 0 for st in saved["ipu_state"].values())
    assert all(int(st["step"]) == 6 for st in saved["ipu_state"].values())
    resumed, _, _ = _run(tmp_path, "cut", "ipu", 12, resume=True)
    cpu, _, _ = _run(tmp_path, "cpu", "cpu", 12)
    for key, w in whole.items():
        assert torch.equal(w, resumed[key]), key
        assert torch.allclose(w, cpu[key], atol=1e-5, rtol=0), key


@pytest.mark.slow
def test_continuing_from_an_ipu_model_file_keeps_its_adam_state(tmp_path, monkeypatch):
    """Two runs of 4 steps on one --model-file (no --resume: the second starts the data again but loads the
    file's weights and optimizer): the emulated IPU ends where the CPU does, which keeps torch's Adam state."""
    monkeypatch.setenv(EMULATOR_ENV, "1")
    ends = {}
    for device in ("cpu", "ipu"):
        opts = Opts(task="babi:1", model="memnn", optimizer="adam", learning_rate=0.05, batchsize=4,
                    embedding_size=8, device=device, ipu_emulator=device == "ipu", max_train_steps=4, num_epochs=1,
                    validation_every_n_epochs=-1, eval_splits="", progress=False, seed=0,
                    model_file=str(tmp_path / device / "model.pt"))
        for _ in range(2):
            world = ab.create_world(opts)
            ab.run(world, opts)
        ends[device] = world.get_model_agent().model.state_dict()
        if device == "ipu":
            saved = torch.load(opts.model_file, weights_only=True)["optimizer"]
            assert all(int(st["step"]) == 8 for st in saved["ipu_state"].values())
    for key, w in ends["cpu"].items():
        assert torch.allclose(w, ends["ipu"][key], atol=1e-5, rtol=0), key


def test_host_optimizer_state_left_behind_is_said_at_the_first_training_call_only(caplog):
    """An evaluation uses no optimizer: a model file's torch-format Adam state is said to be dropped only when
    the device first trains, once."""
    model = fresh()
    adam = torch.optim.Adam(model.parameters(), lr=0.05)
    model(data(4))["loss"].backward()
    adam.step()  # the state an earlier run's model file brings
    with caplog.at_level("WARNING", logger="accelbatch.ipu"):
        engine = emulated(model, adam, ExecutionPlan(micro_batch=4))
        engine.eval_step(data(4))
        assert "starts it afresh" not in caplog.text
        engine.train_step(data(4))
        engine.train_step(data(4))
    assert caplog.text.count("the Adam state the host optimizer holds") == 1

"""Backend registry: names, unknown and unavailable devices, the CPU backend's interface."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from accelbatch.backends import base
from accelbatch.backends.base import Backend, BackendUnavailable, available_backends, get_backend
from accelbatch.backends.cpu import CPUBackend, PlanEngine
from accelbatch.plan import ExecutionPlan


class _Unusable(Backend):
    name = "fake"

    @classmethod
    def is_available(cls):
        return False, "needs a frobnicator attached"

    def compile(self, model, optimizer, plan):
        raise AssertionError("never compiled")


@pytest.fixture()
def fake_registry(monkeypatch):
    module = types.ModuleType("accelbatch_fake_backend")
    module.Unusable = _Unusable
    monkeypatch.setitem(sys.modules, "accelbatch_fake_backend", module)
    paths = {"cpu": base.BACKEND_PATHS["cpu"], "fake": "accelbatch_fake_backend:Unusable",
             "ghost": "accelbatch.backends.ghost_never_built:Ghost"}
    monkeypatch.setattr(base, "BACKEND_PATHS", paths)
    return paths


def test_cpu_is_registered_and_available():
    assert get_backend("cpu") is CPUBackend
    assert available_backends()["cpu"] == ""
    assert set(base.BACKEND_PATHS) >= {"cpu", "cuda", "ipu"}


def test_unknown_device_lists_known_ones():
    with pytest.raises(BackendUnavailable) as err:
        get_backend("tpu")
    text = str(err.value)
    assert "'tpu' is unknown" in text
    for name in ("cpu", "cuda", "ipu"):
        assert name in text


def test_unavailable_device_says_why_and_lists_usable_ones(fake_registry):
    with pytest.raises(BackendUnavailable) as err:
        get_backend("fake")
    text = str(err.value)
    assert "needs a frobnicator attached" in text
    assert "Usable here: cpu " in text and "fake," not in text and "ghost" not in text.split("Usable here")[1]


def test_unbuilt_backend_is_unavailable_not_a_crash(fake_registry):
    assert available_backends() == {"cpu": "", "fake": "needs a frobnicator attached",
                                    "ghost": "this backend is not built yet"}
    with pytest.raises(BackendUnavailable, match="not built yet"):
        get_backend("ghost")


def test_cpu_backend_interface_single_process():
    backend = CPUBackend()
    backend.setup(types.SimpleNamespace(replication_factor=1))
    model = torch.nn.Linear(2, 2)
    engine = backend.compile(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             ExecutionPlan(micro_batch=2, replication_factor=2))
    assert isinstance(engine, PlanEngine)
    assert backend.rank == 0 and backend.world_size == 1 and backend.is_main_process()
    assert backend.reduce_metrics({"exs": 3}) == {"exs": 3}
    batches = [{"x": torch.zeros(2, 2)}]
    assert backend.make_loader(batches, engine.plan) is batches
    backend.teardown()
    backend.teardown()  # safe twice

"""Backend registry: names, unknown and unavailable devices, the CPU backend's interface and its
single-process collectives."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from accelbatch.backends import base
from accelbatch.backends.base import Backend, BackendUnavailable, Topology, available_backends, get_backend
from accelbatch.backends.cpu import CPUBackend, PlanEngine

from accelbatch.plan import ExecutionPlan, PlanError


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


def test_an_unimportable_backend_is_unavailable_naming_the_import_error(fake_registry):
    ghost = ("its module accelbatch.backends.ghost_never_built does not import (ModuleNotFoundError: No "
             "module named 'accelbatch.backends.ghost_never_built')")
    assert available_backends() == {"cpu": "", "fake": "needs a frobnicator attached", "ghost": ghost}
    with pytest.raises(BackendUnavailable, match=r"--device ghost: its module .* \(ModuleNotFoundError"):
        get_backend("ghost")


def test_a_backend_whose_dependency_is_missing_is_unavailable(fake_registry, monkeypatch):
    monkeypatch.setitem(sys.modules, "accelbatch_fake_broken", None)  # importing it raises ImportError
    fake_registry["broken"] = "accelbatch_fake_broken:Broken"
    assert "does not import (ModuleNotFoundError" in available_backends()["broken"]
    with pytest.raises(BackendUnavailable, match="--device broken: its module accelbatch_fake_broken"):
        get_backend("broken")


def test_cpu_backend_interface_single_process(monkeypatch):
    backend = CPUBackend()
    topology = backend.setup(types.SimpleNamespace(replication_factor=1, skip_nan=True))
    assert topology == backend.topology == Topology(rank=0, world_size=1, local_rank=0) and topology.is_main
    model = torch.nn.Linear(2, 2)
    engine = backend.compile(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             ExecutionPlan(micro_batch=2, replication_factor=2))
    assert isinstance(engine, PlanEngine) and engine.skip_nan   # the options setup() kept reach the engine
    assert backend.rank == 0 and backend.world_size == 1 and backend.is_main_process()
    assert not hasattr(Backend, "make_loader")
    # one process: the collectives make no call to torch.distributed
    monkeypatch.setattr("torch.distributed.all_reduce", None)
    monkeypatch.setattr("torch.distributed.all_gather", None)
    backend.barrier()
    assert backend.all_gather_object({"a": 1}) == [{"a": 1}]
    assert backend.decide(True, False) == (True, False) and backend.decide() == ()
    assert backend.reduce_metrics({"exs": 3}) == {"exs": 3}
    backend.teardown()
    backend.teardown()  # safe twice


def test_fp16_on_the_cpu_backend_is_refused_in_one_line_by_a_torch_without_it(monkeypatch):
    import accelbatch.backends.cpu as cpu

    monkeypatch.setattr(cpu, "fp16_on_cpu_supported", lambda: False)
    with pytest.raises(PlanError) as err:
        CPUBackend().setup(types.SimpleNamespace(replication_factor=1, mixed_precision="fp16"))
    assert str(err.value) == (f"--mixed-precision fp16 on the CPU needs a torch with fp16 CPU autocast and CPU "
                              f"loss-scaling kernels (this is {torch.__version__}): upgrade torch, or use bf16 "
                              "or no")
    assert "\n" not in str(err.value)

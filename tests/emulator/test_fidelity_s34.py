"""PopTorch 3.3 fidelity: the async loader's flat-batch rule and option names PopTorch has but the emulator
does not emulate.

Sources (graphcore/poptorch, tag sdk/poptorch/3.3.0): python/_dataloader.py ``_AsynchronousWorkerProcess.
_mainLoopNoInterrupt`` (the first batch must be a tensor, a dict of tensors or a flat 1D container of tensors),
python/options.py (the option setters), python/_options_impl.py ``OptionsDict.__getattr__``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from accelbatch.backends import poptorch_emulator as poptorch

Async, AsyncRebatched = poptorch.DataLoaderMode.Async, poptorch.DataLoaderMode.AsyncRebatched
FAILED_TO_START = "AsynchronousDataAccessor worker thread failed to start (Check above for details)"


def not_flat(index: int, kind: type) -> str:
    """PopTorch's assertion text (python/_dataloader.py), for the element at ``index`` of type ``kind``."""
    return (f"Tensor at index {index} is not a torch tensor ({kind}). AsynchronousDataAccessor expects data to "
            "be organised as a flat 1D container of tensors.")


class WithNames(torch.utils.data.Dataset):
    """``(tensor, str)`` items: torch's collate keeps the strings as a tuple of str."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([float(i)]), f"item{i}"


class Nested(torch.utils.data.Dataset):
    """``((x, 2x), y)`` items: torch's collate makes the inner pair a list of tensors."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        x = torch.tensor([float(i)])
        return (x, 2 * x), torch.tensor(i)


class NamedDict(torch.utils.data.Dataset):
    """``{"x": tensor, "name": str}`` items."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i)]), "name": f"item{i}"}


class FlatDict(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i)]), "y": torch.tensor(i)}


def first_batch(dataset, batch_size=2):
    """The first batch torch's DataLoader makes of ``dataset`` (an independent reference)."""
    return next(iter(torch.utils.data.DataLoader(dataset, batch_size=batch_size)))


def refused(make, expected: str, capsys) -> None:
    """``make()`` fails to start as PopTorch's worker does: the assertion printed above, then the error."""
    with pytest.raises(poptorch.Error, match=r"worker thread failed to start \(Check above for details\)") as info:
        make()
    cause = info.value.__cause__
    assert isinstance(cause, AssertionError) and str(cause) == expected
    assert capsys.readouterr().err.rstrip().endswith(f"AssertionError: {expected}")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_async_modes_and_accessor_refuse_batches_that_are_not_flat_containers_of_tensors(capsys):
    opts = poptorch.Options().deviceIterations(2)
    named = first_batch(WithNames())
    refused(lambda: poptorch.DataLoader(opts.clone(), WithNames(), batch_size=2, mode=Async),
            not_flat(1, type(named[1])), capsys)
    nested = first_batch(Nested())
    refused(lambda: poptorch.DataLoader(opts.clone(), Nested(), batch_size=2, mode=Async),
            not_flat(0, type(nested[0])), capsys)
    # AsyncRebatched: PopTorch checks the workers' batch before rebatching (no word of accelbatch's Rows)
    as_dict = first_batch(NamedDict(), batch_size=1)
    refused(lambda: poptorch.DataLoader(opts.clone(), NamedDict(), batch_size=2, mode=AsyncRebatched,
                                        rebatched_worker_size=1),
            not_flat(list(as_dict).index("name"), type(as_dict["name"])), capsys)
    sync = poptorch.DataLoader(opts.clone(), WithNames(), batch_size=2)
    refused(lambda: poptorch.AsynchronousDataAccessor(sync), not_flat(1, type(named[1])), capsys)
    refused(lambda: poptorch.AsynchronousDataAccessor(WithNames()), not_flat(1, str), capsys)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_flat_tuples_and_dicts_of_tensors_still_load():
    opts = poptorch.Options().deviceIterations(2)
    loader = poptorch.DataLoader(opts.clone(), FlatDict(), batch_size=2, mode=AsyncRebatched,
                                 rebatched_worker_size=1)
    try:
        got = [(b["x"].reshape(-1).tolist(), b["y"].tolist()) for b in loader]
    finally:
        loader.terminate()
    assert got == [([float(i) for i in range(k, k + 4)], list(range(k, k + 4))) for k in (0, 4)]
    tensors = torch.utils.data.TensorDataset(torch.arange(8.0), torch.arange(8))
    loader = poptorch.DataLoader(opts.clone(), tensors, batch_size=2, mode=Async)
    try:
        got = [(x.tolist(), y.tolist()) for x, y in loader]
    finally:
        loader.terminate()
    assert got == [([float(i) for i in range(k, k + 4)], list(range(k, k + 4))) for k in (0, 4)]


def test_options_without_effect_on_the_numbers_are_accepted_and_recorded(caplog):
    opts = poptorch.Options()
    assert opts.logCycleCount(True) is opts and opts.useIpuId(1) is opts and opts.enableStableNorm(True) is opts
    assert opts.enableProfiling("reports") is opts and opts.relaxOptimizerAttributesChecks() is opts
    assert opts.Training.setConvolutionDithering(True) is opts.Training
    popart = opts._Popart.options
    assert popart["instrumentWithHardwareCycleCounter"] is True and popart["enableStableNorm"] is True
    assert popart["engineOptions"]["autoReport.directory"] == "reports"
    assert popart["convolutionOptions"] == {"enableConvDithering": True}
    assert opts.ipu_id == 1
    with caplog.at_level(logging.WARNING, logger="poptorch_emulator"):
        assert opts.Jit.traceModel(False) is opts.Jit
        assert opts.Precision.halfFloatCasting(None) is opts.Precision
    assert "[Deprecated] Do not call options.Jit.traceModel()" in caplog.text
    assert "[Deprecated] Do not call options.Precision.halfFloatCasting()" in caplog.text
    with pytest.raises(ValueError, match=r"options.Jit.traceModel\(True\) is no longer supported"):
        opts.Jit.traceModel(True)
    # a model runs as without them: its outputs are the module's own
    model = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    assert torch.equal(poptorch.inferenceModel(model, opts)(x), model(x))
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.logCycleCount(False)


def test_a_poptorch_option_that_is_not_emulated_is_told_apart_from_a_misspelled_one():
    opts = poptorch.Options()
    with pytest.raises(AttributeError) as info:
        opts.updatableNamedBuffers(["bn.running_mean"])
    text = str(info.value)
    assert text.startswith("poptorch.Options.updatableNamedBuffers exists in PopTorch 3.3 but accelbatch's "
                           "emulator does not emulate it") and "\n" not in text
    with pytest.raises(AttributeError, match="updatableNamedBuffers exists in PopTorch 3.3"):
        opts.from_json('{"updatableNamedBuffers": ["bn.running_mean"]}')
    # a name PopTorch does not have keeps PopTorch's text (python/_options_impl.py OptionsDict.__getattr__)
    with pytest.raises(AttributeError) as info:
        opts.logCycleCounts(True)
    assert str(info.value) == "Invalid attribute logCycleCounts."
    with pytest.raises(AttributeError) as info:
        opts.Training.setConvolutionDitherring(True)
    assert str(info.value) == "Invalid attribute setConvolutionDitherring."

"""Options: setters, getters, freezing (PopTorch python/options.py, python/_options_impl.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from accelbatch.backends import poptorch_emulator as poptorch

FROZEN = "Can't modify frozen Options"


def test_defaults_and_getters():
    opts = poptorch.Options()
    assert opts.device_iterations == 1
    assert opts.replication_factor == 1
    assert opts.input_group_size == 1
    assert opts.Training.gradient_accumulation == 1
    assert opts.Training.accumulation_and_replication_reduction_type == poptorch.ReductionType.Mean
    assert opts.defaultOutputMode()
    assert opts.Distributed.numProcesses == 1 and opts.Distributed.processId == 0
    assert not opts.exists("random_seed")


def test_setters_chain_and_read_back():
    opts = poptorch.Options().deviceIterations(4).replicationFactor(2).randomSeed(7)
    opts.Training.gradientAccumulation(3).accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)
    opts.outputMode(poptorch.OutputMode.EveryN, output_return_period=2)
    assert (opts.device_iterations, opts.replication_factor, opts.random_seed) == (4, 2, 7)
    assert opts.Training.gradient_accumulation == 3
    assert opts.Training.accumulation_and_replication_reduction_type == poptorch.ReductionType.Sum
    assert opts.output_mode == poptorch.OutputMode.EveryN and opts.output_return_period == 2
    # attribute-style assignment goes through the same checks
    opts.device_iterations = 5
    assert opts.device_iterations == 5


def test_invalid_option_name_and_type():
    opts = poptorch.Options()
    with pytest.raises(AssertionError, match="Invalid option foo, valid options are"):
        opts.set(foo=1)
    with pytest.raises(AssertionError, match="Unexpected type <class 'float'> for option device_iterations"):
        opts.deviceIterations(2.0)
    with pytest.raises(AttributeError, match="Invalid attribute nope."):
        _ = opts.nope


def test_reduction_type_and_output_mode_checks():
    opts = poptorch.Options()
    msg = ("accumulationAndReplicationReductionType must be set to poptorch.ReductionType.Mean or "
           "poptorch.ReductionType.Sum")
    with pytest.raises(ValueError, match=msg):
        opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.NoReduction)
    with pytest.raises(AssertionError, match="EveryN anchor must have output_return_period set to valid"):
        opts.outputMode(poptorch.OutputMode.EveryN)


def test_input_replica_grouping_checks():
    opts = poptorch.Options().replicationFactor(4)
    with pytest.raises(ValueError, match="input_group_type cannot be All"):
        opts.inputReplicaGrouping(2, poptorch.CommGroupType.All)
    with pytest.raises(ValueError, match="input_group_size cannot be larger than replication_factor"):
        opts.inputReplicaGrouping(8, poptorch.CommGroupType.Consecutive)
    with pytest.raises(ValueError, match="input_group_size must be a factor of replication_factor"):
        opts.inputReplicaGrouping(3, poptorch.CommGroupType.Consecutive)
    opts.inputReplicaGrouping(2, poptorch.CommGroupType.Orthogonal)
    assert opts.input_group_size == 2


def _assert_frozen(opts):
    with pytest.raises(AttributeError, match=FROZEN):
        opts.deviceIterations(2)
    with pytest.raises(AttributeError, match=FROZEN):
        opts.randomSeed(42)
    with pytest.raises(AttributeError, match=FROZEN):
        opts.Training.gradientAccumulation(2)
    with pytest.raises(AttributeError, match=FROZEN):
        opts.Distributed.configureProcessId(0, 2)
    with pytest.raises(AttributeError, match=FROZEN):
        opts._Popart.set("groupNormStridedChannelGrouping", True)
    with pytest.raises(AttributeError, match=FROZEN):
        opts.replication_factor = 2


def test_model_freezes_options_and_keeps_a_frozen_clone():
    opts = poptorch.Options()
    model = poptorch.trainingModel(torch.nn.Linear(2, 2), options=opts)
    _assert_frozen(opts)
    _assert_frozen(model.options)
    assert model.options is not opts
    # the wrapper's clone got the training default; the user's options did not
    assert model.options.output_mode == poptorch.OutputMode.Final
    assert opts.defaultOutputMode()


def test_dataloader_freezes_options():
    opts = poptorch.Options()
    loader = poptorch.DataLoader(opts, torch.utils.data.TensorDataset(torch.zeros(4, 1)))
    _assert_frozen(opts)
    _assert_frozen(loader.options)


def test_clone_and_deepcopy_are_unfrozen():
    opts = poptorch.Options().deviceIterations(3)
    poptorch.inferenceModel(torch.nn.Linear(2, 2), opts)
    for copied in (opts.clone(), copy.deepcopy(opts)):
        copied.deviceIterations(5)
        copied.Training.gradientAccumulation(2)
        copied.Distributed.configureProcessId(1, 2)
        copied._Popart.set("autoRecomputation", 3)
        assert copied.device_iterations == 5
    assert opts.device_iterations == 3


def test_invalid_options_type_for_model():
    with pytest.raises(poptorch.Error, match="Invalid type: 'options' is of type"):
        poptorch.inferenceModel(torch.nn.Linear(2, 2), options={"deviceIterations": 2})


def test_tensor_locations_recorded_with_poptorch_keys_and_checks():
    opts = poptorch.Options()
    off_chip = poptorch.TensorLocationSettings().useOnChipStorage(False).minElementsForOffChip(128)
    sharded = poptorch.TensorLocationSettings().useReplicatedTensorSharding(True).useIOTilesToLoad()
    assert opts.TensorLocations.setWeightLocation(off_chip) is opts.TensorLocations
    opts.TensorLocations.setOptimizerLocation(sharded).setActivationLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(True)).setAccumulatorLocation(
        poptorch.TensorLocationSettings().useIOTilesToStore(False).minElementsForReplicatedTensorSharding(4))
    opts.TensorLocations.numIOTiles(64)
    locations = opts.TensorLocations
    assert locations.location_weight == {"onChip": 0, "minElementsForOffChip": 128}
    assert locations.location_optimizer == {"useReplicatedTensorSharding": 1, "useIOTilesToLoad": 1}
    assert locations.location_activation == {"onChip": 1}
    assert locations.location_accumulator == {"useIOTilesToStore": 0, "minElementsForReplicatedTensorSharding": 4}
    assert locations.toDict()["numIOTiles"] == 64  # (the setter has the same name)
    assert poptorch.TensorLocationSettings().useOnChipStorage(False).useOnChipStorage(None).toDict() == {}
    for tiles in (30, 194, 33):
        with pytest.raises(AssertionError, match=r"^numIOTiles must be an even number between 32 and 192\.$"):
            opts.TensorLocations.numIOTiles(tiles)
    with pytest.raises(AssertionError):
        opts.TensorLocations.setWeightLocation({"onChip": 0})  # a dict is not a TensorLocationSettings
    with pytest.raises(AssertionError):
        poptorch.TensorLocationSettings().useOnChipStorage(1)
    copied = opts.clone()
    poptorch.trainingModel(torch.nn.Linear(2, 2), options=opts)
    with pytest.raises(AttributeError, match=FROZEN):
        opts.TensorLocations.numIOTiles(32)
    assert copied.TensorLocations.numIOTiles(32).toDict()["numIOTiles"] == 32  # a clone: unfrozen, its own


def test_available_memory_proportion_recorded_per_ipu_index():
    opts = poptorch.Options()
    assert opts.setAvailableMemoryProportion({"IPU0": 0.3, "IPU1": 0.6}) is opts
    assert opts.available_memory_proportion == {0: 0.3, 1: 0.6}
    with pytest.raises(AssertionError, match=r'^Available memory proportions are expected to be in a dictionary '
                                             r'of \{"IPU0": 0.5\} where the 0 in IPU is the index of the IPU\. '
                                             r"Invalid key: 0$"):
        opts.setAvailableMemoryProportion({"0": 0.5})


# -- the mean reduction strategy follows the optimizer's accumulator type (PopTorch's documented rule) ----
class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))

    def forward(self, x):
        out = x * self.w
        return out, poptorch.identity_loss(out.sum(), reduction="none")


@pytest.mark.parametrize("accum_type, combined, expected", [
    (torch.float16, False, poptorch.MeanReductionStrategy.Running),  # float16 accumulators: Running
    (torch.float16, True, poptorch.MeanReductionStrategy.Post),      # the combined variant only has Post
    (torch.float32, False, poptorch.MeanReductionStrategy.Post),
    (None, False, poptorch.MeanReductionStrategy.Post),               # float32 by default
])
def test_mean_reduction_strategy_from_accum_type(accum_type, combined, expected):
    model = _Scale()
    sgd = poptorch.optim.SGD(model.parameters(), lr=0.1, accum_type=accum_type, use_combined_accum=combined)
    training = poptorch.trainingModel(model, poptorch.Options(), sgd)
    training.compile(torch.ones(1, 2))
    assert training.options.Training.meanAccumulationAndReplicationReductionStrategy == expected


def test_float16_accumulators_after_compiling_with_post_are_refused():
    model = _Scale()
    training = poptorch.trainingModel(model, poptorch.Options(), poptorch.optim.SGD(model.parameters(), lr=0.1))
    training.compile(torch.ones(1, 2))
    half = poptorch.optim.SGD(model.parameters(), lr=0.1, accum_type=torch.float16)
    with pytest.raises(ValueError, match="already compiled"):
        training.setOptimizer(half)


# -- POPTORCH_DEFAULT_OPTIONS and from_json ------------------------------------------------------------
def test_default_options_from_the_environment(monkeypatch):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", '{"deviceIterations": 3, "Training.gradientAccumulation": 2, '
                                                   '"connectionType": "ConnectionType.OnDemand", '
                                                   '"_Popart.set": ["saveInitializersToFile", "w.onnx"]}')
    opts = poptorch.Options()
    assert opts.device_iterations == 3
    assert opts.Training.gradient_accumulation == 2
    assert opts.connection_type == poptorch.ConnectionType.OnDemand.value
    assert opts._Popart.options["saveInitializersToFile"] == "w.onnx"
    monkeypatch.delenv("POPTORCH_DEFAULT_OPTIONS")
    assert poptorch.Options().device_iterations == 1


def test_offline_ipu_target_compiles_but_does_not_run():
    opts = poptorch.Options().useOfflineIpuTarget()
    assert opts.connection_type == poptorch.ConnectionType.Never.value
    model = poptorch.inferenceModel(torch.nn.Linear(2, 2), opts)
    model.compile(torch.ones(1, 2))
    with pytest.raises(AssertionError, match="Trying to run a model on an offline device"):
        model(torch.ones(1, 2))

"""Blocks, stages and execution strategies on the emulator: the unsplit model's numbers, PopTorch's placement
rules and error texts (popart_compiler Compiler.cpp / CompilerImpl.cpp, python/ops.py, python/options.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from accelbatch.backends import poptorch_emulator as poptorch


class Chain(torch.nn.Module):
    """``n`` linear layers l0..l{n-1} and a cross-entropy loss; forward(x, t) -> (scores, loss)."""

    def __init__(self, n: int = 4, width: int = 6):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))

    def forward(self, x, t):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        x = self.layers[-1](x)
        return x, F.cross_entropy(x, t)


def chain(seed: int = 0, n: int = 4) -> Chain:
    torch.manual_seed(seed)
    return Chain(n)


def batch(rows: int, seed: int = 1, width: int = 6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g), torch.randint(0, width, (rows,), generator=g)


def reference_sgd(model: Chain, x, t, d: int, g: int, lr: float) -> None:
    """Plain torch: D updates, each the mean gradient of G micro-batches (PopTorch's Mean reduction)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    micro = x.shape[0] // (d * g)
    for i in range(d):
        opt.zero_grad()
        for j in range(g):
            s = (i * g + j) * micro
            (model(x[s:s + micro], t[s:s + micro])[1] / g).backward()
        opt.step()


def options(g: int = 1, d: int = 1, strategy=None) -> poptorch.Options:
    opts = poptorch.Options().deviceIterations(d)
    opts.Training.gradientAccumulation(g)
    if strategy is not None:
        opts.setExecutionStrategy(strategy)
    return opts


# --- the numbers are the unsplit model's ----------------------------------------------------------------

@pytest.mark.parametrize("stages, g", [(2, 3), (2, 4), (4, 7), (4, 8)])
def test_a_pipelined_model_trains_to_the_weights_of_the_unsplit_model(stages, g):
    split, ref = chain(), chain()
    for k in range(1, stages):
        poptorch.BeginBlock(split.layers[k], ipu_id=k)
    x, t = batch(2 * g * 2)
    model = poptorch.trainingModel(split, options(g=g, d=2), torch.optim.SGD(split.parameters(), lr=0.1))
    out = model(x, t)
    reference_sgd(ref, x, t, d=2, g=g, lr=0.1)
    for p, q in zip(split.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0)
    assert model._placement.forward_stages == stages and model._placement.ipus_per_replica == stages
    assert out[1].shape == ()  # output mode Final: the last micro-batch's loss


def test_annotations_do_nothing_outside_an_executor():
    plain, annotated = chain(), chain()
    poptorch.BeginBlock(annotated.layers[1], ipu_id=1)
    x, t = batch(4)
    with poptorch.Block("outside", ipu_id=3):
        y = annotated(x, t)[0]
    assert torch.equal(y, plain(x, t)[0])


def test_inference_of_a_pipeline_returns_the_unsplit_outputs():
    split, ref = chain(), chain()
    poptorch.BeginBlock(split.layers[2], ipu_id=1)
    x, t = batch(8)
    out = poptorch.inferenceModel(split, poptorch.Options().deviceIterations(2))(x, t)
    # each device iteration runs its own micro-batch of 4 rows: the reference runs the same two batches (a
    # matrix product over 8 rows may round differently from two over 4, as it does with AVX-512 kernels)
    with torch.no_grad():
        expected = torch.cat([ref(x[:4], t[:4])[0], ref(x[4:], t[4:])[0]])
    assert torch.equal(out[0], expected)


# --- the pipeline depth rule ----------------------------------------------------------------------------

def test_training_a_pipeline_needs_accumulation_of_twice_its_stages_minus_one():
    model = chain()
    poptorch.BeginBlock(model.layers[1], ipu_id=1)
    poptorch.BeginBlock(model.layers[3], ipu_id=2)
    before = [p.detach().clone() for p in model.parameters()]
    opts = options(g=4).autoRoundNumIPUs(True)  # 3 IPUs
    wrapped = poptorch.trainingModel(model, opts)
    with pytest.raises(poptorch.Error) as info:
        wrapped(*batch(4))
    assert str(info.value) == (
        "poptorch.Options().Training.gradientAccumulation must be greater than or equal to the number of "
        "pipeline stages (5) when using poptorch.PipelinedExecution. Please note that a model with 3 pipeline "
        "stages in PopTorch will have an additional 2 stages when training.")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # nothing was updated
    # the compilation failed, so there is no executable: as PopTorch's, destroy() has nothing to release and
    # the module stays wrapped (PopTorch unwraps it only with the executable)
    assert not wrapped.isCompiled()
    wrapped.destroy()
    with pytest.raises(RuntimeError, match="Model has already been wrapped"):
        poptorch.trainingModel(model, options(g=5))
    model = chain()
    poptorch.BeginBlock(model.layers[1], ipu_id=1)
    poptorch.BeginBlock(model.layers[3], ipu_id=2)
    poptorch.trainingModel(model, options(g=5).autoRoundNumIPUs(True))(*batch(5))


def test_an_inference_pipeline_needs_device_iterations_of_its_stages():
    model = chain()
    poptorch.BeginBlock(model.layers[2], ipu_id=1)
    with pytest.raises(poptorch.Error, match=r"^poptorch.Options\(\).deviceIterations must be greater than or "
                                             r"equal to the number of pipeline stages \(2\) when using "
                                             r"PopTorch.PipelinedExecution.$"):
        poptorch.inferenceModel(model)(*batch(2))
    poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))(*batch(2))


def test_sharded_execution_has_no_depth_rule():
    model = chain()
    poptorch.BeginBlock(model.layers[2], ipu_id=1)
    wrapped = poptorch.trainingModel(model, options(g=1, strategy=poptorch.ShardedExecution()))
    wrapped(*batch(2))
    assert wrapped._placement.mode == "sharded" and wrapped._placement.ipus_per_replica == 2


def test_stages_count_ipu_changes_so_blocks_on_one_ipu_merge():
    model = chain()
    poptorch.BeginBlock(model.layers[1], ipu_id=1)
    poptorch.BeginBlock(model.layers[2], ipu_id=1)  # a second block on the same IPU: no new stage
    wrapped = poptorch.trainingModel(model, options(g=3))
    wrapped(*batch(3))
    assert wrapped._placement.forward_stages == 2


def test_auto_increment_gives_a_return_to_an_ipu_its_own_stage():
    model = chain()
    poptorch.BeginBlock(model.layers[1], ipu_id=1)
    poptorch.BeginBlock(model.layers[2], ipu_id=0)
    strategy = poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)
    wrapped = poptorch.inferenceModel(model, options(d=3, strategy=strategy))
    wrapped(*batch(3))
    p = wrapped._placement
    assert [(s, ipu) for _, s, _, ipu in p.blocks] == [(1, 1), (2, 0)]
    assert p.forward_stages == 3 and p.ipus_per_replica == 2


# --- blocks, ids and stages ------------------------------------------------------------------------------

class Blocks(torch.nn.Module):
    def forward(self, x):
        poptorch.Block.useAutoId()
        with poptorch.Block(ipu_id=0):
            x = x * 4
        with poptorch.Block(ipu_id=1):
            x = x + 1
        return x


def test_an_op_outside_any_block_after_one_ended_is_an_error():
    class Model(torch.nn.Module):
        def forward(self, x):
            with poptorch.Block(ipu_id=0):
                x = x * 4
            return x * 4

    strategy = poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)
    wrapped = poptorch.inferenceModel(Model(), options(d=2, strategy=strategy))
    with pytest.raises(poptorch.Error, match="^No active Block, all the ops must belong to a Block$"):
        wrapped.compile(torch.randn(2, 5))


def test_block_context_managers_get_automatic_ids_and_explicit_stages():
    strategy = poptorch.PipelinedExecution(poptorch.Stage("0"), poptorch.Stage("1").ipu(3))
    wrapped = poptorch.inferenceModel(Blocks(), options(d=4, strategy=strategy).autoRoundNumIPUs(True))
    assert torch.equal(wrapped(torch.ones(4, 2)), torch.full((4, 2), 5.0))
    assert wrapped._placement.blocks == [("0", 0, -1, 0), ("1", 1, -1, 3)]
    assert wrapped._placement.ipus_per_replica == 4
    assert strategy.stage("1").blocks == ("1",)


def test_a_block_missing_from_the_explicit_stages_is_an_assertion():
    strategy = poptorch.PipelinedExecution("0")
    with pytest.raises(AssertionError, match=r"^Unknown Block '1' list of expected Blocks: \['0'\]$"):
        poptorch.inferenceModel(Blocks(), options(d=2, strategy=strategy))(torch.ones(2, 2))


def test_same_as_ipu_needs_an_ipu_for_each_block():
    model = chain()
    poptorch.BeginBlock(model.layers[1], user_id="b")
    with pytest.raises(AssertionError, match="^poptorch.AutoStage.SameAsIpu was selected but no IPU was "
                                             "specified for block b$"):
        poptorch.inferenceModel(model)(*batch(1))


def test_a_block_in_two_stages_is_an_assertion():
    with pytest.raises(AssertionError, match="^A associated with more than one stage$"):
        poptorch.PipelinedExecution(poptorch.Stage("A"), poptorch.Stage("A", "B"))


def test_block_function_runs_its_body_in_a_block():
    class Model(torch.nn.Module):
        def forward(self, x):
            poptorch.Block.useAutoId()
            return self.second(self.first(x))

        @poptorch.BlockFunction(ipu_id=0)
        def first(self, x):
            return x * 4

        @poptorch.BlockFunction(ipu_id=1)
        def second(self, x):
            return x * 2

    wrapped = poptorch.inferenceModel(Model(), options(d=2))
    assert torch.equal(wrapped(torch.ones(2, 3)), torch.full((2, 3), 8.0))
    assert [b[0] for b in wrapped._placement.blocks] == ["0", "1"]


def test_a_module_is_assigned_to_one_block_until_the_blocks_are_removed():
    model = chain()
    assert poptorch.BeginBlock(model.layers[1], ipu_id=1) is model.layers[1]
    with pytest.raises(poptorch.Error, match="module has already been assigned to a block."):
        poptorch.BeginBlock(model.layers[1], ipu_id=2)
    poptorch.removeBlocks(model)
    wrapped = poptorch.trainingModel(model)  # one stage: G = 1 is enough
    wrapped(*batch(1))
    assert wrapped._placement.ipus_per_replica == 1
    poptorch.BeginBlock(model.layers[1], ipu_id=2)


def test_begin_block_wraps_a_plain_function():
    block = poptorch.BeginBlock(lambda x: x + 1.0, "f", 2)
    assert block._user_id == "f" and block._ipu_id == 2
    assert torch.equal(block(torch.zeros(2)), torch.ones(2))


# --- IPUs -----------------------------------------------------------------------------------------------

def test_three_ipus_are_refused_unless_rounded_up():
    model = chain()
    poptorch.BeginBlock(model.layers[1], ipu_id=1)
    poptorch.BeginBlock(model.layers[2], ipu_id=2)
    with pytest.raises(poptorch.Error, match="The model specifies the use of 3 IPUs, however PopTorch must "
                                             "reserve a minimum of 4"):
        poptorch.inferenceModel(model, options(d=3))(*batch(3))
    poptorch.inferenceModel(model, options(d=3).autoRoundNumIPUs(True))(*batch(3))


def test_ipus_per_replica_times_replicas_are_counted():
    model = chain()
    poptorch.BeginBlock(model.layers[2], ipu_id=1)
    opts = options(g=3).replicationFactor(2)
    wrapped = poptorch.trainingModel(model, opts)
    wrapped(*batch(6 * 2))  # 2 IPUs x 2 replicas = 4: reserved as it is
    opts = options(d=2).replicationFactor(40)
    with pytest.raises(poptorch.Error, match=r"^Too many IPUs requested \(80\). Experiments that need more than "
                                             "64 IPUs require distributed execution.$"):
        poptorch.inferenceModel(model, opts)(*batch(80))


# --- phased execution ----------------------------------------------------------------------------------

def test_serial_phases_run_on_one_ipu_group():
    model = chain()
    poptorch.BeginBlock(model.layers[1], user_id="B")
    poptorch.BeginBlock(model.layers[2], user_id="C")
    strategy = poptorch.SerialPhasedExecution(["A"], ["B"], ["C"])
    for k in range(3):
        strategy.phase(k).ipus(0)
    wrapped = poptorch.trainingModel(model, options(strategy=strategy))  # no depth rule
    wrapped(*batch(1))
    assert wrapped._placement.blocks == [("B", -1, 1, 0), ("C", -1, 2, 0)]
    assert wrapped._placement.ipus_per_replica == 1


def test_parallel_phases_alternate_even_and_odd_ipus():
    model = chain()
    poptorch.BeginBlock(model.layers[1], user_id="B")
    strategy = poptorch.ParallelPhasedExecution(["A"], ["B"])
    strategy.phase(0).ipus(0)
    strategy.phase(1).ipus(2)
    with pytest.raises(poptorch.Error, match="^When phases are executed in parallel: even phases must run on even "
                                             "IPUs and odd phases on odd IPUs$"):
        poptorch.inferenceModel(model, options(strategy=strategy))(*batch(1))


def test_phased_execution_needs_explicit_phases():
    with pytest.raises(AssertionError, match="^There is currently no AutoStage for PhasedExecution"):
        poptorch.SerialPhasedExecution()


# --- options and compilation ---------------------------------------------------------------------------

def test_the_strategy_is_an_option_frozen_with_the_others():
    opts = poptorch.Options()
    assert isinstance(opts._execution_strategy, poptorch.PipelinedExecution)
    poptorch.inferenceModel(chain(), opts)
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.setExecutionStrategy(poptorch.ShardedExecution())
    assert isinstance(opts.clone()._execution_strategy, poptorch.PipelinedExecution)


def test_gradient_accumulation_in_inference_names_device_iterations_only_when_pipelined():
    opts = options(g=2)
    with pytest.raises(poptorch.Error, match="for pipelined execution instead.$"):
        poptorch.inferenceModel(chain(), opts)
    opts = options(g=2, strategy=poptorch.ShardedExecution())
    with pytest.raises(poptorch.Error, match=r"poptorch.inferenceModel\(\).$"):
        poptorch.inferenceModel(chain(), opts)


def test_compile_traces_the_model_without_changing_its_buffers_or_the_random_stream():
    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(3)
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.bn(x))

    model = Norm()
    poptorch.BeginBlock(model.drop, ipu_id=1)
    wrapped = poptorch.inferenceModel(model.train(), options(d=2))
    x = torch.randn(4, 3)
    rng = torch.get_rng_state()
    wrapped.compile(x)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model.bn.running_mean, torch.zeros(3)) and int(model.bn.num_batches_tracked) == 0
    assert wrapped._placement.forward_stages == 2
    with pytest.raises(poptorch.Error, match=r"pipeline stages \(2\)"):
        poptorch.inferenceModel(model).compile(torch.randn(4, 3))


def test_module_repr_shows_begin_blocks_that_repr_leaves_out():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 1)))
    assert poptorch.module_repr(model) == repr(model)
    poptorch.BeginBlock(model[1], user_id=1, ipu_id=2)
    text = poptorch.module_repr(model)
    assert "(1): BeginBlock(user_id=1, ipu_id=2) Sequential(\n    (0): ReLU()" in text
    assert "BeginBlock" not in repr(model)
    assert "BeginBlock(user_id=1, ipu_id=2)" in repr(poptorch.inferenceModel(model))

"""R=2 over gloo (two spawned processes) against a one-process plain-torch reference; process hygiene.

The workers below run in spawned children (they must stay module-level). Every replica starts from a
*different* seed, so equality also shows that the engine broadcasts rank 0's initial weights.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from accelbatch.backends import distributed
from accelbatch.backends.distributed import spawn_replicas
from helpers import live_children

from accelbatch.procs import ProcessRaised, ProcessTimeout

pytestmark = pytest.mark.multiprocess

D_IN, D_OUT, LR = 5, 4, 0.1

# name -> plan keywords, rows per call, number of calls, gather outputs, engine inputs
SCENARIOS = {
    "mean": (dict(micro_batch=3, device_iterations=2, replication_factor=2, gradient_accumulation=2), 24, 2,
             False, "shard"),
    "sum_final_gathered": (dict(micro_batch=2, device_iterations=3, replication_factor=2, gradient_accumulation=1,
                                reduction="sum"), 12, 2, True, "shard"),
    "tail": (dict(micro_batch=4, device_iterations=2, replication_factor=2, gradient_accumulation=2,
                  drop_last=False, output_mode="all"), 22, 1, True, "shard"),
    "full_inputs_everyn": (dict(micro_batch=2, device_iterations=4, replication_factor=2, output_mode="everyn",
                                output_return_period=2), 16, 2, False, "full"),
}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D_IN, D_OUT)

    def forward(self, batch):
        scores = self.lin(batch["x"])
        return {"loss": (scores - batch["y"]).pow(2).mean(dim=1).mean(), "scores": scores}


def scenario_data(name: str, call: int, rows: int):
    g = torch.Generator().manual_seed(1000 + 10 * list(SCENARIOS).index(name) + call)
    return {"x": torch.randn(rows, D_IN, generator=g), "y": torch.randn(rows, D_OUT, generator=g)}


def initial_net() -> Net:
    torch.manual_seed(0)
    return Net()


def _train_worker(rank: int, names: list[str]):
    """Runs in each replica: every scenario, on this replica's shard of the same combined batches."""
    from accelbatch.backends.cpu import CPUBackend, ReplicatedEngine

    from accelbatch.plan import ExecutionPlan

    out = {}
    for name in names:
        plan_kw, rows, calls, gather, inputs = SCENARIOS[name]
        plan = ExecutionPlan(**plan_kw)
        torch.manual_seed(0 if rank == 0 else 123)  # rank 1 starts elsewhere: the engine broadcasts rank 0's
        model = Net()
        engine = CPUBackend().compile(model, torch.optim.SGD(model.parameters(), lr=LR), plan,
                                      gather_outputs=gather, inputs=inputs)
        assert isinstance(engine, ReplicatedEngine)
        results = []
        for call in range(calls):
            data = scenario_data(name, call, rows)
            res = engine.train_step(plan.shard(data, rank) if inputs == "shard" else data)
            results.append({"loss": res.loss, "updates": res.updates, "outputs": res.outputs, "rows": res.rows})
        out[name] = {"state": {k: v.clone() for k, v in model.state_dict().items()}, "results": results}
    out["metrics"] = CPUBackend().reduce_metrics({"exs": rank + 1, "loss_sum": 0.5, "extra": {f"r{rank}": 1.0}})
    return out


def reference(name: str):
    """Plain torch, one process: each weight update over its contiguous block of rows."""
    plan_kw, rows, calls, _, _ = SCENARIOS[name]
    b, d = plan_kw["micro_batch"], plan_kw["device_iterations"]
    per_update = b * plan_kw["replication_factor"] * plan_kw.get("gradient_accumulation", 1)
    sum_red = plan_kw.get("reduction") == "sum"
    net = initial_net()
    outs = []
    for call in range(calls):
        data = scenario_data(name, call, rows)
        scores_before = []
        for start in range(0, rows, per_update):
            stop = min(start + per_update, rows)
            scores = net.lin(data["x"][start:stop])
            scores_before.append(scores.detach())
            per_row = (scores - data["y"][start:stop]).pow(2).mean(dim=1)
            loss = per_row.sum() / b if sum_red else per_row.mean()
            net.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= LR * p.grad
        assert len(scores_before) <= d
        outs.append(torch.cat(scores_before))
    return net, outs


@pytest.fixture(scope="module")
def replicated():
    """The replicas' results; meanwhile another program listens on the port ``find_free_port`` gives (two
    runs starting together on one host): the rendezvous must not depend on a port nobody holds."""
    with socket.socket() as squatter, pytest.MonkeyPatch.context() as patch:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        patch.setattr(distributed, "find_free_port", lambda host="127.0.0.1": squatter.getsockname()[1])
        return spawn_replicas(_train_worker, 2, list(SCENARIOS), timeout_s=120)


def _assert_close_state(state, net, atol=1e-6):
    for k, v in net.state_dict().items():
        diff = (state[k] - v).abs().max().item()
        assert diff <= atol, f"{k}: max diff {diff:.3g}"


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_r2_gloo_equals_r1_reference(replicated, name):
    net, _ = reference(name)
    assert not torch.allclose(net.lin.weight, initial_net().lin.weight)
    for rank in range(2):
        _assert_close_state(replicated[rank][name]["state"], net)


@pytest.mark.timeout(180)
def test_local_outputs_are_the_replicas_shard(replicated):
    _, outs = reference("mean")
    plan_kw, rows, _, _, _ = SCENARIOS["mean"]
    b, d, r, g = (plan_kw[k] for k in ("micro_batch", "device_iterations", "replication_factor",
                                       "gradient_accumulation"))
    for rank in range(2):
        res = replicated[rank]["mean"]["results"][-1]
        assert res["updates"] == d
        # Final: this replica's last micro-batch, rows local to its shard ([D, G, b] -> last b rows)
        assert res["rows"].tolist() == list(range(d * g * b - b, d * g * b))
        global_rows = [((d - 1) * g + g - 1) * r * b + rank * b + i for i in range(b)]
        assert torch.allclose(res["outputs"]["scores"], outs[-1][global_rows], atol=1e-5)
        # its loss: its own returned micro-batch's (an IPU's Final), averaged over the replicas in the report
        first, y = replicated[rank]["mean"]["results"][0], scenario_data("mean", 0, rows)["y"]
        expected = (outs[0][global_rows] - y[global_rows]).pow(2).mean(dim=1).mean()
        assert first["loss"] == pytest.approx(float(expected), abs=1e-5)


@pytest.mark.timeout(180)
def test_full_inputs_return_rows_of_the_combined_batch(replicated):
    """inputs='full': each process got the whole batch; EveryN(2) of D=4: iterations 1 and 3, own replica."""
    _, outs = reference("full_inputs_everyn")
    b, r = 2, 2
    for rank in range(2):
        res = replicated[rank]["full_inputs_everyn"]["results"][-1]
        want = [(k * r + rank) * b + i for k in (1, 3) for i in range(b)]
        assert res["rows"].tolist() == want
        # iteration k's outputs were computed before update k: compare with the reference's pre-update scores
        ref_scores = torch.cat([outs[-1][(k * r + rank) * b:(k * r + rank + 1) * b] for k in (1, 3)])
        assert torch.allclose(res["outputs"]["scores"], ref_scores, atol=1e-5)


@pytest.mark.timeout(180)
def test_gathered_outputs_follow_the_plan_order(replicated):
    _, outs = reference("sum_final_gathered")
    plan_kw, rows, _, _, _ = SCENARIOS["sum_final_gathered"]
    b, d, r = plan_kw["micro_batch"], plan_kw["device_iterations"], plan_kw["replication_factor"]
    final_rows = [(d - 1) * r * b + rep * b + i for rep in range(r) for i in range(b)]
    for rank in range(2):
        res = replicated[rank]["sum_final_gathered"]["results"][-1]
        assert res["rows"].tolist() == final_rows
        assert torch.allclose(res["outputs"]["scores"], outs[-1][final_rows], atol=1e-5)
    _, tail_outs = reference("tail")
    res = replicated[0]["tail"]["results"][0]
    assert res["updates"] == 2 and res["rows"].tolist() == list(range(22))
    assert torch.allclose(res["outputs"]["scores"], tail_outs[0], atol=1e-5)


@pytest.mark.timeout(180)
def test_reduce_metrics_sums_across_processes(replicated):
    want = {"exs": 3, "loss_sum": 1.0, "extra": {"r0": 1.0, "r1": 1.0}}
    assert replicated[0]["metrics"] == want and replicated[1]["metrics"] == want


# --- process hygiene -------------------------------------------------------------------------------
def assert_no_leaked_children():
    assert multiprocessing.active_children() == []
    assert live_children() == []


def _raising_worker(rank: int):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom from replica 1")
    dist.barrier()  # rank 0 would wait here forever if nobody ended it


def _exiting_worker(rank: int):
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)  # no exception for the parent to report: the process just ends
    dist.barrier()


def _sleeping_worker(rank: int, pid_dir: str | None = None):
    if pid_dir:
        with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as fh:
            fh.write(str(os.getpid()))
    time.sleep(120)


@pytest.mark.timeout(120)
def test_no_leak_after_gloo_run(replicated):
    assert replicated[0] is not None
    assert_no_leaked_children()


def test_the_parent_passes_one_stop_on_and_ends_the_replicas_on_a_second():
    """A stop signal delivered twice at once (GNU timeout signals its child, then its process group) is one
    request: passed on once, the replicas save and stop; the signal again later ends them at once."""
    class Replicas:
        def __init__(self):
            self.sent = []

        def signal(self, signum):
            self.sent.append(signum)

    replicas, stop = Replicas(), distributed._StopRequests()
    stop.record(signal.SIGINT)
    stop.record(signal.SIGINT)
    assert stop.check(replicas) is True and stop.check(replicas) is False and replicas.sent == [signal.SIGINT]
    time.sleep(distributed.DOUBLE_DELIVERY_S)
    stop.record(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt, match="SIGINT again: the replicas were ended"):
        stop.check(replicas)
    assert replicas.sent == [signal.SIGINT, signal.SIGINT]


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_child_exception_propagates_and_ends_the_others():
    start = time.monotonic()
    with pytest.raises(ProcessRaised) as err:
        spawn_replicas(_raising_worker, 2, timeout_s=90)
    text = str(err.value)
    assert "replica 1 of 2" in text and "Traceback" in text and "ValueError: boom from replica 1" in text
    assert "_raising_worker" in text
    assert err.value.index == 1 and err.value.role == "replica"
    assert err.value.error_types[0] == "builtins.ValueError" and err.value.error_message == "boom from replica 1"
    assert time.monotonic() - start < 60
    assert_no_leaked_children()


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_replica_exiting_with_a_code_of_its_own_is_named_with_it_not_as_a_kill():
    """A replica that ends with os._exit(3) (or Python's own exit 1 at a start-up error) was said to have
    ended "(out of memory? killed?)", which fits a signal, not an exit code."""
    from accelbatch.procs import ProcessDied

    with pytest.raises(ProcessDied) as err:
        spawn_replicas(_exiting_worker, 2, timeout_s=90)
    text = str(err.value)
    assert "replica 1 of 2" in text and "exited with code 3 without a Python traceback" in text, text
    assert "out of memory" not in text and "what it printed above" in text, text
    assert err.value.exitcode == 3
    assert_no_leaked_children()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_timeout_ends_every_child():
    start = time.monotonic()
    with pytest.raises(ProcessTimeout, match="did not finish within 4"):
        spawn_replicas(_sleeping_worker, 2, timeout_s=4, init_process_group=False)
    assert time.monotonic() - start < 30
    assert_no_leaked_children()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_leaves_no_process(tmp_path):
    """SIGINT to a parent blocked in spawn_replicas: it ends its children and exits with the interrupt."""
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = {[p for p in sys.path if p]!r}
        from accelbatch.backends.distributed import spawn_replicas
        from {__name__} import _sleeping_worker
        try:
            spawn_replicas(_sleeping_worker, 2, {str(tmp_path)!r}, init_process_group=False, timeout_s=100)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(130)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=os.getcwd(), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "replicas did not start"
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err.decode()
    assert b"interrupted" in out
    deadline = time.monotonic() + 10
    while any(_state(pid) not in ("gone", "Z") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [(pid, _state(pid)) for pid in pids if _state(pid) not in ("gone", "Z")] == []


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return "gone"
    return stat[stat.rindex(")") + 2:].split()[0]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_launch_equals_reference(tmp_path):
    """torchrun --nproc-per-node 2: CPUBackend.setup joins the group from torchrun's environment."""
    script = tmp_path / "replica.py"
    script.write_text(textwrap.dedent(f"""
        import sys, types
        sys.path[:0] = {[p for p in sys.path if p]!r}
        import torch
        from accelbatch.backends.cpu import CPUBackend, ReplicatedEngine
        from accelbatch.plan import ExecutionPlan
        from {__name__} import SCENARIOS, Net, scenario_data, LR

        backend = CPUBackend()
        backend.setup(types.SimpleNamespace(replication_factor=2))
        plan_kw, rows, calls, _, _ = SCENARIOS["mean"]
        plan = ExecutionPlan(**plan_kw)
        torch.manual_seed(backend.rank)
        model = Net()
        engine = backend.compile(model, torch.optim.SGD(model.parameters(), lr=LR), plan)
        assert isinstance(engine, ReplicatedEngine) and backend.world_size == 2
        for call in range(calls):
            engine.train_step(plan.shard(scenario_data("mean", call, rows), backend.rank))
        if backend.is_main_process():
            torch.save(model.state_dict(), {str(tmp_path / "state.pt")!r})
        backend.teardown()
    """))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed next to this python")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                           "--master-port", str(distributed.find_free_port()), str(script)],
                          capture_output=True, timeout=150, env=env, start_new_session=True)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    net, _ = reference("mean")
    _assert_close_state(torch.load(tmp_path / "state.pt"), net)


def test_env_info_reads_torchrun_variables():
    assert distributed.env_info({}) is None
    info = distributed.env_info({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert (info.rank, info.world_size, info.local_rank) == (1, 2, 1)
    with pytest.raises(ValueError, match="outside WORLD_SIZE"):
        distributed.env_info({"RANK": "2", "WORLD_SIZE": "2"})
    assert distributed.init_from_env() is None or distributed.is_initialized()
    port = distributed.find_free_port()
    assert 0 < port < 65536
    assert distributed.rank() == 0 and distributed.world_size() == 1 and distributed.is_main_process()


# --- a group the replica's function joined itself (accelerate's NCCL group) ------------------------------

def _joins_its_own_group(rank: int, marker_dir: str) -> int:
    """Joins a gloo group itself (as accelerate joins NCCL) and returns without leaving it; records whether
    the group was destroyed after it returned."""
    import torch.distributed as dist

    original = dist.destroy_process_group

    def recorded(*args, **kwargs):
        with open(os.path.join(marker_dir, f"destroyed-{rank}"), "w") as fh:
            fh.write("yes")
        return original(*args, **kwargs)

    dist.destroy_process_group = recorded
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2)
    return rank


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_group_the_replica_joined_itself_is_left_after_it_returns(tmp_path):
    assert spawn_replicas(_joins_its_own_group, 2, str(tmp_path), timeout_s=90, init_process_group=False) == [0, 1]
    assert sorted(os.listdir(tmp_path)) == ["destroyed-0", "destroyed-1"]
    assert_no_leaked_children()


def _aborted_or_stuck(rank: int, stuck: bool) -> None:
    """Replica 0 aborts as NCCL's watchdog aborts a replica whose collective timed out; replica 1 hangs in
    user code (``stuck``) or aborts too."""
    if rank == 0 or not stuck:
        time.sleep(0.5)
        os.abort()
    time.sleep(120)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_abort_while_a_peer_hangs_names_the_peer_as_stuck():
    with pytest.raises(ProcessTimeout) as err:
        spawn_replicas(_aborted_or_stuck, 2, True, timeout_s=90, init_process_group=False, group_timeout_s=7)
    text = str(err.value)
    assert text.startswith("replica 1 of 2") and "is stuck: replica 0 was aborted (SIGABRT)" in text
    assert "--replica-timeout-s=7 s" in text and "_aborted_or_stuck" in text    # its stack is shown
    assert err.value.index == 1
    assert_no_leaked_children()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_abort_of_every_replica_is_reported_as_a_collective_timeout_or_lost_peer():
    from accelbatch.procs import ProcessDied

    with pytest.raises(ProcessDied) as err:
        spawn_replicas(_aborted_or_stuck, 2, False, timeout_s=90, init_process_group=False, group_timeout_s=7)
    text = str(err.value)
    assert "was killed by SIGABRT without a Python traceback (a C++ abort: NCCL's watchdog" in text
    assert "--replica-timeout-s=7 s" in text and "out of memory" not in text
    assert_no_leaked_children()

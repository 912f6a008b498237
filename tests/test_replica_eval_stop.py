"""A stop signal during a validation of a ``-rf 2`` run: replica 1 has finished its share and waits for the
report's collective while replica 0 is still evaluating when the signal comes. The replicas decide together
after their loops, so both stop there and rank 0 saves the checkpoint: exit 130 within seconds, not a replica
alone in a barrier while the other waits in the report's all-gather."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accelbatch.models.bag import BagAgent

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

MARK = "ACCELBATCH_TEST_EVAL_MARK"
ONLY_ME = "ACCELBATCH_TEST_SIGNAL_REPLICA_0"


class SlowFirstReplicaEval(BagAgent):
    """In replica 0's first validation, its third batch writes the file $ACCELBATCH_TEST_EVAL_MARK and waits
    3 s (the test signals the run meanwhile; replica 1 has long finished its share)."""

    eval_batches = 0

    def batch_act(self, observations):
        import torch.distributed as dist

        evaluating = any("eval_labels" in o for o in observations if o)
        if evaluating and dist.is_initialized() and dist.get_rank() == 0:
            type(self).eval_batches += 1
            if type(self).eval_batches == 3:
                Path(os.environ[MARK]).touch()
                if os.environ.get(ONLY_ME):  # as a signal to this replica alone: the other stops by agreement
                    os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(3)
        return super().batch_act(observations)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, None], ids=["SIGINT", "SIGTERM", "replica-0"])
def test_a_stop_during_a_replicated_validation_saves_and_ends_within_seconds(tmp_path, signum):
    """The signal to the run (forwarded to each replica), or to replica 0 alone (None)."""
    mark, model = tmp_path / "mark", tmp_path / "m.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", MARK: str(mark), **({ONLY_ME: "1"} if signum is None else {}),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "accelbatch", "train", "-t", "babi:1", "-m", f"{__name__}:SlowFirstReplicaEval",
         "-rf", "2", "-bs", "8", "-tstep", "100", "-veps", "0.1", "--eval-splits", "", "--no-progress",
         "-mf", str(model)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), proc.communicate(timeout=30)
        began = time.monotonic()
        if signum is not None:
            proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert time.monotonic() - began < 20, err  # the 3 s wait and the save, not the 120 s of a hang
    assert "did not stop within" not in err and "checkpoint saved" in err, err
    assert (tmp_path / "m.pt.ckpt").is_dir()

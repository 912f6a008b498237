"""Hogwild on the CPU: N processes, one model in shared memory, ParlAI's HogwildWorld semantics.

    python examples/hogwild_cpu.py                 # 2 processes on the bundled babi:1 task
    python examples/hogwild_cpu.py -nt 4 -bs 16

Each process has its own copy of the world (teacher and agent clones) and its own optimizer over the
shared parameters, which it updates without locks. `world.parley()` in this process hands one parley to
a free process; evaluation serves every example exactly once across the processes. Agent classes must be
importable by the child processes, hence the `if __name__ == "__main__":` guard below.
"""

from __future__ import annotations

import sys

import accelbatch as ab
from accelbatch.cli import run_script


def main(argv: list[str] | None = None) -> dict:
    opts = ab.Opts.from_args(argv, numthreads=2, num_epochs=1.0)
    world = ab.create_world(opts)                   # a HogwildWorld when --numthreads > 1
    try:
        report = ab.run(world, opts)               # validation runs here, on the shared model
    finally:
        world.shutdown()                           # ends the processes (also done by run)
    print(ab.format_report(report))
    eval_world = ab.create_world(opts.replace(datatype="test"), agent=world.get_model_agent())
    try:
        test = ab.evaluate(eval_world)             # exactly once across the hogwild processes
    finally:
        eval_world.shutdown()
    print(f"test across {opts.numthreads} processes: {test['exs']} examples, accuracy {test['accuracy']:.4f}")
    return {"run": report, "test": test}


if __name__ == "__main__":
    sys.exit(run_script(main))  # bad input: one line and exit 2, as accelbatch train says it

"""Tutorial 5: the same accelbatch world/agent training script on the CPU and on the IPU.

    python examples/ipu/05_world_training_on_ipu.py                  # --device ipu (the default here)
    python examples/ipu/05_world_training_on_ipu.py --device cpu     # the very same script on the CPU
    python examples/ipu/05_world_training_on_ipu.py --compare-cpu    # both, then compare the weights
    python examples/ipu/05_world_training_on_ipu.py --via-cli        # the same through `accelbatch train`

Nothing in the script is IPU-specific: the agent (here the bundled memory network, ``-m memnn``) says what
to compute, ``--device`` says where. On ``--device ipu`` the backend maps the execution plan (``-bs`` the
micro batch, ``-di`` device iterations, ``-rf`` replicas, ``-ga`` gradient accumulation, ``--output-mode``)
to ``poptorch.Options``, wraps the model in ``poptorch.trainingModel`` / ``inferenceModel`` (the host
weights are shared) and compiles one graph per input shape; ``--dynamic-batching buckets`` keeps the number
of shapes, hence of compilations, small.

Same weights? On the emulator, yes: it runs the model with the CPU's float32 arithmetic, so under the same
plan ``--compare-cpu`` finds the weights equal to 1e-5 (the check's default there). On IPU hardware, no
bit-for-bit equality is to be expected: the IPU computes in its own float32 (other operation orders and
fused kernels; stochastic rounding if enabled), so the weights agree only within a tolerance, and the
differences grow with the number of steps. The check's default on hardware is 1e-3 (a starting point, not
a figure measured on an IPU); set ``--tolerance`` for your model and step count.

Every option of ``accelbatch train`` is accepted. Without the Poplar SDK's poptorch the script switches to
accelbatch's CPU emulator of poptorch (the same as passing ``--ipu-emulator`` or setting
``ACCELBATCH_IPU_EMULATOR=1``) and says so.
"""

from __future__ import annotations

import os
import shlex
import sys

import accelbatch as ab
from accelbatch.cli import error_message
from accelbatch.opts import IPU_ONLY, Opts, build_parser

DEFAULTS = dict(task="babi:1", model="memnn", device="ipu", optimizer="sgd", learning_rate=0.5, batchsize=8,
                device_iterations=4, embedding_size=32, max_train_steps=60, num_epochs=-1.0,
                validation_every_n_epochs=-1.0, eval_splits="valid", progress=False)


def parse(argv: list[str]) -> tuple[Opts, bool, bool, float | None]:
    parser = build_parser(prog="05_world_training_on_ipu.py")
    parser.set_defaults(**DEFAULTS)
    parser.add_argument("--compare-cpu", action="store_true", help="also train on the CPU and compare weights")
    parser.add_argument("--via-cli", action="store_true", help="run `accelbatch train` with these options")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest weight difference --compare-cpu accepts (default: 1e-5 on the emulator, "
                             "1e-3 on IPU hardware)")
    ns = parser.parse_args(argv)
    if ns.tolerance is not None and not ns.tolerance >= 0:
        parser.error(f"argument --tolerance: {ns.tolerance:g} is below 0; give the largest difference to accept")
    return Opts.from_namespace(ns), ns.compare_cpu, ns.via_cli, ns.tolerance


def ensure_ipu(opts: Opts) -> Opts:
    """On a machine without poptorch, switch to the emulator (and say so); unchanged on an IPU machine."""
    if opts.device != "ipu" or opts.ipu_emulator:
        if opts.ipu_emulator:
            os.environ["ACCELBATCH_IPU_EMULATOR"] = "1"
        return opts
    try:
        import poptorch  # noqa: F401

        return opts
    except ImportError:
        print("poptorch not found (it ships with the Poplar SDK): running --device ipu on accelbatch's CPU "
              "emulator of poptorch (--ipu-emulator)")
        os.environ["ACCELBATCH_IPU_EMULATOR"] = "1"
        return opts.replace(ipu_emulator=True)


def train(opts: Opts):
    """The whole training script: a world, a run, a report. The same on every device."""
    world = ab.create_world(opts)
    report = ab.run(world, opts)
    return report, world.get_model_agent()


def cli_args(opts: Opts) -> list[str]:
    """The `accelbatch train` command line of these options (those differing from the CLI defaults)."""
    base = Opts()
    flags = {f: "/".join(m) for f, m in ((f.name, f.metadata["flags"]) for f in Opts.__dataclass_fields__.values())}
    out = ["train"]
    for name, flag in flags.items():
        value, default = getattr(opts, name), getattr(base, name)
        if value == default:
            continue
        long = [f for f in flag.split("/") if f.startswith("--")][0]
        if isinstance(value, bool):
            out.append(long if value else "--no-" + long[2:])
        else:
            out += [long, str(value)]
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the tutorial; an option, plan or data error ends in one line and exit 2, as `accelbatch train`."""
    try:
        return run(argv)
    except Exception as exc:
        known = error_message(exc)
        if known is None:
            raise  # a bug: its traceback is what helps
        print(f"05_world_training_on_ipu.py: error: {known[1]}", file=sys.stderr)
        return known[0]


def run(argv: list[str] | None) -> int:
    opts, compare, via_cli, tolerance = parse(sys.argv[1:] if argv is None else argv)
    opts = ensure_ipu(opts)
    if via_cli:
        from accelbatch.cli import main as cli_main

        args = cli_args(opts)
        print("accelbatch " + " ".join(shlex.quote(a) for a in args))
        return cli_main(args)
    report, agent = train(opts)
    print(ab.format_report(report))
    engine = agent.engine
    if opts.device == "ipu":
        print(f"ran on {engine.implementation}; graphs compiled: {engine.compilations} "
              f"({sum(g['training'] for g in engine.compiled_graphs)} training, "
              f"{sum(not g['training'] for g in engine.compiled_graphs)} inference)")
    if compare:
        ipu_defaults = {name: getattr(Opts(), name) for name in IPU_ONLY}  # the IPU's own options: not the CPU's
        cpu_report, cpu_agent = train(opts.replace(device="cpu", **ipu_defaults))
        ipu_state, cpu_state = agent.model.state_dict(), cpu_agent.model.state_dict()
        diff = max(float((ipu_state[k] - cpu_state[k]).abs().max()) for k in cpu_state)
        if tolerance is None:  # exact CPU arithmetic on the emulator; the IPU's own float32 on hardware
            tolerance = 1e-3 if opts.device == "ipu" and engine.implementation == "poptorch" else 1e-5
        print(f"cpu: valid accuracy {cpu_report.get('valid', {}).get('accuracy')}; largest weight difference "
              f"{opts.device} vs cpu: {diff:.2e} (tolerance {tolerance:g})")
        if diff > tolerance:
            print(f"the weights differ by more than {tolerance:g}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

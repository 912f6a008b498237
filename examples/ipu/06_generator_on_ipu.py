"""Tutorial 6: a generator on the IPU (teacher-forced training, greedy decoding), and the same code on CUDA.

    python examples/ipu/06_generator_on_ipu.py                   # --device ipu (the emulator without the SDK)
    python examples/ipu/06_generator_on_ipu.py --device cuda     # the same script on a GPU (skipped without one)
    python examples/ipu/06_generator_on_ipu.py --compare-cpu     # also on the CPU: the same weights (emulator)
    python examples/ipu/06_generator_on_ipu.py --reply abcde     # the trained model's replies to your words

The bundled ``-m transformer/generator`` (a small encoder-decoder transformer over UTF-8 bytes) learns the
bundled ``-t reverse`` task (reply with the text's word reversed): 86-95% exact replies after 3 epochs of
6,000 words, in about a minute on the emulator; the figure depends on the CPU and the torch threads
(``OMP_NUM_THREADS``), whose float sums run in other orders (one machine: 95% with one thread, 86% with two;
another: 88% and 93%). Nothing in the script is device-specific:

* training is teacher forcing on the token loss. With ``-ga 2`` (and ``-rf``), ``--loss-normalization token``
  makes each weight update the per-token mean over its micro-batches, as one big batch would give (their
  words have different lengths); ``micro`` would average the micro-batches' means, as PopTorch's Mean does.
  On the IPU each micro-batch's share reaches the graph as an input, so both need no recompilation;
* generation runs inside the model's forward for a fixed ``--label-truncate`` steps with static shapes:
  the IPU compiles one inference graph per input shape (the script prints the count) and CUDA never waits
  on the host mid-reply;
* ``--text-truncate`` / ``--label-truncate`` bound the shapes: texts and labels pad to a multiple of 8
  tokens, so this task needs at most two training graphs (labels of up to 8 tokens, or up to 16).

``--compare-cpu`` trains again on the CPU: on the emulator the weights are the same (within ``--tolerance``,
1e-4 by default); on a GPU or an IPU float sums run in other orders, which moves a generator's weights apart
over hundreds of updates (0.5 after 100 on one CPU with 1 vs 2 threads), so there the two valid accuracies are
compared instead (at most 0.05 apart), unless ``--tolerance`` is given.

Every option of ``accelbatch train`` is accepted. Without the Poplar SDK's poptorch the script switches to
accelbatch's CPU emulator of poptorch and says so; ``--device cuda`` without a GPU says so and exits 0.
"""

from __future__ import annotations

import os
import sys

import torch

import accelbatch as ab
from accelbatch.cli import error_message
from accelbatch.opts import IPU_ONLY, Opts, build_parser

# -tr 8 holds the longest word (8 letters); --label-truncate 9 its reversal and the end token after it
DEFAULTS = dict(task="reverse:6000", model="transformer/generator", device="ipu", embedding_size=32,
                batchsize=16, device_iterations=2, gradient_accumulation=2, loss_normalization="token",
                text_truncate=8, label_truncate=9, learning_rate=0.003, num_epochs=3.0,
                validation_every_n_epochs=-1.0, eval_splits="valid", progress=False)
WORDS = ["abcde", "milk", "gamble"]


def parse(argv: list[str]) -> tuple[Opts, bool, list[str], float | None]:
    parser = build_parser(prog="06_generator_on_ipu.py")
    parser.set_defaults(**DEFAULTS)
    parser.add_argument("--compare-cpu", action="store_true", help="also train on the CPU and compare weights")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest weight difference --compare-cpu accepts (default: 1e-4 on the emulator; on "
                             "a GPU or an IPU the valid accuracies are compared instead, at most 0.05 apart)")
    parser.add_argument("--reply", nargs="*", default=WORDS, help="words to reverse with the trained model")
    ns = parser.parse_args(argv)
    if ns.tolerance is not None and not ns.tolerance >= 0:
        parser.error(f"argument --tolerance: {ns.tolerance:g} is below 0; give the largest difference to accept")
    return Opts.from_namespace(ns), ns.compare_cpu, ns.reply, ns.tolerance


def ensure_device(opts: Opts) -> Opts | None:
    """The opts to run: the emulator when --device ipu has no poptorch (said); None when CUDA is absent."""
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here; skipped (the same script runs unchanged on a GPU)")
        return None
    if opts.device != "ipu":
        return opts
    if not opts.ipu_emulator:
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


def generate(agent, words: list[str]) -> list[str]:
    """Replies to ``words`` from the trained agent, decoded on its device through its engine."""
    rows = [agent.vectorize(ab.Message(text=word)) for word in words]
    result = agent.engine.eval_step(agent.batchify(rows))
    return [agent.vocab.decode(row) for row in result.outputs["preds"].tolist()]


def main(argv: list[str] | None = None) -> int:
    """Run the tutorial; an option, plan or data error ends in one line and exit 2, as `accelbatch train`."""
    try:
        return run(argv)
    except Exception as exc:
        known = error_message(exc)
        if known is None:
            raise  # a bug: its traceback is what helps
        print(f"06_generator_on_ipu.py: error: {known[1]}", file=sys.stderr)
        return known[0]


def run(argv: list[str] | None) -> int:
    opts, compare, words, tolerance = parse(sys.argv[1:] if argv is None else argv)
    opts = ensure_device(opts)
    if opts is None:
        return 0
    report, agent = train(opts)
    print(ab.format_report(report))
    engine = agent.engine
    if opts.device == "ipu":
        graphs = engine.compiled_graphs
        print(f"ran on {engine.implementation}; graphs compiled: {engine.compilations} "
              f"({sum(g['training'] for g in graphs)} training, {sum(not g['training'] for g in graphs)} "
              "inference: decoding adds none per token)")
    for word, reply in zip(words, generate(agent, words) if words else []):
        print(f"reply: {word} -> {reply}  ({'right' if reply == word[::-1] else 'wrong'})")
    if compare:
        ipu_defaults = {name: getattr(Opts(), name) for name in IPU_ONLY}  # the IPU's own options: not the CPU's
        cpu_report, cpu_agent = train(opts.replace(device="cpu", **ipu_defaults))
        state, cpu_state = agent.model.state_dict(), cpu_agent.model.state_dict()
        diff = max(float((state[k].cpu() - cpu_state[k]).abs().max()) for k in cpu_state)
        accuracy = cpu_report.get("valid", {}).get("accuracy")
        print(f"cpu: valid accuracy {accuracy}; largest weight difference {opts.device} vs cpu: {diff:.2e}")
        hardware = opts.device == "cuda" or opts.device == "ipu" and engine.implementation == "poptorch"
        if tolerance is None and hardware:
            apart = abs(report.get("valid", {}).get("accuracy", 0.0) - (accuracy or 0.0))
            if apart > 0.05:
                print(f"the valid accuracies are {apart:.3f} apart, more than 0.05")
                return 1
        elif diff > (1e-4 if tolerance is None else tolerance):
            print(f"the weights differ by more than {1e-4 if tolerance is None else tolerance:g}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

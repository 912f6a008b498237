"""Tutorial 2: device iterations and output modes.

    python examples/ipu/02_device_iterations_and_output_modes.py [--batch-size 2 --device-iterations 4 --period 2]

``Options.deviceIterations(D)`` runs D iterations (D weight updates when training) per host call: the
call takes D x batch_size rows and the host talks to the IPU once instead of D times. What comes back is
chosen by ``Options.outputMode``:

=========  ==========================================  ==========================
mode       returned                                    rows of a per-row output
=========  ==========================================  ==========================
All        every iteration's outputs                   D x batch_size
EveryN(N)  iterations N-1, 2N-1, ...                   D / N x batch_size
Final      the last iteration's outputs                batch_size
Sum        the element-wise sum over the iterations    batch_size
=========  ==========================================  ==========================

Defaults: ``All`` for ``inferenceModel``, ``Final`` for ``trainingModel`` (returning less saves host-IPU
bandwidth). A scalar (the loss) becomes a vector of one value per returned iteration (unless only one
returns). The script checks every mode against the model run on the host, and prints the rows accelbatch's
``ExecutionPlan`` says each mode returns (the same rule the ``--output-mode`` option applies on every
device).
"""

from __future__ import annotations

import argparse

import torch
from poptorch_or_emulator import import_poptorch  # examples/ipu/poptorch_or_emulator.py

from accelbatch.plan import ExecutionPlan


class Regressor(torch.nn.Module):
    """(per-row prediction, loss): the loss is the last output."""

    def __init__(self, features: int = 3):
        super().__init__()
        self.lin = torch.nn.Linear(features, 1)

    def forward(self, x, y):
        pred = self.lin(x).squeeze(1)
        return pred, torch.nn.functional.mse_loss(pred, y)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--device-iterations", type=int, default=4)
    parser.add_argument("--period", type=int, default=2, help="N of EveryN (must divide --device-iterations)")
    parser.add_argument("--emulator", action="store_true", help="use the CPU emulator even if poptorch exists")
    args = parser.parse_args(argv)
    b, d, n = args.batch_size, args.device_iterations, args.period
    if min(b, d, n) < 1:
        parser.error("--batch-size, --device-iterations and --period must be at least 1")
    if d % n:  # PopTorch refuses it: "the return period must be a factor of Options.deviceIterations"
        parser.error(f"--period {n} must divide --device-iterations {d}")
    poptorch = import_poptorch(args.emulator)
    torch.manual_seed(0)
    x, y = torch.randn(b * d, 3), torch.randn(b * d)
    model = Regressor()
    with torch.no_grad():
        host_pred = model(x, y)[0]  # what each row gives on the host
    per_iteration = host_pred.reshape(d, b)

    # --- inference: D iterations per call, All by default --------------------------------------------
    opts = poptorch.Options().deviceIterations(d)
    inference = poptorch.inferenceModel(model, opts)
    pred, loss = inference(x, y)
    assert torch.allclose(pred, host_pred, atol=1e-6)
    print(f"inferenceModel, deviceIterations({d}): {b * d} rows in, pred{list(pred.shape)} "
          f"loss{list(loss.shape)} out (one loss per iteration); matches the host: yes")
    inference.destroy()

    # --- training: the output modes -------------------------------------------------------------------
    # lr = 0 keeps the weights fixed, so each returned row can be checked against the host's prediction.
    modes = [("Final", poptorch.OutputMode.Final, None, "final"), ("All", poptorch.OutputMode.All, None, "all"),
             (f"EveryN({n})", poptorch.OutputMode.EveryN, n, "everyn"), ("Sum", poptorch.OutputMode.Sum, None, "sum")]
    print(f"\ntrainingModel, deviceIterations({d}), batch_size {b}:")
    print(f"  {'mode':<10}{'pred':>8}{'loss':>8}   iterations returned   plan rows")
    for label, mode, period, plan_mode in modes:
        opts = poptorch.Options().deviceIterations(d)
        opts.outputMode(mode, period)
        training = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
        pred, loss = training(x, y)
        training.destroy()  # one trainingModel per module at a time: release it before wrapping again
        if mode == poptorch.OutputMode.All:
            iterations = list(range(d))
        elif mode == poptorch.OutputMode.Final:
            iterations = [d - 1]
        elif mode == poptorch.OutputMode.EveryN:
            iterations = list(range(n - 1, d, n))
        else:
            iterations = None
        if iterations is None:
            expected = per_iteration.sum(0)
            returned = f"sum of 0..{d - 1}"
        else:
            expected = per_iteration[iterations].reshape(-1)
            returned = ", ".join(map(str, iterations))
        assert torch.allclose(pred, expected, atol=1e-5), label
        plan = ExecutionPlan(micro_batch=b, device_iterations=d, output_mode=plan_mode,
                             output_return_period=period or 1)
        rows = plan.layout(b * d).out_rows
        plan_rows = "per replica, summed" if rows is None else str(rows.tolist())
        print(f"  {label:<10}{str(list(pred.shape)):>8}{str(list(loss.shape)):>8}   {returned:<21} {plan_rows}")
    print("\nevery mode matches the host's predictions for the iterations it returns")


if __name__ == "__main__":
    main()

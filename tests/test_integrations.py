"""Hugging Face Trainer, accelerate and PEFT with slimopt optimizers, on a tiny LLaMA."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import slimopt
from slimopt.integrations.transformers import SlimoptTrainer, create_optimizer, parse_optim_args

from .conftest import tiny_llama

transformers = pytest.importorskip("transformers")


class ShakespeareRows(torch.utils.data.Dataset):
    """Fixed windows of the byte-level corpus."""

    def __init__(self, tokens: torch.Tensor, count: int = 64, seq: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = [
            tokens[s : s + seq] for s in torch.randint(0, len(tokens) - seq, (count,), generator=generator)
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def _args(out: Path, **overrides) -> transformers.TrainingArguments:
    settings = dict(
        output_dir=str(out),
        max_steps=8,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        warmup_steps=2,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        optim_args="rank=8,update_proj_gap=4",
    )
    return transformers.TrainingArguments(**{**settings, **overrides})


def _train(tokens, out, name, refresh_from="step", **overrides) -> SlimoptTrainer:
    trainer = SlimoptTrainer(
        model=tiny_llama(),
        args=_args(out, **overrides),
        train_dataset=ShakespeareRows(tokens),
        optimizer_name=name,
        refresh_from=refresh_from,
    )
    trainer.train()
    return trainer


def _logged(trainer: SlimoptTrainer, key: str) -> list[float]:
    return [record[key] for record in trainer.state.log_history if "loss" in record and key in record]


@pytest.mark.parametrize("name", ["galore_adamw", "galore_adamw8bit", "galore_adamw_ternary"])
def test_trainer_trains_with_slimopt_optimizers(shakespeare_tokens, tmp_path, name) -> None:
    trainer = _train(shakespeare_tokens, tmp_path, name)
    losses = _logged(trainer, "loss")
    assert len(losses) == 8 and sum(losses[-3:]) / 3 < losses[0] - 0.5
    assert type(trainer.optimizer.optimizer).__name__ in ("GaLoreAdamW", "GaLoreAdamW8bit", "AdamWTernary")
    projected = trainer.optimizer.optimizer.param_groups[0]
    assert projected["rank"] == 8 and projected["update_proj_gap"] == 4


def test_layerwise_under_trainer_accumulates_logs_the_right_rate_and_clips(
    shakespeare_tokens, tmp_path
) -> None:
    common = dict(gradient_accumulation_steps=2, max_grad_norm=1e9)
    stepping = _train(shakespeare_tokens, tmp_path / "a", "galore_adamw", **common)
    layered = _train(shakespeare_tokens, tmp_path / "b", "galore_adamw_layerwise", **common)
    assert layered.layerwise_handle.optimizer_steps == 8
    assert _logged(layered, "learning_rate") == _logged(stepping, "learning_rate")
    assert _logged(layered, "loss") == pytest.approx(_logged(stepping, "loss"), rel=1e-4)
    assert all(norm > 0 for norm in _logged(layered, "grad_norm"))
    ranked = _train(
        shakespeare_tokens, tmp_path / "d", "galore_adamw_layerwise", refresh_from="micro_batch", **common
    )
    assert ranked.layerwise_handle.refresh_from == "micro_batch"
    assert _logged(ranked, "loss")[-1] == pytest.approx(_logged(stepping, "loss")[-1], rel=0.05)
    with pytest.raises(ValueError, match="is a layer-wise option: use galore_adamw_layerwise"):
        SlimoptTrainer(
            model=tiny_llama(),
            args=_args(tmp_path),
            optimizer_name="galore_adamw",
            refresh_from="micro_batch",
        )

    clipped = _train(shakespeare_tokens, tmp_path / "c", "galore_adamw_layerwise", max_grad_norm=0.05)
    optimizer = clipped.optimizer.optimizer
    assert clipped.layerwise_handle.max_grad_norm == 0.05
    # The first moment averages clipped gradients, so its norm is bounded by the clip.
    norms = [float(optimizer.state[p]["exp_avg"].norm()) for p in optimizer.param_groups[0]["params"]]
    assert max(norms) <= 0.05 * (1 + 1e-4)


def test_resume_from_checkpoint_restores_the_optimizer_exactly(shakespeare_tokens, tmp_path) -> None:
    name = "galore_adamw_ternary_layerwise"
    whole = _train(shakespeare_tokens, tmp_path / "whole", name, save_strategy="steps", save_steps=4)
    checkpoint = tmp_path / "whole" / "checkpoint-4"
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert any("exp_avg.trits" in s for s in state["state"].values())
    resumed = SlimoptTrainer(
        model=tiny_llama(seed=1),
        args=_args(tmp_path / "resumed"),
        train_dataset=ShakespeareRows(shakespeare_tokens),
        optimizer_name=name,
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_optim_args_are_typed_and_bad_ones_are_named() -> None:
    parsed = parse_optim_args(
        "rank=128, update_proj_gap=200,scale=0.25,proj_type=std,states=int8,stagger=false,fused=true"
    )
    assert parsed == {
        "rank": 128,
        "update_proj_gap": 200,
        "scale": 0.25,
        "proj_type": "std",
        "states": "int8",
        "stagger": False,
        "fused": True,
    }
    assert parse_optim_args(None) == {} and parse_optim_args("") == {}
    with pytest.raises(ValueError, match="unknown optim_args key 'ranks'; valid: rank, update_proj_gap"):
        parse_optim_args("ranks=4")
    with pytest.raises(ValueError, match="optim_args rank='four': expected int"):
        parse_optim_args("rank=four")
    with pytest.raises(ValueError, match="is not key=value"):
        parse_optim_args("rank")


def test_grad_sync_in_optim_args_is_the_trainers_and_checked_before_training(tmp_path) -> None:
    """optim_args' grad_sync is the Trainer's (how DDP synchronizes), not the optimizer's; a bad
    value is named, and projected sync where it cannot run is refused when the optimizer is made."""
    assert parse_optim_args("rank=8,grad_sync=full") == {"rank": 8, "grad_sync": "full"}
    with pytest.raises(ValueError, match="optim_args grad_sync='half'; valid: auto, full, projected"):
        parse_optim_args("grad_sync=half")
    optimizer = create_optimizer(
        tiny_llama(), _args(tmp_path, optim_args="rank=8,grad_sync=full"), "galore_adamw"
    )
    assert "grad_sync" not in optimizer.param_groups[0]
    for name, reason in (("galore_adamw", "there is one process"), ("adamw8bit", "projects no gradient")):
        trainer = SlimoptTrainer(
            model=tiny_llama(),
            args=_args(tmp_path / name, optim_args="grad_sync=projected"),
            train_dataset=ShakespeareRows(torch.zeros(1000, dtype=torch.long)),
            optimizer_name=name,
        )
        with pytest.raises(ValueError, match=f"optim_args grad_sync=projected: .*{reason}"):
            trainer.create_optimizer()


def test_an_infinite_limiter_in_optim_args_is_refused(tmp_path) -> None:
    """optim_args="norm_growth_limit=inf" turned APOLLO's weights NaN at the second step."""
    args = _args(tmp_path, optim="apollo_adamw", optim_args="norm_growth_limit=inf")
    with pytest.raises(ValueError, match="norm_growth_limit must be a finite number >= 1, or None"):
        create_optimizer(tiny_llama(), args)


@pytest.mark.parametrize("name", ["adamw_ternary", "galore_adamw_ternary"])
def test_a_ternary_optimizer_takes_adam_beta1_as_given_and_says_its_own_default(tmp_path, name) -> None:
    """TrainingArguments' adam_beta1 (0.9 unless set) reaches the optimizer, as for every Adam,
    with a warning naming the ternary optimizers' own default, which itself passes quietly."""
    model, optim_args = tiny_llama(), "rank=8" if name.startswith("galore") else ""
    default = slimopt.optimizers.TERNARY_BETAS[0]
    with pytest.warns(
        UserWarning, match=f"{name} runs with adam_beta1=0.9 as given; its own default is {default}"
    ):
        optimizer = create_optimizer(model, _args(tmp_path, optim_args=optim_args), name)
    assert {tuple(group["betas"]) for group in optimizer.param_groups} == {(0.9, 0.999)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer = create_optimizer(model, _args(tmp_path, optim_args=optim_args, adam_beta1=default), name)
    assert {tuple(group["betas"]) for group in optimizer.param_groups} == {(default, 0.999)}


@pytest.mark.parametrize(
    ("optim", "cls", "layer_wise"),
    [
        ("galore_adamw_8bit", "GaLoreAdamW8bit", False),
        ("galore_adamw_8bit_layerwise", "GaLoreAdamW8bit", True),
        ("galore_adafactor", "GaLoreAdafactor", False),
        ("apollo_adamw", "APOLLOAdamW", False),
        ("apollo_adamw_layerwise", "APOLLOAdamW", True),
    ],
)
def test_training_arguments_optim_chooses_the_optimizer(shakespeare_tokens, tmp_path, optim, cls, layer_wise):
    """Hugging Face's own GaLore and APOLLO names in TrainingArguments(optim=...): migrating from
    Trainer is replacing the class."""
    trainer = SlimoptTrainer(
        model=tiny_llama(),
        args=_args(tmp_path, optim=optim, optim_target_modules=["attn", "mlp"], max_steps=2),
        train_dataset=ShakespeareRows(shakespeare_tokens),
    )
    trainer.train()
    optimizer = trainer.optimizer.optimizer
    assert type(optimizer).__name__ == cls and optimizer.param_groups[0]["name"] == "projected"
    assert (trainer.layerwise_handle is not None) == layer_wise
    assert any(key.endswith(".codes") for s in optimizer.state.values() for key in s) == ("8bit" in optim)


@pytest.mark.parametrize("optim", ["galore_adamw", "galore_adamw_8bit", "galore_adafactor", "apollo_adamw"])
def test_hugging_face_names_take_hugging_faces_defaults(tmp_path, optim) -> None:
    """Without rank in optim_args, SlimoptTrainer used slimopt's rank (a quarter of the smaller
    side, 16 here) where Trainer uses 128: the projection options of the projected group are now
    those of Hugging Face's own Trainer for the same TrainingArguments; slimopt's own name keeps
    slimopt's rank."""
    model = tiny_llama()
    args = _args(tmp_path, optim=optim, optim_target_modules=["attn", "mlp"], optim_args="")
    theirs = transformers.Trainer(model=model, args=args).create_optimizer()
    reference = next(group for group in theirs.param_groups if "rank" in group)
    ours = SlimoptTrainer(model=tiny_llama(), args=args).create_optimizer()
    projected = next(group for group in ours.param_groups if "rank" in group)
    for key in ("rank", "update_proj_gap", "scale", "proj_type"):
        assert projected[key] == reference[key], key
    if optim == "apollo_adamw":
        assert projected["proj_method"] == reference["proj"] and projected["scale_type"] == "channel"
    plain = _args(tmp_path, optim_target_modules=["attn", "mlp"], optim_args="")
    own = SlimoptTrainer(model=tiny_llama(), args=plain, optimizer_name="galore_adamw").create_optimizer()
    assert own.param_groups[0]["rank"] == 16


def test_int8_weights_under_several_trainer_processes_are_refused(tmp_path, monkeypatch) -> None:
    """Trainer wraps the model for DDP or FSDP2 after building the optimizer: int8 weights
    crashed in DDP's broadcast, or FSDP2 turned them into plain ones unnoticed."""
    model = slimopt.quantize_weights(tiny_llama().to(torch.bfloat16), "int8")
    trainer = SlimoptTrainer(model=model, args=_args(tmp_path), optimizer_name="adamw")
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="2 processes: int8 weights train in one process"):
        trainer.create_optimizer()


def test_training_arguments_optim_without_a_slimopt_counterpart_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"TrainingArguments\(optim='sgd'\) has no slimopt counterpart"):
        SlimoptTrainer(model=tiny_llama(), args=_args(tmp_path, optim="sgd"))


def test_target_modules_and_names(tmp_path) -> None:
    model = tiny_llama()
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    every = create_optimizer(model, _args(tmp_path, optim_target_modules="all-linear"), "galore_adamw")
    assert len(every.param_groups[0]["params"]) == len(linear)  # the output head too
    attention = create_optimizer(
        model, _args(tmp_path, optim_target_modules=[r".*self_attn.*"]), "galore_adamw"
    )
    assert len(attention.param_groups[0]["params"]) == 4 * 2  # q, k, v, o of two layers
    default = create_optimizer(model, _args(tmp_path, optim_target_modules=None), "galore_adamw8bit")
    assert len(default.param_groups[0]["params"]) == len(linear) - 1
    with pytest.raises(ValueError, match=r"matches no linear module"):
        create_optimizer(model, _args(tmp_path, optim_target_modules=["attn_proj"]), "galore_adamw")
    with pytest.raises(ValueError, match="does not project gradients"):
        create_optimizer(
            model, _args(tmp_path, optim_target_modules="all-linear", optim_args=""), "adamw8bit"
        )
    with pytest.raises(ValueError, match="unknown optimizer 'galore_lion'; available: adamw"):
        SlimoptTrainer(model=model, args=_args(tmp_path), optimizer_name="galore_lion")


@pytest.mark.parametrize("name", slimopt.available_optimizers())
def test_accelerate_prepare_and_accumulate(shakespeare_tokens, name) -> None:
    accelerate = pytest.importorskip("accelerate")
    data = torch.utils.data.DataLoader(ShakespeareRows(shakespeare_tokens, count=48), batch_size=4)

    def run(use_accelerate: bool) -> list[torch.Tensor]:
        model = tiny_llama()
        projection = {"rank": 8} if slimopt.registry.OPTIMIZERS[name].projected else {}
        optimizer = slimopt.build_optimizer(model, name, lr=3e-3, **projection)
        if not use_accelerate:
            for i, batch in enumerate(data):
                (model(**batch).loss / 2).backward()
                if i % 2 == 1:
                    optimizer.step()
                    optimizer.zero_grad()
            return [p.detach().clone() for p in model.parameters()]
        accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, data)
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    manual, prepared = run(False), run(True)
    start = [p.detach() for p in tiny_llama().parameters()]
    assert all(torch.isfinite(p).all() for p in prepared)
    assert any(not torch.equal(p, q) for p, q in zip(prepared, start, strict=True))
    for a, b in zip(prepared, manual, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _train_adapters(model, optimizer, tokens) -> None:
    """Ten steps of 8 rows; the loss falls and the adapters' states are compressed."""
    losses = []
    for batch in torch.utils.data.DataLoader(ShakespeareRows(tokens, count=80), batch_size=8):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3
    compressed = (".codes", ".trits")  # int8, ternary
    assert any(key.endswith(compressed) for state in optimizer.state.values() for key in state)


@pytest.mark.parametrize("name", ["adamw8bit", "adamw_ternary"])
def test_peft_lora_trains_with_compressed_states(shakespeare_tokens, name) -> None:
    peft = pytest.importorskip("peft")
    # Hidden size 256, LoRA rank 16: each adapter matrix has 4096 entries, enough to be compressed.
    base = tiny_llama(dims=(256, 688, 4, 2))
    frozen = {n: p.detach().clone() for n, p in base.named_parameters()}
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    )
    optimizer = slimopt.build_optimizer(model, name, lr=1e-2)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trainable) == 8
    _train_adapters(model, optimizer, shakespeare_tokens)
    for n, p in model.base_model.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, frozen[n.replace(".base_layer", "")])


def test_qlora_with_4bit_base_weights_trains_with_ternary_states(shakespeare_tokens, tmp_path) -> None:
    """QLoRA: bitsandbytes NF4 base weights (its CPU backend), LoRA adapters, slimopt states."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    tiny_llama(dims=(256, 688, 4, 2)).save_pretrained(tmp_path / "base")
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", quantization_config=quantization, device_map="cpu"
    )
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    )
    optimizer = slimopt.build_optimizer(model, "adamw_ternary", lr=1e-2)
    _train_adapters(model, optimizer, shakespeare_tokens)


def _byte_tokenizer():
    """A tokenizer of bytes (Hugging Face's byte-level alphabet, no merges), built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    raw = Tokenizer(models.BPE(vocab={symbol: index for index, symbol in enumerate(alphabet)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token=alphabet[0], eos_token=alphabet[1])


def _sft(shakespeare_tokens, out: Path, name: str, resume: Path | None = None, **options):
    """TRL's SFTTrainer on lines of the built-in corpus, 6 steps with a checkpoint every 3, with
    slimopt's ``name`` through ``optimizer_cls_and_kwargs``."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from slimopt.integrations.transformers import optimizer_cls_and_kwargs

    text = bytes(shakespeare_tokens[:20_000].tolist()).decode("utf-8", errors="ignore")
    lines = [line for line in text.splitlines() if len(line) > 20][:64]
    args = SFTConfig(
        output_dir=str(out), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, save_steps=3, report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        max_length=32,
    )  # fmt: skip
    trainer = SFTTrainer(
        model=tiny_llama(),
        args=args,
        train_dataset=Dataset.from_list([{"text": line} for line in lines]),
        processing_class=_byte_tokenizer(),
        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(name, lr=3e-3, **options),
    )
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return trainer


@pytest.mark.parametrize(("name", "options"), [("muon8bit", {}), ("galore_adamw_8bit", {"rank": 8})])
def test_trls_sft_trainer_takes_any_slimopt_optimizer_and_resumes_exactly(
    shakespeare_tokens, tmp_path, name, options
) -> None:
    """Through Trainer's ``optimizer_cls_and_kwargs`` (no subclass): TRL's SFTTrainer trains
    with the slimopt optimizer built for its model, starting its schedule from the given lr, and
    a run resumed from its step-3 checkpoint logs the uninterrupted run's losses."""
    whole = _sft(shakespeare_tokens, tmp_path / "whole", name, **options)
    optimizer = whole.optimizer.optimizer  # accelerate wraps it
    assert isinstance(optimizer, slimopt.SlimoptOptimizer)
    assert {group["initial_lr"] for group in optimizer.param_groups} == {3e-3}
    losses = [r["loss"] for r in whole.state.log_history if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]
    resumed = _sft(
        shakespeare_tokens, tmp_path / "resumed", name, resume=tmp_path / "whole" / "checkpoint-3", **options
    )
    # The checkpoint brings the first three steps' log; the last three are computed again.
    assert [r["loss"] for r in resumed.state.log_history if "loss" in r][3:] == losses[3:]


def test_optimizer_cls_and_kwargs_refuses_what_it_cannot_build() -> None:
    from slimopt.integrations.transformers import optimizer_cls_and_kwargs

    with pytest.raises(ValueError, match="layer-wise updates run inside backward, which only SlimoptTrainer"):
        optimizer_cls_and_kwargs("galore_adamw8bit_layerwise", lr=1e-3)
    with pytest.raises(ValueError, match="unknown optimizer 'adam'; available: adamw"):
        optimizer_cls_and_kwargs("adam", lr=1e-3)


@pytest.mark.slow  # two torchrun launches: about 30 s
def test_trainer_under_torchrun_ddp(tmp_path) -> None:
    """SlimoptTrainer under torchrun (accelerate's DDP): it trains, the two processes end with
    the very same parameters, its gradients synchronized as projections by itself (with
    grad_sync=full in optim_args, whole, and more bytes); a layer-wise name is refused, saying to
    use FSDP2."""
    import json
    import os
    import subprocess
    import sys

    script = Path(__file__).parent / "scripts" / "trainer_under_torchrun.py"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sent = {}
    for name, optim_args in (
        ("galore_adamw8bit", ""),
        ("galore_adamw8bit", "rank=8,update_proj_gap=4,grad_sync=full"),
        ("galore_adamw8bit_layerwise", ""),
    ):
        out = tmp_path / f"{name}-{optim_args}"
        out.mkdir()
        finished = subprocess.run(
            [*command, str(out), name, optim_args], capture_output=True, text=True, timeout=300, env=env
        )
        assert finished.returncode == 0, finished.stderr[-3000:]
        first, second = (json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1))
        if name.endswith("_layerwise"):
            assert "layer-wise mode in a 2-process run" in first["error"]
            assert "shard the model with fully_shard (FSDP2)" in first["error"]
            continue
        assert first["optimizer"] == "GaLoreAdamW8bit"
        assert first["parameters"] == second["parameters"]
        assert len(first["losses"]) == 8 and first["losses"][-1] < first["losses"][0] - 1.0
        sent[first["grad_sync"]] = first["grad_sync_bytes"]
    assert 0 < sent["projected"] < sent["full"]


def test_taco_layerwise_trains_under_the_trainer(shakespeare_tokens, tmp_path) -> None:
    """``taco_layerwise``: TACO's one-entry-per-column updates inside backward (its fallback
    groups AdamW), driven by the Trainer."""
    trainer = _train(shakespeare_tokens, tmp_path, "taco_layerwise", optim_args=None, learning_rate=3e-3)
    losses = _logged(trainer, "loss")
    assert len(losses) == 8 and sum(losses[-3:]) / 3 < losses[0] - 0.3
    optimizer = trainer.optimizer.optimizer
    assert type(optimizer).__name__ == "TACO" and optimizer.layerwise_handle is not None
    assert {g["name"] for g in optimizer.param_groups} == {"taco", "fallback", "no_decay"}


def test_under_accelerate_fsdp2_the_trainer_keeps_the_basis_on_the_unsplit_side(tmp_path) -> None:
    """accelerate's FSDP2 makes the Trainer build the optimizer before prepare() splits the
    weights by rows: a projecting name used to be refused at the first step ("use
    proj_type='right'") unless optim_args named it; the Trainer now chooses it, and keeps a side
    optim_args names."""
    from types import SimpleNamespace

    for optim_args, side in ((None, "right"), ("proj_type=std", "std")):
        trainer = SlimoptTrainer(
            model=tiny_llama(),
            args=_args(tmp_path / side, optim_args=optim_args),
            train_dataset=ShakespeareRows(torch.zeros(1000, dtype=torch.long)),
            optimizer_name="galore_adamw8bit",
        )
        trainer.accelerator.state.fsdp_plugin = SimpleNamespace(fsdp_version=2)
        optimizer = trainer.create_optimizer()
        assert [g["proj_type"] for g in optimizer.param_groups if "rank" in g] == [side]


@pytest.mark.parametrize("name", ["galore_adamw8bit", "apollo_adamw_layerwise"])
def test_the_trainer_trains_int8_weights_and_resumes_their_codes_exactly(
    shakespeare_tokens, tmp_path, name
) -> None:
    """A model whose linear weights are int8 (``slimopt.quantize_weights``): the Trainer saves
    their codes and scales, and resuming from a checkpoint continues bit for bit."""
    from slimopt.weight_formats import Int8Weight, quantize_weights

    def trainer(out: Path, seed: int = 0, **overrides) -> SlimoptTrainer:
        return SlimoptTrainer(
            model=quantize_weights(tiny_llama(seed=seed), "int8"),
            args=_args(out, **overrides),
            train_dataset=ShakespeareRows(shakespeare_tokens),
            optimizer_name=name,
        )

    whole = trainer(tmp_path / "whole", save_strategy="steps", save_steps=4)
    whole.train()
    losses = _logged(whole, "loss")
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3
    resumed = trainer(tmp_path / "resumed", seed=1)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-4"))
    pairs = list(zip(whole.model.parameters(), resumed.model.parameters(), strict=True))
    assert any(isinstance(a, Int8Weight) for a, _ in pairs)
    for a, b in pairs:
        if isinstance(a, Int8Weight):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
        else:
            assert torch.equal(a, b)

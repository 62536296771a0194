"""build_optimizer: which weights are projected, and how groups are formed."""

from __future__ import annotations

import pytest

from slimopt import (
    AdamW4bit,
    GaLoreAdafactor,
    GaLoreAdamW,
    GaLoreAdamW8bit,
    build_optimizer,
    select_target_modules,
)

from .conftest import tiny_llama

ATTENTION_AND_MLP = {
    f"model.layers.{i}.{part}"
    for i in range(2)
    for part in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
}


@pytest.mark.parametrize(
    ("target_modules", "expected"),
    [
        (None, ATTENTION_AND_MLP),
        ("all-linear", ATTENTION_AND_MLP | {"lm_head"}),
        (["attn", "mlp"], ATTENTION_AND_MLP),
        (["q_proj"], {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"}),
        (r".*\.1\.mlp\..*_proj", {n for n in ATTENTION_AND_MLP if ".1.mlp" in n}),
    ],
)
def test_target_module_selection(target_modules, expected) -> None:
    assert set(select_target_modules(tiny_llama(0), target_modules)) == expected


def test_groups_projected_plain_and_no_decay() -> None:
    model = tiny_llama(0)
    optimizer = build_optimizer(model, "galore_adamw", lr=2e-3, rank=16, weight_decay=0.1, update_proj_gap=50)
    assert isinstance(optimizer, GaLoreAdamW)
    projected, plain, vectors = optimizer.param_groups
    assert [g["name"] for g in optimizer.param_groups] == ["projected", "unprojected", "no_decay"]
    modules = dict(model.named_modules())
    assert {id(p) for p in projected["params"]} == {id(modules[n].weight) for n in ATTENTION_AND_MLP}
    assert projected["rank"] == 16 and projected["update_proj_gap"] == 50
    assert "rank" not in plain and "rank" not in vectors
    assert {id(p) for p in plain["params"]} == {id(model.lm_head.weight), id(model.model.embed_tokens.weight)}
    assert all(p.dim() == 1 for p in vectors["params"])
    assert projected["weight_decay"] == plain["weight_decay"] == 0.1 and vectors["weight_decay"] == 0.0
    assert all(g["lr"] == 2e-3 for g in optimizer.param_groups)
    total = sum(len(g["params"]) for g in optimizer.param_groups)
    assert total == len(list(model.parameters()))


def test_adamw_and_adafactor_names() -> None:
    model = tiny_llama(0)
    assert all("rank" not in g for g in build_optimizer(model, "adamw", lr=1e-3).param_groups)
    adafactor = build_optimizer(model, "galore_adafactor", lr=None, rank=8)
    assert isinstance(adafactor, GaLoreAdafactor) and adafactor.param_groups[0]["relative_step"]
    plain = build_optimizer(model, "adafactor", lr=None)
    assert isinstance(plain, GaLoreAdafactor) and all("rank" not in g for g in plain.param_groups)
    assert [g["name"] for g in plain.param_groups] == ["unprojected", "no_decay"]


@pytest.mark.parametrize(
    ("hf_name", "cls", "states"),
    [
        ("galore_adamw_8bit", GaLoreAdamW8bit, "int8"),
        ("adamw_8bit", GaLoreAdamW8bit, "int8"),
        ("adamw_bnb_8bit", GaLoreAdamW8bit, "int8"),
        ("adamw_torch_4bit", AdamW4bit, "int4"),
        ("adamw_torch_fused", GaLoreAdamW, "fp32"),
    ],
)
def test_hugging_face_names_build_the_same_optimizer(hf_name, cls, states) -> None:
    optimizer = build_optimizer(tiny_llama(0), hf_name, lr=1e-3)
    assert type(optimizer) is cls and optimizer.param_groups[0]["states"] == states
    assert ("rank" in optimizer.param_groups[0]) == hf_name.startswith("galore")
    with pytest.raises(
        ValueError, match=r"unknown optimizer 'sgd'; available: adamw, .*Hugging Face's .*adamw_8bit"
    ):
        build_optimizer(tiny_llama(0), "sgd", lr=1e-3)


def test_weights_fsdp2_splits_by_rows_take_the_basis_on_the_unsplit_side(one_process_group) -> None:
    """``build_optimizer(model, "galore_adamw")`` on a model FSDP2 has sharded used to be refused
    ("use proj_type='right'"); it now chooses right itself, and ``describe`` says why. A side the
    user names on the split rows is still refused."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from slimopt import describe

    model = tiny_llama(0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = build_optimizer(model, "galore_adamw", lr=1e-3, rank=8)
    projected = [g for g in optimizer.param_groups if "rank" in g]
    assert [g["proj_type"] for g in projected] == ["right"]
    assert "proj_type right (rows split across processes: the basis is on the unsplit side)" in describe(
        optimizer, model
    )
    tokens = torch.randint(0, 256, (2, 16))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    for proj_type in ("std", "left"):
        with pytest.raises(ValueError, match=f"proj_type='{proj_type}' puts the basis of .* on the rows"):
            build_optimizer(model, "galore_adamw", lr=1e-3, rank=8, proj_type=proj_type)


def test_unprojected_states_store_the_embedding_and_head_moments_their_own_way() -> None:
    """``unprojected_states`` for the matrices a projecting optimizer leaves whole (embedding,
    head); ``states`` given alone holds for every group; an optimizer that projects nothing has
    no such group, so the option is refused."""
    from slimopt.registry.names import OPTIMIZERS

    def states(name: str, **options) -> dict[str, str]:
        optimizer = build_optimizer(tiny_llama(0), name, lr=1e-3, **options)
        return {g["name"]: g["states"] for g in optimizer.param_groups}

    assert states("galore_adamw", rank=8, unprojected_states="ternary") == {
        "projected": "fp32",
        "unprojected": "ternary",
        "no_decay": "fp32",
    }
    assert states("galore_adamw", rank=8) == dict.fromkeys(("projected", "unprojected", "no_decay"), "fp32")
    assert OPTIMIZERS["apollo_mini"].unprojected_states == "int8"
    assert states("apollo_mini") == {"projected": "fp32", "unprojected": "int8", "no_decay": "fp32"}
    assert set(states("apollo_mini", states="bf16").values()) == {"bf16"}
    assert states("apollo_mini", states="bf16", unprojected_states="fp32")["unprojected"] == "fp32"
    with pytest.raises(ValueError, match="adamw8bit projects nothing, so unprojected_states means nothing"):
        build_optimizer(tiny_llama(0), "adamw8bit", lr=1e-3, unprojected_states="int8")
    with pytest.raises(ValueError, match="unknown states 'int3'"):
        build_optimizer(tiny_llama(0), "apollo_mini", lr=1e-3, unprojected_states="int3")

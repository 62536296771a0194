"""Which weights ``build_optimizer`` projects in model families other than LLaMA (configs built
offline, no downloads): GPT-2's transposed ``Conv1D`` layers, tied embeddings, mixture-of-experts
weights stacked in 3-D tensors; and ``slimopt.describe``, which says what was chosen."""

from __future__ import annotations

import warnings

import pytest
import torch

import slimopt
from slimopt.projection import Basis

transformers = pytest.importorskip("transformers")


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    config.bos_token_id = config.eos_token_id = 0
    return transformers.GPT2LMHeadModel(config)


# A one-layer decoder with grouped-query attention, small enough to build in milliseconds.
SMALL_DECODER = {
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}


def mixtral() -> torch.nn.Module:
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**SMALL_DECODER, num_local_experts=4))


def qwen2_tied() -> torch.nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL_DECODER, tie_word_embeddings=True))


def _projected_names(model: torch.nn.Module, optimizer: slimopt.GaLoreOptimizer) -> dict[str, str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(p)]: group["name"]
        for group in optimizer.param_groups
        for p in group["params"]
        if optimizer.projects(p, group)
    }


def test_gpt2_conv1d_layers_are_projected() -> None:
    model = gpt2()
    optimizer = slimopt.build_optimizer(model, "galore_adamw", lr=1e-3, rank=8)
    expected = {
        f"transformer.h.{i}.{layer}.weight": "projected"
        for i in range(2)
        for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    assert _projected_names(model, optimizer) == expected


def test_a_named_side_of_a_conv1d_weight_is_the_linear_layers_side() -> None:
    """proj_type="left" puts the basis on a layer's output side: the rows of an nn.Linear weight
    (out × in), the columns of a Conv1D weight (in × out)."""
    model = gpt2()
    optimizer = slimopt.build_optimizer(model, "galore_adamw", lr=1e-3, rank=8, proj_type="left")
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert groups["projected_transposed"]["proj_type"] == "right"
    c_fc = model.transformer.h[0].mlp.c_fc.weight  # 64 × 256: in × out
    model.zero_grad()
    c_fc.grad = torch.randn_like(c_fc)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    basis = optimizer.basis(c_fc, groups["projected_transposed"])
    assert isinstance(basis, Basis) and basis.left is None and tuple(basis.right.shape) == (8, 256)


def test_gpt2_trains_with_every_registry_optimizer() -> None:
    for name in slimopt.available_optimizers():
        torch.manual_seed(0)
        model = gpt2()
        options = {"rank": 8} if name.startswith("galore") else {}
        optimizer = slimopt.build_optimizer(model, name, lr=1e-3, **options)
        tokens = torch.randint(0, 128, (2, 16))
        for _ in range(2):
            loss = model(tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert torch.isfinite(loss), name
        assert all(torch.isfinite(p).all() for p in model.parameters()), name


def test_tied_embedding_appears_once() -> None:
    model = qwen2_tied()
    optimizer = slimopt.build_optimizer(model, "galore_adamw", lr=1e-3, rank=8, target_modules="all-linear")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    assert any(p is model.lm_head.weight for p in params)


def test_stacked_expert_weights_are_not_projected_and_it_is_said() -> None:
    model = mixtral()
    with pytest.warns(UserWarning, match=r"mlp\.experts\.gate_up_proj \(4, 192, 64\).*not projected"):
        optimizer = slimopt.build_optimizer(model, "galore_adamw", lr=1e-3, rank=8)
    projected = _projected_names(model, optimizer)
    assert not any("experts" in name for name in projected)
    assert "model.layers.0.self_attn.q_proj.weight" in projected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        slimopt.build_optimizer(model, "adamw", lr=1e-3)  # nothing projects: nothing to say


def test_selecting_expert_weights_by_name_is_refused() -> None:
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj.*exclude"):
        slimopt.build_optimizer(mixtral(), "galore_adamw", lr=1e-3, rank=8, target_modules=["experts"])


def test_describe_names_every_parameter_and_its_basis() -> None:
    model = gpt2()
    optimizer = slimopt.build_optimizer(model, "galore_adamw8bit", lr=1e-3, rank=8)
    before = slimopt.describe(optimizer, model)
    assert "projected: 8 tensors" in before and "rank 8" in before and "states int8" in before
    assert "transformer.h.0.mlp.c_fc.weight  64×256  basis left 64×8" in before
    assert "transformer.wte.weight  128×64  unprojected" in before
    assert "state 0 bytes" in before
    tokens = torch.randint(0, 128, (2, 16))
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    after = slimopt.describe(optimizer, model)
    groups = {line.split(":")[0]: line for line in after.splitlines() if not line.startswith(" ")}
    stored = sum(
        t.numel() * t.element_size()
        for p in optimizer.param_groups[0]["params"]
        for t in optimizer.state[p].values()
        if isinstance(t, torch.Tensor)
    )
    assert f"state {stored:,} bytes" in groups["projected"]
    with pytest.raises(TypeError, match="describe takes a slimopt optimizer"):
        slimopt.describe(torch.optim.SGD(model.parameters(), lr=0.1))

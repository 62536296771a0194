"""Which weights ``build_optimizer`` projects in model families other than LLaMA (configs built
offline, no downloads): GPT-2's transposed ``Conv1D`` layers, tied embeddings, mixture-of-experts
weights stacked in 3-D tensors (projected expert by expert); and ``slimopt.describe``, which says
what was chosen."""

from __future__ import annotations

import warnings

import pytest
import torch

import slimopt
from benchmarks import architectures
from slimopt.projection import Basis

pytest.importorskip("transformers")


# The benchmark's models (benchmarks.architectures), one layer where a test names layer 0's weights.


def gpt2() -> torch.nn.Module:
    return architectures.decoder("gpt2")


def mixtral() -> torch.nn.Module:
    return architectures.decoder("mixtral", layers=1)


def qwen2_tied() -> torch.nn.Module:
    return architectures.decoder("qwen2", layers=1)


def gpt_neox() -> torch.nn.Module:
    return architectures.decoder("gpt_neox", layers=1)


def opt() -> torch.nn.Module:
    return architectures.decoder("opt", layers=1)


def bert() -> torch.nn.Module:
    return architectures.bert(layers=1)


def t5() -> torch.nn.Module:
    return architectures.t5(layers=1)


def vit() -> torch.nn.Module:
    return architectures.vit(layers=1)


# What the default selection projects in each family (one layer each): every linear layer but
# the language-model head; a classifier has no output embedding, so it is projected too.
EXPECTED_PROJECTED = {
    gpt_neox: {
        f"gpt_neox.layers.0.{name}.weight"
        for name in ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
    },
    opt: {
        f"model.decoder.layers.0.{name}.weight"
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.out_proj",
            "fc1",
            "fc2",
        )
    },
    bert: {
        *(
            f"bert.encoder.layer.0.{name}.weight"
            for name in (
                "attention.self.query",
                "attention.self.key",
                "attention.self.value",
                "attention.output.dense",
                "intermediate.dense",
                "output.dense",
            )
        ),
        "bert.pooler.dense.weight",
        "classifier.weight",
    },
    t5: {
        *(
            f"{side}.block.0.layer.0.SelfAttention.{x}.weight"
            for side in ("encoder", "decoder")
            for x in "qkvo"
        ),
        *(f"decoder.block.0.layer.1.EncDecAttention.{x}.weight" for x in "qkvo"),
        *(f"encoder.block.0.layer.1.DenseReluDense.{x}.weight" for x in ("wi", "wo")),
        *(f"decoder.block.0.layer.2.DenseReluDense.{x}.weight" for x in ("wi", "wo")),
    },
    vit: {
        *(f"vit.layers.0.attention.{x}_proj.weight" for x in "qkvo"),
        "vit.layers.0.mlp.fc1.weight",
        "vit.layers.0.mlp.fc2.weight",
        "classifier.weight",
    },
}


@pytest.mark.parametrize("family", list(EXPECTED_PROJECTED), ids=lambda f: f.__name__)
def test_each_family_projects_exactly_its_linear_layers_on_the_smaller_side(family) -> None:
    from slimopt.projection import sides

    model = family()
    optimizer = slimopt.build_optimizer(model, "galore_adamw", lr=1e-3, rank=8)
    assert set(_projected_names(model, optimizer)) == EXPECTED_PROJECTED[family]
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if "rank" in group:
                rows, cols = param.shape
                assert sides((rows, cols), group["proj_type"]) == (
                    (False, True) if rows >= cols else (True, False)
                )
            else:
                assert names[id(param)] not in EXPECTED_PROJECTED[family]


def _projected_names(model: torch.nn.Module, optimizer: slimopt.SlimoptOptimizer) -> dict[str, str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(p)]: group["name"]
        for group in optimizer.param_groups
        for p in group["params"]
        if optimizer.engine.projects(p, group)
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
    basis = optimizer.engine.basis(c_fc, groups["projected_transposed"])
    assert isinstance(basis, Basis) and basis.left is None and tuple(basis.right.shape) == (8, 256)


def _inputs(family) -> dict[str, torch.Tensor]:
    if family is vit:
        return {"pixel_values": torch.rand(2, 1, 8, 8), "labels": torch.tensor([3, 7])}
    tokens = torch.randint(2, 128, (2, 16))
    if family is bert:
        return {"input_ids": tokens, "labels": torch.tensor([0, 2])}
    return {"input_ids": tokens, "labels": tokens}


@pytest.mark.parametrize(
    "family", [gpt2, mixtral, qwen2_tied, gpt_neox, opt, bert, t5, vit], ids=lambda f: f.__name__
)
def test_every_family_trains_with_every_registry_optimizer(family) -> None:
    for name in slimopt.available_optimizers():
        torch.manual_seed(0)
        model = family()
        options = {"rank": 8} if name.startswith("galore") else {}
        optimizer = slimopt.build_optimizer(model, name, lr=1e-3, **options)
        inputs = _inputs(family)
        for _ in range(2):
            loss = model(**inputs).loss
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


def test_stacked_expert_weights_are_projected_per_expert() -> None:
    model = mixtral()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer = slimopt.build_optimizer(model, "galore_adamw", lr=1e-3, rank=8)
    projected = _projected_names(model, optimizer)
    assert {name for name, group in projected.items() if group == "projected_experts"} == {
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    }
    assert "model.layers.0.self_attn.q_proj.weight" in projected
    group = next(g for g in optimizer.param_groups if g["name"] == "projected_experts")
    assert group["experts"] and group["rank"] == 8
    described = slimopt.describe(optimizer, model)
    assert "model.layers.0.mlp.experts.gate_up_proj  4×192×64  basis right 8×64 per expert (4)" in described


def test_selecting_expert_weights_by_name_projects_only_them() -> None:
    model = mixtral()
    optimizer = slimopt.build_optimizer(model, "galore_adamw", lr=1e-3, rank=8, target_modules=["experts"])
    assert set(_projected_names(model, optimizer).values()) == {"projected_experts"}


class _Mixer(torch.nn.Module):
    """A module with a 3-D weight of no known layout (not a convolution, not experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.mixing = torch.nn.Parameter(torch.randn(3, 8, 8))
        self.out = torch.nn.Linear(8, 8)


def test_a_three_dimensional_weight_of_unknown_layout_is_refused_or_left_whole() -> None:
    with pytest.raises(ValueError, match=r"selects mixing of shape \(3, 8, 8\).*do not match the model"):
        slimopt.build_optimizer(_Mixer(), "galore_adamw", lr=1e-3, rank=2, target_modules=".*")
    with pytest.raises(ValueError, match=r"selects 0\.mixing of shape \(3, 8, 8\).*exclude '0' from"):
        slimopt.build_optimizer(
            torch.nn.Sequential(_Mixer()), "galore_adamw", lr=1e-3, rank=2, target_modules="0"
        )
    with pytest.warns(UserWarning, match=r"mixing \(3, 8, 8\).*neither convolution kernels nor stacked"):
        optimizer = slimopt.build_optimizer(_Mixer(), "galore_adamw", lr=1e-3, rank=2)
    assert [g["name"] for g in optimizer.param_groups] == ["projected", "unprojected", "no_decay"]


@pytest.mark.parametrize(
    ("name", "fused"), [("galore_adamw", False), ("galore_adamw8bit", False), ("galore_adamw8bit", True)]
)
def test_each_expert_is_updated_as_a_matrix_of_its_own(name, fused) -> None:
    """A 4×24×16 stacked parameter with experts=True and four 24×16 parameters stepped alike
    (exact SVD and deterministic storage, so no random draw tells them apart): after refreshes
    with rotated moments, every expert's weights and moments equal its 2-D twin's. Expert 2's
    gradient is NaN at step 3: that expert alone skips it."""
    torch.manual_seed(0)
    stacked = torch.nn.Parameter(torch.randn(4, 24, 16))
    twins = [torch.nn.Parameter(stacked.detach()[e].clone()) for e in range(4)]
    options = {
        "rank": 4,
        "update_proj_gap": 2,
        "proj_method": "svd",
        "stagger": False,
        "lr": 1e-2,
        "fused": fused,
    }
    cls = slimopt.registry.OPTIMIZERS[name].cls
    ours = cls([{"params": [stacked], "experts": True}], **options)
    theirs = cls([{"params": [twin]} for twin in twins], **options)
    generator = torch.Generator().manual_seed(1)
    for step in range(6):
        grad = torch.randn(4, 24, 16, generator=generator)
        if step == 3:
            grad[2, 5, 5] = float("nan")
        stacked.grad = grad
        for e, twin in enumerate(twins):
            twin.grad = grad[e].clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ours.step()
            theirs.step()
    decoded = ours.decoded_state(stacked)
    for e, twin in enumerate(twins):
        assert torch.equal(stacked[e], twin), e
        for key, value in theirs.decoded_state(twin).items():
            assert torch.equal(decoded[key][e], value), (e, key)
    steps = [ours.state[stacked][f"expert{e}.step"] for e in range(4)]
    assert steps == [6, 6, 5, 6] and ours.state[stacked]["expert2.nonfinite_skips"] == 1


def test_experts_resume_bit_exactly() -> None:
    """Three steps, a state dict through torch.save, three more in a fresh optimizer: as six in one."""
    import io

    def run(split: bool) -> torch.Tensor:
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(3, 40, 32))
        make = lambda: slimopt.GaLoreAdamW(  # noqa: E731
            [{"params": [weight], "experts": True, "rank": 4, "update_proj_gap": 2}],
            lr=1e-2,
            states="ternary",
        )
        optimizer = make()
        generator = torch.Generator().manual_seed(1)
        for step in range(6):
            if split and step == 3:
                buffer = io.BytesIO()
                torch.save(optimizer.state_dict(), buffer)
                buffer.seek(0)
                optimizer = make()
                optimizer.load_state_dict(torch.load(buffer, weights_only=True))
            weight.grad = torch.randn(weight.shape, generator=generator)
            optimizer.step()
        return weight.detach().clone()

    assert torch.equal(run(True), run(False))


def test_experts_option_is_checked() -> None:
    with pytest.raises(ValueError, match=r"experts=True takes 3-D parameters .*got shapes \[\(8, 8\)\]"):
        slimopt.GaLoreAdamW([{"params": [torch.nn.Parameter(torch.randn(8, 8))], "experts": True, "rank": 2}])
    with pytest.raises(ValueError, match=r"experts=True takes 3-D parameters .*got shapes \[\(8, 8\)\]"):
        slimopt.Muon([{"params": [torch.nn.Parameter(torch.randn(8, 8))], "experts": True}])
    with pytest.raises(ValueError, match="experts is not an option of build_optimizer"):
        slimopt.build_optimizer(mixtral(), "galore_adamw", lr=1e-3, experts=True)
    refusal = r"do not cover per-expert updates \(param groups \['\w*experts'\]"
    for name, options in (("galore_adamw", {"rank": 8}), ("muon", {})):
        optimizer = slimopt.build_optimizer(mixtral(), name, lr=1e-3, **options)
        with pytest.raises(ValueError, match=refusal):
            slimopt.layerwise(optimizer)


def test_describe_names_every_parameter_and_its_basis() -> None:
    model = gpt2()
    optimizer = slimopt.build_optimizer(model, "galore_adamw8bit", lr=1e-3, rank=8)
    before = slimopt.describe(optimizer, model)
    assert "projected: 8 tensors" in before and "rank 8" in before and "states int8" in before
    assert "transformer.h.0.mlp.c_fc.weight  64×256  basis left 64×8" in before
    assert "transformer.wte.weight  256×64  unprojected" in before
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


def test_an_experts_checkpoint_loads_into_another_storage_format() -> None:
    """Stacked experts saved with int8 moments, loaded by a bf16 optimizer: every expert's
    moments and basis decode to what they were."""
    weight = torch.nn.Parameter(torch.randn(3, 96, 64))  # moments 96×48: stored compressed
    saved = slimopt.GaLoreAdamW([{"params": [weight], "experts": True, "rank": 48}], lr=1e-2, states="int8")
    weight.grad = torch.randn(weight.shape)
    saved.step()
    loading = slimopt.GaLoreAdamW([{"params": [weight], "experts": True, "rank": 48}], lr=1e-2, states="bf16")
    group = loading.param_groups[0]
    loading.load_state_dict(saved.state_dict())
    assert loading.param_groups[0]["states"] == "bf16"
    assert loading.state[weight]["expert1.exp_avg"].dtype == torch.bfloat16
    for key, value in saved.decoded_state(weight).items():
        assert torch.allclose(loading.decoded_state(weight)[key], value, rtol=1e-2, atol=1e-6), key
    ours, theirs = loading.engine, saved.engine
    for unit, twin in zip(ours.units(weight, group), theirs.units(weight, group), strict=True):
        assert torch.equal(ours.basis(unit, group).right, theirs.basis(twin, group).right)


def test_an_expert_without_state_yet_decodes_to_zero_moments() -> None:
    """No token reached expert 1 on the first step (an all-zero gradient: no basis, no state):
    ``decoded_state`` stacks the other experts' moments and zeros for it, the moments its first
    update starts from, instead of raising ``KeyError``; the skip is not a non-finite one."""
    weight = torch.nn.Parameter(torch.randn(3, 24, 16))
    optimizer = slimopt.GaLoreAdamW([{"params": [weight], "experts": True, "rank": 4}], lr=1e-2)
    grad = torch.randn(3, 24, 16)
    grad[1] = 0
    weight.grad = grad
    with pytest.warns(RuntimeWarning, match="expert 1 .* no projection basis could be computed yet"):
        optimizer.step()
    decoded = optimizer.decoded_state(weight)
    assert set(decoded) == {"exp_avg", "exp_avg_sq"}
    assert decoded["exp_avg"].shape == (3, 24, 4)
    assert decoded["exp_avg"][0].abs().sum() > 0 and decoded["exp_avg"][1].abs().sum() == 0
    assert optimizer.state[weight]["expert1.nonfinite_skips"] == 0


def test_a_group_of_experts_added_in_layerwise_mode_is_refused_as_at_construction() -> None:
    model = mixtral()
    experts = [p for p in model.parameters() if p.dim() == 3]
    others = [p for p in model.parameters() if p.dim() != 3]
    optimizer = slimopt.GaLoreAdamW(others, lr=1e-3)
    handle = slimopt.layerwise(optimizer)
    with pytest.raises(ValueError, match="layer-wise updates do not cover per-expert updates"):
        optimizer.add_param_group({"params": experts, "rank": 4, "experts": True})
    assert len(optimizer.param_groups) == 1
    handle.remove()


@pytest.mark.slow
def test_the_architectures_benchmark_runs_end_to_end(tmp_path) -> None:
    """``python -m benchmarks.architectures --tiny``: two families (GPT-2, Mixtral) and the QLoRA
    fine-tuning row (a base pretrained for 2 steps, quantized to NF4), AdamW and
    galore_adamw_ternary (not on adapters), a few steps; the table, the sweep, the JSON and the
    plot."""
    from benchmarks import architectures

    plot = tmp_path / "manual" / "quality.png"
    plot.parent.mkdir()
    results = architectures.main(
        ["--tiny", "--rows", "gpt2,mixtral,qlora", "--out", str(tmp_path), "--plot", str(plot)]
    )
    rows = {row["task"]: row for row in results["rows"]}
    assert list(rows) == ["GPT-2 LM", "Mixtral (MoE) LM", "LLaMA → histories, QLoRA r16 (NF4 base)"]
    assert set(rows["LLaMA → histories, QLoRA r16 (NF4 base)"]["optimizers"]) == {"adamw"}
    for name in ("GPT-2 LM", "Mixtral (MoE) LM"):
        entries = rows[name]["optimizers"]
        assert set(entries) == {"adamw", "galore_adamw_ternary"}
        for entry in entries.values():
            assert torch.isfinite(torch.tensor(entry["metric"])) and entry["state_bytes"] > 0
            assert entry["peak_bytes"] > entry["state_bytes"]
        # Per-expert projection keeps less state than AdamW's whole moments.
        assert entries["galore_adamw_ternary"]["state_bytes"] < entries["adamw"]["state_bytes"]
    table = (tmp_path / "results.md").read_text()
    assert "| Mixtral (MoE) LM | val loss |" in table and "metric by learning rate" in table
    assert "| LLaMA → histories, QLoRA r16 (NF4 base) | val loss |" in table
    assert (tmp_path / "quality_vs_bytes.png").stat().st_size > 0
    assert plot.read_bytes() == (tmp_path / "quality_vs_bytes.png").read_bytes()


def test_the_benchmark_refuses_an_optimizer_its_rows_would_leave_out(capsys) -> None:
    """Muon is benchmarks.muon's (its own sweep): named here it would be skipped by every row,
    so it is refused before anything runs."""
    from benchmarks import architectures

    with pytest.raises(SystemExit) as stop:
        architectures.main(["--optimizers", "adamw,muon", "--out", "unused"])
    assert stop.value.code == 2
    assert "not ['muon']" in capsys.readouterr().err

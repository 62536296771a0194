"""state_dict: weights_only loading and bit-exact resumption in the middle of a subspace."""

from __future__ import annotations

import io

import pytest
import torch

from slimopt import (
    AdamWTernary,
    GaLoreAdafactor,
    GaLoreAdamW,
    GaLoreAdamW8bit,
    build_optimizer,
    decoded_state,
)

from .conftest import tiny_llama
from .support import relative_error, step_on_gradients, train_language_model

# Rank 64 of the tiny LLaMA's 64 keeps projected states above the size under which they stay fp32,
# so compressed states are exercised; that rank saves no memory, which build_optimizer warns of.
pytestmark = pytest.mark.filterwarnings("ignore:rank 64 saves no optimizer state")


def roundtrip(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    ("name", "dtype", "states"),
    [
        ("galore_adamw", torch.float32, None),
        ("galore_adamw", torch.bfloat16, None),
        ("galore_adafactor", torch.float32, None),
        ("galore_adafactor", torch.bfloat16, None),
        ("adamw", torch.bfloat16, None),
        # Compressed states, stochastic rounding included; rank 64 keeps the projected states
        # of this small model above the 4096 elements under which states stay fp32.
        ("adamw8bit", torch.bfloat16, None),
        ("galore_adamw4bit", torch.float32, None),
        ("galore_adamw_ternary", torch.float32, None),
        ("galore_adamw_ternary", torch.bfloat16, None),
        ("galore_adamw", torch.float32, "bf16"),
    ],
)
def test_resume_mid_subspace_is_bit_exact(name: str, dtype: torch.dtype, states: str | None) -> None:
    options: dict = {} if states is None else {"states": states}
    if name.startswith("galore"):
        options |= {"rank": 4 if name in ("galore_adamw", "galore_adafactor") and not states else 64}
        options |= {"update_proj_gap": 5}
    lr = 1e-2 if name != "galore_adafactor" else None

    uninterrupted = tiny_llama(0).to(dtype)
    optimizer = build_optimizer(uninterrupted, name, lr=lr, **options)
    train_language_model(uninterrupted, optimizer, range(12))

    first = tiny_llama(0).to(dtype)
    optimizer = build_optimizer(first, name, lr=lr, **options)
    train_language_model(first, optimizer, range(7))  # stop between the refreshes at steps 5 and 10
    stored = [(key, value) for state in optimizer.state.values() for key, value in state.items()]
    if name.endswith(("8bit", "4bit")):
        assert any(key.endswith(".codes") for key, _ in stored)
    if name.endswith("ternary"):
        assert any(key.endswith(".trits") for key, _ in stored)
    if states == "bf16":
        assert any(isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 for _, value in stored)
    saved_model = roundtrip(first.state_dict())
    saved_optimizer = roundtrip(optimizer.state_dict())

    resumed = tiny_llama(1).to(dtype)
    resumed.load_state_dict(saved_model)
    optimizer = build_optimizer(resumed, name, lr=lr, **options)
    optimizer.load_state_dict(saved_optimizer)
    train_language_model(resumed, optimizer, range(7, 12))

    for (key, a), b in zip(uninterrupted.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), key


def test_state_dict_holds_only_tensors_and_numbers() -> None:
    model = tiny_llama(0).bfloat16()
    optimizer = build_optimizer(model, "galore_adamw", lr=1e-2, rank=4)
    train_language_model(model, optimizer, range(2))
    state = optimizer.state_dict()["state"]
    for values in state.values():
        for value in values.values():
            assert isinstance(value, (torch.Tensor, int, float))
    loaded = roundtrip(optimizer.state_dict())
    optimizer.load_state_dict(loaded)
    for values in optimizer.state.values():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == torch.float32, key


def _params(seed=0):
    torch.manual_seed(seed)
    return [torch.randn(256, 96, requires_grad=True), torch.randn(96, requires_grad=True)]


@pytest.mark.parametrize(("states", "tolerance"), [("fp32", 1e-6), ("int8", 2e-3), ("ternary", 3e-2)])
def test_a_torch_adamw_state_dict_continues_in_any_storage(states, tolerance) -> None:
    """Switching from torch.optim.AdamW mid-run: its moments and step counts carry over."""
    reference_params = _params()
    reference = torch.optim.AdamW(reference_params, lr=1e-2, weight_decay=0.1)
    step_on_gradients(reference_params, reference, range(3))
    saved = roundtrip(reference.state_dict())
    params = [p.detach().clone().requires_grad_() for p in reference_params]
    optimizer = GaLoreAdamW(params, lr=1.0, states=states)  # lr, betas, … come from the state dict
    optimizer.load_state_dict(saved)
    assert optimizer.param_groups[0]["lr"] == 1e-2 and optimizer.param_groups[0]["states"] == states
    assert optimizer.state[params[0]]["step"] == 3
    if states != "fp32":
        assert any(key.startswith("exp_avg.") for key in optimizer.state[params[0]])
    second = decoded_state(optimizer, params[0])["exp_avg_sq"]
    expected = reference.state[reference_params[0]]["exp_avg_sq"]
    if states == "ternary":  # factored: the row and column means are what is kept
        second, expected = second.mean(1), expected.mean(1)
    assert relative_error(second, expected) < 0.02
    step_on_gradients(reference_params, reference, range(3, 7))
    step_on_gradients(params, optimizer, range(3, 7))
    for ours, theirs in zip(params, reference_params, strict=True):
        assert relative_error(ours.detach(), theirs.detach()) < tolerance


def test_a_checkpoint_of_another_storage_format_is_reencoded() -> None:
    """AdamW8bit loading a fp32 GaLoreAdamW checkpoint keeps int8 moments (bases too)."""
    params = _params()
    groups = [{"params": params[:1], "rank": 64}, {"params": params[1:]}]
    fp32 = GaLoreAdamW(groups, lr=1e-2)
    step_on_gradients(params, fp32, range(3))
    saved = roundtrip(fp32.state_dict())
    copies = [p.detach().clone().requires_grad_() for p in params]
    int8 = GaLoreAdamW8bit(
        [{"params": copies[:1], "rank": 64}, {"params": copies[1:]}], lr=1e-2, basis_states="int8"
    )
    int8.load_state_dict(saved)
    state = int8.state[copies[0]]
    assert state["exp_avg.codes"].dtype == torch.uint8 and state["basis_right.codes"].dtype == torch.uint8
    assert int8.param_groups[0]["states"] == "int8"
    expected = decoded_state(fp32, params[0])["exp_avg"]
    assert relative_error(decoded_state(int8, copies[0])["exp_avg"], expected) < 0.02
    step_on_gradients(params, fp32, range(3, 5))
    step_on_gradients(copies, int8, range(3, 5))
    assert relative_error(copies[0].detach(), params[0].detach()) < 1e-3


def test_moments_of_a_large_matrix_transplant_into_torch_adamw() -> None:
    """Moments keep the parameter's shape even when the update goes by slices of rows."""
    param = torch.randn(1024, 4097, requires_grad=True)  # over 2²² elements: sliced
    optimizer = GaLoreAdamW([param], lr=1e-3)
    param.grad = torch.randn(1024, 4097)
    optimizer.step()
    state = optimizer.state[param]
    assert state["exp_avg"].shape == state["exp_avg_sq"].shape == param.shape
    reference = torch.optim.AdamW([param], lr=1e-3)
    groups = reference.state_dict()["param_groups"]
    reference.load_state_dict(optimizer.state_dict() | {"param_groups": groups})
    assert torch.equal(reference.state[param]["exp_avg"], state["exp_avg"])


@pytest.mark.parametrize(
    ("make_saved", "make_loader", "message"),
    [
        (
            lambda p: torch.optim.AdamW(p, amsgrad=True),
            lambda p: GaLoreAdamW(p),
            "amsgrad=True, which slimopt does not do",
        ),
        (
            lambda p: torch.optim.Adam(p, weight_decay=0.1),
            lambda p: GaLoreAdamW(p),
            "L2 weight decay",
        ),
        (
            lambda p: torch.optim.AdamW(p),
            lambda p: GaLoreAdamW([{"params": p, "rank": 8}]),
            r"parameter 0 \(256, 96\) is projected \(rank=8\)",
        ),
        (
            lambda p: torch.optim.SGD(p, lr=0.1),
            lambda p: GaLoreAdamW(p),
            "neither a slimopt nor a torch.optim.Adam/AdamW state dict",
        ),
        (
            lambda p: GaLoreAdafactor(p, lr=1e-2),
            lambda p: GaLoreAdamW(p),
            "another update rule than GaLoreAdamW's",
        ),
        (
            lambda p: GaLoreAdamW([{"params": p, "rank": 8}]),
            lambda p: GaLoreAdamW([{"params": p, "rank": 16}]),
            "saved with rank=8, this optimizer has rank=16",
        ),
        (
            lambda p: torch.optim.AdamW(p),
            lambda p: GaLoreAdafactor(p, lr=1e-2),
            "GaLoreAdafactor can load only its own",
        ),
    ],
)
def test_state_dicts_that_cannot_be_loaded_exactly_are_refused(make_saved, make_loader, message) -> None:
    params = _params()
    saved = make_saved(params)
    step_on_gradients(params, saved, range(1))
    loader = make_loader([p.detach().clone().requires_grad_() for p in params])
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(roundtrip(saved.state_dict()))


def test_ternary_moments_of_the_element_order_layout_are_refused() -> None:
    """A ternary moment saved before digits ran down columns (its digits in ``codes``) would
    decode to other values in today's layout: loading names it and the way to carry it over."""
    params = _params()
    saved = AdamWTernary(params, lr=1e-3)
    step_on_gradients(params, saved, range(1))
    state_dict = roundtrip(saved.state_dict())
    state_dict["state"] = {
        param_id: {key.replace(".trits", ".codes"): value for key, value in state.items()}
        for param_id, state in state_dict["state"].items()
    }
    loader = AdamWTernary(_params(), lr=1e-3)
    message = r"parameter 0: its ternary moment 'exp_avg' was saved .* states='fp32'"
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(state_dict)


def _part_shapes(state: dict) -> dict:
    return {key: tuple(value.shape) for key, value in state.items() if torch.is_tensor(value) and value.dim()}


def _earlier_stacked_layout(monkeypatch, shape, slice_numel=None):
    """An AdamWTernary state dict of one 3-D weight as slimopt wrote it before stacked experts'
    ternary moments were scaled by their rows and columns (the codecs viewing the weight as
    shape[0] × rest, and slices of it as 2-D matrices), and its decoded moments."""
    from slimopt.codecs import rows, slicing, ternary
    from slimopt.core import plan

    flat = rows.row_sliced_storage.__wrapped__

    def storage_of_matrix(states, kind, shape, block_size):
        return flat(states, kind, torch.Size(slicing.matrix_shape(shape)), block_size)

    with monkeypatch.context() as patch:
        patch.setattr(ternary, "scaled_shape", slicing.matrix_shape)
        patch.setattr(plan, "row_sliced_storage", storage_of_matrix)
        if slice_numel:
            patch.setattr(slicing, "SLICE_NUMEL", slice_numel)
        torch.manual_seed(0)
        weight = torch.randn(shape, requires_grad=True)
        optimizer = AdamWTernary([weight], lr=1e-3)
        for _ in range(2):
            weight.grad = torch.randn(shape)
            optimizer.step()
        return roundtrip(optimizer.state_dict()), decoded_state(optimizer, weight)


@pytest.mark.parametrize("shape", [(4, 48, 64), (40, 48, 8)])
def test_stacked_ternary_moments_of_the_earlier_layout_are_reencoded(monkeypatch, shape) -> None:
    """A 3-D ternary moment saved with one scale per expert (shape[0] × rest) would decode wrongly
    as today's layout, or lose its moment: it is decoded in its own layout and encoded in today's
    (a new stochastic rounding of the same values), deterministically; the rest is kept."""
    before, moments = _earlier_stacked_layout(monkeypatch, shape)
    assert before["state"][0]["exp_avg.row"].numel() == shape[0]  # one scale per expert
    today = AdamWTernary([fresh := torch.zeros(shape, requires_grad=True)], lr=1e-3)
    fresh.grad = torch.randn(shape)
    today.step()
    loaded = []
    for _ in range(2):
        weight = torch.zeros(shape, requires_grad=True)
        loader = AdamWTernary([weight], lr=1e-3)
        loader.load_state_dict(before)
        loaded.append(decoded_state(loader, weight))
        assert _part_shapes(loader.state[weight]) == _part_shapes(today.state[fresh])
    assert torch.equal(loaded[0]["exp_avg"], loaded[1]["exp_avg"])
    assert relative_error(loaded[0]["exp_avg"], moments["exp_avg"]) < 1.0  # one ternary rounding
    # The second moment's format was chosen by the 3-D shape already: kept as saved.
    for key in [key for key in before["state"][0] if key.startswith("exp_avg_sq")]:
        assert torch.equal(loader.state[weight][key], before["state"][0][key])
    weight.grad = torch.randn(shape)
    loader.step()
    assert torch.isfinite(weight).all()


def test_a_sliced_stack_of_the_earlier_layout_is_reencoded(monkeypatch) -> None:
    """A stack stored by slices of 2-D matrices (one scale per expert, an int4 second moment)
    comes back with each expert's rows and columns scaled and its second moment factored."""
    from slimopt.codecs import rows, slicing

    shape = (4, 32, 128)  # slices of 4096 elements: one expert each
    rows.row_sliced_storage.cache_clear()
    before, moments = _earlier_stacked_layout(monkeypatch, shape, slice_numel=4096)
    assert "exp_avg_sq.codes" in before["state"][0]
    monkeypatch.setattr(slicing, "SLICE_NUMEL", 4096)
    rows.row_sliced_storage.cache_clear()
    weight = torch.zeros(shape, requires_grad=True)
    loader = AdamWTernary([weight], lr=1e-3)
    loader.load_state_dict(before)
    state = loader.state[weight]
    assert "exp_avg_sq.codes" not in state and state["exp_avg_sq.col"].numel() == 4 * 128
    assert state["exp_avg.row"].numel() == 4 * 32
    loaded = decoded_state(loader, weight)
    for key in ("exp_avg", "exp_avg_sq"):
        assert relative_error(loaded[key], moments[key]) < 1.0
    rows.row_sliced_storage.cache_clear()


def test_a_state_dict_with_more_param_groups_is_refused_as_torch_refuses_it() -> None:
    """torch.optim raises for a different number of groups; slimopt used to drop the extra
    group silently and keep its state as a stray entry."""
    first, second = torch.randn(8, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    saved = GaLoreAdamW([{"params": [first]}, {"params": [second]}], lr=1e-3)
    step_on_gradients([first, second], saved, range(1))
    loader = GaLoreAdamW([first], lr=1e-3)
    with pytest.raises(ValueError, match="the state dict has 2 param groups, this optimizer 1"):
        loader.load_state_dict(roundtrip(saved.state_dict()))
    assert not loader.state
    with pytest.raises(
        ValueError, match="param group 0 of the state dict has 2 parameters, this optimizer's 1"
    ):
        loader.load_state_dict(roundtrip(GaLoreAdamW([first, second], lr=1e-3).state_dict()))


def test_a_taco_state_dict_is_refused_by_adamw_at_load() -> None:
    """TACO's groups carry AdamW's hyperparameters (for its fallback), so only its state tells
    it apart: its sketch used to load into GaLoreAdamW and fail at the next step."""
    from slimopt import TACO

    weight = torch.randn(16, 16, requires_grad=True)
    saved = TACO([weight], lr=1e-3)
    step_on_gradients([weight], saved, range(1))
    loader = GaLoreAdamW([weight], lr=1e-3)
    with pytest.raises(ValueError, match=r"sketch_rows.*which AdamWRule does not keep.*another update rule"):
        loader.load_state_dict(roundtrip(saved.state_dict()))
    assert not loader.state


@pytest.mark.parametrize("saved_experts", [True, False])
def test_the_experts_layout_cannot_change_on_load(saved_experts) -> None:
    experts = torch.randn(3, 8, 8, requires_grad=True)
    saved = GaLoreAdamW([{"params": [experts], "rank": 2, "experts": saved_experts}], lr=1e-3)
    step_on_gradients([experts], saved, range(1))
    loader = GaLoreAdamW([{"params": [experts], "rank": 2, "experts": not saved_experts}], lr=1e-3)
    with pytest.raises(ValueError, match=f"saved with experts={saved_experts}, this optimizer has experts"):
        loader.load_state_dict(roundtrip(saved.state_dict()))
    assert loader.param_groups[0]["experts"] is (not saved_experts)


def test_a_tensor_step_as_torch_optim_keeps_it_loads_and_resumes_exactly() -> None:
    """torch.optim keeps ``step`` as a 0-d tensor; a state dict in that form used to load and
    then fail in ``manual_seed`` at the next stochastically rounded step."""
    params = _params()
    original = GaLoreAdamW(params, lr=1e-3, states="bf16")
    step_on_gradients(params, original, range(2))
    state_dict = roundtrip(original.state_dict())
    for state in state_dict["state"].values():
        state["step"] = torch.tensor(float(state["step"]))
    copies = [p.detach().clone().requires_grad_() for p in params]
    resumed = GaLoreAdamW(copies, lr=1e-3, states="bf16")
    resumed.load_state_dict(state_dict)
    step_on_gradients(params, original, range(2, 4))
    step_on_gradients(copies, resumed, range(2, 4))
    for ours, theirs in zip(copies, params, strict=True):
        assert torch.equal(ours, theirs)

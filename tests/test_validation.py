"""Bad input gives one clear error naming the group, the key, the value and the valid choices."""

from __future__ import annotations

import math

import pytest
import torch

from slimopt import TACO, APOLLOAdamW, GaLoreAdafactor, GaLoreAdamW, available_optimizers, build_optimizer

from .conftest import tiny_llama


def groups(**projected):
    return [{"params": [torch.randn(4, 4, requires_grad=True)]}, {"params": [torch.randn(4, 4)], **projected}]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rank": 0}, "param group 1: rank must be a positive integer, got 0"),
        ({"rank": -3}, "rank must be a positive integer, got -3"),
        ({"rank": 2.5}, "rank must be a positive integer, got 2.5"),
        (
            {"rank": 4, "update_proj_gap": 0},
            "param group 1: update_proj_gap must be a positive integer, got 0",
        ),
        ({"rank": 4, "proj_type": "diagonal"}, "unknown proj_type 'diagonal'; valid: std, reverse_std, left"),
        ({"rank": 4, "proj_method": "qr"}, "unknown proj_method 'qr'; valid: subspace, svd"),
        (
            {"rank": 4, "on_subspace_change": "drop"},
            "unknown on_subspace_change 'drop'; valid: keep, reset, rotate",
        ),
        ({"lr": -1.0}, "param group 1: lr must be a finite number >= 0, got -1.0"),
        ({"lr": float("nan")}, "param group 1: lr must be a finite number >= 0, got nan"),
        ({"lr": "0.1"}, "param group 1: lr must be a finite number >= 0, got '0.1'"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\] must be in \[0, 1\), got 1.0"),
        ({"betas": (-0.1, 0.9)}, r"betas\[0\] must be in \[0, 1\), got -0.1"),
        ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0, got -0.1"),
        ({"weight_decay": None}, "weight_decay must be a finite number >= 0, got None"),
        ({"eps": None}, "eps must be a finite number >= 0, got None"),
        ({"betas": (0.9, None)}, r"betas\[1\] must be in \[0, 1\), got None"),
        ({"rank": 4, "scale": float("inf")}, "scale must be a finite number > 0, got inf"),
        ({"rank": 4, "scale": 0}, "scale must be a finite number > 0, got 0"),
    ],
)
def test_bad_group_values_raise_value_error(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        GaLoreAdamW(groups(**options), lr=1e-3)


def test_bad_constructor_defaults_name_group_zero() -> None:
    with pytest.raises(ValueError, match=r"param group 0: lr must be a finite number >= 0, got -0\.5"):
        GaLoreAdamW([torch.randn(3, 3)], lr=-0.5)
    with pytest.raises(ValueError, match="param group 0: unknown proj_type 'middle'"):
        GaLoreAdamW([torch.randn(3, 3)], rank=2, proj_type="middle")
    with pytest.raises(TypeError, match=r"unknown option.*proj_typ"):
        GaLoreAdamW([torch.randn(3, 3)], rank=2, proj_typ="std")


def test_adafactor_validation() -> None:
    with pytest.raises(ValueError, match="manual lr cannot be combined with relative_step=True"):
        GaLoreAdafactor([torch.randn(3, 3)], lr=1e-3, relative_step=True)
    with pytest.raises(ValueError, match=r"beta1 must be None or in \[0, 1\), got 1.5"):
        GaLoreAdafactor([torch.randn(3, 3)], beta1=1.5)


def test_build_optimizer_rejects_unknown_names_and_options() -> None:
    model = tiny_llama(0)
    with pytest.raises(ValueError, match="unknown optimizer 'galore_adam'; available: adamw, galore_adamw"):
        build_optimizer(model, "galore_adam", lr=1e-3)
    with pytest.raises(ValueError, match="'adamw' does not project gradients; remove rank"):
        build_optimizer(model, "adamw", lr=1e-3, rank=8)
    with pytest.raises(
        ValueError,
        match=r"matches no linear module \(nn\.Linear or transformers Conv1D\); linear modules of this "
        r"model: model\.layers",
    ):
        build_optimizer(model, "galore_adamw", lr=1e-3, target_modules=["attention_only"])
    with pytest.raises(ValueError, match="param group 0: rank must be a positive integer"):
        build_optimizer(model, "galore_adamw", lr=1e-3, rank=0)
    assert available_optimizers()[:3] == ["adamw", "galore_adamw", "galore_adafactor"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr": None}, "param group 0: lr is required: AdamW has no relative step size"),
        ({"lr": 1e-3, "eps": None}, "param group 0: eps must be a finite number >= 0, got None"),
        ({"lr": 1e-3, "weight_decay": None}, "weight_decay must be a finite number >= 0, got None"),
        ({"lr": 1e-3, "rank": 8, "scale": float("inf")}, "scale must be a finite number > 0, got inf"),
    ],
)
def test_build_optimizer_refuses_none_and_infinite_values_with_value_error(options, message) -> None:
    """These used to raise raw ``TypeError``s from comparisons with None, or (scale=inf) to be
    accepted and turn the weights to NaN at the first step."""
    name = "galore_adamw" if "rank" in options else "adamw"
    with pytest.raises(ValueError, match=message):
        build_optimizer(tiny_llama(0), name, **options)


def test_adafactor_refuses_values_that_are_not_numbers() -> None:
    with pytest.raises(ValueError, match="clip_threshold must be a finite number > 0, got None"):
        GaLoreAdafactor([torch.randn(3, 3)], clip_threshold=None)
    with pytest.raises(ValueError, match=r"eps must be a pair of non-negative floats, got \(None, 0\.001\)"):
        GaLoreAdafactor([torch.randn(3, 3)], eps=(None, 1e-3))
    with pytest.raises(ValueError, match="decay_rate must be < 0, got None"):
        GaLoreAdafactor([torch.randn(3, 3)], decay_rate=None)


# Every float hyperparameter and option, as a param group of an optimizer sets it: (class, what
# the group needs besides, key, index inside a pair or None).
FLOAT_OPTIONS = [
    (GaLoreAdamW, {}, "lr", None),
    (GaLoreAdamW, {}, "eps", None),
    (GaLoreAdamW, {}, "weight_decay", None),
    (GaLoreAdamW, {}, "betas", 0),
    (GaLoreAdamW, {"rank": 2}, "scale", None),
    (APOLLOAdamW, {"rank": 2}, "norm_growth_limit", None),
    (GaLoreAdamW, {"rule": "lion"}, "betas", 1),
    (GaLoreAdafactor, {"lr": 1e-3, "relative_step": False}, "lr", None),
    (GaLoreAdafactor, {}, "clip_threshold", None),
    (GaLoreAdafactor, {}, "decay_rate", None),
    (GaLoreAdafactor, {}, "beta1", None),
    (GaLoreAdafactor, {}, "eps", 1),
    (TACO, {}, "beta", None),
    (TACO, {}, "lr", None),
]


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 1e300, -1e300], ids=str)
@pytest.mark.parametrize(("cls", "needs", "key", "index"), FLOAT_OPTIONS, ids=lambda v: str(v)[:20])
def test_every_float_option_refuses_what_float32_cannot_hold(cls, needs, key, index, bad) -> None:
    """inf, NaN and values beyond float32's range (1e300 becomes inf in the first fp32 tensor)
    are refused at construction, naming the key: none of them trains."""
    group = {"params": [torch.zeros(4, 4, requires_grad=True)], **needs}
    if index is None:
        group[key] = bad
    else:
        pair = list(
            cls([torch.zeros(1)], **({"lr": 1e-3} if cls is not GaLoreAdafactor else {})).defaults[key]
        )
        pair[index] = bad
        group[key] = tuple(pair)
    with pytest.raises(ValueError, match=rf"param group 0: .*{key}"):
        cls([group])


def test_fallback_lr_and_max_grad_norm_refuse_infinity() -> None:
    with pytest.raises(ValueError, match="fallback_lr must be a finite number >= 0, got inf"):
        build_optimizer(tiny_llama(0), "taco", lr=1e-3, fallback_lr=math.inf)
    from slimopt import layerwise

    optimizer = GaLoreAdamW([torch.zeros(2, 2, requires_grad=True)])
    with pytest.raises(
        ValueError, match="max_grad_norm must be a finite number > 0, or None for no clipping"
    ):
        layerwise(optimizer, max_grad_norm=math.inf)


def test_every_option_of_the_table_is_a_flag_and_an_optim_arg_of_its_type() -> None:
    """The option table (``slimopt.options.OPTIONS``) is what the command line, Hugging Face's
    ``optim_args`` and the param groups read: each option a user gives is a flag and an optim_arg
    whose text of the default reads back as the default, and is in its part's defaults."""
    import argparse

    from slimopt.cli.options import add_optimizer_flags
    from slimopt.integrations.transformers import parse_optim_args
    from slimopt.options import OPTION_TYPES, OPTIONS, PROJECTION_DEFAULTS, STORAGE_DEFAULTS

    parser = argparse.ArgumentParser()
    add_optimizer_flags(parser)
    flags = {action.dest for action in parser._actions}
    for option in OPTIONS:
        defaults = PROJECTION_DEFAULTS if option.part == "projection" else STORAGE_DEFAULTS
        assert defaults[option.name] == option.default
        if not option.given:
            assert option.name not in OPTION_TYPES and option.name not in flags
            continue
        assert option.name in flags
        text = "none" if option.default is None else str(option.default).lower()
        assert parse_optim_args(f"{option.name}={text}") == {option.name: option.default}
    with pytest.raises(SystemExit):
        parser.parse_args(["--block-size", "eight"])


@pytest.mark.parametrize("name", available_optimizers())
def test_each_optimizer_documents_every_option_with_its_own_default(name) -> None:
    """An optimizer class's docstring lists every option of the table with the default a group
    of that class really gets (APOLLO's random projection, AdamW8bit's int8 states)."""
    from slimopt.options import OPTIONS
    from slimopt.registry import OPTIMIZERS

    cls = OPTIMIZERS[name].cls
    group = cls([torch.zeros(4, 4, requires_grad=True)]).param_groups[0]
    for option in OPTIONS:
        shown = "None" if group[option.name] is None else repr(group[option.name])
        assert f"    {option.name} ({option.type.__name__}): {option.help}. Default: {shown}." in cls.__doc__


def test_an_optimizer_constructor_parameter_without_help_text_is_refused() -> None:
    """A new constructor parameter must be explained (by the shell or its rule) before the class
    exists: the reference would otherwise list it blank."""
    from slimopt import GaLoreAdamW

    with pytest.raises(TypeError, match="'gamma' has no help text"):

        class Documented(GaLoreAdamW):
            """AdamW with one more hyperparameter."""

            def __init__(self, params, lr=1e-3, gamma=0.5, **options) -> None:
                super().__init__(params, lr, **options)

"""What ``load_state_dict`` accepts besides a slimopt optimizer's own state dict.

Like ``torch.optim``, a loaded state dict brings its hyperparameters (``lr``, ``betas`` …) with
it. Two kinds of state dict are converted on the way in:

- **Another storage format.** A moment's format is the loading optimizer's choice (``states``,
  ``block_size``, ``basis_states`` of its groups), not the checkpoint's: moments and bases saved
  in another format are decoded and re-encoded, so an ``AdamW8bit`` that loads a ``GaLoreAdamW``
  checkpoint keeps int8 moments (switching format mid-run). So is how the weights are rounded
  (``param_rounding``), which belongs to the weights the optimizer was built for: an optimizer
  of bf16 weights with an 8-bit correction that loads a state dict without one starts it at
  zero (the weights are exactly what they hold), and one without drops a saved correction.
- **torch.optim.AdamW / Adam.** Its fp32 moments and step counts become the loading
  optimizer's (in its storage format), so a run can switch from ``torch.optim.AdamW`` to a
  slimopt optimizer. Full-size moments have no exact counterpart in a rank-r subspace, so a
  projected parameter with saved moments is refused, as are AMSGrad, ``maximize`` and Adam's
  coupled (L2) weight decay, which slimopt does not compute.

Which parameters are projected, at what rank and on which side cannot change on load (the bases
and moments would not fit): a difference raises ``ValueError`` naming the group. Ternary moments
of a layout slimopt no longer writes are re-encoded or refused (``slimopt.core.earlier_layouts``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from slimopt.core.earlier_layouts import carried_over
from slimopt.core.state import CORRECTION, COUNTERS, KEPT, MOMENT_STEP, SEED, SHELL_KEYS, SKIPS, STEP
from slimopt.options import OWN_KEYS, PROJECTION_DEFAULTS, STORAGE_DEFAULTS, STORAGE_KEYS

# Group keys of torch.optim.Adam/AdamW that slimopt has no use for (amsgrad, maximize and
# differentiable set to True are refused first).
TORCH_ADAM_ONLY = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused")
TORCH_ADAM_STATE_KEYS = {"step", "exp_avg", "exp_avg_sq"}


def is_slimopt_state_dict(state_dict: dict[str, Any]) -> bool:
    """Whether ``state_dict`` was written by a slimopt optimizer (its groups name a storage)."""
    return all("states" in group for group in state_dict["param_groups"])


def prepared(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` as ``optimizer.load_state_dict`` loads it: checked for its groups and
    layout (``ValueError`` otherwise), torch.optim.AdamW's converted, options newer than it
    filled in, counters as integers, and each group's ``OWN_KEYS`` the optimizer's own."""
    check_groups(optimizer, state_dict)
    if not is_slimopt_state_dict(state_dict):
        state_dict = from_torch_adam(optimizer, state_dict)
    state_dict = integer_counters(fill_new_options(optimizer, state_dict))
    groups = zip(state_dict["param_groups"], optimizer.param_groups, strict=True)
    state_dict = {
        **state_dict,
        "param_groups": [{**saved, **{key: own[key] for key in OWN_KEYS}} for saved, own in groups],
    }
    check_layout(optimizer, state_dict)
    return carried_over(optimizer, state_dict)


def check_groups(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless ``state_dict`` has the optimizer's number of param groups,
    each with as many parameters (as ``torch.optim.Optimizer.load_state_dict`` does), and state
    only for parameters its groups list."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the state dict has {len(saved_groups)} param groups, this optimizer "
            f"{len(optimizer.param_groups)}"
        )
    for index, (saved, current) in enumerate(zip(saved_groups, optimizer.param_groups, strict=True)):
        if len(saved["params"]) != len(current["params"]):
            raise ValueError(
                f"param group {index} of the state dict has {len(saved['params'])} parameters, "
                f"this optimizer's {len(current['params'])}"
            )
    listed = {param_id for group in saved_groups for param_id in group["params"]}
    stray = sorted(set(state_dict["state"]) - listed, key=str)
    if stray:
        raise ValueError(f"the state dict has state for parameters {stray} that none of its groups lists")


def integer_counters(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with its step counts and seeds as Python integers: torch.optim keeps
    ``step`` as a 0-d tensor, and a state dict edited into that form loads as well."""
    state = {}
    for param_id, saved in state_dict["state"].items():
        state[param_id] = {
            key: int(value.item())
            if key.rsplit(".", 1)[-1] in COUNTERS and isinstance(value, Tensor)
            else value
            for key, value in saved.items()
        }
    return {**state_dict, "state": state}


def check_state_keys(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Raise ``ValueError`` when a parameter's saved state holds what the update rule of its
    group would not keep (a state dict of an optimizer with another rule: TACO's sketch loaded
    into AdamW would fail at the next step instead)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ordinal = 0
    for saved_group, current in zip(state_dict["param_groups"], optimizer.param_groups, strict=True):
        rule = optimizer.rule_of(saved_group)
        group = {**saved_group, "params": current["params"]}
        for saved_id in saved_group["params"]:
            param = params[ordinal]
            ordinal += 1
            kept = _rule_keys(optimizer, rule, param, group)
            saved = state_dict["state"].get(saved_id, {})
            foreign = sorted(key for key in saved if _root(key) not in kept and _root(key) not in SHELL_KEYS)
            if foreign:
                raise ValueError(
                    f"parameter {ordinal - 1} {tuple(param.shape)}: the state dict holds "
                    f"{', '.join(foreign[:4])}, which {type(rule).__name__} does not keep: it was "
                    f"saved by an optimizer with another update rule than {type(optimizer).__name__}'s"
                )


def _rule_keys(optimizer: Optimizer, rule: Any, param: Tensor, group: dict[str, Any]) -> set[str]:
    """The keys of the state ``rule`` creates for ``param`` (each expert's, with experts)."""
    shape = param.shape[1:] if group["experts"] else param.shape
    gradient = torch.empty(shape, device="meta")
    return set(rule.init_state(gradient, group, projected=optimizer.engine.projects(param, group)))


def _root(key: str) -> str:
    """The name of the moment or counter a state key stores (``expert2.exp_avg.codes``: exp_avg)."""
    parts = key.split(".")
    if parts[0].startswith("expert") and parts[0][len("expert") :].isdigit():
        parts = parts[1:]
    return parts[0]


def from_torch_adam(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` of ``torch.optim.AdamW`` (or ``Adam`` without weight decay) rewritten as a
    slimopt state dict with fp32 moments for ``optimizer``. Raises ``ValueError`` for a state
    dict of another optimizer, options slimopt does not compute, or saved moments of a projected
    parameter."""
    from slimopt.rules import AdamWRule

    name = type(optimizer).__name__
    if not isinstance(optimizer.rule, AdamWRule):
        raise ValueError(f"this state dict is not a slimopt one; {name} can load only its own")
    saved_groups = state_dict["param_groups"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ordinals = {}
    groups = []
    for index, (saved, current) in enumerate(zip(saved_groups, optimizer.param_groups, strict=True)):
        _check_torch_adam_group(index, saved)
        group = {key: value for key, value in current.items() if key != "params"}
        group |= {key: value for key, value in saved.items() if key not in TORCH_ADAM_ONLY}
        group.pop("decoupled_weight_decay", None)
        group |= {"states": "fp32", "block_size": None, "basis_states": "fp32"}
        groups.append(group)
        for saved_id in saved["params"]:
            ordinals[saved_id] = (len(ordinals), current)
    state = {}
    for saved_id, saved_state in state_dict["state"].items():
        ordinal, current = ordinals[saved_id]
        param = params[ordinal]
        unknown = set(saved_state) - TORCH_ADAM_STATE_KEYS
        if unknown:
            raise ValueError(f"parameter {ordinal}: unknown Adam state {', '.join(sorted(unknown))}")
        if optimizer.engine.projects(param, current) and "exp_avg" in saved_state:
            raise ValueError(
                f"parameter {ordinal} {tuple(param.shape)} is projected (rank={current['rank']}): "
                "full-size Adam moments have no exact counterpart in its rank-r subspace; load this "
                "state dict into an optimizer without rank groups, or drop its 'state' to start "
                "the moments afresh"
            )
        step = int(saved_state.get("step", 0))
        converted: dict[str, Any] = {STEP: step, MOMENT_STEP: step, SKIPS: 0, SEED: ordinal}
        for key in ("exp_avg", "exp_avg_sq"):
            if key in saved_state:
                moment = saved_state[key]
                converted[key] = (torch.view_as_real(moment) if moment.is_complex() else moment).float()
        if "exp_avg" not in converted:
            del converted[MOMENT_STEP]
        state[saved_id] = converted
    return {"state": state, "param_groups": groups}


def _check_torch_adam_group(index: int, group: dict[str, Any]) -> None:
    missing = [key for key in ("lr", "betas", "eps", "weight_decay") if key not in group]
    if missing:
        raise ValueError(
            f"param group {index} of the state dict has no {', '.join(missing)}: it is neither a "
            "slimopt nor a torch.optim.Adam/AdamW state dict"
        )
    for key in ("amsgrad", "maximize", "differentiable"):
        if group.get(key):
            raise ValueError(
                f"param group {index} of the state dict has {key}=True, which slimopt does not do"
            )
    if group.get("decoupled_weight_decay") is False and group["weight_decay"] != 0:
        raise ValueError(
            f"param group {index} of the state dict is torch.optim.Adam's with L2 weight decay "
            f"{group['weight_decay']}; slimopt decouples weight decay (AdamW): set weight_decay=0 in "
            "the state dict's group, or save from torch.optim.AdamW"
        )


def fill_new_options(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with the projection and storage options its groups lack (a checkpoint
    written before an option existed) taken from the optimizer's groups."""
    options = _options()
    groups = [
        {**{key: current[key] for key in options if key in current}, **saved}
        for saved, current in zip(state_dict["param_groups"], optimizer.param_groups, strict=False)
    ]
    return {**state_dict, "param_groups": groups}


# Rule hyperparameters newer than checkpoints written by slimopt: Muon's ``transposed`` (a
# checkpoint without it takes the loading optimizer's, which ``build_optimizer`` sets by layout).
NEWER_HYPERPARAMETERS = ("transposed",)


def _options() -> set[str]:
    """The options a checkpoint may lack: those every slimopt group has, whatever its update
    rule (projection, storage, and the group's ``rule``: None, the optimizer's own, in
    checkpoints older than that option), and ``NEWER_HYPERPARAMETERS``."""
    return {*PROJECTION_DEFAULTS, *STORAGE_DEFAULTS, "rule", *NEWER_HYPERPARAMETERS}


def check_layout(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Raise ``ValueError`` when the state dict's groups project differently from the optimizer's
    or were written by an optimizer with another update rule."""
    for index, (saved, current) in enumerate(
        zip(state_dict["param_groups"], optimizer.param_groups, strict=False)
    ):
        # torch.optim adds "differentiable" to the defaults after the groups are made; options
        # newer than the checkpoint take this optimizer's values (fill_new_options).
        missing = sorted(set(optimizer.defaults) - set(saved) - {"rank", "differentiable"} - _options())
        if missing:
            raise ValueError(
                f"param group {index} of the state dict has no {', '.join(missing)}: it was saved by "
                f"an optimizer with another update rule than {type(optimizer).__name__}'s"
            )
        for key in ("rank", "proj_type", "experts"):
            if saved.get(key) != current.get(key):
                raise ValueError(
                    f"param group {index}: the state dict was saved with {key}={saved.get(key)!r}, this "
                    f"optimizer has {key}={current.get(key)!r}; projection cannot change on load, so "
                    "construct the optimizer as the checkpoint's was"
                )


def drop_corrections(optimizer: Optimizer) -> None:
    """Remove the weight corrections loaded for parameters of groups that keep none (their
    ``param_rounding`` is not "corrected"): the weights keep their own values."""
    for group in optimizer.param_groups:
        if group["param_rounding"] == "corrected":
            continue
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key in [key for key in state if _root(key) == CORRECTION]:
                del state[key]


def restore_storage(optimizer: Optimizer, storage: list[dict[str, Any]]) -> None:
    """Re-encode the loaded moments and bases of each group whose storage differs from
    ``storage`` (the loading optimizer's own choice per group), and adopt that storage."""
    engine = optimizer.engine
    for group, wanted in zip(optimizer.param_groups, storage, strict=True):
        if all(group[key] == wanted[key] for key in STORAGE_KEYS):
            continue
        contents = []
        for param in group["params"]:
            if param not in optimizer.state:
                continue
            for unit in engine.units(param, group):  # the parameter, or each of its experts
                basis = engine.basis(unit, group) if engine.projects(unit, group) else None
                contents.append((unit, optimizer.decoded_state(unit), basis))
        group.update(wanted)
        for unit, moments, basis in contents:
            state = engine.state_of(unit)
            # Moments and bases are stored anew; APOLLO's limiter norm and a weight correction stay.
            for key in [k for k, v in state.items() if isinstance(v, Tensor) and k not in KEPT]:
                del state[key]
            if moments:
                engine.store_moments(unit, moments)
            if basis is not None:
                engine.store_basis(unit, basis)


def load_state_dict(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict``'s work (see its docstring): torch.optim's hooks run around
    slimopt's own checks and conversions (a pre hook may rewrite the state dict before it is
    checked, a post hook sees the loaded state); every state tensor keeps its saved dtype."""
    state_dict = state_dict.copy()
    for hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        rewritten = hook(optimizer, state_dict)
        state_dict = state_dict if rewritten is None else rewritten
    state_dict = prepared(optimizer, state_dict)
    pairs = zip(state_dict["param_groups"], optimizer.param_groups, strict=True)
    for index, (saved, current) in enumerate(pairs):
        errors = optimizer.errors_of({**saved, "params": current["params"]})
        if errors:
            raise ValueError(f"param group {index} of the state dict: " + "; ".join(errors))
    check_state_keys(optimizer, state_dict)
    storage = [{key: group[key] for key in STORAGE_KEYS} for group in optimizer.param_groups]
    saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    saved_state = state_dict["state"]
    with _hooks_set_aside(optimizer):
        torch.optim.Optimizer.load_state_dict(optimizer, state_dict)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for saved_id, param in zip(saved_ids, params, strict=True):
        for key, value in saved_state.get(saved_id, {}).items():
            if isinstance(value, Tensor):
                optimizer.state[param][key] = value.to(device=param.device, copy=True)
    optimizer.engine.replan()
    drop_corrections(optimizer)
    restore_storage(optimizer, storage)
    for hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        hook(optimizer)


@contextmanager
def _hooks_set_aside(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """``optimizer`` without its load_state_dict hooks for a while (``load_state_dict`` runs
    them itself, around its own checks)."""
    pre, post = (
        optimizer._optimizer_load_state_dict_pre_hooks,
        optimizer._optimizer_load_state_dict_post_hooks,
    )
    optimizer._optimizer_load_state_dict_pre_hooks = type(pre)()
    optimizer._optimizer_load_state_dict_post_hooks = type(post)()
    try:
        yield
    finally:
        optimizer._optimizer_load_state_dict_pre_hooks = pre
        optimizer._optimizer_load_state_dict_post_hooks = post

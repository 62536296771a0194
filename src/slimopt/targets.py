"""The parts of a model that optimizers and weight formats treat apart: linear layers (and
transformers' transposed ``Conv1D``), a mixture of experts' stacked expert weights, the output
head, and which of them ``target_modules`` selects (Hugging Face's ``optim_target_modules``
semantics)."""

from __future__ import annotations

import re
import warnings

from torch import Tensor, nn


def output_head(model: nn.Module) -> nn.Module | None:
    """Return the model's output projection (``get_output_embeddings()`` or ``lm_head``), if any."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if isinstance(head, nn.Module):
        return head
    return getattr(model, "lm_head", None)


def is_transposed_linear(module: nn.Module) -> bool:
    """Whether ``module`` is Hugging Face's ``Conv1D`` (GPT-2 and its kin): a linear layer whose
    weight is stored transposed, in × out. Recognized by name and layout, without importing
    transformers."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and isinstance(weight, Tensor)
        and weight.dim() == 2
    )


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's linear layers by name: ``nn.Linear`` and transformers' ``Conv1D``."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) or is_transposed_linear(module)
    }


def _matches(name: str, target_modules: str | list[str]) -> bool:
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(key == name or key in name or re.fullmatch(key, name) for key in target_modules)


def expert_weights(module: nn.Module) -> dict[str, Tensor]:
    """The stacked expert weights of ``module`` by name: its own 3-D parameters (experts × rows
    × columns, each expert a linear layer's matrix) when the module holds a mixture of experts'
    experts (its class name says "Expert", as transformers' ``MixtralExperts`` and
    ``Qwen2MoeExperts`` do), else none."""
    if isinstance(module, nn.modules.conv._ConvNd) or "expert" not in type(module).__name__.lower():
        return {}
    return {name: p for name, p in module.named_parameters(recurse=False) if p.dim() == 3}


def select_target_modules(model: nn.Module, target_modules: str | list[str] | None = None) -> list[str]:
    """The names of the modules whose weights ``target_modules`` selects for projection.

    Candidates are linear layers (``nn.Linear``, transformers' ``Conv1D``) and modules of stacked
    expert weights (``expert_weights``: each expert is projected as its own matrix).

    Args:
        model: the model to select from.
        target_modules: None: every linear layer except the output head (the attention and MLP
            projections of a transformer) and every experts module. ``"all-linear"``: every
            linear layer and experts module. A string: a regular expression that must match a
            module name in full. A list: module names, substrings of names, or full-match
            regexes.

    Returns:
        The selected modules' names, as ``model.named_modules()`` gives them.

    Raises:
        ValueError: nothing is selected, or an explicit selection names a module with weights of
            3 or more dimensions that are neither a convolution's nor stacked experts' (slimopt
            does not know their layout and would not flatten them silently).
    """
    linears = linear_layers(model)
    experts = [name for name, module in model.named_modules() if expert_weights(module)]
    candidates = list(linears) + experts
    if target_modules is None:
        head = output_head(model)
        chosen = [name for name, module in linears.items() if module is not head] + experts
        return chosen or _nothing(linears, None)
    if isinstance(target_modules, str) and target_modules.replace("_", "-") == "all-linear":
        return candidates or _nothing(linears, target_modules)
    for name, module in model.named_modules():
        if name in candidates or not _matches(name, target_modules):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if param.dim() >= 3 and not isinstance(module, nn.modules.conv._ConvNd):
                remedy = f"exclude {name!r} from" if name else "do not match the model itself (name '') in"
                raise ValueError(
                    f"target_modules={target_modules!r} selects {f'{name}.' if name else ''}{param_name} "
                    f"of shape {tuple(param.shape)}, whose layout slimopt does not know (neither a "
                    f"linear layer's, a convolution's nor stacked experts'); {remedy} target_modules"
                )
    chosen = [name for name in candidates if _matches(name, target_modules)]
    return chosen or _nothing(linears, target_modules)


def projected_weights(model: nn.Module, target_modules: str | list[str] | None = None) -> dict[str, Tensor]:
    """The weights ``select_target_modules`` selects, by parameter name: a linear layer's
    ``weight``, or an experts module's stacked 3-D weights."""
    modules = dict(model.named_modules())
    weights = {}
    for name in select_target_modules(model, target_modules):
        stacked = expert_weights(modules[name])
        owned = stacked if stacked else {"weight": modules[name].weight}
        weights |= {f"{name}.{key}": param for key, param in owned.items()}
    return weights


def _nothing(linears: dict[str, nn.Module], target_modules: str | list[str] | None) -> list[str]:
    shown = ", ".join(list(linears)[:8]) + (", …" if len(linears) > 8 else "")
    raise ValueError(
        f"target_modules={target_modules!r} matches no linear module (nn.Linear or transformers "
        f"Conv1D); linear modules of this model: {shown or 'none'}"
    )


def warn_unknown_layouts(model: nn.Module, params: dict[int, Tensor]) -> None:
    """A ``UserWarning`` naming trainable tensors of three or more dimensions that are neither
    convolution kernels nor stacked experts (``expert_weights``): a projecting optimizer keeps
    their moments whole, unprojected, since it does not know their layout."""
    known = {
        id(p)
        for m in model.modules()
        for p in (m.parameters(recurse=False) if isinstance(m, nn.modules.conv._ConvNd) else [])
    }
    known |= {id(p) for m in model.modules() for p in expert_weights(m).values()}
    names = [
        f"{name} {tuple(p.shape)}"
        for name, p in model.named_parameters()
        if id(p) in params and p.dim() >= 3 and id(p) not in known
    ]
    if names:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        warnings.warn(
            f"{shown}: tensors of 3 or more dimensions that are neither convolution kernels nor "
            "stacked experts are not projected (their layout is unknown); their moments are kept whole",
            UserWarning,
            stacklevel=3,
        )


def target_weight_ids(
    model: nn.Module, target_modules: str | list[str] | None
) -> tuple[set[int], set[int], set[int]]:
    """The ids of the trainable weights ``select_target_modules`` selects, and of those among
    them in ``Conv1D``'s in × out layout and of stacked experts."""
    modules = dict(model.named_modules())
    selected: set[int] = set()
    transposed: set[int] = set()
    experts: set[int] = set()
    for module_name in select_target_modules(model, target_modules):
        module = modules[module_name]
        stacked = expert_weights(module)
        for weight in stacked.values() if stacked else [module.weight]:
            if weight.requires_grad:
                selected.add(id(weight))
                if stacked:
                    experts.add(id(weight))
                elif is_transposed_linear(module):
                    transposed.add(id(weight))
    return selected, transposed, experts

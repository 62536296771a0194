"""Hugging Face ``Trainer`` support: ``SlimoptTrainer`` and ``create_optimizer``.

Both read the usual ``TrainingArguments``: ``learning_rate``, ``weight_decay``, ``adam_beta1``,
``adam_beta2``, ``adam_epsilon``, ``optim_target_modules`` (``"all-linear"``, a regex, or a list
of names / substrings / regexes) and ``optim_args`` in Hugging Face's
``"rank=128,update_proj_gap=200,scale=0.25,proj_type=std"`` format, which also takes slimopt's own
keys (``states=int8``, ``basis_states=int8``, ``proj_method=svd`` …); APOLLO's ``proj=random|svd``
is ``proj_method``. A name ending in
``_layerwise`` (``"galore_adamw8bit_layerwise"``, as in Hugging Face's ``optim``) trains with
``slimopt.layerwise``: gradient accumulation, the logged learning rate and clipping
(``max_grad_norm``, per tensor) all work, where Hugging Face's own layer-wise GaLore refuses
accumulation and makes clipping a no-op.

A name from ``TrainingArguments.optim``, or Hugging Face's spelling of one
(``galore_adamw_8bit``), takes Hugging Face's defaults for what ``optim_args`` leaves out
(``registry.hugging_face_defaults``: rank 128, ``update_proj_gap`` 200, ``scale`` 0.25, or 1.0
and a random projection for APOLLO), so that swapping ``Trainer`` for ``SlimoptTrainer`` trains
the same configuration; slimopt's own names passed as ``optimizer_name`` keep slimopt's (a rank
of a quarter of the matrices' smaller side).

Unlike Hugging Face, an ``optim_target_modules`` that matches no module is an error, never a
silently unprojected model; for a projecting optimizer without ``optim_target_modules`` the
attention and MLP linear layers are projected (every linear layer but the output head).

Any other Trainer (TRL's ``SFTTrainer``, …) takes a slimopt optimizer without subclassing through
``optimizer_cls_and_kwargs(name, lr=..., **options)``, the pair for its
``optimizer_cls_and_kwargs`` argument (transformers 5 calls the factory with the model).

Under accelerate's DDP, ``SlimoptTrainer`` synchronizes the gradients by slimopt's communication
hook (``slimopt.distributed.sync_gradients``): a projecting optimizer's matrices send their
projections between refreshes. ``optim_args`` key ``grad_sync`` (``auto``, the default;
``projected``; ``full``, every gradient whole, as DDP alone) chooses; ``trainer.grad_sync``
counts the bytes.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from slimopt.distributed.grad_sync import GRAD_SYNCS, GradientSync, optimizer_sync_error, sync_gradients
from slimopt.layerwise import LayerwiseHandle, check_refresh_from, layerwise
from slimopt.optimizers import TERNARY_BETAS, AdamWTernary, GaLoreAdafactor, Muon, SlimoptOptimizer
from slimopt.options import OPTION_TYPES, parse_option
from slimopt.registry import (
    HF_NAMES,
    OPTIMIZERS,
    ROW_SPLIT_PROJ_TYPE,
    available_optimizers,
    build_optimizer,
    hugging_face_defaults,
    resolve_name,
)
from slimopt.weight_formats.int8 import INT8_ONE_PROCESS, Int8Weight

try:
    from transformers import Trainer
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "slimopt.integrations.transformers needs transformers: pip install 'slimopt[train]'"
    ) from error

LAYERWISE_SUFFIX = "_layerwise"
# Hugging Face's optim_args keys that slimopt spells otherwise (APOLLO's "proj": random or svd).
OPTIM_ARGS_ALIASES = {"proj": "proj_method"}
# optim_args keys of the Trainer's run rather than of the optimizer: how DDP synchronizes the
# gradients (slimopt.distributed.grad_sync; auto: projections where the optimizer projects).
RUN_KEYS = {"grad_sync": str}


def optimizer_names() -> list[str]:
    """Every name ``SlimoptTrainer`` accepts: the registry's and Hugging Face's (``HF_NAMES``),
    each also with ``_layerwise``."""
    names = available_optimizers() + [name for name in HF_NAMES if name not in OPTIMIZERS]
    return names + [name + LAYERWISE_SUFFIX for name in names]


def split_name(name: str) -> tuple[str, bool]:
    """(registry name, layer-wise?) of a ``SlimoptTrainer`` optimizer name, slimopt's or Hugging
    Face's (``galore_adamw_8bit_layerwise`` → ``("galore_adamw8bit", True)``); raises
    ``ValueError`` naming the valid names."""
    base, layer_wise = (
        (name[: -len(LAYERWISE_SUFFIX)], True) if name.endswith(LAYERWISE_SUFFIX) else (name, False)
    )
    if base not in OPTIMIZERS and base not in HF_NAMES:
        raise ValueError(f"unknown optimizer {name!r}; available: {', '.join(optimizer_names())}")
    return resolve_name(base), layer_wise


def trainer_optimizer_name(args: Any, name: str | None) -> str:
    """``name``, or the optimizer ``TrainingArguments.optim`` names when ``name`` is None.
    Raises ``ValueError`` for an ``optim`` without a slimopt counterpart."""
    if name is not None:
        return name
    optim = getattr(args.optim, "value", args.optim)
    try:
        split_name(optim)
    except ValueError:
        raise ValueError(
            f"TrainingArguments(optim={optim!r}) has no slimopt counterpart; set optim to one of "
            f"{', '.join(HF_NAMES)} (optionally with {LAYERWISE_SUFFIX}), or pass optimizer_name= "
            f"one of {', '.join(available_optimizers())}"
        ) from None
    return optim


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """Read ``"key=value,key=value"`` (``TrainingArguments.optim_args``) into typed options.

    Raises ``ValueError`` naming an unknown key (with the valid ones) or a value of the wrong type.
    """
    options: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, separator, value = (part.strip() for part in item.partition("="))
        if not separator or not value:
            raise ValueError(f"optim_args item {item.strip()!r} is not key=value")
        key = OPTIM_ARGS_ALIASES.get(key, key)
        if key in RUN_KEYS:
            if value not in GRAD_SYNCS:
                raise ValueError(f"optim_args grad_sync={value!r}; valid: {', '.join(GRAD_SYNCS)}")
            options[key] = value
            continue
        if key not in OPTION_TYPES:
            valid = ", ".join([*OPTION_TYPES, *OPTIM_ARGS_ALIASES, *RUN_KEYS])
            raise ValueError(f"unknown optim_args key {key!r}; valid: {valid}")
        try:
            options[key] = parse_option(key, value)
        except ValueError as error:
            raise ValueError(f"optim_args {error}") from None
    return options


def create_optimizer(
    model: nn.Module, args: Any, name: str | None = None, *, rows_split: bool = False
) -> SlimoptOptimizer:
    """The slimopt optimizer ``name`` for ``model``, configured from ``TrainingArguments``.

    Args:
        model: the model to train.
        args: the ``TrainingArguments``: its ``learning_rate``, ``weight_decay``, ``adam_beta1``,
            ``adam_beta2`` and ``adam_epsilon`` (of AdamW moments), ``optim_target_modules``
            and ``optim_args`` (``"rank=128,states=int8"``) configure the optimizer.
        name: an optimizer name (None: ``args.optim``); a ``_layerwise`` suffix names the same
            optimizer (``SlimoptTrainer`` adds the hooks).
        rows_split: FSDP2 will split the weights by rows after the optimizer is built
            (accelerate's ``prepare``), so a projecting optimizer keeps its basis on the unsplit
            side (``proj_type="right"``) unless ``optim_args`` names one.

    Returns:
        The optimizer, as [build_optimizer][slimopt.build_optimizer] makes it.

    Raises:
        ValueError: an unknown name, ``optim_args`` key or value, or an ``optim_target_modules``
            that matches nothing or is given to an optimizer that does not project.
    """
    spelled = trainer_optimizer_name(args, name)
    base, _ = split_name(spelled)
    options = parse_optim_args(getattr(args, "optim_args", None))
    options.pop("grad_sync", None)  # the Trainer's (SlimoptTrainer), not the optimizer's
    plain = spelled.removesuffix(LAYERWISE_SUFFIX)
    from_args = spelled == getattr(args.optim, "value", args.optim)  # TrainingArguments.optim's
    if from_args or plain not in OPTIMIZERS:  # Hugging Face's name: Hugging Face's defaults
        options = {**hugging_face_defaults(plain), **options}
    if rows_split and OPTIMIZERS[base].projected:
        options.setdefault("proj_type", ROW_SPLIT_PROJ_TYPE)
    hyper: dict[str, Any] = {"weight_decay": args.weight_decay}
    if issubclass(OPTIMIZERS[base].cls, GaLoreAdafactor):
        # Hugging Face's optim="adafactor": the Trainer's learning rate and schedule, no relative step.
        hyper |= {"scale_parameter": False, "relative_step": False, "warmup_init": False}
    elif issubclass(OPTIMIZERS[base].cls, Muon):  # AdamW's settings are its AdamW groups'
        hyper |= {"adamw_betas": (args.adam_beta1, args.adam_beta2), "adamw_eps": args.adam_epsilon}
    else:
        hyper |= {"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    if issubclass(OPTIMIZERS[base].cls, AdamWTernary) and args.adam_beta1 != TERNARY_BETAS[0]:
        # TrainingArguments cannot say whether adam_beta1 was chosen or left at 0.9: it is used.
        warnings.warn(
            f"{base} runs with adam_beta1={args.adam_beta1} as given; its own default is "
            f"{TERNARY_BETAS[0]}: at 0.9 a ternary first moment's rounding noise cost 6-10% of "
            "pretraining loss against fp32 AdamW (docs/results/ternary.md). Set "
            f"adam_beta1={TERNARY_BETAS[0]} to follow it.",
            stacklevel=2,
        )
    rank = options.pop("rank", None)
    return build_optimizer(
        model,
        base,
        lr=args.learning_rate,
        rank=rank,
        target_modules=getattr(args, "optim_target_modules", None),
        **options,
        **hyper,
    )


class SlimoptFactory:
    """What ``optimizer_cls_and_kwargs`` hands ``Trainer``: transformers instantiates it and
    calls it with the model and the keyword arguments, and it builds the optimizer by
    ``build_optimizer``."""

    def __call__(self, model: nn.Module, *, name: str, lr: float, **options: Any) -> SlimoptOptimizer:
        return build_optimizer(model, name, lr=lr, **options)


def optimizer_cls_and_kwargs(name: str, *, lr: float, **options: Any) -> tuple[type, dict[str, Any]]:
    """The pair for ``transformers.Trainer(optimizer_cls_and_kwargs=...)``.

    With it any Trainer, TRL's ``SFTTrainer`` among them, trains with slimopt optimizer ``name``,
    built for its model by ``build_optimizer(model, name, lr=lr, **options)``: transformers 5's
    Trainer calls such a factory with the model. The Trainer's ``learning_rate`` does not reach
    it: give ``lr`` here (its schedule then starts from it).

    Args:
        name: a slimopt or Hugging Face optimizer name.
        lr: the learning rate.
        **options: go to [build_optimizer][slimopt.build_optimizer] (``rank``, ``states``,
            ``weight_decay``, …).

    Returns:
        A factory class and its keyword arguments.

    Raises:
        ValueError: an unknown name, or a ``_layerwise`` one (layer-wise updates need
            [SlimoptTrainer][slimopt.integrations.transformers.SlimoptTrainer], which clips and
            accumulates inside backward).
    """
    base, layer_wise = split_name(name)
    if layer_wise:
        raise ValueError(
            f"{name!r}: layer-wise updates run inside backward, which only SlimoptTrainer arranges "
            f"(clipping, accumulation); use SlimoptTrainer(optimizer_name={name!r}), or {base!r} here"
        )
    return SlimoptFactory, {"name": name, "lr": lr, **options}


class SlimoptTrainer(Trainer):
    """``transformers.Trainer`` with a slimopt optimizer; everything else is Trainer's.

    Migrating from ``Trainer`` is one line: ``SlimoptTrainer(model, args, ...)`` with
    ``TrainingArguments(optim="galore_adamw_8bit", optim_target_modules=[...],
    optim_args="rank=128,...")`` reads the optimizer as Trainer does, or ``optimizer_name``
    names one of slimopt's. A name ending in ``_layerwise`` updates each parameter inside
    backward ([layerwise][slimopt.layerwise.layerwise]), with the Trainer's gradient accumulation
    and clipping. The [Hugging Face guide](../huggingface.md) has a full example.

    Args:
        *args: ``Trainer``'s positional arguments (``model``, ``args``, …).
        optimizer_name: a slimopt or Hugging Face optimizer name (None: ``args.optim``).
        refresh_from: layer-wise mode's option, for a ``_layerwise`` name: ``"step"`` or
            ``"micro_batch"``.
        **kwargs: ``Trainer``'s keyword arguments.

    Raises:
        ValueError: a name without a slimopt counterpart, or ``refresh_from`` without a
            ``_layerwise`` name.
    """

    def __init__(
        self, *args: Any, optimizer_name: str | None = None, refresh_from: str = "step", **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.optimizer_name = trainer_optimizer_name(self.args, optimizer_name)
        _, self.layerwise = split_name(self.optimizer_name)
        check_refresh_from(refresh_from, self.layerwise, f"use {self.optimizer_name}{LAYERWISE_SUFFIX}")
        self.refresh_from = refresh_from
        self.layerwise_handle: LayerwiseHandle | None = None
        # How DDP synchronizes the gradients (optim_args grad_sync), and the hook's state once
        # the first step has found the model wrapped in DDP (``training_step``).
        optim_args = parse_optim_args(getattr(self.args, "optim_args", None))
        self.grad_sync_mode = optim_args.get("grad_sync", "auto")
        self.grad_sync: GradientSync | None = None
        self._sync_registered = False

    def create_optimizer(self, model: nn.Module | None = None) -> SlimoptOptimizer:
        """Create the slimopt optimizer (once) and, for a ``_layerwise`` name, its hooks; raises
        ``ValueError`` for int8 weights in a run of several processes (they train in one) and
        for optim_args ``grad_sync=projected`` where it cannot run (``_check_grad_sync``)."""
        if self.optimizer is None:
            used = self.model if model is None else model
            if self.args.world_size > 1 and any(isinstance(p, Int8Weight) for p in used.parameters()):
                raise ValueError(f"{self.args.world_size} processes: {INT8_ONE_PROCESS}")
            # Under accelerate's FSDP2 the Trainer builds the optimizer before prepare() shards
            # the model (it cannot wait), so the weights it sees are whole.
            plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
            rows_split = plugin is not None and getattr(plugin, "fsdp_version", 1) == 2
            self.optimizer = create_optimizer(used, self.args, self.optimizer_name, rows_split=rows_split)
            self._check_grad_sync(self.optimizer)
            if self.layerwise:
                self.layerwise_handle = layerwise(
                    self.optimizer,
                    self.args.gradient_accumulation_steps,
                    max_grad_norm=self.args.max_grad_norm or None,
                    refresh_from=self.refresh_from,
                )
        return self.optimizer

    def training_step(self, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """Trainer's step; the first one, which finds ``model`` wrapped by accelerate, registers
        slimopt's gradient sync (``self.grad_sync``) on a ``DistributedDataParallel`` model:
        optim_args ``grad_sync`` auto (projections where the optimizer projects), projected or
        full."""
        if not self._sync_registered:
            self._sync_registered = True
            if isinstance(model, nn.parallel.DistributedDataParallel):
                optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
                self.grad_sync = sync_gradients(model, optimizer, self.grad_sync_mode)
        return super().training_step(model, *args, **kwargs)

    def _check_grad_sync(self, optimizer: SlimoptOptimizer) -> None:
        """Raise ``ValueError`` for optim_args ``grad_sync=projected`` where it cannot run: one
        process, FSDP2, layer-wise updates, an optimizer that needs whole gradients."""
        if self.grad_sync_mode != "projected":
            return
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        reason = optimizer_sync_error(optimizer)
        if reason is None and self.args.world_size == 1:
            reason = "there is one process: projections are synchronized among DDP's processes"
        elif reason is None and plugin is not None:
            reason = "FSDP reduce-scatters whole gradients itself"
        elif reason is None and self.layerwise:
            reason = "layer-wise updates run before DDP synchronizes"
        if reason is not None:
            raise ValueError(f"optim_args grad_sync=projected: {reason}; use grad_sync=auto or full")

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        # Layer-wise: the hooks clipped each tensor already; report the step's global norm
        # (ending a partial accumulation first, as the optimizer.step() that follows would).
        if self.layerwise_handle is None:
            return super()._clip_grad_norm(model)
        self.layerwise_handle.finish_step()
        return self.layerwise_handle.last_grad_norm

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if self.layerwise_handle is None:
            return super()._get_grad_norm(model, grad_norm)
        return self._clip_grad_norm(model) if grad_norm is None else grad_norm

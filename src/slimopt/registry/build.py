"""``build_optimizer``: from a model and an optimizer name to configured param groups, the
modules whose weights are projected chosen with Hugging Face's ``optim_target_modules``
semantics (``slimopt.targets``)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from slimopt.checks import number_error
from slimopt.optimizers import TACO, Muon, SlimoptOptimizer
from slimopt.options import PROJECTION_DEFAULTS
from slimopt.registry.names import HF_NAMES, OPTIMIZERS, OptimizerSpec, hugging_face_defaults, resolve_name
from slimopt.registry.ranks import default_rank, warn_if_projection_saves_nothing
from slimopt.sharding import split_by_rows
from slimopt.targets import target_weight_ids, warn_unknown_layouts
from slimopt.weight_formats import lost_int8_weights
from slimopt.weight_formats.int8 import INT8_ONE_PROCESS

# TACO's fallback for what is not a linear layer's matrix (embeddings, the output head, vectors).
TACO_FALLBACK = {"rule": "adamw", "states": "int8"}

FLIPPED_SIDES = {"left": "right", "right": "left"}
# The projection side of weights split by rows (FSDP2) when the user names none: the r×n basis
# is replicated, so projecting and projecting back stay local to each process's rows.
ROW_SPLIT_PROJ_TYPE = "right"


def build_optimizer(
    model: nn.Module,
    name: str,
    *,
    lr: float | None,
    rank: int | None = None,
    target_modules: str | list[str] | None = None,
    **options: Any,
) -> SlimoptOptimizer:
    """Optimizer ``name`` configured for ``model``, its parameters in named param groups.

    The groups, each named by ``group["name"]``, in this order (empty ones left out):

    - ``"projected"`` (projecting optimizers only): the weights of the selected linear modules, at
      rank ``rank``, with any projection ``options``;
    - ``"projected_transposed"``: transformers ``Conv1D`` weights (stored in × out) when
      ``proj_type`` names a side: they get the other one, so "left" is the output side of every
      layer;
    - ``"projected_experts"``: a mixture of experts' stacked 3-D expert weights, with
      ``experts=True``, each expert projected as its own matrix (out × in);
    - ``"unprojected"``: every other matrix, its moments stored as ``unprojected_states`` says;
    - ``"no_decay"``: 1-D parameters (biases and norms), without weight decay.

    A rank at which projection saves no state warns. Where FSDP2 has split the selected weights by
    rows and no ``proj_type`` is given, it is ``"right"`` (the basis on the unsplit side;
    [describe][slimopt.describe.describe] says why).

    Args:
        model: the model whose parameters the optimizer updates.
        name: one of [available_optimizers][slimopt.available_optimizers], or a Hugging Face
            ``optim`` name (``"galore_adamw_8bit"``, ``"adamw_torch"``, …) with Hugging Face's
            defaults.
        lr: learning rate (None only for Adafactor's relative step size).
        rank: the projection's rank, for projecting optimizers only (None: the name's own, as
            APOLLO-Mini's 1, or else a quarter of the smaller side most selected weights share,
            as in the GaLore paper).
        target_modules: which modules' weights are projected, as
            [select_target_modules][slimopt.select_target_modules] reads it (None: every linear
            layer but the output head).
        **options: go to the optimizer class: its hyperparameters (``weight_decay``, ``betas``, …)
            and options (``states``, ``update_proj_gap``, …), and ``unprojected_states``, the
            storage of the ``"unprojected"`` group's moments (default: as ``states``, or int8 for
            APOLLO-Mini).

    Returns:
        The optimizer, a [SlimoptOptimizer][slimopt.SlimoptOptimizer].

    Raises:
        ValueError: an unknown name, projection options on an optimizer that does not project, a
            target selection that matches nothing, or int8 weights that FSDP2 turned into plain
            ones.
    """
    lost = lost_int8_weights(model)
    if lost:
        raise ValueError(
            f"module {lost[0]!r} was made int8 (quantize_weights) but holds a plain weight now: FSDP2 "
            f"turns int8 weights into plain ones; {INT8_ONE_PROCESS}"
        )
    if name not in OPTIMIZERS and name in HF_NAMES:  # Hugging Face's spelling: its defaults
        options = {**hugging_face_defaults(name), **options}
        rank = options.pop("rank", None) if rank is None else rank
    name = resolve_name(name)
    spec = OPTIMIZERS[name]
    if spec.cls is TACO:
        return _build_taco(model, lr=lr, rank=rank, target_modules=target_modules, **options)
    if issubclass(spec.cls, Muon):
        return _build_muon(name, model, lr=lr, rank=rank, target_modules=target_modules, **options)
    unprojected = _unprojected_states(name, options)
    rank, projection = _projection_asked(name, rank, target_modules, options)
    return spec.cls(
        _named_groups(model, spec, rank, target_modules, projection, unprojected), lr=lr, **options
    )


def _named_groups(
    model: nn.Module,
    spec: OptimizerSpec,
    rank: int | None,
    target_modules: str | list[str] | None,
    projection: dict[str, Any],
    unprojected: dict[str, Any],
) -> list[dict[str, Any]]:
    """``build_optimizer``'s param groups for ``model`` in its order, empty ones left out."""
    # model.parameters() yields a tied parameter (an embedding shared with the output head) once.
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    projected_ids: set[int] = set()
    transposed_ids: set[int] = set()
    expert_ids: set[int] = set()
    if spec.projected:
        projected_ids, transposed_ids, expert_ids = target_weight_ids(model, target_modules)
        warn_unknown_layouts(model, params)
    projected = [p for i, p in params.items() if i in projected_ids]
    if spec.projected and projected:
        rank = _rank_for(spec, rank, projection, projected, expert_ids)
    flipped = _choose_side(projection, projected)
    transposed = [p for p in projected if id(p) in transposed_ids] if flipped else []
    experts = [p for p in projected if id(p) in expert_ids]
    linear_layout = [p for p in projected if not any(p is q for q in transposed + experts)]
    groups = [
        {"name": "projected", "params": linear_layout, "rank": rank, **projection},
        {
            "name": "projected_transposed",
            "params": transposed,
            "rank": rank,
            **projection,
            "proj_type": flipped,
        },
        {"name": "projected_experts", "params": experts, "rank": rank, **projection, "experts": True},
        {
            "name": "unprojected",
            "params": [p for i, p in params.items() if i not in projected_ids and p.dim() >= 2],
            **unprojected,
        },
        {"name": "no_decay", "params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def _unprojected_states(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The ``"unprojected"`` group's own storage of ``build_optimizer(model, name)``'s moments:
    ``unprojected_states`` (taken out of ``options``), else the name's default unless
    ``states`` is given (then it holds for every group). Raises ``ValueError`` for
    ``unprojected_states`` on an optimizer that projects nothing."""
    spec = OPTIMIZERS[name]
    states = options.pop("unprojected_states", None)
    if states is not None and not spec.projected:
        raise ValueError(f"{name} projects nothing, so unprojected_states means nothing: give states")
    if states is None and "states" not in options:
        states = spec.unprojected_states
    return {} if states is None else {"states": states}


def _projection_asked(
    name: str, rank: int | None, target_modules: str | list[str] | None, options: dict[str, Any]
) -> tuple[int | None, dict[str, Any]]:
    """The rank (None: ``default_rank``'s) and projection options of ``build_optimizer(model,
    name)``: those given, else the name's own (APOLLO-Mini's). Takes the projection options out
    of ``options``; raises ``ValueError`` for them, a rank or target modules on an optimizer
    that does not project, and for ``experts``, which ``build_optimizer`` sets itself."""
    spec = OPTIMIZERS[name]
    if "experts" in options:
        raise ValueError(
            "experts is not an option of build_optimizer: it puts a mixture of experts' stacked "
            "weights in their own group (projected_experts) with experts=True itself"
        )
    rank = spec.rank if rank is None else rank
    asked = {key: options.pop(key) for key in list(options) if key in PROJECTION_DEFAULTS}
    projection = {**dict(spec.options), **asked}  # the name's own options, unless given here
    if not spec.projected and (rank is not None or target_modules is not None or projection):
        given = ["rank"] * (rank is not None) + ["target_modules"] * (target_modules is not None)
        raise ValueError(
            f"optimizer {name!r} does not project gradients; remove {', '.join(given + list(projection))} "
            f"or choose one of: {', '.join(n for n, s in OPTIMIZERS.items() if s.projected)}"
        )
    return rank, projection


def _rank_for(
    spec: OptimizerSpec,
    rank: int | None,
    projection: dict[str, Any],
    projected: list[Tensor],
    expert_ids: set[int],
) -> int:
    """The rank of the ``projected`` weights: ``rank``, or ``default_rank`` of their matrices
    (each expert a matrix of its own: the rank and the savings are the experts'); warns when
    projection saves no state at it."""
    matrices = [m for p in projected for m in (p.detach().unbind(0) if id(p) in expert_ids else [p])]
    rank = default_rank(matrices) if rank is None else rank
    random = {**spec.cls.projection_defaults, **projection}.get("proj_method") == "random"
    warn_if_projection_saves_nothing(matrices, rank, stored_basis=not random)
    return rank


def _choose_side(projection: dict[str, Any], projected: list[Tensor]) -> str | None:
    """Set ``projection``'s ``proj_type`` where weights FSDP2 splits by rows need one, and return
    the side a transposed (``Conv1D``) weight takes instead of a named one (None: the same).

    Weights split by rows take their basis on the side FSDP2 does not split unless the user
    chose a side (one on the split rows is refused, naming this one); those rows are the stored
    matrix's whatever its layout. A side the user names ("left": the output side of a layer) is
    the other side of a transposed weight; the other proj_types choose by shape alike."""
    if any(split_by_rows(p) for p in projected) and "proj_type" not in projection:
        projection["proj_type"] = ROW_SPLIT_PROJ_TYPE
        return None
    return FLIPPED_SIDES.get(projection.get("proj_type", ""))


def _build_taco(
    model: nn.Module,
    *,
    lr: float | None,
    rank: int | None,
    target_modules: str | list[str] | None,
    **options: Any,
) -> SlimoptOptimizer:
    """``build_optimizer(model, "taco")``: the selected linear layers' weights in a group
    ``"taco"`` (``Conv1D`` ones in ``"taco_transposed"``), every other matrix in ``"fallback"``
    and vectors in ``"no_decay"``, both with ``TACO_FALLBACK`` (AdamW, int8 moments; override
    with ``fallback_states``) and the learning rate ``fallback_lr`` (default ``lr``): a TACO
    step moves one entry per column, an AdamW step every entry, so their best rates differ."""
    projection = [key for key in options if key in PROJECTION_DEFAULTS] + ["rank"] * (rank is not None)
    if projection:
        raise ValueError(f"taco does not project gradients; remove {', '.join(projection)}")
    fallback = {**TACO_FALLBACK, "states": options.pop("fallback_states", TACO_FALLBACK["states"])}
    fallback_lr = options.pop("fallback_lr", None)
    if fallback_lr is not None:
        errors = number_error("fallback_lr", fallback_lr)
        if errors:
            raise ValueError(errors[0])
        fallback["lr"] = float(fallback_lr)
    linear, transposed, experts, others, vectors = _matrices_and_the_rest(model, target_modules)
    groups = [
        {"name": "taco", "params": linear},
        {"name": "taco_transposed", "params": transposed, "transposed": True},
        {"name": "fallback", "params": experts + others, **fallback},
        {"name": "no_decay", "params": vectors, **fallback, "weight_decay": 0.0},
    ]
    rate = {} if lr is None else {"lr": lr}  # None: TACO's default
    return TACO([g for g in groups if g["params"]], **rate, **options)


def _build_muon(
    name: str,
    model: nn.Module,
    *,
    lr: float | None,
    rank: int | None,
    target_modules: str | list[str] | None,
    **options: Any,
) -> SlimoptOptimizer:
    """``build_optimizer(model, name)`` for a Muon name: the selected linear layers' weights in a
    group ``"muon"`` (``Conv1D`` ones in ``"muon_transposed"``, ``transposed=True``, so that the
    step's shape adjustment reads them as out × in; a mixture of experts' stacked weights in
    ``"muon_experts"``, each expert orthogonalized as its own matrix), every other trainable
    tensor in ``"adamw"`` (embeddings, the output head) and ``"no_decay"`` (vectors) with
    ``rule="adamw"`` (Moonlight's recipe), with ``adamw_betas`` and ``adamw_eps`` when given
    (AdamW's own defaults otherwise; Muon's ``eps`` is its iteration's). The GaLore names
    project the Muon groups at ``rank`` (``default_rank`` of their matrices when None) with the
    projection ``options``: Muon orthogonalizes the projected momentum. Muon's step takes
    ``adjust_lr_fn="match_rms_adamw"`` unless given, so that the one learning rate ``lr`` serves
    both rules (AdamW's RMS, Moonshot's matching)."""
    spec = OPTIMIZERS[name]
    if spec.projected:
        rank, projection = _projection_asked(name, rank, target_modules, options)
    else:
        asked = [key for key in options if key in PROJECTION_DEFAULTS] + ["rank"] * (rank is not None)
        if asked:
            raise ValueError(
                f"{name} does not project gradients; remove {', '.join(asked)} or choose one of: "
                f"{', '.join(n for n, s in OPTIMIZERS.items() if s.projected and issubclass(s.cls, Muon))}"
            )
        projection = {}
    options.setdefault("adjust_lr_fn", "match_rms_adamw")
    # AdamW's moments in the storage format's own blocks, unless a block size is given.
    adamw = {"rule": "adamw", "block_size": options.get("block_size")}
    for key in ("betas", "eps"):
        if f"adamw_{key}" in options:
            adamw[key] = options.pop(f"adamw_{key}")
    linear, transposed, experts, others, vectors = _matrices_and_the_rest(model, target_modules)
    flipped = None
    if spec.projected and linear + transposed + experts:
        expert_ids = {id(p) for p in experts}
        rank = _rank_for(spec, rank, projection, linear + transposed + experts, expert_ids)
        flipped = _choose_side(projection, linear + transposed + experts)
        projection = {"rank": rank, **projection}
    transposed_side = {"proj_type": flipped} if flipped else {}
    groups = [
        {"name": "muon", "params": linear, **projection},
        {
            "name": "muon_transposed",
            "params": transposed,
            **projection,
            **transposed_side,
            "transposed": True,
        },
        {"name": "muon_experts", "params": experts, **projection, "experts": True},
        {"name": "adamw", "params": others, **adamw},
        {"name": "no_decay", "params": vectors, **adamw, "weight_decay": 0.0},
    ]
    rate = {} if lr is None else {"lr": lr}  # None: Muon's default
    return spec.cls([g for g in groups if g["params"]], **rate, **options)


def _matrices_and_the_rest(
    model: nn.Module, target_modules: str | list[str] | None
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    """The trainable parameters of ``model`` for an optimizer of matrices with an AdamW
    fallback: the selected linear layers' weights (``slimopt.targets``) in ``nn.Linear``'s
    layout, in ``Conv1D``'s and a mixture of experts' stacked ones, every other tensor of two or
    more dimensions (embeddings, the output head) and the vectors."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    targets, transposed_ids, expert_ids = target_weight_ids(model, target_modules)
    plain = targets - transposed_ids - expert_ids
    return (
        [p for i, p in params.items() if i in plain],
        [p for i, p in params.items() if i in transposed_ids],
        [p for i, p in params.items() if i in expert_ids],
        [p for i, p in params.items() if i not in targets and p.dim() >= 2],
        [p for p in params.values() if p.dim() < 2],
    )

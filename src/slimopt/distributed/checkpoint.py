"""Distributed checkpoints of a model and its slimopt optimizer, written and read with
``torch.distributed.checkpoint`` (DCP): every process writes its own shards in parallel, and a
checkpoint loads into any number of processes.

A checkpoint is a DCP directory of tensors only (no pickled objects), under flat keys:

- ``model/<name>``: the model's state dict; FSDP2's DTensors are saved by shard and DCP
  reassembles or re-splits them on load.
- ``optimizer/groups`` and ``optimizer/<param>/scalars``: JSON (as uint8 tensors) of the param
  groups, with parameters named, and of each parameter's counters (step, seed, …).
- ``optimizer/<param>/<state key>``: a state tensor every process holds alike (a replicated
  parameter's, a projection basis, or APOLLO's limiter norm).
- ``optimizer/<param>/<state key>/shard <i> of <n>``: a state tensor of a parameter split by
  rows over n processes, as process i stores it (compressed blocks never straddle processes).

Loading into the same number of processes restores every stored tensor bit for bit, so the run
continues as if uninterrupted. Into another number (2 → 1, 1 → 2, …) each process decodes the
saved shards that overlap its rows to fp32 and encodes its own rows in its storage format, as
loading another storage format does: exact for fp32 states, within one quantization step for
compressed ones. ``export_model`` writes the whole model as one safetensors file.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from slimopt.core.state import CORRECTION, LIMITER, MOMENT_STEP, is_basis_key
from slimopt.core.tensors import values as own_values
from slimopt.files import move_into_place
from slimopt.optimizers import SlimoptOptimizer
from slimopt.sharding import barrier, initialized, local_view, process_rank

MODEL, OPTIMIZER = "model/", "optimizer/"
GROUPS = "optimizer/groups"
SHARD = "/shard "  # ``<key>/shard <i> of <n>``


def save(directory: str | Path, model: nn.Module, optimizer: SlimoptOptimizer) -> Path:
    """Write ``model`` and ``optimizer`` to the distributed (DCP) checkpoint ``directory``.

    Every process of the run calls this; they must share the file system. The checkpoint is
    written into a hidden sibling directory and renamed into place once every process has
    finished, so an interrupted save leaves no directory that looks complete and replaces nothing.

    Args:
        directory: the checkpoint's directory.
        model: the model (FSDP2's, DDP's or a plain one).
        optimizer: its slimopt optimizer.

    Returns:
        The checkpoint's path.

    Raises:
        TypeError: an optimizer that is not slimopt's.
    """
    _check_optimizer(optimizer)
    final = Path(directory)
    staging = final.parent / f".{final.name}.tmp"
    if process_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.parent.mkdir(parents=True, exist_ok=True)
    barrier()
    write(staging, model, optimizer)
    barrier()
    if process_rank() == 0:
        move_into_place(staging, final)
    barrier()
    return final


def write(directory: str | Path, model: nn.Module, optimizer: SlimoptOptimizer) -> None:
    """Write the checkpoint into ``directory`` as it is (no staging; ``save`` stages). Every
    process calls this. Raises ``TypeError`` for an optimizer that is not slimopt's."""
    _check_optimizer(optimizer)
    items = {f"{MODEL}{key}": value for key, value in model.state_dict().items()}
    items |= _optimizer_items(model, optimizer)
    with _one_process_is_intended():
        dcp.save(items, checkpoint_id=directory, no_dist=not initialized())


def load(directory: str | Path, model: nn.Module, optimizer: SlimoptOptimizer | None = None) -> None:
    """Load the distributed (DCP) checkpoint ``directory`` into ``model`` and ``optimizer``.

    Every process of the run calls this, whatever number of processes wrote the checkpoint. The
    optimizer must be built as the saved one was (same groups, parameters, projection); its
    storage formats may differ (moments are re-encoded).

    Args:
        directory: a directory [save][slimopt.distributed.checkpoint.save] wrote.
        model: the model, built and sharded as for training.
        optimizer: its slimopt optimizer (None: the model alone).

    Raises:
        ValueError: what does not match (a missing directory, other parameter names or shapes,
            other groups), named before anything is loaded.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"no checkpoint directory {str(directory)!r}")
    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    model_state = model.state_dict()
    _check_model(model_state, saved)
    targets = {f"{MODEL}{key}": value for key, value in model_state.items()}
    plan = _OptimizerLoad(model, optimizer, saved) if optimizer is not None else None
    if plan is not None:
        targets |= plan.targets
    with _one_process_is_intended():
        dcp.load(targets, checkpoint_id=directory, no_dist=not initialized())
    model.load_state_dict({key[len(MODEL) :]: targets[key] for key in targets if key.startswith(MODEL)})
    if plan is not None:
        plan.finish(targets)


def export_model(directory: str | Path, file: str | Path) -> Path:
    """Write the model of a distributed (DCP) checkpoint as one safetensors file of whole tensors.

    The file loads without torch.distributed (``safetensors.torch.load_file`` or
    ``load_model``), for inference or fine-tuning elsewhere. Runs in one process.

    Args:
        directory: a directory [save][slimopt.distributed.checkpoint.save] wrote.
        file: the safetensors file to write.

    Returns:
        The file's path.

    Raises:
        ValueError: ``directory`` is not a checkpoint directory.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"no checkpoint directory {str(directory)!r}")
    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    targets = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in saved.items()
        if key.startswith(MODEL) and hasattr(meta, "size")
    }
    with _one_process_is_intended():
        dcp.load(targets, checkpoint_id=directory, no_dist=True)
    file = Path(file)
    file.parent.mkdir(parents=True, exist_ok=True)
    save_file({key[len(MODEL) :]: value.contiguous() for key, value in targets.items()}, str(file))
    return file


def _optimizer_items(model: nn.Module, optimizer: SlimoptOptimizer) -> dict[str, Tensor]:
    names = _names(model, optimizer)
    groups = []
    for group in optimizer.param_groups:
        groups.append({**group, "params": [names[p] for p in group["params"]]})
    items = {GROUPS: _json_tensor(groups)}
    for param, name in names.items():
        state = optimizer.state.get(param, {})
        items[f"{OPTIMIZER}{name}/scalars"] = _json_tensor(
            {key: value for key, value in state.items() if not isinstance(value, Tensor)}
        )
        sharding = optimizer.engine.sharding_of(param)
        shard = "" if sharding is None else _shard_suffix(param)
        for key, value in state.items():
            if isinstance(value, Tensor):
                items[f"{OPTIMIZER}{name}/{key}{'' if _replicated(key) else shard}"] = value
    return items


class _OptimizerLoad:
    """What one process reads of a checkpoint's optimizer state, and how it is restored."""

    def __init__(self, model: nn.Module, optimizer: SlimoptOptimizer, saved: dict[str, Any]) -> None:
        _check_optimizer(optimizer)
        self.optimizer = optimizer
        self.names = _names(model, optimizer)
        self.saved = saved
        missing = [name for name in self.names.values() if f"{OPTIMIZER}{name}/scalars" not in saved]
        if GROUPS not in saved or missing:
            raise ValueError(
                "the checkpoint holds no optimizer state"
                + (f" for parameters {missing[:3]}" if missing and GROUPS in saved else "")
            )
        self.targets: dict[str, Tensor] = {GROUPS: _empty(saved[GROUPS])}
        self.resharded: dict[Tensor, int] = {}  # parameter → number of processes that saved it
        for param, name in self.names.items():
            self.targets[f"{OPTIMIZER}{name}/scalars"] = _empty(saved[f"{OPTIMIZER}{name}/scalars"])
            count = self._saved_count(name)
            own = _shard_suffix(param) if optimizer.engine.sharding_of(param) is not None else ""
            # The shard suffix of the keys to restore as they are: this process's own, or for a
            # whole parameter the one shard of a parameter one FSDP2 process saved ("0 of 1").
            wanted: str | None = own or _suffix(0, 1)
            if (count > 1 or own) and not own.endswith(f" of {count}"):
                wanted = None
                self.resharded[param] = count
            for key in self._keys(name):
                shard = key[key.index(SHARD) :] if SHARD in key else ""
                needed = shard == "" or shard == wanted or (wanted is None and self._overlaps(param, shard))
                if needed:
                    self.targets[key] = _empty(saved[key])

    def _keys(self, name: str) -> list[str]:
        prefix = f"{OPTIMIZER}{name}/"
        return [key for key in self.saved if key.startswith(prefix) and key != f"{prefix}scalars"]

    def _saved_count(self, name: str) -> int:
        counts = {int(key.rsplit(" of ", 1)[1]) for key in self._keys(name) if SHARD in key}
        return counts.pop() if counts else 1

    def _overlaps(self, param: Tensor, shard: str) -> bool:
        first, rows = _saved_rows(param.shape[0], shard)
        place, local = _own_rows(self.optimizer, param)
        return rows > 0 and first < place + local and place < first + rows

    def finish(self, loaded: dict[str, Tensor]) -> None:
        groups = _from_json(loaded[GROUPS])
        current = [[self.names[p] for p in group["params"]] for group in self.optimizer.param_groups]
        if [group["params"] for group in groups] != current:
            raise ValueError(
                "the checkpoint's optimizer groups hold other parameters than this optimizer's "
                f"(saved {[len(g['params']) for g in groups]} per group, here {[len(c) for c in current]}); "
                "build the optimizer as the saved run did"
            )
        index = {name: i for i, name in enumerate(n for names in current for n in names)}
        state_dict: dict[str, Any] = {"state": {}, "param_groups": []}
        for group in groups:
            hyper = {key: tuple(value) if isinstance(value, list) else value for key, value in group.items()}
            state_dict["param_groups"].append({**hyper, "params": [index[name] for name in group["params"]]})
        deferred = {}
        for param, name in self.names.items():
            scalars = _from_json(loaded[f"{OPTIMIZER}{name}/scalars"])
            tensors = {}
            for key, value in loaded.items():
                if key.startswith(f"{OPTIMIZER}{name}/") and key != f"{OPTIMIZER}{name}/scalars":
                    tensors[key[len(OPTIMIZER) + len(name) + 1 :]] = value
            if param in self.resharded:
                # Moments are restored after the basis they are expressed in.
                deferred[param] = (scalars.pop(MOMENT_STEP, None), tensors)
                tensors = {key: value for key, value in tensors.items() if _replicated(key)}
            else:
                tensors = {key.partition(SHARD)[0]: value for key, value in tensors.items()}
            if scalars or tensors:
                state_dict["state"][index[name]] = {**scalars, **tensors}
        saved_storage = [{key: group[key] for key in ("states", "block_size")} for group in groups]
        self.optimizer.load_state_dict(state_dict)
        group_of = {p: i for i, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        for param, (moment_step, tensors) in deferred.items():
            if moment_step is not None:
                self._reshard(param, saved_storage[group_of[param]], moment_step, tensors)

    def _reshard(self, param: Tensor, storage: dict[str, Any], moment_step: int, tensors: dict) -> None:
        """Decode the saved shards that overlap this process's rows, keep those rows, and encode
        them in this optimizer's format."""
        optimizer = self.optimizer
        count = self.resharded[param]
        rows = param.shape[0]
        place, local = _own_rows(optimizer, param)
        pieces: dict[str, list[Tensor]] = {}
        for shard_index in range(count):
            shard = _suffix(shard_index, count) if count > 1 else ""
            first, saved_rows = _saved_rows(rows, shard) if shard else (0, rows)
            start, stop = max(first, place), min(first + saved_rows, place + local)
            if start >= stop:
                continue
            stored = {
                key.partition(SHARD)[0]: value
                for key, value in tensors.items()
                if not _replicated(key) and (key.endswith(shard) if shard else SHARD not in key)
            }
            values = torch.Size((saved_rows, *own_values(param).shape[1:]))
            saved_state = {**stored, MOMENT_STEP: moment_step}
            shard = (values, rows if count > 1 else None)
            moments = optimizer.engine.decoded_saved(param, saved_state, shard, storage)
            if CORRECTION in stored:  # bf16 weights' 8-bit correction: rows, as the weights
                moments[CORRECTION] = stored[CORRECTION]
            for key, value in moments.items():
                pieces.setdefault(key, []).append(value[start - first : stop - first])
        moments = {key: torch.cat(parts) for key, parts in pieces.items()}
        correction = moments.pop(CORRECTION, None)
        optimizer.engine.store_moments(param, moments)
        optimizer.state[param][MOMENT_STEP] = moment_step
        if correction is not None and optimizer.engine.plan_of(param).corrects_weights:
            optimizer.state[param][CORRECTION] = correction


def _replicated(key: str) -> bool:
    """Whether every process holds the same state tensor ``key`` of a parameter split by rows:
    its basis, and APOLLO's limiter norm (of the whole tensor)."""
    return is_basis_key(key) or key == LIMITER


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, SlimoptOptimizer):
        raise TypeError(
            f"slimopt.distributed.checkpoint saves slimopt optimizers, got {type(optimizer).__name__}; "
            "for ZeroRedundancyOptimizer use consolidate_state_dict and torch.save"
        )


def _check_model(model_state: dict[str, Tensor], saved: dict[str, Any]) -> None:
    saved_names = {key[len(MODEL) :] for key in saved if key.startswith(MODEL)}
    missing, unexpected = sorted(set(model_state) - saved_names), sorted(saved_names - set(model_state))
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint is of another model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for key, value in model_state.items():
        shape = tuple(saved[f"{MODEL}{key}"].size)
        if shape != tuple(value.shape):
            raise ValueError(f"the checkpoint's {key} has shape {shape}, the model's {tuple(value.shape)}")


def _names(model: nn.Module, optimizer: SlimoptOptimizer) -> dict[Tensor, str]:
    """Each parameter of ``optimizer`` by its name in ``model``."""
    by_tensor = {param: name for name, param in model.named_parameters()}
    names = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param not in by_tensor:
                raise ValueError(f"optimizer parameter {tuple(param.shape)} is not a parameter of the model")
            names[param] = by_tensor[param]
    return names


def _place(param: Tensor) -> int:
    return param.device_mesh.get_local_rank()


def _shard_suffix(param: Tensor) -> str:
    return _suffix(_place(param), param.device_mesh.size())


def _suffix(place: int, count: int) -> str:
    return f"{SHARD}{place} of {count}"


def _saved_rows(rows: int, shard: str) -> tuple[int, int]:
    """First row and row count of saved shard ``shard`` (torch.chunk's split, as DTensor's)."""
    place, count = (int(part) for part in shard[len(SHARD) :].split(" of "))
    chunk = -(-rows // count)
    first = min(place * chunk, rows)
    return first, min(chunk, rows - first)


def _own_rows(optimizer: SlimoptOptimizer, param: Tensor) -> tuple[int, int]:
    """First row and row count this process holds of ``param``."""
    sharding = optimizer.engine.sharding_of(param)
    return (0 if sharding is None else sharding.offset), local_view(param).shape[0]


def _json_tensor(value: Any) -> Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).clone()


def _from_json(tensor: Tensor) -> Any:
    return json.loads(bytes(tensor.tolist()).decode())


def _empty(meta: Any) -> Tensor:
    return torch.empty(meta.size, dtype=meta.properties.dtype)


@contextmanager
def _one_process_is_intended() -> Iterator[None]:
    """Silence DCP's warning that it assumes one process: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield

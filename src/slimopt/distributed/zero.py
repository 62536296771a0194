"""ZeRO-1 over a slimopt optimizer: ``torch.distributed.optim.ZeroRedundancyOptimizer`` whose
state dicts load through slimopt's own loading.

``ZeroRedundancyOptimizer.load_state_dict`` copies each owned parameter's saved state into the
local optimizer as it is and then sets every group's options from the checkpoint, past the
local optimizer's ``load_state_dict``: a run resumed with ``states="int8"`` from fp32 moments
kept fp32 moments under groups that said fp32, and one resumed as bf16+8 from bf16 weights kept
no correction. Here this process's part of the state dict goes through the slimopt optimizer's
``load_state_dict`` (checks, another storage format re-encoded, its own ``param_rounding`` and
``fused``), and the groups keep what that loading keeps.

The local optimizer is given each parameter's place in the whole model, so that its random draws
and refresh staggering do not depend on which parameters this process owns.

Under projected gradient sync (``slimopt.distributed.grad_sync``) every process projects every
matrix's gradient, so every process needs every basis: a second optimizer, the follower
(``follow_bases``), keeps the bases and step counts of the projected matrices other processes
own, as their owners' steps keep them from the same synchronized gradient (``Engine.follow``),
without moments. It starts from the owners' (broadcast once, and again after a load).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.distributed.optim import ZeroRedundancyOptimizer

from slimopt.core.plan import Place
from slimopt.core.state import COUNTERS, MOMENT_STEP, is_basis_key
from slimopt.optimizers import SlimoptOptimizer
from slimopt.options import OWN_KEYS, STORAGE_KEYS


class SlimoptZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
    """``ZeroRedundancyOptimizer`` over a slimopt optimizer class (``zero_redundancy_optimizer``
    builds it) whose local optimizer takes ``places``, each parameter's place in the whole
    model; ``load_state_dict`` differs too (see the module docstring)."""

    def __init__(self, params: Any, places: Mapping[Tensor, Place], **options: Any) -> None:
        self._places = places  # read by _init_local_optimizer, which the constructor calls
        self._following = False  # whether follow_bases was called (every process calls it)
        self.follower: SlimoptOptimizer | None = None  # the bases this process follows
        super().__init__(params, **options)

    def _init_local_optimizer(self) -> None:
        """torch's construction of the local optimizer (also after ``add_param_group``, which
        assigns the parameters anew), which then takes the places of the whole model; a
        follower is made anew for the new assignment."""
        super()._init_local_optimizer()
        self.optim.engine.keep_places(self._places)
        if self._following:
            self._following, self.follower = False, None
            self.follow_bases()

    def follow_bases(self) -> SlimoptOptimizer | None:
        """The follower: an optimizer of this process that keeps the bases and step counts of the
        projected matrices other processes own (made once, every process calling this together:
        it starts from the owners' bases, broadcast); None when there are none."""
        if not self._following:
            self._following = True
            owner = self._param_to_rank
            groups = [
                {**group, "params": [p for p in group["params"] if owner[p] != self.rank]}
                for group in self.param_groups
                if "rank" in group
            ]
            groups = [group for group in groups if group["params"]]
            if groups:
                self.follower = self._optim_constructor(groups, **self._optim_defaults)
                self.follower.engine.keep_places(self._places)
            self._share_bases()
        return self.follower

    def local_optimizers(self) -> list[SlimoptOptimizer]:
        """The slimopt optimizers of this process: the local one, and the follower if any."""
        return [self.optim] if self.follower is None else [self.optim, self.follower]

    def step(self, closure: Any = None) -> Any:
        """ZeRO's step (this process's parameters updated and broadcast); then the follower
        keeps the bases of the others' as their owners just did."""
        loss = super().step(closure)
        if self.follower is not None:
            self.follower.engine.follow()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or set to None) every gradient; none holds a synchronized projection any more."""
        for optimizer in self.local_optimizers():
            optimizer.engine.packed_gradients.clear()
        super().zero_grad(set_to_none)

    def _share_bases(self) -> None:
        """Every process's follower takes the bases and counters (not the moments) of the
        projected matrices it follows from their owners: one broadcast from each process, which
        every process takes part in."""
        projected = [p for group in self.param_groups if "rank" in group for p in group["params"]]
        for rank in range(torch.distributed.get_world_size(self.process_group)):
            owned = [p for p in projected if self._param_to_rank[p] == rank]
            mine = rank == self.rank
            payload = [[_shared(self.optim.state.get(p, {})) for p in owned] if mine else None]
            source = torch.distributed.get_global_rank(self.process_group, rank)
            torch.distributed.broadcast_object_list(payload, src=source, group=self.process_group)
            if not mine and self.follower is not None:
                for param, state in zip(owned, payload[0], strict=True):
                    self.follower.state[param] = {
                        key: _to(value, param.device) for key, value in state.items()
                    }
        if self.follower is not None:
            self.follower.engine.replan()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state dict (``consolidate_state_dict``, then ``state_dict``): this
        process's parameters through the local slimopt optimizer's ``load_state_dict``, which
        raises ``ValueError`` as it does; every group then holds the state dict's options but
        the storage and rounding the local optimizer keeps."""
        self.optim.load_state_dict(self._local_part(state_dict))
        if self._following:  # the loaded bases of the matrices it follows
            if self.follower is not None:
                self.follower.state.clear()
            self._share_bases()
        kept = [{key: group[key] for key in (*STORAGE_KEYS, *OWN_KEYS)} for group in self.optim.param_groups]
        for group, saved, own in zip(self.param_groups, state_dict["param_groups"], kept, strict=True):
            group.update({key: value for key, value in saved.items() if key != "params"} | own)
        for group, local in zip(self.param_groups, self.optim.param_groups, strict=True):
            local.update({key: value for key, value in group.items() if key != "params"})

    def _local_part(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The part of the consolidated ``state_dict`` (indexed over every process's parameters)
        of the parameters this process owns, indexed as the local optimizer's own."""
        everyone = chain.from_iterable(group["params"] for group in self.param_groups)
        index = {param: i for i, param in enumerate(everyone)}
        saved_state, state, groups = state_dict["state"], {}, []
        mine = 0
        for saved, local in zip(state_dict["param_groups"], self.optim.param_groups, strict=True):
            ids = []
            for param in local["params"]:
                if index[param] in saved_state:
                    state[mine] = saved_state[index[param]]
                ids.append(mine)
                mine += 1
            groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}


# A state key's name within a unit: an expert's keys start with its index.
_EXPERT = re.compile(r"^expert\d+\.")


def _shared(state: Mapping[str, Any]) -> dict[str, Any]:
    """What a follower takes of an owner's ``state``: the counters but the moments' age, and the
    basis parts (tensors on the CPU, to be sent)."""
    shared = {}
    for key, value in state.items():
        name = _EXPERT.sub("", key)
        if (name in COUNTERS and name != MOMENT_STEP) or is_basis_key(name):
            shared[key] = value.cpu() if isinstance(value, Tensor) else value
    return shared


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, Tensor) else value

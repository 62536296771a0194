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
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import Any

from torch import Tensor
from torch.distributed.optim import ZeroRedundancyOptimizer

from slimopt.core.plan import Place
from slimopt.options import OWN_KEYS, STORAGE_KEYS


class SlimoptZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
    """``ZeroRedundancyOptimizer`` over a slimopt optimizer class (``zero_redundancy_optimizer``
    builds it) whose local optimizer takes ``places``, each parameter's place in the whole
    model; ``load_state_dict`` differs too (see the module docstring)."""

    def __init__(self, params: Any, places: Mapping[Tensor, Place], **options: Any) -> None:
        self._places = places  # read by _init_local_optimizer, which the constructor calls
        super().__init__(params, **options)

    def _init_local_optimizer(self) -> None:
        """torch's construction of the local optimizer (also after ``add_param_group``), which
        then takes the places of the whole model."""
        super()._init_local_optimizer()
        self.optim.engine.keep_places(self._places)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state dict (``consolidate_state_dict``, then ``state_dict``): this
        process's parameters through the local slimopt optimizer's ``load_state_dict``, which
        raises ``ValueError`` as it does; every group then holds the state dict's options but
        the storage and rounding the local optimizer keeps."""
        self.optim.load_state_dict(self._local_part(state_dict))
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

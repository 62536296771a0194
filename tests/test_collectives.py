"""Every collective slimopt issues has its tensors on the device its backend needs.

NCCL takes only CUDA tensors, gloo CPU ones; a vote built with ``torch.tensor([...])`` lives on
the CPU, which gloo accepts and NCCL rejects, so CPU tests alone cannot see the mistake. Here two
gloo processes train (FSDP2 with a skipped step, refreshes, layer-wise clipping; Muon under FSDP2;
DDP with shared refreshes and projected gradient sync; the training loop's loss sum) with
torch.distributed's tensor collectives wrapped by a checker, under two policies:

- ``gloo``: every tensor slimopt hands to a collective is on the CPU;
- ``nccl`` (pretended on the CPU): every such tensor was put on the group's device by
  ``slimopt.collectives.to_group_device`` (under real NCCL: this process's GPU), which the test
  marks instead of moving, since there is no GPU to move to.

Collectives that torch issues itself (FSDP2's all-gathers, DCP) are not slimopt's to place.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import slimopt
import slimopt.collectives
from benchmarks.processes import free_port

from .conftest import in_process_group, run_ranks
from .support import token_batch

WORLD = 2
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
)
PLACED = "_slimopt_on_group_device"


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [item for item in value if isinstance(item, torch.Tensor)]
    return found


class Checker:
    """Wraps torch.distributed's tensor collectives; records who called each one from slimopt
    and every tensor that was not where ``policy`` needs it."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.calls: set[str] = set()
        self.callers: set[str] = set()  # every slimopt function on the way to a collective
        self.misplaced: list[str] = []

    def wrap(self, patch: pytest.MonkeyPatch) -> None:
        for name in COLLECTIVES:
            original = getattr(dist, name)

            def checked(*args, _original=original, _name=name, **kwargs):
                caller = sys._getframe(1)
                module = caller.f_globals.get("__name__", "")
                if module.startswith("slimopt"):
                    where = f"{_name} in {module}.{caller.f_code.co_name}"
                    self.calls.add(where)
                    self.callers |= _slimopt_callers(caller)
                    for tensor in _tensors(args, kwargs):
                        if not self._placed(tensor):
                            self.misplaced.append(f"{where}: {tensor.device} {tuple(tensor.shape)}")
                return _original(*args, **kwargs)

            patch.setattr(dist, name, checked)
        if self.policy == "nccl":
            patch.setattr(slimopt.collectives, "to_group_device", _mark)

    def _placed(self, tensor: torch.Tensor) -> bool:
        if self.policy == "gloo":
            return tensor.device.type == "cpu"
        return getattr(tensor, PLACED, False)


def _slimopt_callers(frame) -> set[str]:
    names = set()
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("slimopt"):
            names.add(frame.f_code.co_name)
        frame = frame.f_back
    return names


def _mark(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``to_group_device`` under the pretended NCCL policy: a view (the same memory) marked as
    placed, where real NCCL would copy to the GPU."""
    view = tensor.view_as(tensor)
    setattr(view, PLACED, True)
    return view


def _model() -> torch.nn.Module:
    from slimopt.models import build_llama

    torch.manual_seed(0)
    return build_llama((64, 172, 4, 2), 257, max_seq_len=32)


def _batch(step: int, rank: int) -> torch.Tensor:
    return token_batch(step, vocab=257)[rank::WORLD]


def _fsdp2(rank: int) -> None:
    """FSDP2: a step skipped for a NaN gradient (device flags voted on), refreshes (sketches
    all-reduced), an all-zero gradient at a refresh (agreed on), then layer-wise with per-tensor
    clipping (norms all-reduced, finiteness agreed per tensor)."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = slimopt.build_optimizer(model, "galore_adamw8bit", lr=3e-3, rank=8, update_proj_gap=2)
    for step in range(4):
        batch = _batch(step, rank)
        model(input_ids=batch, labels=batch).loss.backward()
        params = list(model.parameters())
        if step == 1:
            params[3].grad.to_local().fill_(float("nan"))
        if step == 2:
            params[5].grad.to_local().zero_()
        optimizer.step()
        optimizer.zero_grad()
    handle = slimopt.layerwise(optimizer, max_grad_norm=0.5)
    for step in range(4, 6):
        batch = _batch(step, rank)
        model(input_ids=batch, labels=batch).loss.backward()
    handle.remove()


def _fsdp2_muon(rank: int) -> None:
    """Muon under FSDP2: each matrix's step gathered to its owner, orthogonalized there and its
    rows scattered back."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    optimizer = slimopt.build_optimizer(model, "muon", lr=3e-3)
    for step in range(2):
        batch = _batch(step, rank)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _ddp_spread(rank: int) -> None:
    """DDP with the refreshes shared out (each basis computed once, its status and factors
    broadcast) and the gradients synchronized as projections (slimopt's communication hook)."""
    model = _model()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = slimopt.build_optimizer(model, "galore_adamw", lr=3e-3, rank=8, update_proj_gap=2)
    slimopt.distributed.spread_refreshes(optimizer)
    slimopt.distributed.sync_gradients(wrapped, optimizer, "projected")
    for step in range(3):
        batch = _batch(step, rank)
        wrapped(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _loop_sum() -> None:
    from slimopt.train.parallel import Parallel

    total = Parallel("ddp", dist.get_rank(), WORLD).sum([1.0, 0.0])
    assert total == [float(WORLD), 0.0]


def _worker(rank: int, port: int, policy: str, out: str) -> None:
    in_process_group(rank, WORLD, port, out, lambda: _checked(rank, policy))


def _checked(rank: int, policy: str) -> dict:
    """Every scenario's collectives under ``policy``'s checker: who called them, and what was
    misplaced."""
    checker = Checker(policy)
    with pytest.MonkeyPatch.context() as patch, pytest.warns(RuntimeWarning):
        checker.wrap(patch)
        _fsdp2(rank)
        _fsdp2_muon(rank)
        _ddp_spread(rank)
        _loop_sum()
    return {
        "calls": sorted(checker.calls),
        "callers": sorted(checker.callers),
        "misplaced": checker.misplaced,
    }


@pytest.mark.slow  # two processes, twice: about 40 s
@pytest.mark.parametrize("policy", ["gloo", "nccl"])
def test_every_collective_has_its_tensors_on_the_backends_device(policy: str, tmp_path: Path) -> None:
    for result in run_ranks(_worker, (free_port(), policy, str(tmp_path)), WORLD, tmp_path, timeout=300):
        assert not result["misplaced"], result["misplaced"]
        calls = set(result["calls"])
        # The collectives the CPU tensors of the defect went through, and the others: each was
        # reached, so the check is not vacuous.
        expected = {
            "all_reduce in slimopt.collectives.all_reduce",
            "all_reduce in slimopt.collectives.all_reduce_async",
            "broadcast in slimopt.collectives.broadcast",
            "gather in slimopt.collectives.gather",
            "scatter in slimopt.collectives.scatter",
        }
        assert calls == expected, calls  # no collective of slimopt's bypasses the helpers
        # Each place the defect's CPU tensors came from was reached: device flags voted on, a
        # decision agreed on, a gradient norm, refresh sketches, a shared basis and its status,
        # the training loop's sum, a bucket of gradients and projections (DDP's hook).
        reached = {"finite_flags", "all_agree", "gradient_norm", "gram", "compute_on_owner", "sum", "reduce"}
        reached |= {"on_owner"}  # Muon's matrices, orthogonalized by one process under FSDP2
        assert reached <= set(result["callers"]), result["callers"]


def test_the_group_device_is_the_gpu_under_nccl_and_the_cpu_otherwise(monkeypatch) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert slimopt.collectives.group_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert slimopt.collectives.group_device() == torch.device("cpu")

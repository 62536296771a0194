"""Projected gradient sync (``slimopt.distributed.sync_gradients``) on 2 gloo processes: it
trains as DDP's whole-gradient sync does, for every GaLore storage and rule, stacked experts and
GPT-2's transposed layers; with micro-batches under ``no_sync``; its gradients clip by the norm
of what the optimizer reads; a misuse of its packed gradients raises; and the bytes it counts
are the bytes that cross the loopback interface."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import slimopt
import slimopt.codecs.slicing
import slimopt.core.seeds
import slimopt.projection
from benchmarks.architectures import decoder
from benchmarks.processes import free_port
from slimopt.distributed import sync_gradients

from .conftest import in_process_group, run_ranks
from .support import relative_error, token_batch

WORLD = 2
STEPS = 6
NAMES = ["galore_adamw", "galore_adamw8bit", "galore_adamw_ternary", "galore_adafactor"]
# Refreshes every 3 steps, staggered: most steps synchronize some matrices whole, some projected.
OPTIONS = {"rank": 32, "update_proj_gap": 3}
# fp32 moments: only the order of the sums differs; int8 ones round a few values otherwise.
TOLERANCES = {"galore_adamw": 1e-5, "galore_adafactor": 1e-5, "galore_adamw8bit": 1e-4}


def _llama() -> torch.nn.Module:
    from slimopt.models import build_llama

    torch.manual_seed(0)
    return build_llama((64, 172, 4, 2), 257, max_seq_len=32)


def _family(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return decoder(family, layers=1)


def _train(
    model: torch.nn.Module,
    name: str,
    mode: str,
    rank: int,
    *,
    accumulation: int = 1,
    clip: float = 0.0,
    loopback: bool = False,
    stagger: bool = True,
) -> dict:
    """``STEPS`` steps of DDP over ``model`` with gradient sync ``mode``: the parameters, the
    bytes sent per step, and with ``clip`` the norms the clip saw beside the norm of what the
    optimizer reads, found without DDP; with ``loopback`` the bytes the steps sent over the
    loopback interface (``_loopback_sent``)."""
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = slimopt.build_optimizer(model, name, lr=3e-3, **OPTIONS, stagger=stagger)
    sync = sync_gradients(ddp, optimizer, mode)
    sent, norms, expected = [], [], []
    dist.barrier()
    before = _loopback_sent() if loopback else 0
    for step in range(STEPS):
        batch = token_batch(step, (4 * accumulation, 32), vocab=model.config.vocab_size)[rank::WORLD]
        if clip:
            expected.append(_norm_read(model, optimizer, batch))
        for micro in range(accumulation):
            rows = batch[micro * 2 : (micro + 1) * 2]
            context = ddp.no_sync() if micro < accumulation - 1 else contextlib.nullcontext()
            with context:
                (ddp(input_ids=rows, labels=rows).loss / accumulation).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
        sent.append(sync.take_sent())
    dist.barrier()
    parameters = {key: value.detach().clone() for key, value in model.named_parameters()}
    run = {"parameters": parameters, "sent": sent, "norms": norms, "expected": expected, "mode": sync.mode}
    return run | ({"loopback": _loopback_sent() - before} if loopback else {})


def _norm_read(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """The norm of what this step's optimizer reads, from this process's gradients averaged by
    hand: a matrix's projection into its basis where its step does not need it whole."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = torch.autograd.grad(model(input_ids=batch, labels=batch).loss, params)
    total = 0.0
    for group in optimizer.param_groups:
        for param, grad in zip(group["params"], grads[: len(group["params"])], strict=True):
            dist.all_reduce(grad)
            grad /= WORLD
            if not optimizer.engine.needs_whole_gradient(param, group):
                grad = slimopt.projection.project(grad, optimizer.engine.basis(param, group))
            total += float(grad.double().square().sum())
        grads = grads[len(group["params"]) :]
    return total**0.5


def _loopback_sent() -> int:
    """Bytes sent over the loopback interface by every process of this machine so far."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def _misuse(rank: int) -> dict:
    """What each misuse of packed gradients does, each on a model of its own (an error inside
    backward leaves DDP's reduction unfinished): a load between backward and step, a second
    synchronized backward before the step, a backward after a step without zero_grad; and that a
    step skipped with the model's own zero_grad (an AMP grad scaler's) is no misuse."""
    batch = token_batch(0, vocab=257)[rank::WORLD]
    messages = {}
    for case in ("load", "second backward", "skipped step", "no zero_grad"):
        model = _llama()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = slimopt.build_optimizer(model, "galore_adamw", lr=3e-3, **OPTIONS)
        sync_gradients(ddp, optimizer, "projected")

        def backward(ddp: torch.nn.Module = ddp) -> None:
            ddp(input_ids=batch, labels=batch).loss.backward()

        backward()  # the first step synchronizes whole gradients: no basis yet
        optimizer.step()
        optimizer.zero_grad()
        backward()  # projections, packed
        try:
            if case == "load":
                optimizer.load_state_dict(optimizer.state_dict())
            elif case == "second backward":
                backward()
            elif case == "skipped step":
                model.zero_grad()  # the packed projections are gone with the gradients
                backward()
                optimizer.step()
            else:
                optimizer.step()
                backward()
            messages[case] = None
        except (RuntimeError, ValueError) as error:
            messages[case] = str(error)
    return messages


def _zero1(name: str, mode: str, rank: int, out: str, resume_at: int | None = None) -> dict:
    """``STEPS`` steps under ZeRO-1 (``zero_redundancy_optimizer``) with gradient sync ``mode``;
    with ``resume_at``, saved there (the consolidated state dict) and resumed by a new model,
    optimizer and sync. The parameters, and the bases this process keeps."""
    model = _llama()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = slimopt.distributed.zero_redundancy_optimizer(model, name, lr=3e-3, **OPTIONS)
    sync_gradients(ddp, optimizer, mode)
    for step in range(STEPS):
        if step == resume_at:
            optimizer.consolidate_state_dict(to=0)
            if rank == 0:
                torch.save(optimizer.state_dict(), Path(out) / "zero1.pt")
            dist.barrier()
            saved = torch.load(Path(out) / "zero1.pt", weights_only=True)
            weights = model.state_dict()
            model = _llama()
            model.load_state_dict(weights)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            optimizer = slimopt.distributed.zero_redundancy_optimizer(model, name, lr=3e-3, **OPTIONS)
            sync_gradients(ddp, optimizer, mode)
            optimizer.load_state_dict(saved)
        batch = token_batch(step, vocab=257)[rank::WORLD]
        ddp(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    bases = sum(
        any(key.startswith("basis") for key in state)
        for local in optimizer.local_optimizers()
        for state in local.state.values()
    )
    parameters = {key: value.detach().clone() for key, value in model.named_parameters()}
    return {"parameters": parameters, "bases": bases}


def _worker(rank: int, port: int, out: str) -> None:
    in_process_group(rank, WORLD, port, out, lambda: _results(rank, out))


def _results(rank: int, out: str) -> dict:
    results = {}
    for name in NAMES:
        for mode in ("full", "projected"):
            results[name, mode] = _train(_llama(), name, mode, rank)
    with pytest.MonkeyPatch.context() as patch:  # other random draws: ternary's spread
        seed = slimopt.core.seeds.step_seed
        patch.setattr(slimopt.core.seeds, "step_seed", lambda state: seed(state) + 7919)
        results["galore_adamw_ternary", "other draws"] = _train(
            _llama(), "galore_adamw_ternary", "full", rank
        )
    for family in ("mixtral", "gpt2"):
        for mode in ("full", "projected"):
            results[family, mode] = _train(_family(family), "galore_adamw", mode, rank)
    for mode in ("full", "projected"):
        results["accumulated", mode] = _train(_llama(), "galore_adamw", mode, rank, accumulation=2)
        with pytest.MonkeyPatch.context() as patch:  # matrices of over 4096 elements by row slices
            patch.setattr(slimopt.codecs.slicing, "SLICE_NUMEL", 4096)
            results["row slices", mode] = _train(_llama(), "galore_adamw8bit", mode, rank)
        results["clipped", mode] = _train(_llama(), "galore_adamw", mode, rank, clip=1e-3)
        run = _train(_llama(), "galore_adamw", mode, rank, loopback=True)
        results["loopback", mode] = (sum(run["sent"]), run["loopback"])
    results["unstaggered"] = _train(_llama(), "galore_adamw", "projected", rank, stagger=False)
    results["misuse"] = _misuse(rank)
    for name in ("galore_adamw", "galore_adamw8bit"):
        for mode in ("full", "projected"):
            results["zero1", name, mode] = _zero1(name, mode, rank, out)
        results["zero1", name, "resumed"] = _zero1(name, "projected", rank, out, resume_at=3)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("grad_sync")
    return run_ranks(_worker, (free_port(), str(out)), WORLD, out, timeout=600)


@pytest.mark.slow  # two processes: about 40 s
@pytest.mark.parametrize("name", NAMES)
def test_projected_sync_trains_as_full_sync_does(ranks: list[dict], name: str) -> None:
    full, projected = ranks[0][name, "full"], ranks[0][name, "projected"]
    assert projected["mode"] == "projected"
    for key, value in projected["parameters"].items():  # the replicas agree bit for bit
        assert torch.equal(value, ranks[1][name, "projected"]["parameters"][key]), key
    error = relative_error(projected["parameters"], full["parameters"])
    if name == "galore_adamw_ternary":  # stochastic rounding: closer than other random draws are
        other = ranks[0][name, "other draws"]["parameters"]
        assert error < relative_error(other, full["parameters"])
    else:
        assert error < TOLERANCES[name]
    # The first step has no basis yet and sends every gradient whole; the later ones send less.
    assert projected["sent"][0] == full["sent"][0]
    assert all(p < f for p, f in zip(projected["sent"][1:], full["sent"][1:], strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mixtral", "gpt2", "accumulated", "row slices"])
def test_experts_transposed_layers_micro_batches_and_row_slices_sync_projected_too(
    ranks: list[dict], case: str
) -> None:
    full, projected = ranks[0][case, "full"], ranks[0][case, "projected"]
    tolerance = TOLERANCES["galore_adamw8bit"] if case == "row slices" else 1e-5
    assert relative_error(projected["parameters"], full["parameters"]) < tolerance
    assert sum(projected["sent"]) < sum(full["sent"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["galore_adamw", "galore_adamw8bit"])
def test_under_zero1_every_process_follows_every_basis_and_resumes_exactly(ranks: list[dict], name) -> None:
    """ZeRO-1 with projected sync trains as with full sync; every process keeps every matrix's
    basis (its own and the others', followed), and a run resumed from a consolidated state
    dict (the followers take the loaded bases from their owners) repeats the uninterrupted
    one bit for bit."""
    full, projected = ranks[0]["zero1", name, "full"], ranks[0]["zero1", name, "projected"]
    assert relative_error(projected["parameters"], full["parameters"]) < TOLERANCES[name]
    for rank in ranks:  # 14 projected matrices: every process has all their bases
        assert rank["zero1", name, "projected"]["bases"] == 14
        assert rank["zero1", name, "full"]["bases"] < 14
    resumed = ranks[0]["zero1", name, "resumed"]["parameters"]
    assert all(torch.equal(resumed[key], value) for key, value in projected["parameters"].items())


@pytest.mark.slow
def test_a_clip_sees_the_norm_of_what_the_optimizer_reads(ranks: list[dict]) -> None:
    """The clip's global norm is that of the projections and the whole gradients the optimizer
    reads, as averaged by hand; at the first step (no basis yet: every gradient whole) it is
    full sync's."""
    full, projected = ranks[0]["clipped", "full"], ranks[0]["clipped", "projected"]
    assert projected["norms"] == pytest.approx(projected["expected"], rel=1e-5)
    assert projected["norms"][0] == pytest.approx(full["norms"][0], rel=1e-6)


@pytest.mark.slow
def test_the_bytes_counted_are_the_bytes_sent(ranks: list[dict]) -> None:
    for mode in ("full", "projected"):
        counted, measured = ranks[0]["loopback", mode]
        # Each of the 2 processes sends its all-reduce's bytes once; gloo's headers and the
        # barriers add a little.
        assert WORLD * counted <= measured < WORLD * counted * 1.02 + 100_000, mode


@pytest.mark.slow
def test_the_planner_counts_the_bytes_exactly(ranks: list[dict], tmp_path: Path) -> None:
    """``slimopt memory --distributed ddp``'s gradient-sync bytes are the hook's counts: full
    sync's at every step; projected sync's at a step that refreshes no basis, and on average
    over a gap of update_proj_gap steps, in which each matrix is refreshed (sent whole) once."""
    from slimopt.planner import plan_memory

    _llama().config.save_pretrained(tmp_path)
    plan = plan_memory(
        str(tmp_path), "galore_adamw", dtype="fp32", vocab_size=257, seq_len=32, distributed="ddp",
        processes=WORLD, **OPTIONS,
    )  # fmt: skip
    sync = plan.grad_sync
    assert ranks[0]["galore_adamw", "full"]["sent"] == [sync.full] * STEPS
    unstaggered = ranks[0]["unstaggered"]["sent"]  # every basis refreshed at steps 1 and 4
    assert unstaggered == [sync.full, sync.steady, sync.steady, sync.full, sync.steady, sync.steady]
    gap = OPTIONS["update_proj_gap"]
    staggered = ranks[0]["galore_adamw", "projected"]["sent"]
    assert sum(staggered[1 : 1 + gap]) == pytest.approx(gap * sync.per_step, rel=1e-12)
    assert (
        "gradient sync per step and process (ddp): full 0.5 MiB; projected 0.4 MiB on average"
        in plan.report()
    )


@pytest.mark.slow
def test_misusing_packed_gradients_raises(ranks: list[dict]) -> None:
    messages = ranks[0]["misuse"]
    assert "load before backward, or call zero_grad() first" in messages["load"]
    assert messages["skipped step"] is None
    for case in ("second backward", "no zero_grad"):
        assert "holds a synchronized projection" in messages[case]
        assert "no_sync()" in messages[case]


def test_what_cannot_sync_projections_is_refused_in_one_line(one_process_group) -> None:
    model = _llama()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    refusals = {
        "apollo_adamw": "scales each raw gradient by its projected direction",
        "taco": "taco sketches each whole gradient",
        "adamw8bit": "projects no gradient",
    }
    for name, reason in refusals.items():
        optimizer = slimopt.build_optimizer(model, name, lr=1e-3)
        with pytest.raises(ValueError, match=f"projected gradient sync: .*{reason}.*; use full"):
            sync_gradients(ddp, optimizer, "projected")
    optimizer = slimopt.build_optimizer(model, "galore_adamw", lr=1e-3)
    with pytest.raises(ValueError, match="unknown gradient sync 'half'; valid: auto, full, projected"):
        sync_gradients(ddp, optimizer, "half")
    with pytest.raises(TypeError, match="needs a DistributedDataParallel model, got LlamaForCausalLM"):
        sync_gradients(model, optimizer)
    with pytest.raises(TypeError, match="needs a slimopt optimizer, got AdamW"):
        sync_gradients(ddp, torch.optim.AdamW(model.parameters()))
    # auto: projected where the optimizer projects, else full.
    assert sync_gradients(ddp, optimizer).mode == "projected"
    other = torch.nn.parallel.DistributedDataParallel(model)
    assert sync_gradients(other, slimopt.build_optimizer(model, "apollo_adamw", lr=1e-3)).mode == "full"

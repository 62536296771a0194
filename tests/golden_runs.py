"""The golden runs: every configuration of ``tests/configurations.py`` plus the layouts a
refactoring of the optimizer core could break (a row-sliced matrix, bf16 weights with stochastic
rounding, an int8 basis), each trained three seeded steps and then two more.

``tests/golden/`` holds what the code at the time of writing produced: a digest of every state
dict entry and parameter (key, dtype, shape, SHA-256 of the bytes) after steps 3 and 5, and the
step-3 checkpoints themselves (``torch.save`` files, and DCP directories for two layouts), with
the digests of those checkpoints loaded and continued for two steps. Every run happens in a
process whose CPU kernels are pinned (``PINNED_ENVIRONMENT``). Pinned, the bits are the same on
most x86-64 machines but not all (an AMD EPYC computes other fp32 bits than the machine the
digests were first written on, in every run with fp32 AdamW moments, at the very commit that
wrote them): the manifest keeps one set of digests per kind of machine, and a machine is compared
with the set whose plain ``adamw`` run it reproduces (``expected_runs``). Regenerate only when a
change of numbers is intended, and say why in the commit:

    .venv/bin/python -m tests.golden_runs

A newly documented import path, or a new configuration's runs, join the snapshot without
touching the runs written before; after a change of torch, ``--numbers`` writes every digest
again and keeps the checkpoint files (which stand for the formats of the code that wrote them):

    .venv/bin/python -m tests.golden_runs --paths
    .venv/bin/python -m tests.golden_runs --new-runs
    .venv/bin/python -m tests.golden_runs --numbers

On a kind of machine whose bits no set holds yet, ``--this-machine`` adds its own set; run it only
at a commit that passes on a machine already recorded (check the code out there, then add the set
to today's manifest), so that both sets stand for the same code:

    .venv/bin/python -m tests.golden_runs --this-machine
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import slimopt
from slimopt.distributed import checkpoint as dcp_checkpoint
from tests.configurations import CONFIGURATIONS, Configuration, loss_of, make_net

GOLDEN = Path(__file__).parent / "golden"
ROOT = Path(__file__).parents[1]
# The pages that document import paths: the README and the manual, not the results pages (which
# quote messages of code as it was).
DOCUMENTS = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.relative_to(ROOT / "docs").parts),
]
MANIFEST = GOLDEN / "manifest.json"
FIRST_STEPS, MORE_STEPS = 3, 2
LATER = range(FIRST_STEPS, FIRST_STEPS + MORE_STEPS)

# A CPU's results are its own where a library picks kernels by instruction set: ATen's vectorized
# kernels (AVX2 and AVX-512 sum in another order and draw normals another way), MKL's matrix
# products and oneDNN's bf16 ones. Golden runs pin all three to paths that every x86-64 machine
# takes (files written on one kind of CPU once failed on another), and use one thread.
PINNED_ENVIRONMENT = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "OMP_NUM_THREADS": "1",
}
# The digests the manifest keeps for each run; the tests compare more results with "continued".
KEPT = ("first", "more", "loaded", "continued")
# The run that tells which machine's set of digests applies (``expected_runs``).
CANARY = "adamw"


class Wide(nn.Module):
    """One 2049×2048 matrix: over 2²² elements with a last row slice under 4096, so its
    unprojected compressed moments are stored by row slices (the small one merged)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2049, 2048) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight[:, :64].T) @ self.weight[:, 64:128] / 45


@dataclass(frozen=True)
class GoldenRun:
    """One golden configuration: a table configuration with its network's dtype or shape."""

    label: str
    configuration: Configuration
    dtype: torch.dtype = torch.float32
    wide: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    saved: bool = True  # whether its step-3 checkpoint is kept as a file (the wide ones are 8+ MB)
    dcp: bool = False  # whether a DCP checkpoint is kept too
    layerwise: dict[str, Any] | None = None  # slimopt.layerwise's options, for updates in backward
    int8: bool = False  # the linear weights stored as int8 codes (slimopt.quantize_weights)

    def net(self) -> nn.Module:
        if self.wide:
            torch.manual_seed(0)
            return Wide()
        net = make_net(0, self.configuration.experts, self.dtype)
        return slimopt.quantize_weights(net, "int8", skip=()) if self.int8 else net

    def optimizer(self, net: nn.Module) -> slimopt.SlimoptOptimizer:
        optimizer = self.configuration.build(net, **self.options)
        if self.layerwise is not None:
            slimopt.layerwise(optimizer, **self.layerwise)
        return optimizer

    @property
    def micro_batches(self) -> int:
        return 1 if self.layerwise is None else self.layerwise.get("accumulation_steps", 1)


def _by_name(name: str) -> Configuration:
    return next(c for c in CONFIGURATIONS if c.label == name)


# The ternary optimizers' default β₁ was 0.9 when these runs were written (0.7 since):
# their runs keep it, so they still check the code, not the default.
WRITTEN_WITH = {name: {"betas": (0.9, 0.999)} for name in ("adamw_ternary", "galore_adamw_ternary")}

RUNS: list[GoldenRun] = [
    GoldenRun(c.label, c, dcp=c.experts, options=WRITTEN_WITH.get(c.name, {})) for c in CONFIGURATIONS
]
RUNS += [
    GoldenRun("adamw8bit (row slices)", _by_name("adamw8bit"), wide=True, saved=False),
    GoldenRun(
        "adamw_ternary (row slices)",
        _by_name("adamw_ternary"),
        wide=True,
        saved=False,
        options=WRITTEN_WITH["adamw_ternary"],
    ),
    GoldenRun(
        "galore_adamw_ternary (bf16 weights, stochastic rounding)",
        _by_name("galore_adamw_ternary"),
        dtype=torch.bfloat16,
        options={"param_rounding": "stochastic", **WRITTEN_WITH["galore_adamw_ternary"]},
        dcp=True,
    ),
    GoldenRun(
        "galore_adamw8bit (int8 basis)", _by_name("galore_adamw8bit"), options={"basis_states": "int8"}
    ),
    GoldenRun(
        "galore_adamw8bit (bf16 weights, 8-bit correction)",
        _by_name("galore_adamw8bit"),
        dtype=torch.bfloat16,
        options={"param_rounding": "corrected"},
    ),
    GoldenRun("adamw (int8 weights)", _by_name("adamw"), dtype=torch.bfloat16, int8=True),
    GoldenRun(
        "galore_adamw (int8 weights, stochastic rounding of the rest)",
        _by_name("galore_adamw"),
        dtype=torch.bfloat16,
        int8=True,
        options={"param_rounding": "stochastic"},
    ),
]


@contextmanager
def one_thread() -> Iterator[None]:
    """CPU results depend on the thread count (matmul blocking); golden runs use one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train(run: GoldenRun, net: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        for micro_batch in range(run.micro_batches):
            loss_of(net, step * run.micro_batches + micro_batch).backward()
        optimizer.step()


# Options every group gained after runs were written, with their defaults: a group at the
# default is digested without them (a new option is not a change of numbers).
ADDED_OPTIONS = {"scale_type": None, "norm_growth_limit": None}
MISSING = object()


def digest(net: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter and state dict entry as key → [dtype, shape, SHA-256 of its bytes];
    param groups as their JSON text."""
    state_dict = optimizer.state_dict()
    entries = {f"param/{name}": _tensor_digest(value) for name, value in net.state_dict().items()}
    for index, state in state_dict["state"].items():
        for key, value in state.items():
            entries[f"state/{index}/{key}"] = _tensor_digest(value) if torch.is_tensor(value) else repr(value)
    groups = [
        {key: value for key, value in group.items() if ADDED_OPTIONS.get(key, MISSING) != value}
        for group in state_dict["param_groups"]
    ]
    entries["param_groups"] = json.dumps(groups, sort_keys=True, default=repr)
    return entries


def _tensor_digest(tensor: torch.Tensor) -> list[Any]:
    data = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return [str(tensor.dtype), list(tensor.shape), hashlib.sha256(data).hexdigest()]


def results() -> dict[str, dict[str, Any]]:
    """Every run's digests (call in a pinned process): three steps ("first"), two more ("more"),
    and for a run with saved checkpoints, the file loaded ("loaded") and continued for two steps
    ("continued"), the ternary runs' file continued by an optimizer built with today's defaults,
    and the DCP checkpoint continued."""
    with one_thread():
        return {run.label: _results_of(run) for run in RUNS}


def _results_of(run: GoldenRun) -> dict[str, Any]:
    net = run.net()
    optimizer = run.optimizer(net)
    train(run, net, optimizer, range(FIRST_STEPS))
    found = {"first": digest(net, optimizer)}
    train(run, net, optimizer, LATER)
    found["more"] = digest(net, optimizer)
    if run.saved:
        saved = torch.load(file_of(run), weights_only=True)

        def from_file(net: nn.Module, optimizer: torch.optim.Optimizer) -> None:
            net.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])

        found["loaded"], found["continued"] = _loaded_and_continued(run, run.optimizer, from_file)
        if "betas" in run.options:
            today = {k: v for k, v in run.options.items() if k != "betas"}
            _, found["continued with today's defaults"] = _loaded_and_continued(
                run, lambda net: run.configuration.build(net, **today), from_file
            )
    if run.dcp:
        _, found["continued from DCP"] = _loaded_and_continued(
            run, run.optimizer, lambda net, optimizer: dcp_checkpoint.load(dcp_of(run), net, optimizer)
        )
    return found


def _loaded_and_continued(
    run: GoldenRun,
    build: Callable[[nn.Module], torch.optim.Optimizer],
    load: Callable[[nn.Module, torch.optim.Optimizer], None],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The digests of a fresh network and the optimizer ``build`` makes for it, after ``load``
    and after two more steps."""
    net = run.net()
    optimizer = build(net)
    load(net, optimizer)
    loaded = digest(net, optimizer)
    train(run, net, optimizer, LATER)
    return loaded, digest(net, optimizer)


def pinned_results() -> dict[str, dict[str, Any]]:
    """``results()`` computed in a fresh interpreter with the pinned environment (the kernels are
    chosen as torch starts, so this process cannot pin itself)."""
    done = _in_pinned_process(["--results"], check=True, capture_output=True, text=True, timeout=600)
    return json.loads(done.stdout)


def _in_pinned_process(arguments: list[str], **options: Any) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tests.golden_runs", *arguments]
    return subprocess.run(command, cwd=ROOT, env={**os.environ, **PINNED_ENVIRONMENT}, **options)


def file_of(run: GoldenRun) -> Path:
    return GOLDEN / f"{_slug(run.label)}.pt"


def dcp_of(run: GoldenRun) -> Path:
    return GOLDEN / f"{_slug(run.label)}.dcp"


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label).strip("_")


def documented_paths() -> set[str]:
    """Every ``from slimopt… import …`` name and every dotted ``slimopt.…`` path in the README's
    and the manual's text, as module paths and module.attribute paths."""
    text = "\n".join(page.read_text() for page in DOCUMENTS)
    paths = set()
    for module, names in re.findall(r"from (slimopt[\w.]*) import (\([\w,\s]+\)|[\w, ]+)", text):
        paths |= {f"{module}:{name}" for name in re.findall(r"\w+", names)}
    for dotted in re.findall(r"(?<![\w.])slimopt(?:\.\w+)+", text):
        paths.add(dotted)
    return paths


# Run in a fresh interpreter: which of ``paths`` (argv[1], JSON) resolve as attributes after
# nothing but ``import slimopt`` (as a user writes ``slimopt.distributed.spread_refreshes``).
ATTRIBUTE_CHECK = """
import json, sys
import slimopt
found = []
for path in json.loads(sys.argv[1]):
    module, _, name = path.partition(":")
    value = slimopt
    parts = module.split(".")[1:] + ([name] if name else [])
    for part in parts:
        value = getattr(value, part, None)
    if value is not None:
        found.append(path)
print(json.dumps(found))
"""


def attribute_paths(paths: list[str]) -> list[str]:
    """Which of ``paths`` resolve by attributes after only ``import slimopt``."""
    command = [sys.executable, "-c", ATTRIBUTE_CHECK, json.dumps(paths)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True, timeout=120).stdout)


def generate() -> None:
    """Run every golden configuration at the code as it is and write ``tests/golden``."""
    shutil.rmtree(GOLDEN, ignore_errors=True)
    GOLDEN.mkdir()
    paths = sorted(documented_paths())
    manifest: dict[str, Any] = {
        "import_paths": paths,
        "attribute_paths": attribute_paths(paths),
        "runs": {},
    }
    _write_runs(manifest, RUNS)


def add_new_runs() -> None:
    """Run the golden configurations the snapshot lacks (a new optimizer's) and add them; the
    runs written before stay as they are."""
    manifest = json.loads(MANIFEST.read_text())
    _write_runs(manifest, [run for run in RUNS if run.label not in manifest["runs"]])


def write_numbers() -> None:
    """Write every run's digests again at the code and torch as they are, keeping the checkpoint
    files (for a change of torch or of the pinned environment, not of the code's numbers). The
    other machines' sets are dropped: they stand for the numbers before."""
    manifest = json.loads(MANIFEST.read_text())
    manifest.pop("other machines", None)
    _write_runs(manifest, [])


def add_this_machine() -> None:
    """Add this machine's digests as a set of their own (``expected_runs``), keeping the
    checkpoint files and every set written before; refused where a set holds its bits already."""
    manifest = json.loads(MANIFEST.read_text())
    with one_thread():
        found = {run.label: _results_of(run) for run in RUNS}
    if expected_runs(manifest, found, strict=True) is not None:
        sys.exit("the manifest holds this machine's bits already: nothing to add")
    manifest.setdefault("other machines", []).append({"written on": _processor(), "runs": _kept(found)})
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def expected_runs(
    manifest: dict[str, Any], found: dict[str, dict[str, Any]], strict: bool = False
) -> dict[str, Any] | None:
    """The set of digests (run label → digests) this machine is compared with: the one whose
    ``adamw`` run's first digests are the ones ``found`` holds. A change of the code's numbers
    matches no set, and is compared with the first one written (``strict``: None instead)."""
    sets = [manifest["runs"], *(other["runs"] for other in manifest.get("other machines", []))]
    matching = [runs for runs in sets if runs[CANARY]["first"] == found[CANARY]["first"]]
    if matching:
        return matching[0]
    return None if strict else manifest["runs"]


def _processor() -> str:
    """The processor's model name (Linux), for the reader of the manifest."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.machine()


def _write_runs(manifest: dict[str, Any], runs: list[GoldenRun]) -> None:
    """Write the step-3 checkpoints of ``runs``, then every run's digests with what they ran on."""
    with one_thread():
        for run in runs:
            net = run.net()
            optimizer = run.optimizer(net)
            train(run, net, optimizer, range(FIRST_STEPS))
            if run.saved:
                torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, file_of(run))
            if run.dcp:
                dcp_checkpoint.save(dcp_of(run), net, optimizer)
        found = {run.label: _results_of(run) for run in RUNS}
    manifest["torch"] = torch.__version__
    manifest["machine"] = platform.machine()
    manifest["environment"] = PINNED_ENVIRONMENT
    manifest["runs"] = _kept(found)
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def _kept(found: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The digests the manifest keeps of every run's results."""
    return {
        label: {key: value for key, value in digests.items() if key in KEPT}
        for label, digests in found.items()
    }


def add_documented_paths() -> None:
    """Add the import paths documented since the snapshot to it (and, of them, those that
    resolve as attributes after ``import slimopt``); the runs stay as they are."""
    manifest = json.loads(MANIFEST.read_text())
    new = sorted(documented_paths() - set(manifest["import_paths"]))
    manifest["import_paths"] = sorted({*manifest["import_paths"], *new})
    manifest["attribute_paths"] = sorted({*manifest["attribute_paths"], *attribute_paths(new)})
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def _print_results() -> None:
    print(json.dumps(results()))


# Anything but these forms is refused: regenerating every run is never a default.
COMMANDS = {
    "": generate,
    "--paths": add_documented_paths,
    "--new-runs": add_new_runs,
    "--numbers": write_numbers,
    "--this-machine": add_this_machine,
    "--results": _print_results,
}


def _run_pinned(arguments: list[str]) -> None:
    """Run a command of this module in a process with the pinned environment: this one when its
    environment already is (torch reads it as it starts), else a fresh interpreter."""
    if any(os.environ.get(name) != value for name, value in PINNED_ENVIRONMENT.items()):
        sys.exit(_in_pinned_process(arguments).returncode)
    COMMANDS[" ".join(arguments)]()


if __name__ == "__main__":
    if " ".join(sys.argv[1:]) not in COMMANDS:
        sys.exit(
            "usage: python -m tests.golden_runs [--paths | --new-runs | --numbers | --this-machine] "
            "(no argument: regenerate all runs)"
        )
    _run_pinned(sys.argv[1:])

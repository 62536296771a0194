"""Which block size and map Muon's momentum needs: the error that storing real Muon momenta
costs, measured where it matters, in the orthogonalized update.

Trains the architectures benchmark's LLaMA row (hidden 64) with fp32 Muon and, at a few steps,
stores every Muon matrix's momentum in each candidate format (8 and 4 bits, the dynamic-exponent
map slimopt uses or a linear absmax map as the 8-bit Muon paper uses, several block sizes; and
slimopt's ternary format), then compares against fp32: the momentum's relative error and that
of the step Muon takes from it (the Nesterov look-ahead orthogonalized), both as norms over all
matrices, with the bytes each format stores per parameter (what its encoding holds).

    python -m benchmarks.muon_storage [--steps 300] [--at 50,150,300]

prints a markdown table.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch

import slimopt
from benchmarks.architectures import corpus_bytes, lm_task
from slimopt.codecs import moment_codec
from slimopt.codecs.base import Codec
from slimopt.codecs.blockwise import BlockwiseCodec
from slimopt.codecs.maps import dynamic_map
from slimopt.rules.muon import NS_COEFFICIENTS, orthogonalized


def linear_map(bits: int) -> torch.Tensor:
    """``2**bits`` evenly spaced values from -1 to 1: linear absmax quantization."""
    return torch.linspace(-1.0, 1.0, 2**bits)


def candidates() -> dict[str, Callable[[torch.Size], Codec]]:
    """The formats compared, by label: each a codec for a momentum of a given shape."""
    formats: dict[str, Callable[[torch.Size], Codec]] = {
        "bf16": partial(moment_codec, "bf16", "linear"),
        "ternary (slimopt's)": partial(moment_codec, "ternary", "linear"),
    }
    for bits, sizes in ((8, (256, 2048)), (4, (64, 128, 256))):
        dynamic = dynamic_map(signed=True) if bits == 8 else dynamic_map(True, total_bits=4, exponent_bits=3)
        for size in sizes:
            for name, values in (("dynamic", dynamic), ("linear", linear_map(bits))):
                formats[f"int{bits} {name}, block {size}"] = lambda _, v=values, n=size: BlockwiseCodec(v, n)
    return formats


def step_of(buffer: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Muon's step from momentum ``buffer`` (after this step's gradient): Nesterov, orthogonalized."""
    return orthogonalized(grad.lerp(buffer, 0.95), NS_COEFFICIENTS, 5, 1e-7).float()


def measure(args: argparse.Namespace) -> list[tuple[str, float, float, float]]:
    task = lm_task("llama", "LLaMA LM", corpus_bytes())
    torch.manual_seed(0)
    model = task.build()
    optimizer = slimopt.build_optimizer(model, "muon", lr=1e-2, weight_decay=0.0)
    matrices = optimizer.param_groups[0]["params"]
    generator = torch.Generator().manual_seed(1)
    formats = candidates()
    errors = {label: [0.0, 0.0] for label in formats}
    stored_bytes = dict.fromkeys(formats, 0)
    totals = [0.0, 0.0]
    elements = 0
    for step in range(1, args.steps + 1):
        model(**task.batch(generator, 16)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grads = {id(p): p.grad.clone() for p in matrices}
        optimizer.step()
        optimizer.zero_grad()
        if step not in args.at:
            continue
        for p in matrices:
            buffer, grad = optimizer.state[p]["momentum_buffer"], grads[id(p)]
            exact = step_of(buffer, grad)
            totals[0] += float(buffer.norm() ** 2)
            totals[1] += float(exact.norm() ** 2)
            elements += buffer.numel()
            for label, codec_for in formats.items():
                codec = codec_for(buffer.shape)
                encoded = codec.encode(buffer, generator)
                stored_bytes[label] += sum(t.numel() * t.element_size() for t in encoded.values())
                stored = codec.decode(encoded, buffer.shape)
                errors[label][0] += float((stored - buffer).norm() ** 2)
                errors[label][1] += float((step_of(stored, grad) - exact).norm() ** 2)
    rows = []
    for label in formats:
        momentum, step = ((errors[label][k] / totals[k]) ** 0.5 for k in range(2))
        rows.append((label, stored_bytes[label] / elements, momentum, step))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--at", type=lambda s: {int(v) for v in s.split(",")}, default={50, 150, 300})
    args = parser.parse_args(argv)
    print("| format | bytes per parameter | momentum error | step error |")
    print("|---|---|---|---|")
    for label, nbytes, momentum, step in measure(args):
        print(f"| {label} | {nbytes:.4f} | {momentum:.4f} | {step:.4f} |")


if __name__ == "__main__":
    main()

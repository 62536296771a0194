"""Compile every Triton kernel launch of a few fused optimizer steps for an H100/H200 (sm_90)
without a GPU: Triton's whole pipeline (its frontend, the GPU IR passes, LLVM, PTX and the
bundled ptxas) runs on the host. Run as a script with ``TRITON_INTERPRET`` unset (the kernels
must be compiled functions, not interpreted ones); it prints one JSON line: the kernel variants
compiled, by kernel name.

The steps run on CPU tensors with the Triton kernels enabled there, but each launch is recorded
instead of run: its arguments are those the optimizer passes on CUDA, from which the signature
(pointer and scalar types) and the constants of the variant are taken.
"""

from __future__ import annotations

import json
import os
from collections import Counter

assert "TRITON_INTERPRET" not in os.environ, "run with TRITON_INTERPRET unset"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import slimopt  # noqa: E402
from slimopt import kernels  # noqa: E402
from slimopt.kernels import (  # noqa: E402
    triton_adamw,
    triton_multi_tensor,
    triton_newton_schulz,
    triton_ternary,
)

TARGET = GPUTarget("cuda", 90, 32)
KERNELS = [
    (triton_adamw, "_adamw_kernel"),
    (triton_multi_tensor, "_adamw_steps_kernel"),
    (triton_ternary, "_update_strips"),
    (triton_ternary, "_column_scales"),
    (triton_ternary, "_block_exponents"),
    (triton_ternary, "_digits"),
    (triton_newton_schulz, "_product_kernel"),
]
POINTEE = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
}
# The optimizers and options stepped: every storage format, fp32 and bf16 weights (rounded to
# nearest and stochastically), whole and projected matrices (the direction returned), Muon's
# iteration (its symmetric and plain products).
RUNS = [
    ("adamw", {}),
    ("adamw", {"states": "bf16"}),
    ("adamw8bit", {}),
    ("adamw4bit", {"param_rounding": "stochastic"}),
    ("adamw_ternary", {}),
    ("adamw_ternary", {"param_rounding": "stochastic"}),
    ("galore_adamw8bit", {"rank": 32}),
    ("galore_adamw_ternary", {"rank": 32}),
    ("muon", {}),
]


class Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **constants)`` records the launch."""

    def __init__(self, kernel: triton.JITFunction, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **constants: self.launches.append((self.kernel, args, constants))


def signature_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + POINTEE[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def record_launches() -> list:
    launches: list = []
    for module, name in KERNELS:
        setattr(module, name, Recorder(getattr(module, name), launches))
    # The Triton kernels, and skip flags kept on the device, on the CPU as on CUDA.
    policy = kernels.FusedPolicy(triton=("cuda", "cpu"), flags=("cuda", "cpu"), iteration=("cuda", "cpu"))
    for dtype in (torch.float32, torch.bfloat16):
        for name, options in RUNS:
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(160, 144), torch.nn.LayerNorm(144), torch.nn.Linear(144, 72, bias=False)
            ).to(dtype)
            optimizer = slimopt.build_optimizer(model, name, lr=1e-3, fused=True, **options)
            optimizer.engine.use_fused_policy(policy)
            for _ in range(2):  # the first step creates the state
                for param in model.parameters():
                    param.grad = torch.randn(param.shape).to(dtype)
                optimizer.step()
    return launches


def main() -> None:
    compiled: Counter = Counter()
    seen = set()
    for kernel, args, constants in record_launches():
        names = kernel.arg_names
        signature = dict(zip(names[: len(args)], map(signature_type, args), strict=True))
        key = (kernel.__name__, tuple(signature.items()), tuple(sorted(constants.items())))
        if key in seen:
            continue
        seen.add(key)
        signature.update({name: "constexpr" for name in constants})
        source = ASTSource(
            fn=kernel,
            signature=signature,
            constexprs={(names.index(name),): value for name, value in constants.items()},
        )
        binary = triton.compile(source, target=TARGET)
        assert binary.asm["cubin"], kernel.__name__
        compiled[kernel.__name__] += 1
    print(json.dumps(compiled))


if __name__ == "__main__":
    main()

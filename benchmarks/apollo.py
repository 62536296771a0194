"""APOLLO and APOLLO-Mini in the memory planner, beside TACO and GaLore: LLaMA-7B and OPT-13B,
bf16 weights, 1×256 tokens, layer-wise updates (the meta-device plan; GiB at the predicted peak).

    python -m benchmarks.apollo

Their convergence is measured by ``benchmarks.architectures`` (``--optimizers
adamw,galore_adamw,apollo_adamw,apollo_mini,taco``) and ``slimopt compare --preset demo``;
the commands and numbers are in ``docs/results/apollo.md``.
"""

from __future__ import annotations

from benchmarks.taco import plan_lines

# (optimizer, options, layer-wise). APOLLO's groups without a projection (embedding, head,
# norms) keep AdamW moments in the optimizer's ``states``: fp32 by default, int8 as TACO's
# fallback keeps them.
PLANNED = (
    ("apollo_mini", {}, True),
    ("apollo_mini", {"states": "int8"}, True),
    ("apollo_adamw", {"states": "int8"}, True),
    ("taco", {}, True),
    ("galore_adamw8bit", {}, True),
    ("galore_adamw_ternary", {"basis_states": "int8"}, True),
)


def main() -> None:
    print("\n".join(plan_lines(PLANNED)))


if __name__ == "__main__":
    main()

"""Run by ``test_integrations`` under ``torchrun``: SlimoptTrainer (DDP through accelerate) on a
tiny LLaMA; each process writes its losses and a digest of its parameters to ``<out>/rank<N>.json``.

    torchrun --standalone --nproc_per_node 2 tests/scripts/trainer_under_torchrun.py OUT NAME [OPTIM_ARGS]
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.conftest import tiny_llama
from tests.test_integrations import ShakespeareRows, _args


def main(out: str, name: str, optim_args: str | None = None) -> None:
    from slimopt.integrations.transformers import SlimoptTrainer
    from slimopt.train.corpus import load_corpus

    text = "".join(document.text for document in load_corpus("shakespeare"))[:200_000]
    tokens = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    rank = int(os.environ["RANK"])
    overrides = {"optim_args": optim_args} if optim_args else {}
    record: dict = {}
    trainer = None
    try:
        trainer = SlimoptTrainer(
            model=tiny_llama(),
            args=_args(Path(out) / "trainer", per_device_train_batch_size=2, **overrides),
            train_dataset=ShakespeareRows(tokens),
            optimizer_name=name,
        )
        trainer.train()
        digest = hashlib.sha256()
        for param in trainer.model.parameters():
            digest.update(param.detach().numpy().tobytes())
        record = {
            "losses": [r["loss"] for r in trainer.state.log_history if "loss" in r],
            "parameters": digest.hexdigest(),
            "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__,
            "grad_sync": None if trainer.grad_sync is None else trainer.grad_sync.mode,
            "grad_sync_bytes": None if trainer.grad_sync is None else trainer.grad_sync.sent,
        }
    except RuntimeError as error:
        record = {"error": str(error)}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))
    # The model, its DDP wrapper and optimizer released before the process group, as slimopt
    # train does: gloo's work objects destroyed at interpreter exit can abort the process
    # ("terminate called without an active exception"; once in CI here).
    if trainer is not None:
        trainer.accelerator.free_memory()  # accelerate keeps the prepared model and optimizer
    del trainer
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

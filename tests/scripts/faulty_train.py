"""Run by ``test_kills`` under torchrun: ``slimopt train`` with one fault planted.

    torchrun --standalone --nproc_per_node 2 tests/scripts/faulty_train.py POINT RANK COUNT -- TRAIN ARGS

Process RANK meets the fault at the COUNT-th time it passes POINT:

- ``step``: SIGKILL as its optimizer step begins;
- ``dcp-before`` / ``dcp-after``: SIGKILL inside a sharded (DCP) checkpoint write, before or
  after this process has written its shard files;
- ``manifest``: SIGKILL as the first process is about to seal a checkpoint (its files written,
  the manifest not yet);
- ``enospc``: its shard files cannot be written (no space left on device).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def plant(point: str, rank: int, count: int) -> None:
    """Patch the code at ``point`` so that process ``rank`` fails there the ``count``-th time."""
    import torch.distributed.checkpoint.filesystem as dcp_files

    from slimopt.optimizers import SlimoptOptimizer
    from slimopt.train import checkpoint

    passes = [0]
    here = int(os.environ["RANK"]) == rank

    def due() -> bool:
        passes[0] += 1
        return here and passes[0] == count

    def kill() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "step":
        step = SlimoptOptimizer.step

        def killed_step(self, *args, **kwargs):
            if due():
                kill()
            return step(self, *args, **kwargs)

        SlimoptOptimizer.step = killed_step
    elif point in ("dcp-before", "dcp-after", "enospc"):
        write = dcp_files.FileSystemWriter.write_data

        def faulty_write(self, *args, **kwargs):
            if due():
                if point == "enospc":
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                if point == "dcp-before":
                    kill()
                written = write(self, *args, **kwargs)
                written.wait()
                kill()
            return write(self, *args, **kwargs)

        dcp_files.FileSystemWriter.write_data = faulty_write
    elif point == "manifest":
        seal = checkpoint._seal

        def killed_seal(*args, **kwargs):
            if due():
                kill()
            return seal(*args, **kwargs)

        checkpoint._seal = killed_seal
    else:
        raise ValueError(f"unknown fault point {point!r}")


if __name__ == "__main__":
    point, rank, count, separator, *argv = sys.argv[1:]
    assert separator == "--"
    plant(point, int(rank), int(count))
    from slimopt.cli import main

    sys.exit(main(argv))

"""A one-rank torch.distributed group in the test process (Gloo over an in-memory store), for
the tests of the torch.distributed driver and the DDP face; real multi-rank jobs are in
tests/multiproc/test_ddp.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def single_rank_group() -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()

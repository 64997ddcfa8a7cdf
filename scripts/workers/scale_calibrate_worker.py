"""One rank of the network calibration of scripts/scale.py: Horovod's own allreduce and
allgather, timed at message sizes from 1 KB to 16 MB on the network the job runs in.

The cost model (hvd_sparse/plan/network.py) needs, per op, a fixed cost per collective (latency
and Horovod's software overhead together) and a bandwidth. The fixed cost of a small message is
what a sparsifier's few-KB collectives mostly pay, and no bandwidth probe shows it: a least-squares
line through these timings gives both. Each size is timed ``--repeats`` times after one untimed
call, every call between barriers; rank 0 writes the medians to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SIZES_BYTES = (1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def main() -> None:
    """Time every (op, size); rank 0 writes {op: [[bytes per rank, median seconds], ...]}."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()
    ops = {"allreduce": lambda t, name: hvd.allreduce(t, name=name, op=hvd.Sum),
           "allgather": lambda t, name: hvd.allgather(t, name=name)}
    result: dict = {"size": hvd.size(), "repeats": args.repeats}
    for op, call in ops.items():
        rows = []
        for nbytes in SIZES_BYTES:
            tensor = torch.ones(nbytes // 4)
            times = []
            for i in range(args.repeats + 1):
                hvd.barrier()
                began = time.perf_counter()
                call(tensor, f"calibrate.{op}.{nbytes}.{i}")
                times.append(time.perf_counter() - began)
            rows.append([nbytes, statistics.median(times[1:])])
        result[op] = rows
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()

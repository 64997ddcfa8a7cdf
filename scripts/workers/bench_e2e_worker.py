"""One rank of the end-to-end benchmark (started by scripts/bench_e2e.py, one process per rank).

Every configuration -- dense allreduce, Horovod's fp16 compression, every sparsifier, and a
no-communication reference -- runs in this one job, side by side: per repeat, the configurations
run one after another in an order rotated (and reversed every other repeat) from repeat to repeat,
so slow drifts of a shared machine spread over all of them. Each block builds a fresh model from
the same seed, wraps stock ``hvd.DistributedOptimizer`` with the configuration's ``compression=``
(as a user would), runs ``--warmup`` untimed steps (the first step plans the buckets), then
``--steps`` timed steps. A step is ``zero_grad``, forward, backward (Horovod's hooks start the
communication), ``optimizer.step()`` (waits for it and updates the weights); its time is read
after ``step()`` returns, and the job's step time is the slowest rank's mean over the block.

Before the blocks, a raw Horovod allreduce of ``--probe-mb`` MB (fp32) measures the bandwidth the
network really gives, and a no-communication block measures what the computation alone costs.
Rank 0 writes every block's record, with each rank's statistics, to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any

from e2e_phases import TimedCompression, rank_phases, slowest_rank_phases, timed_optimizer
from models.e2e_models import MODELS, build

from hvd_sparse.algorithms.corrections import RECOMMENDED

# name -> (registry method or a Horovod compression, options). "local" trains without any
# communication: the computation's own cost, measured under the same CPU contention.
CONFIGS: dict[str, tuple[str, dict]] = {
    "dense": ("horovod", {"compression": "none"}),
    "fp16": ("horovod", {"compression": "fp16"}),
    "exdyna": ("exdyna", {}),
    "exdyna-tracking": ("exdyna", {"threshold_scaling": "tracking"}),
    "micro": ("micro", {}),
    "deft": ("deft", {}),
    "lags": ("lags", {}),
    "topk": ("topk", {}),
    "randomk": ("randomk", {}),
    "threshold": ("threshold", {}),
    "gaussiank": ("gaussiank", {}),
    "dgc": ("dgc", {}),
    "local": ("local", {}),
    # TopK, DGC and Gaussian-k per tensor in a bucket per gradient, as before PyTorch packed their
    # steps (``planning.pack_tensors``): the same decisions at each bucket's own per-step cost.
    "topk-unpacked": ("topk", {"packs_tensors": False}),
    "dgc-unpacked": ("dgc", {"packs_tensors": False}),
    "gaussiank-unpacked": ("gaussiank", {"packs_tensors": False}),
}
UNPACKED = "-unpacked"
# "<method>+corr": the method with the recommended corrections (corrections.RECOMMENDED) in their
# steady state: the momentum correction and dense small tensors; the warm-up's steps, denser
# than the rest, are left out (time_to_accuracy.py charges them at dense's step time).
CORRECTED = ("exdyna-tracking", "micro", "deft", "lags", "topk", "dgc")
STEADY_RECIPE = {key: value for key, value in RECOMMENDED.items() if key != "warmup_steps"}
CONFIGS.update({f"{name}+corr": (CONFIGS[name][0], {**CONFIGS[name][1], **STEADY_RECIPE})
                for name in CORRECTED})
# ... and TopK's and DGC's with a bucket per tensor (packed: the dense_below tensors bundled too).
CONFIGS.update({f"{name}+corr{UNPACKED}": (CONFIGS[name][0], {**STEADY_RECIPE, "packs_tensors": False})
                for name in ("topk", "dgc")})

# "<method>+adam": the method on the Adam path (docs/methods.md#adam-and-adamw) of hvd_sparse's
# AdamW (only with ``--optimizer adamw``), timed in its sparse steps: its dense steps (100) are
# added to the untimed warm-up (time_to_accuracy.py charges them at dense's step time).
ADAM_PATH = "+adam"
CONFIGS.update({f"{name}{ADAM_PATH}": (CONFIGS[name][0], {**CONFIGS[name][1], "adam_path": True})
                for name in CORRECTED})
# "<method>+adam-shared-v": the path with Adam's v shared by the ranks, refreshed every
# SHARED_V_EVERY sparse steps (``second_moment_refresh``): its median step is one between
# refreshes. "<method>+adam-refresh": a refresh on every sparse step, so its median is a refresh
# step. time_to_accuracy.py composes the shared v's mean step from the two.
SHARED_V, REFRESH = "+adam-shared-v", "+adam-refresh"
SHARED_V_EVERY = 20
CONFIGS.update({f"{name}{suffix}": (CONFIGS[name][0], {**CONFIGS[name][1], "adam_path": True,
                                                       "second_moment_refresh": every})
                for name in CORRECTED for suffix, every in ((SHARED_V, SHARED_V_EVERY), (REFRESH, 1))})

# "<config>@ref": the same configuration with the kernels off (the reference path), so one job
# measures what the kernels change, side by side with everything else.
REFERENCE = "@ref"


def resolve(config: str) -> tuple[str, dict, str]:
    """(method or Horovod compression, options, kernel mode) of a configuration name; KeyError
    when it names none (``@ref`` only suffixes an hvd_sparse method)."""
    base = config.removesuffix(REFERENCE)
    method, options = CONFIGS[base]
    if base != config and method in ("horovod", "local"):
        raise KeyError(config)
    return method, options, "off" if base != config else "auto"


def method_options(options: dict) -> tuple[dict, bool]:
    """A configuration's options for the method, and whether it may pack per-tensor steps (set on
    the instance, ``algorithm.packs_tensors &= packs``: the class's flag is every instance's)."""
    options = dict(options)
    return options, options.pop("packs_tensors", True)


def known(config: str, resolver: Any = None) -> bool:
    """Whether ``config`` names a configuration (of ``resolver``, default ``resolve``)."""
    try:
        (resolver or resolve)(config)
    except KeyError:
        return False
    return True


STAT_KEYS = ("density_actual", "buildup", "bytes_sent", "bytes_received", "select_seconds",
             "comm_wait_seconds", "comm_inflight_seconds")

SETTLE_CHECK = 10   # settling steps between two looks at the density (stats() costs a pass)
SETTLE_FACTOR = 2.0


def settled(density: float, target: float, size: int) -> bool:
    """A sparsifier's aggregate density is settled when it lies within ``SETTLE_FACTOR`` of what a
    method can aim at: ρ (exclusive partitions) to N·ρ (every rank's own top-k, full build-up).
    MiCRO's paper start (λ0 = 1/(2√k), moved 0.5% a step) can take hundreds of steps to get there;
    its step before that times a far denser exchange than the method's steady state."""
    return target / SETTLE_FACTOR <= density <= SETTLE_FACTOR * size * target


def settle(step: Any, compressor: Any, batches: list, first: int, args: argparse.Namespace,
           size: int, agree: Any) -> dict | None:
    """With ``--settle``, a sparsifier steps on (untimed) until its density has ``settled``,
    looking every ``SETTLE_CHECK`` steps, at most ``--settle`` steps: what it did, or None when
    there was nothing to do. ``agree(done, i)`` returns rank 0's verdict on every rank, so that
    all stop at the same step. Both workers use it."""
    if compressor is None or args.settle <= 0:
        return None
    extra = 0
    while True:
        density = float(compressor.stats()["density_actual"])
        if agree(settled(density, args.density, size) or extra >= args.settle, extra):
            break
        for _ in range(SETTLE_CHECK):
            step(*batches[(first + extra) % len(batches)])
            extra += 1
    return {"steps": extra, "density": density, "settled": settled(density, args.density, size)}


def agree_on_rank0(hvd: Any, config: str) -> Any:
    """``settle``'s ``agree`` through Horovod's ``broadcast_object`` (PyTorch or TensorFlow)."""
    def agree(done: bool, i: int) -> bool:
        return bool(hvd.broadcast_object(done, root_rank=0, name=f"e2e.settle.{config}.{i}"))

    return agree


def build_model(name: str, image_size: int | None = None, with_model: bool = True):
    """The model ``name`` of scripts/models/e2e_models.py in PyTorch, from seed 0 on every rank (identical
    weights, no broadcast): its ``ModelSpec`` (module, batches, loss, throughput unit)."""
    return build(name, "torch", image_size=image_size, with_model=with_model)


def block_order(configs: list[str], repeat: int) -> list[str]:
    """The order of the configurations in a repeat: even repeats rotate by one more place, odd
    repeats reverse the previous order, so across repeats each configuration runs early and late,
    before and after each other one (with an even count too)."""
    shift = (repeat // 2) % len(configs)
    order = configs[shift:] + configs[:shift]
    return order[::-1] if repeat % 2 else order


def build_parser() -> argparse.ArgumentParser:
    """The worker's command line (bench_e2e.py builds it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="mlp25m")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--image-size", type=int, default=None,
                        help="side of the images of the ResNets and cnn (default: the model's, "
                             "224 and 32); smaller is cheaper, the parameters are the same")
    parser.add_argument("--configs", default=",".join(c for c in CONFIGS if ADAM_PATH not in c))
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sparse-warmup", type=int, default=8,
                        help="untimed steps of a sparsifier (thresholds settle)")
    parser.add_argument("--settle", type=int, default=0,
                        help="after --sparse-warmup, at most this many more untimed steps of a "
                             "sparsifier whose aggregate density is not yet settled (settled())")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stat-steps", type=int, default=2,
                        help="untimed steps after the timed ones, each followed by stats()")
    parser.add_argument("--probe-mb", type=float, default=32.0)
    parser.add_argument("--lr", type=float, default=None,
                        help="the optimizer's learning rate (default: 0.01 for SGD, 1e-3 for AdamW)")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="what every configuration steps: plain SGD, or AdamW (weight decay "
                             "0.01; the +adam configurations: hvd_sparse's AdamW on the Adam path)")
    parser.add_argument("--schedule", choices=("blocks", "interleaved"), default="blocks",
                        help="blocks: per repeat, each configuration in turn, built afresh, "
                             "--steps steps; interleaved: every configuration alive, one step "
                             "each per round (--repeats rounds)")
    parser.add_argument("--out", required=True)
    return parser


@dataclass
class Job:
    """This rank's part of the job: the arguments, the frameworks (imported in ``main``, after
    the command line is read) and the rank's fixed batches."""

    args: argparse.Namespace
    hvd: Any
    torch: Any
    hvd_sparse: Any
    rank: int
    batches: list

    def trainer(self, config: str, tag: str) -> Trainer:
        return Trainer(config, self.args, tag, self.hvd, self.torch, self.hvd_sparse)

    def warm_up(self, trainer: Trainer) -> None:
        """The configuration's untimed steps, then ``--settle``'s (``settle``)."""
        steps = trainer.warmup_steps(self.args)
        for step in range(steps):
            trainer.step(*self.batches[step % len(self.batches)])
        trainer.settle = settle(trainer.step, trainer.compressor, self.batches, steps, self.args,
                                self.hvd.size(), agree_on_rank0(self.hvd, trainer.config))

    def timed_step(self, trainer: Trainer, step: int) -> list[float]:
        """Ranks start aligned (a barrier, untimed); the step's time on this rank follows."""
        self.hvd.barrier()
        return trainer.step(*self.batches[step % len(self.batches)])


def run_blocks(job: Job, configs: list[str]) -> list[dict]:
    """Per repeat, each configuration in turn: a fresh model, optimizer and compressor per visit
    (memory for one configuration only), warmed up, then ``--steps`` timed steps."""
    args, records = job.args, []
    for repeat in range(args.repeats):
        for config in block_order(configs, repeat):
            trainer = job.trainer(config, f"r{repeat}")
            job.warm_up(trainer)
            steps = [job.timed_step(trainer, step) for step in range(args.steps)]
            records.append(trainer.record(repeat, steps, job.batches, args.stat_steps))
            del trainer
            gc.collect()  # the configuration's model, optimizer and residuals go now
            if job.rank == 0:
                print(f"[e2e] repeat {repeat} {config}: "
                      f"{statistics.fmean(sum(s[:3]) for s in steps) * 1e3:.1f} ms/step", flush=True)
    return records


def run_interleaved(job: Job, configs: list[str]) -> list[dict]:
    """Every configuration alive at once; one timed step of each per round, in rotated order."""
    args, records = job.args, []
    trainers = {config: job.trainer(config, "i") for config in configs}
    for trainer in trainers.values():
        job.warm_up(trainer)
    timed: dict[str, list[tuple[int, list[float]]]] = {config: [] for config in configs}
    for repeat in range(args.repeats):
        for config in block_order(configs, repeat):
            timed[config].append((repeat, job.timed_step(trainers[config], repeat)))
        if job.rank == 0 and repeat % 5 == 4:
            print(f"[e2e] round {repeat + 1}/{args.repeats}", flush=True)
    for config, trainer in trainers.items():
        stats = trainer.record(0, [], job.batches, args.stat_steps)
        for repeat, step in timed[config]:
            records.append({**stats, "repeat": repeat, "steps": [step]})
    return records


def write_result(args: argparse.Namespace, merged: list[dict], size: int, configs: list[str],
                 probe: dict, torch_version: str) -> None:
    """Rank 0's JSON: the job's settings, the bandwidth probe and the merged records."""
    spec = build_model(args.model, args.image_size, with_model=False)
    out = {
        "model": args.model, "numel": merged[0]["numel"] if merged else None,
        "input_shape": list(spec.input_shape), "unit": spec.unit,
        "items_per_sample": spec.items_per_sample, "batch_per_rank": args.batch, "size": size,
        "density": args.density, "optimizer": args.optimizer,
        "schedule": args.schedule, "repeats": args.repeats, "warmup": args.warmup,
        "sparse_warmup": args.sparse_warmup, "settle": args.settle, "steps": args.steps,
        "stat_steps": args.stat_steps,
        "configs": configs, "probe": probe, "records": merged,
        "rank_env": {k: os.environ.get(k) for k in ("HOROVOD_HOSTNAME", "HOROVOD_LOCAL_SIZE",
                                                    "HOROVOD_GLOO_IFACE", "OMP_NUM_THREADS")},
        "torch": torch_version, "python": platform.python_version(),
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def main() -> None:
    """Measure every configuration on this rank; rank 0 writes the merged records."""
    args = build_parser().parse_args()

    import horovod.torch as hvd
    import torch

    import hvd_sparse

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    configs = args.configs.split(",")
    unknown = [c for c in configs if not known(c)]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}, and "
                         f"any sparsifier with {REFERENCE} (kernels off)")

    probe = torch_probe(hvd, torch, args.probe_mb, size)

    spec = build_model(args.model, args.image_size, with_model=False)
    generator = spec.generator(1000 + rank)
    batches = [spec.make_batch(args.batch, generator) for _ in range(4)]
    job = Job(args, hvd, torch, hvd_sparse, rank, batches)
    records = run_blocks(job, configs) if args.schedule == "blocks" else run_interleaved(job, configs)

    everyone = hvd.allgather_object(records, name="e2e.records")
    if rank == 0:
        write_result(args, merge_ranks(everyone), size, configs, probe, torch.__version__)
    hvd.shutdown()


class Trainer:
    """One configuration: its model (seed 0 on every rank: identical weights, no broadcast), plain
    SGD (or AdamW) wrapped in stock ``hvd.DistributedOptimizer`` with the configuration's
    ``compression=``."""

    def __init__(self, config: str, args, tag: str, hvd, torch, hvd_sparse):
        method, options, self.kernels = resolve(config)
        self.config, self.method, self.options = config, method, options
        self.hvd_sparse = hvd_sparse
        spec = build_model(args.model, args.image_size)
        self.model = spec.model
        named = list(self.model.named_parameters())
        self.numel = sum(p.numel() for _, p in named)
        options = dict(options)
        adam_path = options.pop("adam_path", False)
        optimizer = self._optimizer(args, adam_path, torch)
        self.compressor = self.timing = None
        if method == "horovod":
            self.timing = TimedCompression(getattr(hvd.Compression, options["compression"]))
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                                 compression=self.timing)
        elif method != "local":
            options, packs = method_options(options)
            link = {"optimizer": optimizer} if adam_path else {}
            self.compressor = hvd_sparse.create(method, framework="torch", density=args.density,
                                                named_parameters=named,
                                                prefix=f"e2e.{config.replace('@', '-')}.{tag}",
                                                **options, **link)
            self.compressor.algorithm.packs_tensors &= packs
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                                 compression=self.compressor)
            self.timing = self.compressor
        self.optimizer = optimizer
        self._loss = spec.loss
        self.settle: dict | None = None   # what --settle did (Job.warm_up)

    def _optimizer(self, args, adam_path: bool, torch):
        """The configuration's optimizer, timing its own update (scripts/e2e_phases.py: the step's
        breakdown): SGD, torch's AdamW, or hvd_sparse's AdamW for the Adam path."""
        if adam_path and args.optimizer != "adamw":
            raise SystemExit(f"{self.config}: the Adam path's configurations need --optimizer adamw")
        if args.optimizer == "sgd":
            return timed_optimizer(torch.optim.SGD)(self.model.parameters(), lr=args.lr or 0.01)
        import hvd_sparse.torch.optim as optim

        base = optim.AdamW if adam_path else torch.optim.AdamW
        return timed_optimizer(base)(self.model.parameters(), lr=args.lr or 1e-3, weight_decay=0.01)

    def warmup_steps(self, args) -> int:
        """Sparsifiers get more: their thresholds settle (the first step also plans buckets); the
        Adam path's dense steps come first."""
        if self.method in ("horovod", "local"):
            return args.warmup
        dense_steps = self.compressor.algorithm.corrections.dense_steps
        return dense_steps + args.sparse_warmup

    def step(self, x, y) -> list:
        """One training step; seconds of zero_grad + forward, backward (Horovod's hooks and, for
        some methods, the selection run here) and optimizer.step() (waiting for the exchange,
        reconstruction, the update), then the CPU seconds the process spent on it (all threads,
        Horovod's background thread included: a busy wait shows there), then the step's phases
        (scripts/e2e_phases.py)."""
        self.hvd_sparse.set_kernels(self.kernels)   # configurations may take turns step by step
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        self.optimizer.zero_grad()
        loss = self._loss(self.model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.optimizer.step()
        t3 = time.perf_counter()
        cpu = time.process_time() - cpu0
        phases = rank_phases([t0, t1, t2, t3], self.optimizer.update_seconds, self.timing)
        return [t1 - t0, t2 - t1, t3 - t2, cpu, phases]

    def record(self, repeat: int, steps: list[list[float]], batches, stat_steps: int) -> dict:
        """This rank's record of a visit; the statistics come from ``stat_steps`` further untimed
        steps, each followed by stats() (which costs a pass over the residual: kept out of the
        timed steps)."""
        stats = visit_stats(self.step, self.compressor, self.method, self.options, self.numel,
                            batches, stat_steps)
        settle = {"settle": self.settle} if self.settle is not None else {}
        return {"config": self.config, "repeat": repeat, "numel": self.numel, "steps": steps, **stats,
                **settle}


def visit_stats(step: Any, compressor: Any, method: str, options: dict, numel: int, batches: list,
                stat_steps: int) -> dict:
    """A visit's ``STAT_KEYS``: for an hvd_sparse compressor the mean of ``stats()`` over
    ``stat_steps`` further untimed steps (``step(x, y)``); for Horovod's own compressions what
    they send (every entry, in fp32 or fp16); nothing for ``local``. Both workers use it."""
    stats = dict.fromkeys(STAT_KEYS, 0.0)
    if compressor is not None:
        for i in range(stat_steps):
            step(*batches[i % len(batches)])
            current = compressor.stats()
            for key in STAT_KEYS:
                stats[key] += float(current.get(key, 0.0)) / stat_steps
    elif method == "horovod":
        itemsize = 2 if options["compression"] == "fp16" else 4
        stats.update(density_actual=1.0, buildup=1.0, bytes_sent=numel * itemsize,
                     bytes_received=numel * itemsize)
    return stats


def merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """One record per (configuration, repeat): each step's time is its slowest rank's (the job
    moves at that pace), the visit's step time their mean; phases and statistics are averaged
    over ranks and steps."""
    merged = []
    for records in zip(*per_rank, strict=True):
        first = records[0]
        steps = [[r["steps"][i] for r in records] for i in range(len(first["steps"]))]
        step_times = [max(sum(s[:3]) for s in ranks) for ranks in steps]
        # When the last rank finished its backward pass: from then on, the step is the part of
        # the exchange that computation did not hide, reconstruction and the update.
        slowest_compute = [max(s[0] + s[1] for s in ranks) for ranks in steps]
        out = {"config": first["config"], "repeat": first["repeat"], "numel": first["numel"],
               "step_seconds": statistics.fmean(step_times), "step_times": step_times,
               "slowest_compute_seconds": statistics.fmean(slowest_compute),
               "after_compute_seconds": statistics.fmean(
                   t - c for t, c in zip(step_times, slowest_compute, strict=True))}
        for i, phase in enumerate(("forward_seconds", "backward_seconds", "optimizer_step_seconds")):
            out[phase] = statistics.fmean(s[i] for ranks in steps for s in ranks)
        cpu = [s[3] for ranks in steps for s in ranks if len(s) > 3]
        if cpu:
            out["cpu_seconds"] = statistics.fmean(cpu)
        if steps and all(len(s) > 4 for ranks in steps for s in ranks):
            out["phases"] = slowest_rank_phases([[s[4] for s in ranks] for ranks in steps])
        for key in STAT_KEYS:
            out[key] = statistics.fmean(r[key] for r in records)
        if "settle" in first:
            out["settle"] = first["settle"]
        merged.append(out)
    return merged


def bandwidth_probe(allreduce: Any, barrier: Any, megabytes: float, size: int) -> dict:
    """Time raw Horovod allreduces of ``megabytes`` MB of fp32 (median of 3 after one untimed):
    the bus bandwidth (bytes x 2(N-1)/N / time, what each rank's link carries each way in a ring)
    shows whether the emulated network gives what it was set to. The same element count in fp16
    shows what Horovod's fp16 compression gains or costs on this transport. ``allreduce(numel,
    label, i)`` sums ``numel`` ones of dtype ``label`` ("fp32", "fp16") over the ranks and waits
    for it (a framework's own Horovod call); ``barrier()`` aligns the ranks."""
    numel = max(1, int(megabytes * 1e6 / 4))
    out: dict = {"bytes": numel * 4}
    for label in ("fp32", "fp16"):
        times = []
        for i in range(4):
            barrier()
            began = time.perf_counter()
            allreduce(numel, label, i)
            times.append(time.perf_counter() - began)
        out[f"{label}_seconds"] = times[1:]
        out[f"{label}_seconds_median"] = statistics.median(times[1:])
    bus_bits = numel * 4 * 2 * (size - 1) / size * 8
    out["bus_gbit_s_median"] = bus_bits / out["fp32_seconds_median"] / 1e9
    out["bus_gbit_s_best"] = bus_bits / min(out["fp32_seconds"]) / 1e9
    return out


def torch_probe(hvd, torch, megabytes: float, size: int) -> dict:
    """The bandwidth probe through Horovod's PyTorch allreduce."""
    def allreduce(numel: int, label: str, i: int) -> None:
        dtype = torch.float32 if label == "fp32" else torch.float16
        hvd.allreduce(torch.ones(numel, dtype=dtype), name=f"e2e.probe.{label}.{i}", op=hvd.Sum)

    return bandwidth_probe(allreduce, hvd.barrier, megabytes, size)


if __name__ == "__main__":
    main()

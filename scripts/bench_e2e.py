"""End-to-end training step time of real Horovod jobs: dense allreduce, Horovod's fp16
compression and every hvd_sparse method, on loopback and on emulated networks.

    python scripts/bench_e2e.py --quick     # ~4 min: the two target configurations, the target
                                            # methods -> bench/e2e-quick.{json,md}
    python scripts/bench_e2e.py             # full matrix, ~2.5 h on 2 shared cores -> bench/e2e.*
    python scripts/bench_e2e.py --models cnn --nets loopback --sizes 2 4 \
        --configs dense,exdyna,exdyna-tracking,topk,local --rounds 60 --out bench/e2e-compute
                                            # the compute-bound target with many paired steps
    python scripts/bench_e2e.py --models mlp25m --nets 1gbit --sizes 2 \
        --configs dense,exdyna-tracking,exdyna-tracking@ref,topk,topk@ref,deft,deft@ref,lags,lags@ref \
        --out bench/e2e-kernels             # the kernels' targets: "X@ref" is X with the kernels off
                                            # the compute-bound target with many paired steps
    python scripts/bench_e2e.py --models resnet18 --nets loopback --sizes 2 --image-size 112 \
        --configs dense,fp16,local,exdyna-tracking,micro,topk --settle 600 --out bench/e2e-resnet18
                                            # a standard architecture (scripts/models/e2e_models.py:
                                            # resnet18, resnet50, gpt); img/s or tokens/s per rank;
                                            # --settle: a sparsifier whose density has not settled
                                            # after --sparse-warmup (MiCRO's paper start) steps on
    python scripts/bench_e2e.py --framework tensorflow --models mobilenetv2 resnet18 --nets loopback \
        --sizes 2 --out bench/e2e-tf       # the same jobs in TensorFlow (tf-keras,
                                            # hvd.DistributedGradientTape;
                                            # scripts/workers/bench_e2e_tf_worker.py)
    python scripts/bench_e2e.py --resummarize bench/e2e.json   # tables again, no measuring

Each job is one Horovod run of scripts/workers/bench_e2e_worker.py over N ranks, training every
configuration side by side (alternating order across repeats; see the worker's docstring), so
ratios to dense come from the same run, the same machine state and the same ranks.

Networks: ``loopback`` starts ``horovodrun --gloo -np N -H localhost:N`` (ranks talk over lo).
A rate (``10gbit``, ``1gbit``, ``100mbit``) puts every rank in its own network namespace
(scripts/netns.sh: a veth pair per rank into a bridge, both directions shaped with tc tbf), and
starts the ranks the way ``horovodrun --gloo`` does -- Horovod's own rendezvous server (here in
the root namespace, reachable on the bridge) and the same per-rank environment -- except that
each rank runs under ``ip netns exec`` with a host name of its own (local size 1, as on a cluster
of one-rank hosts), so every byte between ranks crosses two shaped links and a bridge. The
namespaces are removed at the end, on error and on Ctrl-C (needs root).

Writes ``<out>.json`` (every visit of every job, the bandwidth probes, the machine) and
``<out>.md`` (tables and the targets, met or not), after every job. Figures are medians over
visits or rounds with quartiles; ratios to dense are taken within each visit or round, then their
median, with a 95% bootstrap interval for the targets' verdicts.

Horovod 0.28.1 binds the Gloo contexts of process sets (the global one included) to the address
the machine's host name resolves to, whatever HOROVOD_GLOO_IFACE says; netns.sh therefore gives
each namespace a hosts file (see there). Without sch_netem in the kernel no latency is added.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from e2e_phases import breakdown_table, phase_targets, summarize_phases
from results import machine_info
from workers import bench_e2e_tf_worker
from workers.bench_e2e_worker import ADAM_PATH, CONFIGS, REFERENCE, UNPACKED, known

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

WORKER = HERE / "workers" / "bench_e2e_worker.py"
WORKERS = {"torch": WORKER, "tensorflow": HERE / "workers" / "bench_e2e_tf_worker.py"}
NETNS = HERE / "netns.sh"
PREFIX = os.environ.get("HVDS_NETNS_PREFIX", "hvds")
SUBNET = os.environ.get("HVDS_NETNS_SUBNET", "10.231.0")
NS_IFACE = f"{PREFIX}eth"
SPARSIFIERS = [c for c in CONFIGS if c not in ("dense", "fp16", "local")]

# Per model: samples per rank per step, and how configurations share the job. mlp25m is the
# communication-bound model of the target (25.2M parameters, little arithmetic per parameter);
# one configuration is alive at a time (13 copies of its residuals would not fit 4 ranks here).
# cnn is the compute-bound one (0.54M parameters): every configuration stays alive and they take
# turns step by step, which keeps small differences measurable on a busy machine.
# The standard architectures (scripts/models/e2e_models.py): resnet18 (11.7M) interleaved like cnn (the
# loopback overhead target is a small difference); resnet50 (25.6M) and gpt (27.4M, 128 tokens per
# sample) one at a time. On one thread here a step of resnet18 at batch 16 takes ~3 s at 224x224,
# ~0.8 s at --image-size 112 and ~0.3 s at 64; gpt at batch 4 ~2.3 s.
WORKLOADS = {"mlp25m": {"batch": 8, "schedule": "blocks"},
             "mlp7m": {"batch": 8, "schedule": "blocks"},
             "cnn": {"batch": 32, "schedule": "interleaved"},
             "resnet18": {"batch": 16, "schedule": "interleaved"},
             "resnet50": {"batch": 8, "schedule": "blocks"},
             "gpt": {"batch": 4, "schedule": "blocks"},
             "word-lstm": {"batch": 16, "schedule": "interleaved"},
             "word-gpt": {"batch": 8, "schedule": "interleaved"},
             # TensorFlow only (tf.keras.applications), as in Horovod's tensorflow2 synthetic benchmark
             "mobilenetv2": {"batch": 8, "schedule": "blocks", "frameworks": ("tensorflow",)}}
TARGET_CONFIGS = ["dense", "fp16", "exdyna", "exdyna-tracking", "topk", "local"]
# repeats: visits of each configuration (blocks of `steps` timed steps); rounds: interleaved
# steps of each configuration.
FULL = {"models": ["mlp25m", "cnn"], "nets": ["loopback", "10gbit", "1gbit", "100mbit"],
        "sizes": [2, 4], "configs": [c for c in CONFIGS if ADAM_PATH not in c], "repeats": 3,
        "rounds": 20, "warmup": 2,
        "sparse_warmup": 12, "steps": 4}
FULL_SKIP = {("cnn", "10gbit"), ("cnn", "100mbit")}   # nothing to learn from a slower network
FULL_EXTRA_REPEATS = {("mlp25m", "1gbit", 4): 5}       # the target configuration
QUICK = {"models": ["mlp25m", "cnn"], "nets": ["1gbit", "loopback"], "sizes": [4],
         "configs": TARGET_CONFIGS, "repeats": 3, "rounds": 10, "warmup": 1, "sparse_warmup": 8,
         "steps": 2}
QUICK_JOBS = {("mlp25m", "1gbit"), ("cnn", "loopback")}

# The targets of issue 7 (end to end).
COMM_BOUND = {"model": "mlp25m", "net": "1gbit", "size": 4}
COMM_RATIO_MAX = 0.35
COMPUTE_BOUND = {"model": "cnn", "net": "loopback"}
COMPUTE_OVERHEAD_MAX = 0.15
# The TensorFlow targets (issue 19), on loopback: throughput as a share of dense's at least this.
TF_THROUGHPUT_MIN = {**dict.fromkeys(("exdyna-tracking", "micro", "deft", "lags"), 0.9),
                     "topk": 0.7, "topk-model": 0.7}
# Issue 20: on loopback, no configuration's ResNet-18 step (kernels on) above this x dense's.
RESNET18_LOOPBACK_MAX = 1.10
# The targets of issue 11 (kernels), on every job that ran the configurations they name: with
# kernels, these are faster than top-k; DEFT within this factor of ExDyna-tracking's step; and no
# configuration slower than itself with the kernels off ("<config>@ref").
FASTER_THAN_TOPK = ("deft", "lags")
DEFT_VS_TRACKING_MAX = 1.3


class StopRequestedError(Exception):
    """SIGTERM or SIGHUP: stop like Ctrl-C (clean up the namespaces and the ranks)."""


def rate_bits(rate: str) -> float | None:
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    return None


def job_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        # scripts/workers/ import the models and helpers of scripts/
        "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        "TF_USE_LEGACY_KERAS": "1",     # Keras 2: what Horovod 0.28.1 and hvd_sparse's Keras face take
        "TF_CPP_MIN_LOG_LEVEL": env.get("TF_CPP_MIN_LOG_LEVEL", "3"),
    })
    env.update(extra or {})
    return env


def run_processes(commands: list[tuple[list[str], dict]], logdir: Path, timeout: float) -> None:
    """Start every rank, wait for all; on a failure, timeout or interrupt kill every rank's
    process group and raise with the logs' tails."""
    procs = []
    try:
        for i, (cmd, env) in enumerate(commands):
            log = open(logdir / f"rank{i}.log", "w")  # noqa: SIM115 -- closed with the process
            procs.append((subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True), log))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p, _ in procs):
            failed = [p for p, _ in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError("a rank failed" if failed else f"job exceeded {timeout:.0f} s")
            time.sleep(0.5)
        if any(p.returncode != 0 for p, _ in procs):
            raise RuntimeError("a rank failed")
    except BaseException as error:
        for p, _ in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p, _ in procs:
            p.wait()
        tails = []
        for i in range(len(procs)):
            text = (logdir / f"rank{i}.log").read_text(errors="replace").splitlines()
            text = [line for line in text if "I0000" not in line and "absl::" not in line]
            tails.append(f"--- rank {i} ---\n" + "\n".join(text[-25:]))
        if isinstance(error, RuntimeError):
            raise RuntimeError(f"{error}\n" + "\n".join(tails)) from None
        raise
    finally:
        for _, log in procs:
            log.close()


def launch_horovodrun(size: int, worker_args: list[str], logdir: Path, timeout: float,
                      worker: Path = WORKER) -> None:
    horovodrun = Path(sys.executable).parent / "horovodrun"
    cmd = [str(horovodrun), "--gloo", "-np", str(size), "-H", f"localhost:{size}",
           sys.executable, str(worker), *worker_args]
    run_processes([(cmd, job_env())], logdir, timeout)


def launch_gloo(size: int, worker_args: list[str], logdir: Path, timeout: float,
                namespaces: bool, worker: Path = WORKER) -> None:
    """Start the ranks of ``worker`` as ``horovodrun --gloo`` would, one host name per rank; with
    ``namespaces`` each rank inside its own network namespace (scripts/netns.sh)."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousServer

    names = [f"{PREFIX}{i}" if namespaces else f"rank{i}" for i in range(size)]
    plan = get_host_assignments(parse_hosts(",".join(f"{n}:1" for n in names)), size)
    server = RendezvousServer(verbose=0)
    port = server.start()
    try:
        server.init(plan)
        address, iface = (f"{SUBNET}.1", NS_IFACE) if namespaces else ("127.0.0.1", "lo")
        common = {k: str(v) for k, v in create_run_env_vars(address, [iface], port).items()}
        commands = []
        for slot in plan:
            env = job_env({**common, **{k: str(v) for k, v in create_slot_env_vars(slot).items()}})
            cmd = [sys.executable, str(worker), *worker_args]
            if namespaces:
                cmd = ["ip", "netns", "exec", names[slot.rank], *cmd]
            commands.append((cmd, env))
        run_processes(commands, logdir, timeout)
    finally:
        server.stop()


def netns(*args: str) -> str:
    result = subprocess.run(["bash", str(NETNS), *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"netns.sh {' '.join(args)} failed:\n{result.stderr}")
    return result.stdout.strip()


# --- summaries --------------------------------------------------------------------------------
def spread(values: list[float]) -> dict:
    """Median, quartiles (inclusive method: within [min, max] even for 2-3 values) and range."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": min(values),
            "max": max(values), "n": len(values)}


def median_ci(values: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of the median (resampling visits or rounds; seeded, so a rerun of
    the summary gives the same interval)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def per_repeat_ratios(recs: list[dict], reference: dict[int, float]) -> list[float]:
    return [r["step_seconds"] / reference[r["repeat"]] for r in recs if r["repeat"] in reference]


def summarize_job(job: dict) -> dict:
    """Per configuration: step time and samples/s (median, [min, max] over repeats), the per-repeat
    ratio to dense within the same repeat (median and range), and the statistics."""
    records = job["records"]
    by_config: dict[str, list[dict]] = {}
    for r in records:
        by_config.setdefault(r["config"], []).append(r)
    dense = {r["repeat"]: r["step_seconds"] for r in by_config.get("dense", [])}
    items = job["batch_per_rank"] * job.get("items_per_sample", 1)   # images, tokens or samples
    topk = {r["repeat"]: r["step_seconds"] for r in by_config.get("topk", [])}
    rows = {}
    for config, recs in by_config.items():
        steps = [r["step_seconds"] for r in recs]
        row = {"step_seconds": spread(steps),
               "samples_per_second": spread([job["size"] * job["batch_per_rank"] / s for s in steps]),
               "throughput_per_rank": spread([items / s for s in steps])}
        ratios = per_repeat_ratios(recs, dense)
        if ratios:
            row["ratio_to_dense"] = {**spread(ratios), "ci95": median_ci(ratios)}
        ratios = per_repeat_ratios(recs, topk)
        if ratios and config != "topk":
            row["ratio_to_topk"] = {**spread(ratios), "ci95": median_ci(ratios)}
        for key in ("density_actual", "buildup", "bytes_sent", "bytes_received", "select_seconds",
                    "comm_wait_seconds", "forward_seconds", "backward_seconds",
                    "optimizer_step_seconds", "slowest_compute_seconds", "after_compute_seconds",
                    "cpu_seconds"):
            if all(key in r for r in recs):  # cpu_seconds: not in runs before it was measured
                row[key] = statistics.fmean(r[key] for r in recs)
        add_limit_and_phases(row, recs, by_config.get("local", []))
        rows[config] = row
    return rows


def add_limit_and_phases(row: dict, recs: list[dict], local: list[dict]) -> None:
    """The row's per-visit ratio to the compute-only configuration ``local`` of the same job (the
    same steps without communication: the limit a method can reach) and its breakdown
    (scripts/e2e_phases.py)."""
    steps = {r["repeat"]: r["step_seconds"] for r in local}
    ratios = per_repeat_ratios(recs, steps)
    if ratios:
        row["ratio_to_local"] = {**spread(ratios), "ci95": median_ci(ratios)}
    phases = summarize_phases(recs)
    if phases is not None:
        row["phases"] = phases


def verdict(median: float, ci: list[float], limit: float) -> str:
    """'met' / 'not met', qualified when the 95% interval of the median straddles the limit."""
    met = median <= limit
    clear = ci[1] <= limit if met else ci[0] > limit
    return ("met" if met else "not met") + ("" if clear else " (within noise)")


def evaluate_targets(jobs: list[dict]) -> list[dict]:
    """The issue's end-to-end targets, for every job of the configurations they name. A verdict
    follows the median; "(within noise)" when the 95% bootstrap interval of the median crosses
    the limit."""
    out = []

    def find(model: str, net: str, size: int | None = None) -> list[dict]:
        return [j for j in torch_jobs if j["model"] == model and j["net"] == net
                and (size is None or j["size"] == size)]

    torch_jobs = [j for j in jobs if j.get("framework", "torch") == "torch"]

    for job in find(**COMM_BOUND):
        rows = job["summary"]
        topk, local = rows.get("topk"), rows.get("local")
        for config in ("exdyna", "exdyna-tracking"):
            row = rows.get(config)
            if row is None or "ratio_to_dense" not in row:
                continue
            ratio = row["ratio_to_dense"]
            vs_topk = row.get("ratio_to_topk")
            ratio_verdict = verdict(ratio["median"], ratio["ci95"], COMM_RATIO_MAX)
            topk_verdict = None if vs_topk is None else verdict(vs_topk["median"], vs_topk["ci95"], 1.0)
            out.append({
                "target": f"{config} step <= {COMM_RATIO_MAX} x dense allreduce and faster than top-k "
                          f"({job['model']}, {job['net']}, {job['size']} ranks)",
                "kind": "communication-bound", "config": config, "size": job["size"],
                "ratio_to_dense": ratio["median"], "ratio_ci95": ratio["ci95"],
                "ratio_quartiles": [ratio["q1"], ratio["q3"]],
                "ratio_to_topk": None if vs_topk is None else vs_topk["median"],
                "ratio_to_topk_ci95": None if vs_topk is None else vs_topk["ci95"],
                "step_ms": 1e3 * row["step_seconds"]["median"],
                "topk_step_ms": None if topk is None else 1e3 * topk["step_seconds"]["median"],
                "density_actual": row["density_actual"],
                "topk_density_actual": None if topk is None else topk["density_actual"],
                "compute_only_ratio_to_dense": None if local is None else local["ratio_to_dense"]["median"],
                "verdict_ratio": ratio_verdict, "verdict_faster_than_topk": topk_verdict,
                "met_ratio": ratio["median"] <= COMM_RATIO_MAX,
                "met_faster_than_topk": None if vs_topk is None else vs_topk["median"] < 1.0,
                "met": bool(ratio["median"] <= COMM_RATIO_MAX and vs_topk is not None
                            and vs_topk["median"] < 1.0),
            })
    for job in find(**COMPUTE_BOUND):
        rows = job["summary"]
        for config in ("exdyna", "exdyna-tracking"):
            row = rows.get(config)
            if row is None or "ratio_to_dense" not in row:
                continue
            ratio = row["ratio_to_dense"]
            out.append({
                "target": f"{config} overhead vs dense <= {COMPUTE_OVERHEAD_MAX:.0%} "
                          f"({job['model']}, {job['net']}, {job['size']} ranks)",
                "kind": "compute-bound", "config": config, "size": job["size"],
                "overhead": ratio["median"] - 1, "overhead_ci95": [x - 1 for x in ratio["ci95"]],
                "overhead_quartiles": [ratio["q1"] - 1, ratio["q3"] - 1],
                "samples": ratio["n"],
                "step_ms": 1e3 * row["step_seconds"]["median"],
                "dense_step_ms": 1e3 * rows["dense"]["step_seconds"]["median"],
                "verdict": verdict(ratio["median"], ratio["ci95"], 1 + COMPUTE_OVERHEAD_MAX),
                "met": ratio["median"] - 1 <= COMPUTE_OVERHEAD_MAX,
            })
    for job in torch_jobs:
        out += kernel_targets(job)
        out += phase_targets(job, verdict)
    for job in jobs:
        out += overhead_targets(job)
    for target in out:
        target["figure"], target["verdict"] = describe_target(target)
    return out


def overhead_targets(job: dict) -> list[dict]:
    """Where communication is cheap (loopback) a sparsifier must not cost: on ResNet-18, in either
    framework, no configuration (kernels on) more than ``RESNET18_LOOPBACK_MAX`` x dense's step
    (issue 20); in TensorFlow also each method's throughput at least ``TF_THROUGHPUT_MIN`` of
    dense's (issue 19). Per-visit ratios to dense, median and 95% bootstrap interval."""
    if job["net"] != "loopback":
        return []
    framework = job.get("framework", "torch")
    where = f"({framework}, {job['model']}, {job['net']}, {job['size']} ranks)"
    out = []
    if framework == "tensorflow":
        for config, share in TF_THROUGHPUT_MIN.items():
            ratio = job["summary"].get(config, {}).get("ratio_to_dense")
            if ratio is not None:
                median, (lo, hi) = ratio["median"], ratio["ci95"]
                out.append(_overhead(config, job, ratio, 1.0 / share,
                                     f"{config} throughput >= {share:g}× dense's {where}",
                                     f"{1 / median:.3f}× dense's throughput ({1 / hi:.3f}–{1 / lo:.3f}), "
                                     f"{ratio['n']} paired visits"))
    if job["model"] == "resnet18":
        for config in job["summary"]:
            ratio = job["summary"][config].get("ratio_to_dense")
            if (config in ("dense", "fp16", "local") or config.endswith((REFERENCE, UNPACKED))
                    or ratio is None):   # the limit is on what users run: kernels on, packed
                continue
            median, (lo, hi) = ratio["median"], ratio["ci95"]
            out.append(_overhead(config, job, ratio, RESNET18_LOOPBACK_MAX,
                                 f"{config} step <= {RESNET18_LOOPBACK_MAX:g}× dense's {where}",
                                 f"{median:.3f}× dense's step ({lo:.3f}–{hi:.3f}), "
                                 f"{ratio['n']} paired visits"))
    return out


def _overhead(config: str, job: dict, ratio: dict, limit: float, claim: str, figure: str) -> dict:
    median, interval = ratio["median"], ratio["ci95"]
    return {"target": claim, "kind": "overhead", "config": config, "size": job["size"],
            "ratio": median, "ratio_ci95": list(interval), "limit": limit, "met": median <= limit,
            "figure": figure, "verdict": verdict(median, list(interval), limit)}


def kernel_targets(job: dict) -> list[dict]:
    """The kernels' targets on one job, each a per-visit step ratio of two configurations of the
    same job (median, 95% bootstrap interval) against a limit."""
    configs = sorted({r["config"] for r in job["records"]})
    pairs = [(c, "topk", 1.0, "faster than top-k") for c in FASTER_THAN_TOPK]
    pairs.append(("deft", "exdyna-tracking", DEFT_VS_TRACKING_MAX,
                  f"within {DEFT_VS_TRACKING_MAX}× of exdyna-tracking"))
    pairs += [(c.removesuffix(REFERENCE), c, 1.0, "no slower with kernels than without")
              for c in configs if c.endswith(REFERENCE)]
    pairs += [(c.removesuffix(UNPACKED), c, 1.0, "no slower packed than in a bucket per tensor")
              for c in configs if c.endswith(UNPACKED)]
    out = []
    for config, reference, limit, claim in pairs:
        if not {config, reference} <= set(configs):
            continue
        steps = {r["repeat"]: r["step_seconds"] for r in job["records"] if r["config"] == reference}
        ratios = per_repeat_ratios([r for r in job["records"] if r["config"] == config], steps)
        if not ratios:
            continue
        median, ci = statistics.median(ratios), median_ci(ratios)
        strict = limit == 1.0 and reference == "topk"   # "faster": a tie does not count
        out.append({
            "target": f"{config} {claim} ({job['model']}, {job['net']}, {job['size']} ranks)",
            "kind": "kernels", "config": config, "reference": reference, "size": job["size"],
            "ratio": median, "ratio_ci95": ci, "samples": len(ratios), "limit": limit,
            "met": median < limit if strict else median <= limit,
            "verdict_ratio": verdict(median, ci, limit),
        })
    return out


def describe_target(t: dict) -> tuple[str, str]:
    """(figure, verdict) of a target as text: what BENCHMARKS.md and the Markdown show."""
    def number(value, spec: str) -> str:
        return "–" if value is None else format(value, spec)

    if t["kind"] in ("limit", "phases", "overhead"):   # worded where they are made
        return t["figure"], t["verdict"]
    if t["kind"] == "kernels":
        lo, hi = t["ratio_ci95"]
        figure = (f"{t['config']} / {t['reference']} step: {t['ratio']:.3f} ({lo:.3f}–{hi:.3f}), "
                  f"{t['samples']} paired visits")
        return figure, t["verdict_ratio"]
    if t["kind"] == "communication-bound":
        lo, hi = t["ratio_ci95"]
        topk_lo, topk_hi = t["ratio_to_topk_ci95"] or (None, None)
        figure = (f"{t['ratio_to_dense']:.3f}× dense ({lo:.3f}–{hi:.3f}); {t['step_ms']:.0f} ms "
                  f"vs top-k {number(t['topk_step_ms'], '.0f')} ms, per-visit ratio to top-k "
                  f"{number(t['ratio_to_topk'], '.2f')} ({number(topk_lo, '.2f')}–"
                  f"{number(topk_hi, '.2f')}); achieved density {t['density_actual']:.2e} vs "
                  f"top-k {number(t['topk_density_actual'], '.2e')}; computation alone "
                  f"{number(t['compute_only_ratio_to_dense'], '.3f')}× dense")
        verdict = (f"ratio: {t['verdict_ratio']}; faster than top-k: "
                   f"{'yes' if t['met_faster_than_topk'] else 'no'}"
                   f"{' (within noise)' if 'noise' in (t['verdict_faster_than_topk'] or '') else ''}")
        return figure, verdict
    lo, hi = t["overhead_ci95"]
    figure = (f"{t['overhead']:+.1%} ({lo:+.1%}–{hi:+.1%}), {t['samples']} paired steps; "
              f"{t['step_ms']:.0f} ms vs dense {t['dense_step_ms']:.0f} ms")
    return figure, t["verdict"]


def input_text(job: dict) -> str:
    """", input 3×112×112" (a sample's shape, as the worker recorded it), or nothing."""
    shape = job.get("input_shape")
    return f", input {'×'.join(map(str, shape))}" if shape else ""


def framework_text(job: dict) -> str:
    """" in TensorFlow" for a TensorFlow job (PyTorch is the default and goes unsaid)."""
    return " in TensorFlow" if job.get("framework") == "tensorflow" else ""


def settle_lines(job: dict) -> list[str]:
    """What ``--settle`` did: the extra untimed steps each sparsifier took before its density
    settled (first visit), or that it did not within the limit."""
    done = {}
    for r in job["records"]:
        done.setdefault(r["config"], r.get("settle"))
    notes = [f"{config} {s['steps']} ({'density' if s['settled'] else 'NOT settled, density'} "
             f"{s['density']:.2e})" for config, s in done.items() if s is not None]
    if not notes:
        return []
    return [f"Settling (`--settle {job.get('settle')}`): extra untimed steps before the timed ones "
            f"until a sparsifier's aggregate density lay within 2x of ρ..N·ρ: {'; '.join(notes)}.", ""]


def markdown(result: dict) -> str:
    lines = [f"### End to end ({result['mode']} run)", ""]
    m = result["machine"]
    lines += [
        f"Machine: {m.get('cpus')} CPUs ({m.get('cpu_model')}), {m.get('memory_gb')} GiB, kernel "
        f"{m.get('kernel')}, shared with other jobs (load average at start "
        f"{result['load_average_start']}). Every rank runs one thread (`OMP_NUM_THREADS=1`, "
        "`torch.set_num_threads(1)`); with 4 ranks on this machine ranks share cores, so the "
        "computation itself is slower than on a dedicated host (the `local` row: same steps, no "
        "communication).",
        "",
        f"Command: `{result['command']}`. Density {result['density']} for every sparsifier. "
        "All configurations of a job run side by side in one Horovod run: `blocks` = per repeat, "
        "each configuration in turn (order rotated and reversed across repeats), built afresh, "
        f"{result['plan']['warmup']} untimed steps ({result['plan']['sparse_warmup']} for "
        "sparsifiers, whose thresholds settle), then the timed steps; `interleaved` = every "
        "configuration alive, one timed step of each per round, order rotated. Each timed step "
        "starts with the ranks aligned (an untimed barrier) and counts until the slowest rank's "
        "`optimizer.step()` returns. Figures: median over visits (blocks) or rounds (interleaved), "
        "[quartiles] in brackets; ratio = step / dense step of the same visit or round, median "
        "[quartiles]. `slowest fwd+bwd`: when the last rank finished its backward pass (mean over "
        "steps; ranks share cores, so it exceeds one rank's computation); `after it`: the rest of "
        "the step -- the exchange the backward pass did not hide, reconstruction, the update; "
        "`CPU ms/rank`: CPU time of a rank's process per step, all its threads. "
        "Statistics (achieved density = aggregated distinct entries / entries, MB this rank sent "
        "per step, selection time, time `optimizer.step()` blocked on collectives) come from a "
        "few untimed steps after the timed ones.",
        "",
        "Networks: `loopback` = `horovodrun --gloo` on one host; a rate = one network namespace "
        "per rank, veth + bridge, both directions of each rank's link shaped with `tc tbf` "
        f"({result['netem_note']}). `probe` = a raw Horovod allreduce's bus bandwidth "
        "(bytes × 2(N−1)/N / time), median of 3.",
        "",
    ]
    for job in result["jobs"]:
        probe = job["probe"]
        lines += [
            f"#### {job['model']}{framework_text(job)} ({job['numel'] / 1e6:.2f}M parameters, batch "
            f"{job['batch_per_rank']}/rank{input_text(job)}), {job['size']} ranks, {job['net']}",
            "",
            f"{job['schedule']}: {job['repeats']} × {job['steps']} timed steps per configuration; "
            f"launcher: {job['launcher']}; {job['wall_seconds']:.0f} s; load average before/after "
            f"{job['load_average_before'][0]:.1f} / {job['load_average_after'][0]:.1f}.",
            "",
            f"probe: {probe['bus_gbit_s_median']:.2f} Gbit/s ({probe['bytes'] / 1e6:.0f} MB allreduce)"
            + (f"; fp16 allreduce of the same element count: {probe['fp16_seconds_median'] * 1e3:.0f} ms"
               f" vs fp32 {probe['fp32_seconds_median'] * 1e3:.0f} ms" if "fp16_seconds_median" in probe
               else ""),
            "",
            f"| config | step ms | {job.get('unit', 'samples/s')} per rank | samples/s | ratio to dense "
            "| achieved density | MB sent/rank/step "
            "| slowest fwd+bwd ms | after it ms | CPU ms/rank | select ms | comm wait ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for config in job["configs"]:
            row = job["summary"].get(config)
            if row is None:
                continue
            st, sp, tp = row["step_seconds"], row["samples_per_second"], row["throughput_per_rank"]
            ratio = row.get("ratio_to_dense")
            ratio_text = "–" if ratio is None else (
                f"{ratio['median']:.3f} [{ratio['q1']:.3f}–{ratio['q3']:.3f}]")
            density = "–" if config == "local" else f"{row['density_actual']:.2e}"
            if config in ("dense", "fp16"):
                density = "1"
            mb = "0" if config == "local" else f"{row['bytes_sent'] / 1e6:.3f}"
            def ms(key: str, digits: int = 0, row: dict = row) -> str:   # "–": not measured
                return f"{row[key] * 1e3:.{digits}f}" if key in row else "–"

            lines.append(
                f"| {config} | {st['median'] * 1e3:.0f} [{st['q1'] * 1e3:.0f}–{st['q3'] * 1e3:.0f}] "
                f"| {tp['median']:.1f} | {sp['median']:.1f} | {ratio_text} | {density} | {mb} "
                f"| {ms('slowest_compute_seconds')} | {ms('after_compute_seconds')} "
                f"| {ms('cpu_seconds')} | {ms('select_seconds', 1)} | {ms('comm_wait_seconds', 1)} |")
        lines.append("")
        lines += settle_lines(job)
        if job.get("framework") == "tensorflow":
            lines += ["A TensorFlow step is one `tf.function` (forward, backward, the distributed "
                      "tape's exchange and the update), timed until its loss is on the host: it has "
                      "no per-phase clocks (–).", ""]
        if any(row.get("phases") for row in job["summary"].values()):
            lines += [*breakdown_table(job), ""]
        lines += fp16_note(job)
    if result["targets"]:
        lines += ["#### Targets", "",
                  "Verdicts follow the median; \"within noise\" where the 95% bootstrap interval "
                  "of the median (in parentheses) crosses the limit.", "",
                  "| target | figure | met |", "|---|---|---|"]
        for t in result["targets"]:
            lines.append(f"| {t['target']} | {t['figure']} | {t['verdict']} |")
        lines.append("")
    return "\n".join(lines)


# Why Horovod's fp16 compression can lose to fp32 on these runs (see fp16_note).
FP16_ON_GLOO = (
    "Horovod's Gloo transport reduces float16 with Gloo's float16 type "
    "(`GlooAlgorithms<gloo::float16>` in horovod/common/ops/gloo_operations.cc), whose sum "
    "converts each element to float and back unless Gloo was compiled with AVX (Horovod's MPI "
    "transport has an F16C-vectorised sum instead); on this stack an fp16 allreduce costs a rank "
    "more CPU than an fp32 one of the same elements, so the reduction, not the link, bounds it "
    "unless the link is slow enough, and in a training step it competes with the backward pass "
    "for the same cores. The probe runs alone on a quiet link, where the halved bytes win.")


def fp16_note(job: dict) -> list[str]:
    """Where Horovod's fp16 compression stands in this job against dense, and why."""
    ratio = job["summary"].get("fp16", {}).get("ratio_to_dense")
    probe = job["probe"]
    if ratio is None or "fp16_seconds_median" not in probe:
        return []
    probe_ratio = probe["fp16_seconds_median"] / probe["fp32_seconds_median"]
    verdict = "faster than" if ratio["median"] < 1.0 else "no faster than"
    return [f"fp16 is {verdict} dense in this job ({ratio['median']:.2f}x dense's step), while "
            f"the probe's fp16 allreduce took {probe_ratio:.2f}x fp32's time with half the bytes. "
            + FP16_ON_GLOO, ""]


def netem_available() -> bool:
    try:
        return "CONFIG_NET_SCH_NETEM=" in subprocess.run(
            ["bash", "-c", "zcat /proc/config.gz 2>/dev/null | grep NET_SCH_NETEM"],
            capture_output=True, text=True, check=False).stdout
    except OSError:
        return False


def build_parser() -> argparse.ArgumentParser:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="the two target configurations, the target methods, fewer repeats "
                             "(a few minutes)")
    parser.add_argument("--framework", choices=sorted(WORKERS), default="torch",
                        help="the jobs' framework: PyTorch (hvd.DistributedOptimizer) or TensorFlow "
                             "(tf-keras, hvd.DistributedGradientTape; "
                             "scripts/workers/bench_e2e_tf_worker.py)")
    parser.add_argument("--models", nargs="+", choices=sorted(WORKLOADS))
    parser.add_argument("--nets", nargs="+", help="loopback and/or tc rates (e.g. 10gbit 1gbit 100mbit)")
    parser.add_argument("--sizes", nargs="+", type=int)
    parser.add_argument("--configs", help=f"comma-separated, from {', '.join(CONFIGS)}")
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="what the jobs step (AdamW: lr 1e-3, weight decay 0.01; the "
                             "'<method>+adam' configurations need it)")
    parser.add_argument("--image-size", type=int,
                        help="image side of the ResNets and cnn (default: 224 and 32); e.g. 112 or "
                             "64 on a slow host: same parameters, ~size^2 less computation")
    parser.add_argument("--repeats", type=int, help="visits per configuration (blocks schedule)")
    parser.add_argument("--rounds", type=int, help="steps per configuration (interleaved schedule)")
    parser.add_argument("--warmup", type=int, help="untimed steps of dense, fp16 and local")
    parser.add_argument("--sparse-warmup", type=int, help="untimed steps of each sparsifier")
    parser.add_argument("--settle", type=int,
                        help="after --sparse-warmup, at most this many more untimed steps of a "
                             "sparsifier until its aggregate density is settled (within 2x of "
                             "density..N*density; e.g. MiCRO's paper start takes hundreds)")
    parser.add_argument("--steps", type=int, help="timed steps per visit (blocks schedule)")
    parser.add_argument("--schedule", choices=("blocks", "interleaved"),
                        help="override the model's schedule (WORKLOADS): interleaved keeps every "
                             "configuration alive and steps them in turn, so drifts of a shared "
                             "machine hit all alike")
    parser.add_argument("--delay", default="", help="one-way delay per link direction (needs sch_netem)")
    parser.add_argument("--loopback-launcher", choices=["horovodrun", "direct"], default="horovodrun",
                        help="direct: the namespace launcher's way, without namespaces, on lo")
    parser.add_argument("--job-timeout", type=float, default=3600)
    parser.add_argument("--resummarize", metavar="JSON",
                        help="recompute the summaries, targets and Markdown of an earlier run's "
                             "JSON (written back beside it, or to --out) without measuring")
    parser.add_argument("--out", help="output path without extension "
                                      "(default bench/e2e, or bench/e2e-quick with --quick)")
    return parser


def resummarize(source: Path, out: str | None) -> None:
    """Summaries, targets and Markdown again from an earlier run's JSON, without measuring."""
    result = json.loads(source.read_text())
    for job in result["jobs"]:
        job["summary"] = summarize_job(job)
    result["targets"] = evaluate_targets(result["jobs"])
    write(Path(out) if out else source.with_suffix(""), result)


def make_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The quick or full plan with the command line's overrides; unknown configurations refused."""
    plan = dict(QUICK if args.quick else FULL)
    for key in ("models", "nets", "sizes", "repeats", "rounds", "warmup", "sparse_warmup", "settle", "steps"):
        if getattr(args, key) is not None:
            plan[key] = getattr(args, key)
    if args.configs:
        plan["configs"] = args.configs.split(",")
    if "local" not in plan["configs"]:   # the compute-only row: every table has the limit
        plan["configs"] = [*plan["configs"], "local"]
    plan["framework"] = args.framework
    tensorflow = args.framework == "tensorflow"
    for c in plan["configs"]:
        if not (bench_e2e_tf_worker.known(c) if tensorflow else known(c)):
            extra = f", {', '.join(bench_e2e_tf_worker.TF_CONFIGS)}" if tensorflow else ""
            parser.error(f"unknown configuration {c!r}; known: {', '.join(CONFIGS)}{extra}, and any "
                         f"sparsifier with {REFERENCE} (the same with the kernels off)")
    adam_path = [c for c in plan["configs"] if ADAM_PATH in c]
    if adam_path and args.optimizer != "adamw":
        parser.error(f"{', '.join(adam_path)}: the Adam path's configurations need --optimizer adamw")
    for model in plan["models"]:
        if args.framework not in WORKLOADS[model].get("frameworks", tuple(WORKERS)):
            parser.error(f"model {model!r} exists only in {', '.join(WORKLOADS[model]['frameworks'])}: "
                         "pass --framework accordingly")
    return plan


def plan_jobs(plan: dict, quick: bool, explicit: bool) -> list[tuple[str, str, int]]:
    """(model, net, size) of every job, the target configurations first: an interrupted run has
    measured them."""
    jobs = []
    for model in plan["models"]:
        for net in plan["nets"]:
            wanted = (model, net) in QUICK_JOBS if quick else (model, net) not in FULL_SKIP
            if not (explicit or wanted):
                continue
            for size in plan["sizes"]:
                jobs.append((model, net, size))
    targets = {(COMM_BOUND["model"], COMM_BOUND["net"], COMM_BOUND["size"])}
    targets |= {(COMPUTE_BOUND["model"], COMPUTE_BOUND["net"], size) for size in plan["sizes"]}
    jobs.sort(key=lambda job: job not in targets)
    return jobs


def check_networks(jobs: list[tuple[str, str, int]], delay: str, parser: argparse.ArgumentParser) -> None:
    """Refuse rates tc cannot read, emulated networks without root, and a delay without netem."""
    shaped = [net for _, net, _ in jobs if net != "loopback"]
    for net in shaped:
        if rate_bits(net) is None:
            parser.error(f"network {net!r}: use loopback or a tc rate such as 1gbit or 100mbit")
    if shaped and os.geteuid() != 0:
        parser.error("emulated networks need root (network namespaces, veth, tc); "
                     "run as root or use --nets loopback")
    if delay and not netem_available():
        parser.error("--delay needs tc netem, which this kernel lacks (CONFIG_NET_SCH_NETEM)")


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP end the run as Ctrl-C does: results so far kept, namespaces removed."""
    def on_signal(signum, frame):
        raise StopRequestedError(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)


def new_result(args: argparse.Namespace, plan: dict, explicit: bool) -> dict:
    """The run's record before any job: command, machine, plan."""
    return {
        "mode": "quick" if args.quick else ("custom" if explicit or args.configs else "full"),
        "command": "python scripts/bench_e2e.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(), "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "density": args.density, "plan": plan, "delay": args.delay or None,
        "netem_note": ("no added delay: this kernel has no sch_netem" if not netem_available()
                       else (f"delay {args.delay} per direction" if args.delay else "no added delay")),
        "jobs": [], "targets": [],
    }


def worker_arguments(model: str, net: str, size: int, plan: dict, args: argparse.Namespace,
                     explicit: bool, out: Path) -> tuple[list[str], str, int, int]:
    """The worker's command line for one job, and its schedule, repeats and timed steps."""
    batch, schedule = WORKLOADS[model]["batch"], args.schedule or WORKLOADS[model]["schedule"]
    bits = rate_bits(net)
    # The probe moves about 0.3 s of traffic at the emulated rate (capped at 64 MB).
    probe_mb = 64.0 if bits is None else min(64.0, bits * 0.3 / 8 / 1e6 / (2 * (size - 1) / size))
    steps = plan["steps"]
    if bits is not None and bits < 5e8 and model == "mlp25m":
        steps = min(steps, 2)  # a dense step moves ~150 MB per link at 4 ranks
    if schedule == "interleaved":
        repeats, steps = plan["rounds"], 1
    else:
        repeats = plan["repeats"]
        if not (args.quick or explicit or args.repeats):
            repeats = FULL_EXTRA_REPEATS.get((model, net, size), repeats)
    worker_args = ["--model", model, "--batch", str(batch), "--configs", ",".join(plan["configs"]),
                   "--density", str(args.density), "--repeats", str(repeats),
                   "--optimizer", args.optimizer,
                   *(["--image-size", str(args.image_size)] if args.image_size else []),
                   "--schedule", schedule,
                   "--warmup", str(plan["warmup"]), "--sparse-warmup", str(plan["sparse_warmup"]),
                   "--settle", str(plan.get("settle", 0)), "--steps", str(steps),
                   "--probe-mb", f"{probe_mb:.3f}", "--out", str(out)]
    return worker_args, schedule, repeats, steps


def run_job(model: str, net: str, size: int, plan: dict, args: argparse.Namespace, explicit: bool,
            workdir: Path) -> dict:
    """One Horovod job on its network; its result, with its summary."""
    jobdir = workdir / f"{model}-{net}-{size}"
    jobdir.mkdir()
    worker_args, schedule, repeats, steps = worker_arguments(model, net, size, plan, args, explicit,
                                                             jobdir / "result.json")
    print(f"[bench_e2e] {model} batch {WORKLOADS[model]['batch']}/rank, {size} ranks, {net}: "
          f"{len(plan['configs'])} configurations, {schedule}, {repeats} x {steps} timed steps each",
          flush=True)
    load_before = [round(x, 2) for x in os.getloadavg()]
    began = time.time()
    worker = WORKERS[plan.get("framework", "torch")]
    if net == "loopback":
        if args.loopback_launcher == "horovodrun":
            launch_horovodrun(size, worker_args, jobdir, args.job_timeout, worker)
        else:
            launch_gloo(size, worker_args, jobdir, args.job_timeout, namespaces=False, worker=worker)
        launcher = f"{args.loopback_launcher} (lo)"
    else:
        print("[bench_e2e]   " + netns("up", str(size), net, *([args.delay] if args.delay else [])),
              flush=True)
        launch_gloo(size, worker_args, jobdir, args.job_timeout, namespaces=True, worker=worker)
        launcher = "gloo in network namespaces"
    job = json.loads((jobdir / "result.json").read_text())
    job.setdefault("framework", "torch")
    job.update(net=net, launcher=launcher, wall_seconds=round(time.time() - began, 1),
               load_average_before=load_before,
               load_average_after=[round(x, 2) for x in os.getloadavg()])
    job["summary"] = summarize_job(job)
    return job


def print_job(job: dict, configs: list[str]) -> None:
    """Each configuration's median step time and ratio to dense."""
    for config in configs:
        row = job["summary"].get(config)
        if row:
            ratio = row.get("ratio_to_dense", {}).get("median", float("nan"))
            limit = row.get("ratio_to_local", {}).get("median", float("nan"))
            print(f"[bench_e2e]   {config:16s} {row['step_seconds']['median'] * 1e3:8.1f} ms "
                  f"x{ratio:.3f} dense x{limit:.3f} local", flush=True)


def run_jobs(jobs: list[tuple[str, str, int]], plan: dict, args: argparse.Namespace, explicit: bool,
             result: dict, out: Path) -> None:
    """Every job in turn, writing the results after each; namespaces and work folder removed at
    the end, on error and on Ctrl-C."""
    workdir = Path(tempfile.mkdtemp(prefix="bench_e2e."))
    try:
        for model, net, size in jobs:
            job = run_job(model, net, size, plan, args, explicit, workdir)
            result["jobs"].append(job)
            print_job(job, plan["configs"])
            result["targets"] = evaluate_targets(result["jobs"])
            write(out, result)  # after every job: an interrupted run keeps what it measured
    except (KeyboardInterrupt, StopRequestedError):
        print("[bench_e2e] interrupted; results so far are in " + str(out) + ".json", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if any(net != "loopback" for _, net, _ in jobs):
            try:
                netns("down")
            except RuntimeError as error:
                print(error, file=sys.stderr)
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    """Measure (or, with ``--resummarize``, summarize again) and write the results."""
    parser = build_parser()
    args = parser.parse_args()
    if args.resummarize:
        resummarize(Path(args.resummarize), args.out)
        return
    plan = make_plan(args, parser)
    explicit = any(v is not None for v in (args.models, args.nets, args.sizes))
    out = Path(args.out or (REPO / "bench" / ("e2e-quick" if args.quick else "e2e")))
    out.parent.mkdir(parents=True, exist_ok=True)
    jobs = plan_jobs(plan, args.quick, explicit)
    check_networks(jobs, args.delay, parser)
    stop_on_signals()
    result = new_result(args, plan, explicit)
    run_jobs(jobs, plan, args, explicit, result, out)
    write(out, result)
    for t in result["targets"]:
        print(f"[bench_e2e] target: {t['target']}: {'met' if t['met'] else 'NOT met'}")
    print(f"[bench_e2e] wrote {out}.json and {out}.md")


def write(out: Path, result: dict) -> None:
    Path(f"{out}.json").write_text(json.dumps(result, indent=1))
    Path(f"{out}.md").write_text(markdown(result))


if __name__ == "__main__":
    main()

"""A real transformer under AdamW: examples/gpt2.py's Hugging Face GPT-2 in both faces.

Every run is a real 2-rank job of the example (torchrun for the DDP hook, horovodrun --gloo for
the Horovod face), 600 steps, AdamW (lr 1e-3, weight decay 0.01), the same seeds and data; only
the exchange changes:

* ``dense``: the plain average (DDP's allreduce, Horovod's), torch's AdamW;
* ``<method>``: the method as users ran it before the Adam path: torch's AdamW on its sparse
  average (``--plain``);
* ``<method>+adam``: the method on the Adam path (``hvd_sparse.torch.optim.AdamW`` as
  ``optimizer=``; 100 dense steps, then error feedback on each rank's update).

What a run reports: the training loss (mean of the last 10 steps' rank-mean losses, the issue's
measure), the held-out loss on 8 k held-out bytes, and the bytes a rank put into collectives against
a dense allreduce's over every step, dense steps included.

The targets (issue 35): at ρ = 0.01 and at most 25% of dense's bytes, ExDyna on the path at most
1.30x dense's loss and DEFT at most 1.35x, in both faces; moonshot at most 1.10x.

    OMP_NUM_THREADS=1 python scripts/gpt2_adam.py            # about 15 minutes here
    OMP_NUM_THREADS=1 python scripts/gpt2_adam.py --quick    # 150 steps, two runs a face

Writes bench/gpt2-adam.{json,md} (``--quick``: bench/quick/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import machine_info, output_dir

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EXAMPLE = REPO / "examples" / "gpt2.py"
# name: (method, example arguments)
RUNS = {
    "dense": ("dense", []),
    "exdyna-tracking": ("exdyna", ["--option", "threshold_scaling=tracking", "--plain"]),
    "exdyna-tracking+adam": ("exdyna", ["--option", "threshold_scaling=tracking"]),
    "deft": ("deft", ["--plain"]),
    "deft+adam": ("deft", []),
    "topk": ("topk", ["--plain"]),
    "topk+adam": ("topk", []),
}
QUICK_RUNS = ("dense", "exdyna-tracking+adam")
FACES = ("ddp", "horovod")
TARGETS = {"exdyna-tracking+adam": 1.30, "deft+adam": 1.35}
MOONSHOT = 1.10
BYTES_SHARE = 0.25


def command(face: str, method: str, extra: list[str], steps: int, density: float, out: Path) -> list[str]:
    """The job's command line: the example under torchrun or horovodrun on 2 ranks."""
    example = [str(EXAMPLE), "--method", method, "--density", str(density), "--steps", str(steps),
               "--log-every", str(max(steps // 6, 1)), "--out", str(out), "--face", face, *extra]
    if face == "ddp":
        return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", *example]
    return [str(BIN / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, *example]


def run(face: str, name: str, steps: int, density: float) -> dict:
    method, extra = RUNS[name]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        started = time.perf_counter()
        job = subprocess.run(command(face, method, extra, steps, density, out), cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=1200, check=False)
        if job.returncode != 0:
            tail = (job.stdout + job.stderr)[-3000:]
            raise SystemExit(f"{face}/{name} failed (exit {job.returncode}):\n{tail}")
        record = json.loads(out.read_text())
    record.update(name=name, wall_seconds=time.perf_counter() - started)
    print(f"{face:8s} {name:22s} train {record['train_loss']:.4f}  held-out {record['held_out_loss']:.4f}  "
          f"bytes {record['bytes_sent'] / record['dense_bytes']:.3f} x dense  {record['seconds']:.0f} s",
          flush=True)
    return record


def table(records: list[dict]) -> str:
    """The Markdown table: each run beside its face's dense run."""
    dense = {r["face"]: r for r in records if r["name"] == "dense"}
    lines = ["| face | run | training loss | x dense | held-out loss | x dense | bytes / dense | target |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        base = dense[r["face"]]
        ratio = r["train_loss"] / base["train_loss"]
        share = r["bytes_sent"] / r["dense_bytes"]
        target = TARGETS.get(r["name"])
        verdict = "" if target is None else (
            ("met" if ratio <= target and share <= BYTES_SHARE else "NOT met") + f" (<= {target:.2f}x)"
            + (", moonshot met" if ratio <= MOONSHOT else ""))
        lines.append(f"| {r['face']} | {r['name']} | {r['train_loss']:.3f} | {ratio:.3f} | "
                     f"{r['held_out_loss']:.3f} | {r['held_out_loss'] / base['held_out_loss']:.3f} | "
                     f"{share:.3f} | {verdict} |")
    return "\n".join(lines)


def targets(records: list[dict]) -> list[dict]:
    """The issue's targets as scripts/report.py collects them, per face."""
    dense = {r["face"]: r for r in records if r["name"] == "dense"}
    out = []
    for r in records:
        limit = TARGETS.get(r["name"])
        if limit is None:
            continue
        ratio = r["train_loss"] / dense[r["face"]]["train_loss"]
        share = r["bytes_sent"] / r["dense_bytes"]
        out.append({"target": f"GPT-2 example, {r['name']} at most {limit:.2f}x dense AdamW's loss with at "
                              f"most {BYTES_SHARE:.0%} of its bytes ({r['face']} face, 2 ranks)",
                    "met": bool(ratio <= limit and share <= BYTES_SHARE),
                    "figure": f"{ratio:.3f}x, {share:.1%} of dense's bytes"})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="150 steps, dense and ExDyna on the path")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=None)
    parser.add_argument("--faces", nargs="+", choices=FACES, default=list(FACES))
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    steps = args.steps or (150 if args.quick else 600)
    names = args.runs or (QUICK_RUNS if args.quick else tuple(RUNS))
    if "dense" not in names:
        names = ("dense", *names)
    records = [run(face, name, steps, args.density) for face in args.faces for name in names]
    folder = output_dir(args.out_dir, args.quick)
    summary = {"steps": steps, "density": args.density, "ranks": 2, "machine": machine_info(),
               "command": " ".join(["python", "scripts/gpt2_adam.py", *(argv or sys.argv[1:])]),
               "records": records, "targets": targets(records)}
    (folder / "gpt2-adam.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = (f"# GPT-2 under AdamW, 2 ranks, {steps} steps, density {args.density}\n\n"
            f"`{summary['command']}`\n\n{table(records)}\n")
    (folder / "gpt2-adam.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

"""Assemble BENCHMARKS.md from the results the benchmark scripts wrote under bench/.

Nothing here is typed by hand: every figure comes from a JSON or Markdown file a script wrote
(scripts/bench_select.py, scripts/fidelity.py, scripts/convergence.py, scripts/bench_e2e.py),
and each target is evaluated from those JSON files.

    python scripts/report.py [--bench-dir bench] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import posixpath
import re
from importlib import metadata
from pathlib import Path

from results import machine_info

SECTIONS = [  # (fragment, title, the full run's command; every script's docstring has the rest)
    ("select.md", "Selection cost, kernels on and off",
     "python scripts/bench_select.py --sizes 25e6 --world-sizes --repeats 3 --kernels on off "
     "--out-dir bench"),
    ("select-1e8/select.md", "Selection cost at 1e8 elements, kernels on and off",
     "python scripts/bench_select.py --sizes 1e8 --world-sizes --repeats 3 --kernels on off "
     "--methods exdyna micro topk lags deft dgc gaussiank --no-tensorflow --out-dir bench/select-1e8"),
    ("select-momentum/select.md", "Selection cost with the momentum correction (momentum=0.9)",
     "python scripts/bench_select.py --sizes 25e6 --world-sizes --repeats 9 --kernels on off "
     "--methods exdyna micro --momentum 0.9 --no-tensorflow --out-dir bench/select-momentum"),
    ("select-tf/select.md", "Selection cost on the TensorFlow backend, every method",
     "python scripts/bench_select.py --sizes 25e6 --world-sizes --repeats 3 --kernels on "
     "--out-dir bench/select-tf"),
    ("fidelity.md", "Fidelity: density error, imbalance, build-up", "python scripts/fidelity.py"),
    ("convergence.md", "Convergence", "python scripts/convergence.py"),
    ("convergence-long/convergence.md", "Convergence over a longer budget (char-LSTM)",
     "python scripts/convergence.py --tasks lstm --methods dense exdyna-tracking topk "
     "--densities 0.01 --steps 6000 --out-dir bench/convergence-long"),
    ("convergence-10k/convergence.md",
     "Convergence over 10,000 steps at ρ = 0.001 with the corrections (char-LSTM)",
     "python scripts/convergence.py --long"),
    ("e2e.md", "End to end", "python scripts/bench_e2e.py  (root: network namespaces)"),
    ("e2e-compute.md", "End to end, compute-bound, many paired steps",
     "python scripts/bench_e2e.py --models cnn --nets loopback --sizes 2 4 "
     "--configs dense,exdyna,exdyna-tracking,topk,local --rounds 60 --out bench/e2e-compute"),
    ("e2e-nets.md", "End to end across networks (7M-parameter MLP, 4 ranks)",
     "python scripts/bench_e2e.py --models mlp7m --nets 10gbit 100mbit --sizes 4 "
     "--configs dense,fp16,exdyna,exdyna-tracking,topk,dgc,local --out bench/e2e-nets"),
    ("e2e-kernels.md", "End to end with the kernels on and off (`X@ref`: kernels off)",
     "python scripts/bench_e2e.py --models mlp25m --nets 1gbit --sizes 2 --configs "
     "dense,exdyna-tracking,exdyna-tracking@ref,topk,topk@ref,deft,deft@ref,lags,lags@ref "
     "--repeats 5 --steps 3 --sparse-warmup 8 --out bench/e2e-kernels"),
    ("e2e-phases.md", "End to end: where the step's time goes (mlp25m, 1 Gbit/s, 2 ranks)",
     "python scripts/bench_e2e.py --models mlp25m --nets 1gbit --sizes 2 --configs "
     "dense,fp16,local,exdyna-tracking,micro,deft,lags,topk,dgc --repeats 5 --steps 3 "
     "--sparse-warmup 8 --out bench/e2e-phases  (root: network namespaces)"),
    ("e2e-models.md", "End to end on a standard architecture (ResNet-18, loopback)",
     "python scripts/bench_e2e.py --models resnet18 --nets loopback --sizes 2 --image-size 64 "
     "--configs dense,fp16,local,exdyna-tracking,micro,deft,lags,topk,dgc --rounds 36 --settle 600 "
     "--out bench/e2e-models; the same with --models resnet50 gpt --nets 1gbit "
     "(root) into bench/e2e-models-1gbit"),
    ("e2e-models-1gbit.md", "End to end on standard architectures at 1 Gbit/s (ResNet-50, GPT)",
     "python scripts/bench_e2e.py --models resnet50 gpt --nets 1gbit --sizes 2 --image-size 64 "
     "--repeats 3 --out bench/e2e-models-1gbit  (root: network namespaces)"),
    ("e2e-models-loopback.md", "End to end on standard architectures on loopback (ResNet-50, GPT)",
     "python scripts/bench_e2e.py --models resnet50 gpt --nets loopback --sizes 2 --image-size 64 "
     "--configs dense,fp16,local,exdyna-tracking,micro,deft,lags,topk,dgc --repeats 2 --steps 2 "
     "--out bench/e2e-models-loopback"),
    ("e2e-tf.md", "End to end in TensorFlow (MobileNetV2, 2 ranks, loopback)",
     "python scripts/bench_e2e.py --framework tensorflow --models mobilenetv2 --nets loopback "
     "--sizes 2 --configs dense,fp16,local,exdyna-tracking,micro,deft,lags,topk,topk-model,dgc "
     "--repeats 2 --steps 3 --out bench/e2e-tf"),
    ("e2e-tf-models.md", "End to end in TensorFlow on a standard architecture (ResNet-18, loopback)",
     "python scripts/bench_e2e.py --framework tensorflow --models resnet18 --nets loopback --sizes 2 "
     "--image-size 64 --configs dense,fp16,local,exdyna-tracking,micro,deft,lags,topk,topk-model,dgc "
     "--rounds 10 --out bench/e2e-tf-models"),
    ("e2e-tf-models-quiet.md", "End to end in TensorFlow on ResNet-18 again: current code, a quiet machine",
     "python scripts/bench_e2e.py --framework tensorflow --models resnet18 --nets loopback --sizes 2 "
     "--image-size 64 --configs dense,fp16,local,exdyna-tracking,micro,deft,lags,topk,topk-model,dgc "
     "--rounds 10 --settle 600 --out bench/e2e-tf-models-quiet (after DEFT's one-pass TF norms; the "
     "section above ran on older code while other jobs loaded the machine; every method's ratio moved, "
     "those whose code did not change too)"),
    ("e2e-tf-models-inplace.md", "End to end in TensorFlow on ResNet-18: residuals written in place",
     "python scripts/bench_e2e.py --framework tensorflow --models resnet18 --nets loopback --sizes 2 "
     "--image-size 64 --configs dense,fp16,local,exdyna-tracking,micro,deft,lags,topk,topk-model,dgc "
     "--rounds 10 --settle 600 --out bench/e2e-tf-models-inplace (after the in-place TF ops: no "
     "bucket-sized tensor allocated per step, see docs/kernels.md#tensorflow)"),
    ("e2e-tf-models-eager.md",
     "End to end in TensorFlow on ResNet-18: fewer eager ops per call, on a faster machine",
     "python scripts/bench_e2e.py --framework tensorflow --models resnet18 --nets loopback --sizes 2 "
     "--image-size 64 --configs dense,fp16,local,exdyna-tracking,micro,deft,lags,topk,topk-model,dgc "
     "--rounds 10 --settle 600 --out bench/e2e-tf-models-eager (after the op wrappers lost their "
     "per-call eager ops and DEFT selects in one op call, docs/kernels.md#tensorflow; this machine "
     "computed the same dense step in 0.41 s against 1.95 s in the section above, so every fixed "
     "cost of a sparsifier weighs about 4.8 times as much against dense)"),
    ("time-to-accuracy/tta.md", "Time to accuracy (word-level LSTM)",
     "python scripts/time_to_accuracy.py --curves --sizes 2 4 (4 ranks: configurations split "
     "over two --out-dir runs side by side, then --merge-from their tta.json); --step-times-from "
     "bench/time-to-accuracy/step-times.json bench/time-to-accuracy/step-times-4.json; "
     "--validate exdyna-tracking@1gbit (root); see the script's docstring"),
    ("time-to-accuracy-gpt/tta.md", "Time to accuracy (the transformer task, AdamW)",
     "python scripts/time_to_accuracy.py --task gpt --curves --step-times (root: network "
     "namespaces)"),
    ("ddp.md", "DDP communication hooks on loopback (torchrun)",
     "python scripts/bench_ddp.py --model mlp7m --repeats 5 --steps 10 --warmup 10 --out-dir bench"),
    ("ddp-1gbit/ddp.md", "DDP communication hooks at 1 Gbit/s, beside the Horovod face",
     "python scripts/bench_ddp.py --net 1gbit --horovod --model mlp25m --size 2 --repeats 5 "
     "--out-dir bench/ddp-1gbit  (root: network namespaces)"),
    ("sim_scale.md", "Simulator scale", "python scripts/sim_scale.py"),
    ("soak.md", "Soak (2 ranks, 3000 steps per method)", "python scripts/soak.py"),
    ("e2e-models-dgc.md",
     "End to end on ResNet-18 in PyTorch again: DGC's one-call selection, on the faster machine",
     "python scripts/bench_e2e.py --models resnet18 --nets loopback --sizes 2 --image-size 64 "
     "--configs dense,fp16,local,exdyna-tracking,micro,deft,lags,topk,dgc --rounds 30 --settle 600 "
     "--out bench/e2e-models-dgc (section 14's job on the machine of section 21, after DGC selects "
     "in one kernel call, docs/kernels.md)"),
    ("e2e-tf-models-dgc.md",
     "End to end in TensorFlow on ResNet-18: DGC's one-call selection, cheaper eager calls",
     "python scripts/bench_e2e.py --framework tensorflow --models resnet18 --nets loopback --sizes 2 "
     "--image-size 64 --configs dense,fp16,local,exdyna-tracking,micro,deft,lags,topk,topk-model,dgc "
     "--rounds 20 --settle 600 --out bench/e2e-tf-models-dgc (after DGC selects in one op call and "
     "the TensorFlow backend calls tf.raw_ops with cached constants, docs/kernels.md#tensorflow)"),
    ("e2e-tf-models-dgc30.md",
     "End to end in TensorFlow on ResNet-18: the same code again, 30 rounds",
     "python scripts/bench_e2e.py --framework tensorflow --models resnet18 --nets loopback --sizes 2 "
     "--image-size 64 --configs dense,fp16,local,exdyna-tracking,micro,deft,lags,topk,topk-model,dgc "
     "--rounds 30 --settle 600 --out bench/e2e-tf-models-dgc30 (the section above's job on the same "
     "code 40 minutes later, on a quieter machine: dense's step 350 ms against 399 ms; both runs "
     "are kept, the Targets table reads this one, the larger)"),
    ("e2e-tf-models-packed.md",
     "End to end in TensorFlow on ResNet-18: TopK and DGC per tensor in one packed bucket",
     "python scripts/bench_e2e.py --framework tensorflow --models resnet18 --nets loopback --sizes 2 "
     "--image-size 64 --configs dense,fp16,local,exdyna-tracking,micro,deft,lags,topk,topk-model,dgc "
     "--rounds 30 --settle 600 --out bench/e2e-tf-models-packed (after TensorFlow's per-tensor TopK "
     "and DGC run as one bucket selecting per tensor, docs/architecture.md#tensorflow-face; the "
     "Targets table reads this run. This session's machine computed the model six times slower "
     "than section 29's, dense's step 2196 ms against 350 ms, which dilutes the sparsifiers' fixed "
     "cost in the ratios: section 31 measures the exchange alone)"),
    ("tf-packing.md", "TensorFlow's per-tensor steps packed or a bucket per tensor: the exchange alone",
     "python scripts/investigations/tf_packing.py --rounds 30 --out-dir bench"),
    ("e2e-models-packed.md",
     "End to end on ResNet-18 in PyTorch: TopK and DGC per tensor packed, or a bucket per tensor",
     "python scripts/bench_e2e.py --models resnet18 --nets loopback --sizes 2 --image-size 64 "
     "--configs dense,local,topk,topk-unpacked,dgc,dgc-unpacked --rounds 20 --settle 600 "
     "--out bench/e2e-models-packed (after PyTorch's Horovod and DDP faces pack per-tensor TopK and "
     "DGC into buckets of up to 2^22 entries, docs/architecture.md#pytorch-face; `-unpacked` is "
     "the same method with a bucket per tensor, side by side. The Targets table's TopK and DGC "
     "rows for PyTorch read this run, the other methods' section 27. This machine computes "
     "ResNet-18 about 2.5 times slower than section 27's: dense's step 1049 ms against 411 ms)"),
    ("e2e-models-corr-packed.md",
     "End to end on ResNet-18 in PyTorch with the corrections: small tensors bundled densely",
     "python scripts/bench_e2e.py --models resnet18 --nets loopback --sizes 2 --image-size 64 "
     "--configs dense,local,topk+corr,topk+corr-unpacked,dgc+corr,dgc+corr-unpacked --rounds 20 "
     "--settle 600 --out bench/e2e-models-corr-packed (TopK and DGC with the recommended "
     "corrections in their steady state: momentum correction and dense_below=1024. Packed, the "
     "41 tensors under 1024 entries go in a dense bucket beside each of the 4 packed buckets, 8 "
     "buckets in all, docs/architecture.md#pytorch-face; `-unpacked` takes a bucket per tensor, "
     "62, side by side)"),
    ("e2e-models-baselines.md",
     "End to end on ResNet-18 in PyTorch: random-k, hard threshold, Gaussian-k packed",
     "python scripts/bench_e2e.py --models resnet18 --nets loopback --sizes 2 --image-size 64 "
     "--configs dense,local,randomk,threshold,gaussiank,gaussiank-unpacked --rounds 20 --settle 600 "
     "--out bench/e2e-models-baselines (the baselines the earlier ResNet-18 runs left out, "
     "per-tensor Gaussian-k packed as TopK is, its paper-mode loop in threshold form; "
     "`-unpacked`: a bucket per tensor. Hard threshold runs in its default whole-model scope; its "
     "density follows the gradients, so it never settles near the target)"),
    ("adam-quality.md", "Quality under AdamW: the transformer task, every method plain and on the Adam path",
     "python scripts/adam_quality.py --jobs 2 (4 simulated ranks, 2000 steps, ρ = 0.01 and 0.001; "
     "docs/methods.md#adam-and-adamw)"),
    ("adam-quality-10k/adam-quality.md", "Quality under AdamW over 10,000 steps at ρ = 0.001",
     "python scripts/adam_quality.py --long --methods lags --variants adam-shared-v --jobs 2, then "
     "python scripts/adam_quality.py --long --resume (4 simulated ranks; the moonshot's long run: LAGS "
     "with the shared v, then ExDyna tracking with its own)"),
    ("adam-twin-tf.md", "The Adam path in TensorFlow: the transformer task's Keras twin beside PyTorch",
     "python scripts/adam_twin_tf.py (2 ranks, 1000 steps, ρ = 0.01; real Horovod TensorFlow jobs)"),
    ("gpt2-adam.md", "A real transformer under AdamW: the Hugging Face GPT-2 example in both faces",
     "python scripts/gpt2_adam.py (2 ranks, torchrun and horovodrun, 600 steps, ρ = 0.01)"),
    ("select-adam/select.md", "Selection cost on the Adam path",
     "python scripts/bench_select.py --sizes 25e6 --world-sizes --repeats 5 --kernels on off --methods "
     "exdyna micro topk --adam --no-tensorflow --out-dir bench/select-adam"),
    ("select-adam-shared-v/select.md", "Selection cost on the Adam path with a shared second moment",
     "python scripts/bench_select.py --sizes 25e6 --world-sizes --repeats 5 --kernels on off --methods "
     "exdyna micro topk --adam --shared-v --no-tensorflow --out-dir bench/select-adam-shared-v"),
    ("lever-safety.md", "Are the SGD levers safe? The digits CNN at ρ = 0.001",
     "python scripts/lever_safety.py --jobs 2"),
    ("scale/summary.md", "Scale: where sparsification pays, 2 to 1024 ranks (projection)",
     "python scripts/scale_summary.py (after `python scripts/scale.py --validate "
     "bench/scale/validate-e2e.json bench/scale/validate-e2e-4ranks.json`, seconds, and `python "
     "scripts/scale_tta.py --curves --sizes 16`, about 70 minutes)"),
]


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def machine() -> str:
    info = machine_info()
    versions = []
    for package in ("torch", "tensorflow-cpu", "horovod", "numpy"):
        try:   # the installed version, without importing (and initialising) the framework
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} -")
    return (f"{info['cpus']} cores ({info['cpu_model'] or 'unknown CPU'}), {info.get('memory_gb')} GiB, "
            f"{platform.system()} {info['kernel']}, Python {info['python']}; " + ", ".join(versions))


# Runs that measure the same targets as an earlier run of the list on code changed since: their
# rows replace the earlier run's rows of the same title (the earlier ones stay in their sections).
SUPERSEDING = {"e2e-models-packed.json"}


def collected_targets(bench: Path) -> list[tuple[str, str, str]]:
    """Targets the scripts evaluated themselves: a "targets" list in their JSON, each with
    "target", "met" and optionally "method" (one target judged on several runs: grouped into one
    row), "verdict" (a qualified verdict) and "figure" or "measured" (the numbers behind it)."""
    rows: list[tuple[str, str, str]] = []
    grouped: dict[str, list[dict]] = {}
    for name in ("select.json", "select-1e8/select.json", "select-momentum/select.json",
                 "select-tf/select.json", "fidelity.json", "convergence.json",
                 "convergence-long/convergence.json", "convergence-10k/convergence.json", "e2e.json",
                 "e2e-compute.json", "e2e-kernels.json", "e2e-phases.json", "e2e-models-dgc.json",
                 "e2e-models-packed.json", "e2e-models-corr-packed.json", "e2e-models-baselines.json",
                 "e2e-tf.json", "e2e-tf-models-packed.json", "time-to-accuracy/tta.json",
                 "time-to-accuracy-gpt/tta.json",
                 "adam-quality.json", "adam-quality-10k/adam-quality.json", "adam-twin-tf.json",
                 "gpt2-adam.json", "lever-safety.json",
                 "select-adam/select.json", "select-adam-shared-v/select.json",
                 "ddp-1gbit/ddp.json"):
        result = load(bench / name)
        for target in (result or {}).get("targets", []):
            if target.get("method"):
                grouped.setdefault(target["target"], []).append(target)
                continue
            verdict = target.get("verdict") or ("met" if target.get("met") else "not met")
            row = (target["target"], verdict, target.get("figure") or target.get("measured", ""))
            replaced = [i for i, old in enumerate(rows) if old[0] == row[0]] if name in SUPERSEDING else []
            for i in replaced:
                rows[i] = row
            if not replaced:
                rows.append(row)
    soak = load(bench / "soak.json")
    for method, run in ((soak or {}).get("methods") or {}).items():
        for target, met in run.get("targets", {}).items():
            rows.append((f"Soak, {method}: {target}", "met" if met else "not met",
                         soak_figure(target, run)))
    for title, runs in grouped.items():
        missed = sum(not run["met"] for run in runs)
        verdict = "met" if not missed else f"not met ({missed} of {len(runs)} runs)"
        figure = "; ".join(f"{run['method']}: {run.get('figure') or run.get('measured', '')}"
                           for run in runs)
        rows.append((f"{title} (convergence runs)", verdict, figure))
    return rows


# Why a target can be missed, shown under the table only when one of its rows is not met (a key is a
# title's prefix, or a tuple of them). Prose about causes, no figures: the numbers are in the rows
# and the sections.
CAUSES = {
    "ExDyna padding waste": (
        "**Padding waste.** Two causes, told apart by the Fidelity section's last table. On small "
        "models each rank selects tens to a few hundred entries a step and the count of a "
        "partition jumps from step to step (error feedback releases bursts); the rebalancer works "
        "from the previous step and cannot follow that noise, whatever its rule. On larger models "
        "the load sits in a small region (the LSTM's input weights, say) and the paper's sweep "
        "moves one block per boundary per step, so it trails for hundreds of steps; "
        "`rebalance=\"histogram\"` places the boundaries from per-block loads and removes that "
        "part."),
    "LSTM perplexity": (
        "**Perplexity after a fixed budget.** Error feedback delays most of each update: at "
        "ρ = 0.01 an entry is applied on average only every few dozen steps, so within a short "
        "budget every sparsifier trails dense on the char-LSTM; the ones closest to dense (DGC, "
        "LAGS) send several times the requested entries (their build-up). The longer run (section "
        "'Convergence over a longer budget': same recipe, more steps) shows how the gap changes "
        "with the budget."),
    "ExDyna tracking with corrections beats DGC": (
        "**ExDyna against DGC at equal aggregate density.** The verdict compares curves, not single "
        "runs: each configuration ran at several densities, and DGC's curves (plain, and with the "
        "recipe) are interpolated at each ExDyna run's aggregate density (section 4: the "
        "equal-density table and plot). With the momentum correction alone ExDyna exchanges "
        "what ρ asks (exclusive partitions, no build-up, the density held by the adaptive "
        "controller). With the whole recipe, what a 2000-step run exchanges is set by its fixed "
        "costs more than by ρ: the warm-up's first, nearly dense steps and, on this small "
        "char-LSTM, biases many times k averaged densely at every step; plain DGC at a higher "
        "density spends the same exchange on the weights. The recipe buys quality at a given ρ, "
        "not at a given exchange, wherever its fixed costs are a large share."),
    "achieved density": (
        "**Achieved density under the momentum correction.** With the velocity in the accumulated "
        "vector, entries pile up just under the threshold, and a change of λ by a few percent "
        "releases a burst many times k or leaves several steps with almost nothing to send. The "
        "tracking controller's fixed step overshot on that into a limit cycle with the mean count "
        "well above k; its adaptive gain (`tracking_gain`, the default under the momentum "
        "correction) halves the step at each overshoot. Without the momentum correction the "
        "tracking controller keeps its fixed step, bit for bit; where such a run misses the band "
        "(small k, error feedback's own bursts), `tracking_gain=\"adaptive\"` applies the same "
        "damping, not measured in this matrix. The plot under section 4 shows the achieved density "
        "step by step."),
    "exdyna step": (
        "**End to end.** The ratio is judged on its median; where the bootstrap interval of the "
        "median crosses the limit the verdict says so. Paper-mode ExDyna starts from "
        "λ0 = 1/(2√k) and moves λ by at most 0.5% a step, so over a short benchmark it sends far "
        "fewer entries than asked (see its achieved density); the tracking option is at target "
        "after the warm-up."),
    "gaussiank step <= 1.1× dense's": (
        "**Gaussian-k on ResNet-18.** Its paper-mode refinement (`variant=\"original\"`, up to 100 "
        "loops) runs in threshold form and settles each tensor in about one read beyond the "
        "accumulating pass (docs/kernels.md), where threshold and random-k need none: about 47 ms of "
        "selection a step against their 15 ms, on a step of about 280 ms, so the verdict rests on "
        "this machine's noise. `variant=\"rescale\"` stops after 3 loops."),
    # bench_select's momentum target (the prefixes of its ExDyna and MiCRO rows).
    ("exdyna per-rank step ≤ 1.3× the momentum floor", "micro per-rank step ≤ 1.3× the momentum floor"): (
        "**The momentum path against its floor.** With `nonfinite=\"skip\"` (the default) a rank whose "
        "gradient holds NaN/Inf keeps its residual and velocity bit for bit, so the fused op reads "
        "the whole gradient before its pass writes anything: what the pass leaves could not undo it "
        "(an entry's old u and e take 64 bits, the gradient's slot holds 32), and buffers written "
        "elsewhere cost this machine more than the read (docs/kernels.md). One core's reads bound "
        "the floor here, so the check is a fourth read against the floor's three, before clearing "
        "the gradient, selecting and the step's bookkeeping; without it (`nonfinite=\"ignore\"`) the "
        "step comes to about the limit. `scripts/investigations/momentum_profile.py` splits the step."),
}


def soak_figure(target: str, run: dict) -> str:
    """The numbers behind one of scripts/soak.py's verdicts."""
    if "weights" in target:
        return f"bitwise identical after {run['steps']} steps: {run['identical_weights']}"
    if "residual" in target:
        return "last-third / middle-third maximum per rank: " + ", ".join(
            f"{r['growth']:.2f}" for r in run["residual"].values())
    if "density" in target:
        return (f"100-step windows {run['density_windows_min']:.3f}–{run['density_windows_max']:.3f}"
                f"× target, {run['density_windows_outside']} of {run['density_windows']} outside")
    return "per rank: " + ", ".join(f"{r['slope_mb_per_1000']:+.2f}" for r in run["rss"]) + " MB / 1000 steps"


def cause_notes(rows: list[tuple[str, str, str]]) -> list[str]:
    notes = []
    for prefix, text in CAUSES.items():
        if any(title.startswith(prefix) and verdict != "met" for title, verdict, _ in rows):
            notes += [text, ""]
    return notes


def relink(text: str, prefix: str) -> str:
    """A fragment links its plots and pages relative to its own folder; BENCHMARKS.md may sit
    elsewhere."""
    return re.sub(r"\]\((?!https?:|/|#)([^)\s]+)\)",
                  lambda m: f"]({posixpath.normpath(f'{prefix}/{m.group(1)}')})", text)


def nest_headings(text: str, top: int = 3) -> str:
    """A fragment's headings shifted so that its highest is level ``top``: written for a file of
    its own (``# Soak``), it then nests under its numbered section instead of breaking the outline.
    Lines inside code fences are left alone."""
    lines, fenced, headings = text.split("\n"), False, {}
    for i, line in enumerate(lines):
        fenced ^= line.startswith("```")
        heading = re.match(r"(#{1,6}) ", line)
        if heading and not fenced:
            headings[i] = len(heading.group(1))
    shift = top - min(headings.values(), default=top)
    for i in headings if shift > 0 else ():
        lines[i] = "#" * shift + lines[i]
    return "\n".join(lines)


def command_text(command: str) -> str:
    """A section's command as code, its closing parenthetical note (which may quote code) as prose."""
    line, bracket, note = command.partition(" (")
    if bracket and command.endswith(")"):
        return f"`{line.rstrip()}` ({note}"
    return f"`{command}`"


# The page answers one question per section from its latest run (fragment -> question); every
# other section is an earlier run or a narrower one and goes to the archive, whole, with the full
# Targets table.
CURRENT = {
    "select.md": "Selection cost",
    "fidelity.md": "Fidelity: density, imbalance, build-up",
    "adam-quality.md": "Quality under AdamW (the transformer task)",
    "adam-quality-10k/adam-quality.md": "Quality under AdamW over 10,000 steps",
    "gpt2-adam.md": "Quality on a real transformer (GPT-2, both faces)",
    "adam-twin-tf.md": "Quality in TensorFlow (the Keras twin beside PyTorch)",
    "lever-safety.md": "Quality: are the SGD levers safe?",
    "e2e-phases.md": "End to end: where the step's time goes",
    "time-to-accuracy/tta.md": "Time to accuracy",
    "time-to-accuracy-gpt/tta.md": "Time to accuracy under AdamW",
    "scale/summary.md": "Scale: 2 to 1024 ranks (a projection, checked at 2)",
    "ddp-1gbit/ddp.md": "DDP communication hooks",
    "soak.md": "Reliability: a long run",
    "select-adam/select.md": "Selection cost on the Adam path",
}
ARCHIVE = "BENCHMARKS-archive.md"


def section(number: int, fragment: str, title: str, command: str, bench: Path, out: Path) -> list[str]:
    """One section: its title, its command and the fragment the script wrote (or a note)."""
    lines = [f"## {number}. {title}", "", f"Command (with `OMP_NUM_THREADS=1`): {command_text(command)}", ""]
    path = bench / fragment
    prefix = Path(os.path.relpath(path.parent, out.resolve().parent)).as_posix()
    text = nest_headings(relink(path.read_text().strip(), prefix)) if path.exists() else None
    lines.append(text or "_Not run on this machine._")
    png = path.with_suffix(".png")
    if png.exists() and f"{prefix}/{png.name}" not in (text or ""):
        lines += ["", f"![{title}]({prefix}/{png.name})"]
    return [*lines, ""]


def target_summary(rows: list[tuple[str, str, str]]) -> list[str]:
    """The Targets table grouped: per section of targets, how many are met, and the ones that are not."""
    groups: dict[str, list[tuple[str, str, str]]] = {}
    for row in rows:
        groups.setdefault(target_group(row[0]), []).append(row)
    lines = ["| targets | met | not met |", "|---|---|---|"]
    for group, members in groups.items():
        missed = [title for title, verdict, _ in members
                  if verdict != "met" and not title.startswith("moonshot")]
        moon = sum(title.startswith("moonshot") for title, _, _ in members)
        met = sum(verdict == "met" for _, verdict, _ in members)
        note = "; ".join(missed[:3]) + (f"; and {len(missed) - 3} more" if len(missed) > 3 else "")
        lines.append(f"| {group} | {met} of {len(members)}{f' ({moon} moonshots)' if moon else ''} | "
                     f"{note or '-'} |")
    return lines


def target_group(title: str) -> str:
    """A target's group in the summary: what it measures."""
    lowered = title.lower()
    for key, group in (("sooner", "Time to accuracy"), ("floor", "Selection cost"),
                       ("overhead", "End to end"), ("faster", "End to end"),
                       ("adam path", "Quality under AdamW"), ("gpt-2", "Quality under AdamW"),
                       ("tensorflow:", "Quality under AdamW"), ("digits cnn", "Safety of the SGD levers"),
                       ("memory", "Selection cost"),
                       ("perplexity", "Quality under SGD"), ("accuracy", "Quality under SGD"),
                       ("density", "Fidelity"), ("build-up", "Fidelity"), ("imbalance", "Fidelity"),
                       ("soak", "Reliability"), ("weights", "Reliability"), ("rss", "Reliability"),
                       ("ddp", "DDP"), ("step", "End to end"), ("sooner", "Time to accuracy")):
        if key in lowered:
            return group
    return "Other"


def header(what: str) -> list[str]:
    return ["# Benchmarks" if what == "page" else "# Benchmarks: the archive", "",
            "Written by `scripts/report.py` from the files the benchmark scripts left in `bench/`; "
            "no figure is typed by hand. These machines are small and shared: results are ratios "
            "measured side by side in one run, medians over repeats. Where a result is bad for "
            "hvd_sparse it is shown as it is. `make bench` runs every script's `--quick` version "
            "into bench/quick/.", "", f"Machine of this report: {machine()}.", ""]


def gpu_lines(bench: Path) -> list[str]:
    gpu = sorted((bench / "gpu").glob("*.log")) if (bench / "gpu").exists() else []
    if not any(log.name.startswith("select_kernels_") for log in gpu):
        return ["## GPU kernels", "",
                "GPU: not measured. The Triton kernels (hvd_sparse/kernels/triton) are tested on every CI "
                "run in Triton's interpreter and compiled for sm_90 there, but have not run on a GPU: "
                "no GPU was lent to the sessions that built them. `bash scripts/gpu_check.sh` runs "
                "the CUDA tests, `bench_select.py --device cuda --kernels on off` and "
                "`scripts/workers/ddp_cuda_check.py` (the DDP face on NCCL) in one command and writes "
                "its logs to bench/gpu/.", ""]
    lines = ["## On a GPU", "", "Logs of the runs on a lent GPU machine; a run the time limit cut off is "
             "shown as far as it got.", ""]
    for log in gpu:
        lines += [f"`{log.as_posix()}`:", "", "```", log.read_text().strip(), "```", ""]
    return lines


README_START = ("<!-- written by scripts/report.py from bench/e2e-phases.json and "
                "bench/time-to-accuracy/tta.json -->")
README_END = "<!-- end of the table written by scripts/report.py -->"


def readme_table(bench: Path) -> list[str]:
    """The README's first table: ExDyna (tracking) beside dense on the 25M-parameter MLP's end-to-end
    job and the word-level LSTM's time to accuracy (2 ranks, 1 Gbit/s), from those runs' files."""
    jobs = json.loads((bench / "e2e-phases.json").read_text())["jobs"]
    (job,) = [j for j in jobs if j["model"] == "mlp25m"]
    runs = {name: job["summary"][name] for name in ("dense", "exdyna-tracking", "local")}
    ratio = runs["exdyna-tracking"]["ratio_to_dense"]["median"]   # paired with dense, step by step
    step = {name: run["step_seconds"]["median"] * 1e3 for name, run in runs.items()}
    tta = json.loads((bench / "time-to-accuracy" / "tta.json").read_text())["table"]["1gbit"]["2"]
    dense, ours = tta["rows"]["dense"], tta["rows"]["exdyna-tracking"]
    local = tta["local_step_seconds"] * 1e3
    return ["| | dense allreduce | ExDyna |", "|---|---|---|",
            f"| bytes a rank sends per step, 25M-parameter MLP | {runs['dense']['bytes_sent'] / 1e6:.1f} "
            f"MB | {runs['exdyna-tracking']['bytes_sent'] / 1e6:.2f} MB |",
            f"| step time, the same model | {step['dense']:.0f} ms | {step['exdyna-tracking']:.0f} ms "
            f"({ratio:.2f}x; computation alone: {step['local']:.0f} ms) |",
            f"| step time, word-level LSTM (6.2M parameters) | {dense['step_seconds'] * 1e3:.0f} ms | "
            f"{ours['step_seconds'] * 1e3:.0f} ms ({ours['step_seconds'] / dense['step_seconds']:.2f}x; "
            f"computation alone: {local:.0f} ms) |",
            f"| time to dense's held-out perplexity, word-level LSTM | {dense['seconds']:.0f} s | "
            f"{ours['seconds']:.0f} s ({ours['speedup']:.2f}x sooner) |"]


def with_readme_table(readme: str, table: list[str]) -> str:
    """``readme`` with the text between its table markers replaced by ``table``."""
    head, start, rest = readme.partition(README_START + "\n")
    _, end, tail = rest.partition(README_END)
    if not (start and end):
        raise SystemExit(f"README.md lacks the markers {README_START!r} ... {README_END!r}")
    return head + start + "\n".join(table) + "\n" + end + tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench-dir", default="bench")
    parser.add_argument("--out", default="BENCHMARKS.md")
    args = parser.parse_args()
    bench, out = Path(args.bench_dir), Path(args.out)
    archive = out.with_name(ARCHIVE)
    rows = collected_targets(bench)
    page = [*header("page"), "## Targets", "",
            f"Grouped; every target with its figure is in [{ARCHIVE}]({ARCHIVE}), with the earlier and "
            "narrower runs (their sections there keep this page's former numbers).", "",
            *target_summary(rows), ""]
    rest = [*header("archive"), "## Targets", "", "| target | verdict | figure |", "|---|---|---|",
            *[f"| {t} | {v} | {f} |" for t, v, f in rows], "", *cause_notes(rows)]
    current = {fragment: (fragment, title, command) for fragment, title, command in SECTIONS}
    for number, fragment in enumerate(CURRENT, start=1):
        _, _, command = current[fragment]
        page += section(number, fragment, CURRENT[fragment], command, bench, out)
    for number, (fragment, title, command) in enumerate(SECTIONS, start=1):
        if fragment not in CURRENT:
            rest += section(number, fragment, title, command, bench, archive)
    page += gpu_lines(bench)
    archive.write_text("\n".join(rest) + "\n")
    out.write_text("\n".join(page) + "\n")
    readme = out.with_name("README.md")
    if readme.exists() and (bench / "e2e-phases.json").exists():
        readme.write_text(with_readme_table(readme.read_text(), readme_table(bench)))
    print(f"wrote {out}, {archive} and the first table of {readme}")


if __name__ == "__main__":
    main()

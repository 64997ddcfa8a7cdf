"""The scale study on one screen, for BENCHMARKS.md: read what scripts/scale.py and
scripts/scale_tta.py saved and answer the issue's questions in a few tables. Does the model hold
against real runs? At N >= 16 with the GPU profile on 10 Gbit/s, does ExDyna beat TopK and DGC
on step time and on time to accuracy, and by how much? Where does each seed method start to
win? The full tables (every model, profile and rate) stay in bench/scale/scale.md.

    python scripts/scale_summary.py      # seconds; writes bench/scale/summary.md

after ``python scripts/scale.py --validate bench/scale/validate-e2e.json
bench/scale/validate-e2e-4ranks.json`` (seconds; hours with
``--calibrate``) and ``python scripts/scale_tta.py --curves --sizes 16`` (about 70 minutes).

Everything past the validation is a projection and is labelled as one.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import scale
import time_to_accuracy as tta

OUT = Path(__file__).resolve().parent.parent / "bench" / "scale"
HEADLINE = ("gpu", "10gbit")          # the question: N >= 16, GPU profile, 10 Gbit/s
SIZES = ("16", "64", "256", "1024")
RIVALS = ("topk", "dgc")
CROSSOVER_COLUMNS = (("cpu", "1gbit"), ("cpu", "10gbit"), ("gpu", "1gbit"), ("gpu", "10gbit"),
                     ("gpu", "25gbit"), ("gpu", "100gbit"))


def validation_lines(rows: list[dict]) -> list[str]:
    """Every real run beside the model, one row per configuration, a column pair per network."""
    if not rows:
        return ["_No validation runs saved._", ""]
    columns = sorted({(int(r["size"]), r["net"]) for r in rows},
                     key=lambda c: (c[0], -scale.parse_rate(c[1])))
    lines = [f"Measured step against the model's, {rows[0]['model']} on emulated links; "
             f"{scale.validation_verdict(rows)}. At 4 ranks this 2-core machine runs two processes "
             "per core (shown, not judged).", "",
             "| configuration | " + " | ".join(f"{net}, {size} ranks: measured / model ms"
                                               for size, net in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for config in dict.fromkeys(r["config"] for r in rows):
        cells = []
        for size, net in columns:
            row = next((r for r in rows if r["config"] == config and r["net"] == net
                        and int(r["size"]) == size), None)
            cells.append(f"{row['measured'] * 1e3:.1f} / {row['predicted'] * 1e3:.1f} ({row['error']:+.0%})"
                         if row else "-")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def headline_lines(table: dict) -> list[str]:
    """ExDyna's projected step beside dense, TopK and DGC for every model at N >= 16; a ratio
    above 1: ExDyna's step is the shorter."""
    profile, rate = HEADLINE
    lines = ["| model | N | dense ms | exdyna-tracking ms | topk ms | dgc ms | TopK / ExDyna | "
             "DGC / ExDyna |", "|---|---|---|---|---|---|---|---|"]
    for key, by_size in table.items():
        at_profile, model, at_rate = key.split("|")
        if (at_profile, at_rate) != (profile, rate):
            continue
        for n in (s for s in SIZES if s in by_size):
            row = by_size[n]
            ours = row["exdyna-tracking"]["step"]
            lines.append(f"| {model} | {n} | {row['dense']['step'] * 1e3:.1f} | {ours * 1e3:.1f} | "
                         f"{row['topk']['step'] * 1e3:.1f} | {row['dgc']['step'] * 1e3:.1f} | "
                         + " | ".join(f"{row[r]['step'] / ours:.2f}x" for r in RIVALS) + " |")
    return [*lines, ""]


def tta_variant(config: str) -> tuple[str, str]:
    """(method, which second moment) of a scale_tta configuration: "shared v" for the path with
    ``second_moment_refresh``, "own v" for the path's default (and dense)."""
    if config.endswith(tta.SHARED_V):
        return config.removesuffix(tta.SHARED_V) + tta.ADAM_PATH, "shared v"
    return config, "own v"


def tta_lines(tta_rows: list[dict]) -> list[str]:
    """Steps to the target (simulated) and the projected time on the headline profile and rate,
    a row per method, a column pair per world size and second moment."""
    profile, rate = HEADLINE
    mine = [r for r in tta_rows if (r["profile"], r["rate"]) == (profile, rate)]
    columns = list(dict.fromkeys((r["world"], tta_variant(r["config"])[1]) for r in mine))
    columns.sort(key=lambda c: (c[0], c[1] != "own v"))
    if not columns:
        return ["_No time-to-accuracy curves saved._", ""]
    lines = ["| configuration | " + " | ".join(f"N = {w}, {v}: steps | seconds (speedup)" for w, v in columns)
             + " |", "|---|" + "---|---|" * len(columns)]
    for method in dict.fromkeys(tta_variant(r["config"])[0] for r in mine):
        cells = []
        for world, variant in columns:
            row = next((r for r in mine
                        if r["world"] == world and tta_variant(r["config"]) == (method, variant)), None)
            if row is None:
                cells += ["not run" if method != "dense" else "-", "-"]
            elif row["steps"] is None:
                cells += [f"not reached (best {row['best']:.2f})", "-"]
            else:
                cells += [str(row["steps"]), f"{row['seconds']:.1f} ({row['speedup']:.2f}x)"]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def probe_sentence(probe: list[dict]) -> str:
    """What each configuration really sent after the Adam path's dense steps at the probe's N
    (scripts/investigations/adam_release_probe.py): the median achieved aggregate density."""
    if not probe:
        return ""
    def sent(run: dict) -> float:
        return statistics.median(r["density_actual"] for r in run["rows"] if r["step"] >= 100)
    shares = ", ".join(f"{run['config']} {sent(run):.1%}" for run in probe)
    return (f" What they send at {probe[0]['size']} ranks after the dense steps, as aggregate density "
            f"(median; bench/adam-release/probe.md): {shares}.")


def crossover_lines(crossovers: list[dict]) -> list[str]:
    """Per model, the smallest N from which ExDyna's step beats TopK / DGC / dense at every larger N."""
    columns = [c for c in CROSSOVER_COLUMNS
               if any((x["profile"], x["rate"]) == c for x in crossovers)]
    lines = ["| model | " + " | ".join(f"{p} {r}" for p, r in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for model in dict.fromkeys(x["model"] for x in crossovers):
        cells = []
        for profile, rate in columns:
            x = next((x for x in crossovers if (x["model"], x["profile"], x["rate"], x["method"])
                      == (model, profile, rate, "exdyna-tracking")), None)
            cells.append(" / ".join(str(x[r] or "-") for r in ("topk", "dgc", "dense")) if x else "-")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def claim_line(table: dict) -> str:
    """LAGS-SGD's stated speedup at 16 workers on 1 GbE beside the model's, per model and profile."""
    figures = []
    for key, by_size in table.items():
        profile, model, rate = key.split("|")
        if rate == "1gbit" and "16" in by_size:
            row = by_size["16"]
            figures.append(f"{model} {profile} {row['dense']['step'] / row['lags']['step']:.2f}x")
    return ("LAGS-SGD (arXiv 1911.08727) states 2.86x to 8.52x over dense S-SGD at 16 workers on "
            "1 Gbit/s Ethernet. The model's LAGS over dense at N = 16, 1gbit: " + ", ".join(figures) + ".")


def summary(scale: dict, tta_report: dict, probe: list[dict] | None = None) -> str:
    """The fragment BENCHMARKS.md shows; ``scale`` and ``tta`` as the two scripts saved them."""
    profile, rate = HEADLINE
    return "\n".join([
        "Every table but the first is a projection of `hvd_sparse.plan`'s cost model; the full tables "
        "(four models, both profiles, 1 to 100 Gbit/s, N = 2 to 1024) are in "
        "[bench/scale/scale.md](scale.md), planning your own job in "
        "[docs/planning.md](../../docs/planning.md). "
        f"ρ = {scale['density']:g}, steady state; dense = Horovod's fused ring allreduce in fp32.",
        "",
        *[f"- {note}" for note in scale["profiles"].values()],
        "",
        "## The model against real runs", "", *validation_lines(scale["validation"]),
        f"## Does ExDyna beat TopK and DGC at N >= 16? Step time ({profile} profile, {rate}, projection)",
        "", *headline_lines(scale["table"]),
        f"## ... and time to accuracy ({profile} profile, {rate}; steps simulated, seconds projected)", "",
        "The transformer task under AdamW, every method on the Adam path, ρ = 0.01, per-rank batch held "
        "fixed; target: dense's held-out perplexity + 2% (bench/scale/tta/scale-tta.md has every "
        "profile and rate). Own v: each rank's own second moment (the path's default); shared v: "
        f"`second_moment_refresh={tta.SHARED_V_EVERY}` (docs/methods.md#adam-and-adamw), its dense "
        "allreduces priced in." + probe_sentence(probe or []), "", *tta_lines(tta_report.get("rows", [])),
        "## Where ExDyna starts to win (projection)", "",
        "The smallest N from which ExDyna's step is shorter than TopK's / DGC's / dense's at every "
        "larger N up to 1024; - : at none.", "", *crossover_lines(scale["crossovers"]),
        claim_line(scale["table"]),
        f"![step time against N, {profile} profile, {rate}](scale-{profile}-{rate}.png) "
        "![time to accuracy against N](tta/tta-vs-n.png)", ""])


def main() -> None:
    scale = json.loads((OUT / "scale.json").read_text())
    tta_path = OUT / "tta" / "tta.json"
    tta_report = json.loads(tta_path.read_text()) if tta_path.exists() else {}
    probe_path = OUT.parent / "adam-release" / "probe.json"
    probe = json.loads(probe_path.read_text()) if probe_path.exists() else []
    text = summary(scale, tta_report, probe)
    (OUT / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

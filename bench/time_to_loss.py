"""
bench/time_to_loss.py -- issue 34's time-to-loss table from a sweep's run folders: for each run, the steps and
the training wall time it takes to reach the best AdamW run's final validation loss, its final validation loss
and bits per byte.

    python3 bench/time_to_loss.py RUN_DIR... [--md FILE]

Each RUN_DIR is the --out of a train run: its train_log.jsonl gives the curves (evaluate.curves) and its
ckpt.npz's train_state the optimiser and rates. Wall time is the sum of the steps' own ms (validation and
checkpoints left out), the first WARM steps counted at the run's median step time: they hold the kernels'
compilation and the CUDA graph's capture, which a longer run pays once. The target is the lowest final validation loss of the AdamW runs; a run reaches it at its first
validation at or below it (so the step count is a multiple of --eval-every, or the last step), and never if
none is. The ratios are against that AdamW run; issue 34 asks the best Muon run for <= 0.70 of its steps and
<= 0.75 of its wall time.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import evaluate  # noqa: E402
import pipeline as pl  # noqa: E402


WARM = 5


def run_info(run_dir):
    """-> dict: name, optim, lr (the peak that names the run: --muon-lr under Muon), curves, final val loss/bpb."""
    with np.load(os.path.join(run_dir, "ckpt.npz"), allow_pickle=False) as z:
        train = json.loads(str(z["train_state"]))["train"]
    c = evaluate.curves(run_dir)
    if not len(c["val_loss"]):
        raise pl.UserError(f"{run_dir}: its log holds no validation loss; run with --eval-every")
    last = [r for r in c["recs"] if r.get("val_loss") is not None][-1]
    optim = train.get("optim", "adamw")
    ms = np.array([r["ms"] for r in c["recs"]], float)
    median = float(np.median(ms[WARM:] if len(ms) > WARM else ms))
    wall = np.cumsum(np.where(np.arange(len(ms)) < WARM, median, ms)) / 1e3
    val = np.array([i for i, r in enumerate(c["recs"]) if r.get("val_loss") is not None], int)
    c["val_wall"] = wall[val]
    return dict(name=os.path.basename(os.path.normpath(run_dir)), optim=optim,
                lr=train["muon_lr"] if optim == "muon" else train["lr"], curves=c, final=last["val_loss"],
                bpb=last.get("val_bpb"), ms=median)


def reach(info, target):
    """(step, wall s) of the run's first validation at or below target, or (None, None)."""
    c = info["curves"]
    hit = np.flatnonzero(c["val_loss"] <= target)
    return (int(c["val_step"][hit[0]]), float(c["val_wall"][hit[0]])) if len(hit) else (None, None)


def table(runs):
    """-> (markdown lines, verdict line) for the runs' infos."""
    adam = [r for r in runs if r["optim"] == "adamw"]
    if not adam:
        raise pl.UserError("no AdamW run among the folders: the target is the best AdamW run's final validation loss")
    best = min(adam, key=lambda r: r["final"])
    target = best["final"]
    ref_step, ref_wall = reach(best, target)
    lines = [f"target: {target:.4f}, the final validation loss of {best['name']} (AdamW, lr {best['lr']:g})", "",
             "| run | optimiser | peak lr | final val loss | val bpb | ms/step | steps to target | wall s to target |"
             " steps ratio | wall ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for r in runs:
        step, wall = reach(r, target)
        rs, rw = (step / ref_step, wall / ref_wall) if step else (None, None)
        if r["optim"] == "muon" and rs is not None:
            ratios.append((rs, rw, r["name"]))
        bpb = f"{r['bpb']:.4f}" if r["bpb"] is not None else "-"
        lines.append(f"| {r['name']} | {r['optim']} | {r['lr']:g} | {r['final']:.4f} | {bpb} | {r['ms']:.1f} | "
                     + (f"{step} | {wall:.2f} | {rs:.2f} | {rw:.2f} |" if step else "not reached | - | - | - |"))
    if ratios:
        rs, rw, name = min(ratios)
        verdict = (f"best Muon run {name}: {rs:.2f} of the steps and {rw:.2f} of the wall time of {best['name']} "
                   f"(issue 34 asks <= 0.70 and <= 0.75): {'met' if rs <= 0.70 and rw <= 0.75 else 'NOT met'}")
    else:
        verdict = "no Muon run reached the target: issue 34's time-to-loss target is NOT met"
    return lines, verdict


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[1])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--md", help="also write the table to this markdown file")
    a = p.parse_args(argv)
    try:
        lines, verdict = table([run_info(d) for d in a.runs])
    except (pl.UserError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = "\n".join(lines + ["", verdict])
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

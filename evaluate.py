"""
evaluate.py -- engine-neutral evaluation and reports: run logs, loss-curve plots, bits per byte of any
text, HellaSwag completion scoring and the report.md written at the end of a training run.

Each engine hands in one function, logprobs_fn(seqs) -> [per-token head-0 log-probs], where seqs is a list
of token-id lists of at most ctx ids and the k-th result, an array of len(seqs[k]) - 1 floats, holds
log p(seqs[k][t + 1] | seqs[k][:t + 1]) for t = 0 .. len - 2. Everything else here is numpy (matplotlib is
imported lazily, by plot only). Bad input raises pipeline.UserError.
"""
import io
import json
import math
import os
import sys
import time

import numpy as np

import pipeline as pl

LOG, EVALS = pl.LOG, pl.EVALS
DEFAULT_HELLASWAG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hellaswag_val.jsonl")


# ----------------------------------------------------------------------------------------------------
# run logs

def read_log(run_dir):
    """A run folder's train_log.jsonl -> list of dicts, one per step (pl.read_log). Missing/empty: UserError."""
    if not os.path.isdir(run_dir):
        raise pl.UserError(f"run folder not found: {run_dir}")
    path = os.path.join(run_dir, LOG)
    if not os.path.isfile(path):
        raise pl.UserError(f"{run_dir} holds no {LOG}; give the --out folder of a training run")
    recs = [rec for rec in pl.read_log(run_dir) if "loss" in rec]
    if not recs:
        raise pl.UserError(f"{path} holds no steps; the run has not logged yet")
    for rec in recs:                                    # a hand-edited or foreign log: say where, not a traceback
        bad = [k for k in ("loss", "val_loss", "ms", "tokens", "tok_s") if k in rec and
               (isinstance(rec[k], bool) or not isinstance(rec[k], (int, float)))]
        if bad:
            raise pl.UserError(f"{path}: step {rec['step']} has {bad[0]} {rec[bad[0]]!r}, not a number; the log is damaged")
    return recs


def curves(run_dir):
    """-> dict of arrays: step, tokens, wall (s, cumulative ms), loss; val_step, val_tokens, val_wall, val_loss;
    and recs, the log's records."""
    recs = read_log(run_dir)
    step = np.array([r["step"] for r in recs], float)
    ms = np.array([r.get("ms", 0.0) for r in recs], float)
    if all("tokens" in r for r in recs):                # the sum of each step's own tokens
        tokens = np.cumsum([r["tokens"] for r in recs], dtype=float)
    else:                                               # logs from before "tokens": tok_s x ms a step
        tokens = np.cumsum([r.get("tok_s", 0) * r.get("ms", 0.0) / 1e3 for r in recs])
    wall = np.cumsum(ms) / 1e3
    val = np.array([i for i, r in enumerate(recs) if r.get("val_loss") is not None], int)
    return dict(step=step, tokens=tokens, wall=wall, loss=np.array([r["loss"] for r in recs], float),
                val_step=step[val] if len(val) else step[:0], val_tokens=tokens[val] if len(val) else tokens[:0],
                val_wall=wall[val] if len(val) else wall[:0],
                val_loss=np.array([recs[i]["val_loss"] for i in val], float), recs=recs)


def plot_out(path):
    """plot's --out, checked before any work: a .png file name that can be written (its folder is made, a
    file there replaced)."""
    if os.path.exists(path):
        pl.writable(path, "--out", force=True)
    if not path.lower().endswith(".png"):
        raise pl.UserError(f"--out {path!r}: give a file name ending in .png")
    pl.writable(os.path.dirname(path) or ".", "--out", folder=True)
    return path


def plot(run_dirs, out_png):
    """Train (lines) and validation (markers) loss against steps, tokens and wall time; one colour per run."""
    return _plot([(d, curves(d)) for d in run_dirs], out_png)   # every folder checked before matplotlib


def _plot(data, out_png):
    """plot() of [(run_dir, curves(run_dir))]. Runs are separate lines, each counted from its own start (sft's
    steps and tokens are not more of train's), as the legend says."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise pl.UserError("plot needs matplotlib: pip install matplotlib") from None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, (d, c) in enumerate(data):
        colour = f"C{i % 10}"
        name = os.path.basename(os.path.normpath(d)) or d
        for ax, key in zip(axes, ("step", "tokens", "wall")):
            ax.plot(c[key], c["loss"], color=colour, lw=1, alpha=0.8, label=f"{name} train")
            if len(c["val_loss"]):
                ax.plot(c["val_" + key], c["val_loss"], "o--", color=colour, ms=4, label=f"{name} val")
    for ax, label in zip(axes, ("steps", "tokens", "wall time (s)")):
        ax.set_xlabel(label)
        ax.set_ylabel("loss (head 0, nats)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, title="each run from its own start" if len(data) > 1 else None, title_fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    pl.atomic_write(out_png, png.getvalue())          # a plot or report cut short keeps the last good one
    return out_png


# ----------------------------------------------------------------------------------------------------
# bits per byte

def bpb(tok, text, logprobs_fn, ctx):
    """Bits per byte of text: the head-0 negative log-likelihood (nats) summed over its tokens, / ln 2 /
    the text's UTF-8 byte count. Windows of ctx tokens with a stride of ctx - 1 (no overlap of scored
    tokens: a window's last token is the next one's first input): each token is predicted from the tokens
    before it within its window, so context resets at every window (the first token of the text, which
    has no context, is not scored). -> (bpb, nats per token, n tokens scored, n bytes)."""
    ids = tok.encode(text)
    n_bytes = len(text.encode("utf-8"))
    if len(ids) < 2:
        raise pl.UserError("the text is too short to score: it needs at least 2 tokens")
    nll, n = 0.0, 0
    starts = list(range(0, len(ids) - 1, ctx - 1))
    for k in range(0, len(starts), 8):                  # 8 windows per call
        seqs = [ids[s:s + ctx] for s in starts[k:k + 8]]
        for lp in logprobs_fn(seqs):
            nll -= float(np.sum(lp))
            n += len(lp)
    return nll / math.log(2) / n_bytes, nll / n, n, n_bytes


# ----------------------------------------------------------------------------------------------------
# HellaSwag

def load_hellaswag(path, limit=None):
    """HellaSwag JSONL (one object a line with ctx, endings (4 strings), label) -> list of dicts."""
    if path is None:
        path = DEFAULT_HELLASWAG
        if not os.path.isfile(path):
            raise pl.UserError("no HellaSwag data: run data/get_hellaswag.sh (or give --data FILE.jsonl)")
    items = []
    for n, ex in pl.read_jsonl(path, "data file"):
        try:
            ctx, endings, label = ex["ctx"], ex["endings"], int(ex["label"])
            assert isinstance(ctx, str) and len(endings) >= 2 and all(isinstance(e, str) and e for e in endings)
            assert 0 <= label < len(endings)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise pl.UserError(f"{path} line {n} is not a HellaSwag item (ctx, endings: non-empty strings, label)") from None
        items.append(dict(ctx=ctx, endings=list(endings), label=label))
        if limit and len(items) >= limit:
            break
    if not items:
        raise pl.UserError(f"{path} holds no HellaSwag items")
    return items


def hellaswag_sequences(tok, item, ctx_len):
    """-> ([ids of context + ending], [n ending tokens], truncated?) for each ending. The ending is scored
    as " " + ending, tokenised apart from the context; a too-long context loses its first tokens."""
    c = tok.encode(item["ctx"])
    if not c:
        raise pl.UserError("a HellaSwag item has an empty ctx: its first ending token would have no context")
    seqs, ns, cut = [], [], False
    for e in item["endings"]:
        t = tok.encode(" " + e)[:ctx_len - 1]
        keep = ctx_len - len(t)
        cut |= len(c) > keep
        seqs.append(c[-keep:] + t)
        ns.append(len(t))
    return seqs, ns, cut


def hellaswag(tok, items, logprobs_fn, ctx_len, warn=None, batch_items=1):
    """-> dict(acc, acc_norm, n, truncated, preds: [(pred, pred_norm, label)]). logprobs_fn scores the
    sequences of batch_items items a call (None: every item in one call, as the GPU batches them). acc
    picks the argmax of each ending's summed log-prob; acc_norm of the sum / len(ending) in characters
    (as lm-evaluation-harness does)."""
    tokd = [hellaswag_sequences(tok, item, ctx_len) for item in items]
    n_cut = sum(cut for _, _, cut in tokd)
    if n_cut and warn:
        warn(f"note: a context + ending is longer than the context of {ctx_len} tokens; the context keeps its "
             "last tokens (said once)")
    step, lps = batch_items or max(len(items), 1), []
    for i in range(0, len(items), step):
        lps += logprobs_fn([s for seqs, _, _ in tokd[i:i + step] for s in seqs])
    preds, lps = [], iter(lps)
    for item, (_, ns, _) in zip(items, tokd):
        sums = [float(np.sum(lp[len(lp) - n:])) for n, lp in zip(ns, lps)]    # ns first: zip stops on it
        norm = [s / len(e) for s, e in zip(sums, item["endings"])]          # the ending alone, not its " "
        preds.append((int(np.argmax(sums)), int(np.argmax(norm)), item["label"]))
    n = len(preds)
    return dict(acc=sum(p == l for p, _, l in preds) / n, acc_norm=sum(q == l for _, q, l in preds) / n, n=n,
                truncated=n_cut, preds=preds)


def record_eval(ckpt, result):
    """Append an eval result to evals.jsonl beside the checkpoint (report.md lists them)."""
    folder = ckpt if os.path.isdir(ckpt) else os.path.dirname(os.path.abspath(ckpt))
    rec = {k: v for k, v in result.items() if k != "preds"}
    rec["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        with open(os.path.join(folder, EVALS), "a") as f:
            f.write(json.dumps(rec) + "\n")
    except OSError as e:                                # a read-only checkpoint folder: the scores are printed
        print(f"note: not recorded in {os.path.join(folder, EVALS)} ({e.strerror})", file=sys.stderr)


def read_evals(folder):
    path = os.path.join(folder, EVALS)
    return [r for _, r in pl.read_jsonl(path, "eval log")] if os.path.isfile(path) else []

# ----------------------------------------------------------------------------------------------------
# the eval and plot modes of both engines

EVAL_HELP = ("score a checkpoint under head 0: HellaSwag completion scoring (acc; acc_norm divides each ending's "
             "log-prob by its length in characters) or bits per byte of any UTF-8 text file (comparable across "
             "tokenizers); results go to evals.jsonl beside the checkpoint")
PLOT_HELP = ("PNG of the train and validation loss of one or more runs against steps, tokens and wall time (needs "
             "matplotlib: pip install matplotlib)")


def add_eval_flags(p, ckpt):
    p.add_argument("--ckpt", default=ckpt, help=f"checkpoint file or run folder (default {ckpt})")
    p.add_argument("--task", choices=("hellaswag", "bpb"), default="hellaswag", help="(default hellaswag)")
    p.add_argument("--data", help="hellaswag: a JSONL file (default data/hellaswag_val.jsonl, from "
                                  "data/get_hellaswag.sh); bpb: a text file (required)")
    p.add_argument("--limit", type=int, help="hellaswag: score the first N items only (default all)")


def add_plot_flags(p):
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (--out of train), overlaid")
    p.add_argument("--out", default="loss.png", help="PNG file to write (default loss.png)")


def check_eval_args(a):
    if a.limit is not None:
        pl.check_positive(a, "limit")
    if a.task == "bpb" and not a.data:
        raise pl.UserError("--task bpb needs --data TEXT_FILE")


def run_eval(a, tok, ctx, logprobs_fn, batch_items=1):
    """The eval mode once the engine has its logprobs_fn (HellaSwag: batch_items items a call, None for
    all): prints the result on its last line and records it in evals.jsonl."""
    if a.task == "bpb":
        value, nats, n, n_bytes = bpb(tok, pl.read_text(a.data), logprobs_fn, ctx)
        record_eval(a.ckpt, dict(task="bpb", data=a.data, bpb=round(value, 5), loss=round(nats, 5), tokens=n,
                                 bytes=n_bytes))
        print(f"bpb: {value:.4f} bits per byte | {nats:.4f} nats per token | {n:,} tokens scored | {n_bytes:,} bytes "
              f"(windows of {ctx} tokens, stride {ctx - 1}: each token scored once)")
        return
    items = load_hellaswag(a.data, a.limit)
    warn = lambda m: print(m, file=sys.stderr)
    r = hellaswag(tok, items, logprobs_fn, ctx, warn, batch_items)
    record_eval(a.ckpt, dict(task="hellaswag", data=a.data, n=r["n"], acc=round(r["acc"], 5),
                             acc_norm=round(r["acc_norm"], 5)))
    print(f"hellaswag: {r['n']} items | acc {r['acc']:.4f} | acc_norm {r['acc_norm']:.4f}")


def write_report(out_dir, args, cfg, val_loss, val_bpb, sample, engine="CPU", peak_tflops=None):
    """report.md in out_dir: config, parameters, tokens seen, wall time, tokens/s, model FLOP/s and (given
    the devices' peak) MFU, final validation loss and bpb, the sample, the loss-curve plot (if matplotlib)
    and eval scores (evals.jsonl)."""
    c = curves(out_dir)
    steps, tokens, wall = int(c["step"][-1]), int(round(c["tokens"][-1])), float(c["wall"][-1])
    per_step = {r.get("tokens") for r in c["recs"]}
    per_step = (f" ({steps} steps x {per_step.pop():,})" if len(per_step) == 1 and None not in per_step
                else " (the sum of each step's own)" if None not in per_step else "")
    n_params = pl.num_params(cfg)
    flops = pl.model_flops_per_token(cfg, args["seq"])
    rate = tokens / wall if wall > 0 else float("nan")
    lines = [f"# Run report: {args.get('config', pl.config_name(cfg))}", "",
             f"- engine: {engine}", f"- config: {args.get('config')} {cfg}", f"- parameters: {n_params:,}",
             "- arguments: " + ", ".join(f"{k}={v}" for k, v in sorted(args.items())),
             f"- steps: {steps}", f"- tokens seen: {tokens:,}{per_step}",
             f"- wall time: {wall:.1f} s (training steps, from {LOG})", f"- tokens/s: {rate:,.0f}",
             f"- model FLOP/s: {rate * flops / 1e9:,.1f} GFLOP/s ({flops:,} FLOPs per token; "
             + (f"MFU {rate * flops / (peak_tflops * 1e12):.1%} of {peak_tflops:,.0f} TFLOP/s" if peak_tflops
                else "MFU is a GPU notion") + ")",
             f"- final validation loss: {val_loss:.4f}", f"- final validation bpb: {val_bpb:.4f}", "",
             "## Sample", "", "```", pl.printable(sample), "```", "", "## Loss curves", ""]
    try:
        _plot([(out_dir, c)], os.path.join(out_dir, "loss.png"))
        lines.append("![loss curves](loss.png)")
    except pl.UserError as e:
        lines.append(f"(no plot: {e})")
    lines += ["", "## Evaluations", ""]
    evals = read_evals(out_dir)
    if evals:
        lines += [f"- {json.dumps(e)}" for e in evals]
    else:
        lines.append(f"none run yet (`nanoeuler.py eval --ckpt {out_dir} --task hellaswag|bpb` records them in "
                     f"{EVALS})")
    path = os.path.join(out_dir, "report.md")
    pl.atomic_write(path, "\n".join(lines) + "\n")
    return path


if __name__ == "__main__":                          # a library of the engines, not a command of its own
    raise SystemExit("error: evaluate.py is the eval and plot modes: "
                     "python3 nanoeuler.py eval --help (or plot --help)")

"""
speedrun.py -- from nothing to a chat model in one command (`make speedrun`), and one report card.

The recipe, stage by stage, each run by the engines' own modes in this process:
    1. data       the corpora of `make data` (Gutenberg books + FineWeb-Edu, Alpaca, HH-RLHF); with --data FILE,
                  or offline, that text or the embedded corpus and the built-in SFT and DPO sets instead
    2. tokenizer  a byte-level BPE of the config's vocabulary trained on the text, which it encodes (bpe.py)
    3. pretrain   `train` for the tokens the budget buys
    4. sft        `sft` of the base model on instructions
    5. dpo        `dpo` of the chat model on preference pairs
    6. eval       HellaSwag (when its data is there) and a few fixed prompts answered by the base, SFT and DPO models
then REPORT.md and REPORT.json in --out: the card, from the run folders' logs, report.md and evals.jsonl.

The GPU engine runs when CuPy imports and sees a device, else the CPU engine. --budget-minutes sets the whole run's
length; the pretraining tokens it buys follow from an assumed rate per engine and config (SETUPS, from `bench`),
printed at the start. Every stage resumes: a stage that ends writes its figures to a marker file (atomically), so
running again skips the finished stages, and a pretraining cut short goes on from its checkpoint (`resume`); SFT
and DPO, minutes at most, start over. A finished run, run again, prints its card.
"""
import contextlib
import json
import math
import os
import platform
import re
import socket
import subprocess
import sys
import threading
import time

import pipeline as pl

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = ("data", "tokenizer", "pretrain", "sft", "dpo", "eval")
CHAT_PROMPTS = ("What is the capital of France?", "Explain the \"for\" statement.", "Write a haiku about the sea.")

# (engine, config): batch, seq, the training tokens/s assumed, and where that rate comes from
SETUPS = {
    ("gpu", "big"): (64, 512, 550_000, "bench bf16 B=64 on one H200: 585,365 tokens/s (README, 29d9754), "
                                       "less ~6% for the loop's evaluations and checkpoints"),
    ("gpu", "large"): (16, 1024, 200_000, "bench large T=1024 on 2 x H200: 419,565 tokens/s (README, 56dbec8), "
                                          "halved, less ~5%"),
    ("cpu", "small"): (8, 256, 19_000, "bench small B=8 T=256 on 2 cores: 19,800-20,900 tokens/s (README, 9906af9)"),
    ("cpu", "medium"): (8, 256, 2_400, "bench medium on 2 cores: 2,530 tokens/s (README, cf376fb)"),
}
DEFAULT_CONFIG = {"gpu": "big", "cpu": "small"}
SHARES = {"pretrain": 0.80, "sft": 0.07, "dpo": 0.05, "eval": 0.08}   # of the budget; the tokenizer comes on top
TOKENIZER_S_PER_MB = (1.4, 1.0)   # training on the first 20 MB (28 s for 20 MB of docs.txt here); encoding, per core
CKPT_MINUTES = 2             # pretraining checkpoints this often, so a kill loses at most that
MIN_STEPS = 5
MAX_EPOCHS = 4               # passes over the training split at most: past ~4 repeated text gains little (Muennighoff
                             # et al. 2023, "Scaling Data-Constrained Language Models"); on docs.txt (35 MB) an H200 run
                             # of 27 epochs saw the validation loss rise from 2.97 (8 epochs) to 5.08 (dev/LOG.md)
WEB_BYTES_PER_TOKEN = 4.0    # FineWeb-Edu text a token of the 4096 tokenizer, about: sizes the download to the budget
WEB_MB = 100                 # make data's FineWeb-Edu megabytes (Makefile), the least the speedrun fetches
CORPORA = ("data/pretrain.txt", "data/alpaca.json", "data/prefs.jsonl")   # make's targets that download
HELLASWAG = "data/hellaswag_val.jsonl"


# ----------------------------------------------------------------------------------------------------
# the plan: engine, config, data and budget -> the steps of each stage, fixed for the run (plan.json)

def gpu_present():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def online(host="huggingface.co"):
    try:
        socket.create_connection((host, 443), timeout=3).close()
        return True
    except OSError:
        return False


def make_plan(a):
    engine = a.engine if a.engine != "auto" else "gpu" if gpu_present() else "cpu"
    if a.engine == "gpu" and not gpu_present():
        raise pl.UserError("--engine gpu: CuPy does not import or sees no GPU; pip install cupy-cuda12x, or --engine cpu")
    config = a.config or DEFAULT_CONFIG[engine]
    if (engine, config) not in SETUPS:
        raise pl.UserError(f"no speedrun setup for {config} on the {engine.upper()}; the setups are "
                           + ", ".join(f"{c} ({e})" for e, c in SETUPS))
    batch, seq, rate, source = SETUPS[engine, config]
    rate, source = (a.rate, "--rate") if a.rate is not None else (rate, source)
    if not (0 < a.budget_minutes < math.inf and 0 < rate < math.inf and 0 <= a.price < math.inf):
        raise pl.UserError("--budget-minutes, --rate and --price: give positive, finite numbers")
    if a.data:
        data = dict(text=os.path.abspath(pl.existing_file(a.data, "--data")), why=f"--data {a.data}")
    elif a.offline:
        data = dict(text=None, why="offline (--offline)")
    elif all(os.path.isfile(os.path.join(HERE, p)) for p in CORPORA) or online():
        data = dict(text=os.path.join(HERE, CORPORA[0]), sft=os.path.join(HERE, CORPORA[1]),
                    prefs=os.path.join(HERE, CORPORA[2]), why="make data")
    else:
        data = dict(text=None, why="offline (huggingface.co cannot be reached)")
    for key, path, read in (("sft", a.sft_data, pl.load_sft_data), ("prefs", a.dpo_data, pl.load_prefs)):
        if path:
            read(path)                              # a bad file is found now, not after the pretraining
            data[key] = os.path.abspath(path)
    if a.hellaswag:
        import evaluate
        evaluate.load_hellaswag(a.hellaswag)
    hellaswag = os.path.abspath(a.hellaswag or os.path.join(HERE, HELLASWAG))
    budget = 60 * a.budget_minutes
    cfg = pl.get_config(config)
    ft = pl.SFT_DEFAULTS[engine]
    steps = max(MIN_STEPS, int(SHARES["pretrain"] * budget * rate // (batch * seq)))
    sft_steps = min(pl.SFT_DEFAULTS["steps"], max(MIN_STEPS, int(SHARES["sft"] * budget * rate
                                                                 // (ft["batch"] * ft["seq"]))))
    dpo_steps = min(pl.DPO_DEFAULTS["steps"], max(MIN_STEPS, int(SHARES["dpo"] * budget * rate
                                                                 // (2 * pl.DPO_DEFAULTS["batch"] * cfg.ctx))))
    size = os.path.getsize(data["text"]) if data["text"] and os.path.isfile(data["text"]) else 0.47e6
    train_s, encode_s = TOKENIZER_S_PER_MB
    tokenizer_s = (train_s * min(size, 20e6) + encode_s * size / (os.cpu_count() or 1)) / 1e6
    estimates = dict(data=0.0, tokenizer=tokenizer_s, pretrain=steps * batch * seq / rate,
                     sft=SHARES["sft"] * budget, dpo=SHARES["dpo"] * budget, eval=SHARES["eval"] * budget)
    return dict(engine=engine, config=config, batch=batch, seq=seq, rate=rate, rate_source=source,
                budget_minutes=a.budget_minutes, steps=steps, tokens=steps * batch * seq, sft_steps=sft_steps,
                dpo_steps=dpo_steps, data=data, hellaswag=hellaswag, hellaswag_items=a.hellaswag_items or
                (None if engine == "gpu" else 500), price=a.price, estimates=estimates)


def engine_of(plan):
    """The engine module; its main(argv) runs a mode as its command line does and returns the exit status."""
    if plan["engine"] == "gpu":
        import nanoeuler_cuda
        return nanoeuler_cuda
    import nanoeuler
    return nanoeuler


def mode(plan, *argv):
    """One mode of the engine; a failure stops the speedrun with the engine's status (its `error:` line printed)."""
    status = engine_of(plan).main([str(x) for x in argv])
    if status == 130:
        raise KeyboardInterrupt
    if status:
        raise Failed(status)


class Failed(Exception):
    """A stage's mode failed; it has said why."""


def last(recs, key):
    return next((r for r in reversed(recs) if r.get(key) is not None), {})


def run_figures(folder):
    """Steps, tokens, training time and rate of a run folder, from its log (all attempts of a resumed run)."""
    import evaluate
    c = evaluate.curves(folder)
    tokens, wall = int(c["tokens"][-1]), float(c["wall"][-1])
    return dict(steps=int(c["step"][-1]), tokens=tokens, train_seconds=round(wall, 2),
                tokens_per_s=round(tokens / wall) if wall > 0 else None)


# ----------------------------------------------------------------------------------------------------
# the stages, in order: each returns its figures, which its marker keeps

def stage_data(plan, run):
    d = plan["data"]
    if d["why"] != "make data":
        what = d["text"] or pl.default_corpus()[1]
        return dict(skipped=f"{d['why']}: no download; pretraining on {what}", text=d["text"] or "embedded")
    missing = [p for p in CORPORA if not os.path.isfile(os.path.join(HERE, p))]
    web = os.path.join(HERE, "data", "web.txt")
    if CORPORA[0] in missing and not os.path.isfile(web):      # enough text for the budget in MAX_EPOCHS passes
        mb = max(WEB_MB, math.ceil(plan["tokens"] / MAX_EPOCHS * WEB_BYTES_PER_TOKEN / 1e6))
        print(f"FineWeb-Edu: {mb:,} MB, so that {plan['tokens']:,} tokens of pretraining take at most {MAX_EPOCHS} "
              "passes over the text")
        shell(["bash", os.path.join(HERE, "data", "get_web.sh"), str(mb)])
    if missing:
        shell(["make", "-C", HERE, *missing])      # make data's downloads (its tokenizer is the next stage's)
    if not os.path.isfile(plan["hellaswag"]):
        try:
            shell(["bash", os.path.join(HERE, "data", "get_hellaswag.sh")], env=dict(os.environ, OUT=plan["hellaswag"]))
        except pl.UserError:
            print("note: HellaSwag did not download; the evaluation skips it")
    return dict(text=d["text"], mb=round(os.path.getsize(d["text"]) / 1e6, 2))


def shell(cmd, env=None):
    """A command whose output goes to this process's stdout (and so to the stage's log)."""
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    except OSError as e:
        raise pl.UserError(f"{cmd[0]}: {e.strerror}; install it, or go offline with --offline or --data FILE") from None
    for line in p.stdout:
        print(line, end="", flush=True)
    if p.wait():
        raise pl.UserError(f"{' '.join(cmd)} failed (exit {p.returncode}; its output is above and in the stage's log); "
                           "fix it and run again, or go offline with --offline or --data FILE")


def stage_tokenizer(plan, run):
    cfg = pl.get_config(plan["config"])
    tokens, tok = pl.prepare_data(plan["data"]["text"], cfg, plan["config"], cache_dir=os.path.join(run, "tokenizer"))
    path = tokens.filename
    return dict(tokens=len(tokens), vocab=tok.vocab_size, bytes_per_token=round(pl.bytes_per_token(tok, tokens), 3),
                bin=path, bpe=path[:-4] + ".bpe")


def epochs(plan, tokens, steps):
    """Passes over the training split (all but pipeline's VAL_FRAC of the tokens) that `steps` steps make."""
    return steps * plan["batch"] * plan["seq"] / ((1 - pl.VAL_FRAC) * tokens)


def pretrain_steps(plan, tokens):
    """The budget's steps, or fewer: at most MAX_EPOCHS passes over the training split."""
    per_step = plan["batch"] * plan["seq"]
    return max(MIN_STEPS, min(plan["steps"], int(MAX_EPOCHS * (1 - pl.VAL_FRAC) * tokens // per_step)))


def stage_pretrain(plan, run, tokenizer, log):
    out, tokens = os.path.join(run, "pretrain"), tokenizer["tokens"]
    steps = pretrain_steps(plan, tokens)
    print(f"pretraining {plan['config']}: {steps:,} steps x {plan['batch']} x {plan['seq']} = "
          f"{steps * plan['batch'] * plan['seq']:,} tokens, {epochs(plan, tokens, steps):.1f} epochs of the training "
          "split"
          + (f" (the budget buys {plan['steps']:,} steps, {epochs(plan, tokens, plan['steps']):.1f} epochs; past "
             f"{MAX_EPOCHS} repeated text gains little and overfits: Muennighoff et al. 2023; more text: make data, or "
             "a larger --data)" if steps < plan["steps"] else ""))
    ckpt = os.path.join(out, "ckpt.npz")
    done = 0
    if os.path.isfile(ckpt):
        import numpy as np
        with np.load(ckpt) as z:
            done = int(z["step"]) if "step" in z.files else 0
    if done >= steps:
        print(f"{ckpt} is at step {done}: trained")
    elif done:
        mode(plan, "resume", "--out", out)          # the engine's resume: the same run, from its checkpoint
    else:
        mode(plan, "train", plan["config"], "--data", tokenizer["bin"], "--out", out, "--force", "--steps", steps,
             "--batch", plan["batch"], "--seq", plan["seq"], "--warmup", max(1, min(200, steps // 20)),
             "--eval-every", max(5, steps // 10), "--log-every", max(1, min(50, steps // 10)), "--sample-every", 0,
             "--ckpt-every", steps, "--ckpt-minutes", CKPT_MINUTES)
    recs = pl.read_log(out)
    v = last(recs, "val_loss")
    report = open(os.path.join(out, "report.md"), encoding="utf-8").read() if os.path.isfile(
        os.path.join(out, "report.md")) else ""
    mfu = re.search(r"MFU ([\d.]+)%", report)
    before = re.findall(r"step 0: val loss ([\d.]+)", open(log, encoding="utf-8").read())   # printed, not logged
    return dict(run_figures(out), val_loss=v.get("val_loss"), val_bpb=v.get("val_bpb"),
                loss=last(recs, "loss").get("loss"), val_loss_before=float(before[0]) if before else None,
                mfu=float(mfu.group(1)) / 100 if mfu else None, folder=out)


def stage_sft(plan, run, log):
    out = os.path.join(run, "sft")
    mode(plan, "sft", "--ckpt", os.path.join(run, "pretrain"), "--out", out, "--force", "--steps", plan["sft_steps"],
         *(["--data", plan["data"]["sft"]] if plan["data"].get("sft") else []))
    before = re.findall(r"SFT validation loss before: ([\d.]+)", open(log, encoding="utf-8").read())
    recs = pl.read_log(out)
    return dict(run_figures(out), val_loss_before=float(before[-1]) if before else None,
                val_loss=last(recs, "val_loss").get("val_loss"), data=plan["data"].get("sft", "built-in"), folder=out)


def stage_dpo(plan, run):
    out = os.path.join(run, "dpo")
    mode(plan, "dpo", "--ckpt", os.path.join(run, "sft"), "--out", out, "--force", "--steps", plan["dpo_steps"],
         *(["--data", plan["data"]["prefs"]] if plan["data"].get("prefs") else []))
    recs = pl.read_log(out)
    first, end = recs[0], last(recs, "pref_acc")
    return dict(run_figures(out), pref_acc_before=first.get("pref_acc"), pref_acc=end.get("pref_acc"),
                margin=end.get("margin"), dpo_loss=end.get("dpo_loss"), data=plan["data"].get("prefs", "built-in"),
                folder=out)


def stage_eval(plan, run):
    figures = {}
    if os.path.isfile(plan["hellaswag"]):
        limit = ["--limit", plan["hellaswag_items"]] if plan["hellaswag_items"] else []
        mode(plan, "eval", "--ckpt", os.path.join(run, "pretrain"), "--task", "hellaswag", "--data", plan["hellaswag"],
             *limit)
        import evaluate
        h = last([e for e in evaluate.read_evals(os.path.join(run, "pretrain")) if e.get("task") == "hellaswag"], "acc")
        figures["hellaswag"] = dict(acc=h["acc"], acc_norm=h["acc_norm"], n=h["n"], data=plan["hellaswag"])
    else:
        figures["hellaswag"] = dict(skipped=f"no HellaSwag data at {plan['hellaswag']} (bash data/get_hellaswag.sh)")
    figures["samples"] = {q: {} for q in CHAT_PROMPTS}
    for name in ("pretrain", "sft", "dpo"):
        for q, answer in zip(CHAT_PROMPTS, answers(plan, os.path.join(run, name), CHAT_PROMPTS)):
            figures["samples"][q][name] = answer
            print(f"[{name}] {q} -> {json.dumps(answer)}")
    return figures


def answers(plan, ckpt, prompts, n=48):
    """Greedy answers of a checkpoint to prompts in the SFT template (the base model too: what SFT changed)."""
    P, tok, _, _ = pl.load_checkpoint(ckpt)
    greedy = pl.Sampling(temperature=0)
    if plan["engine"] == "gpu":
        sampler = engine_of(plan).Sampler(P)
        gen = lambda ids: sampler.generate(ids, n, greedy)
    else:
        gen = lambda ids: engine_of(plan).generate(P, ids, n, sampling=greedy)
    out = []
    for q in prompts:
        ids = []
        for t in gen(tok.encode(pl.format_prompt(q))):
            if t == tok.eot:
                break
            ids.append(t)
        out.append(tok.decode(ids))
    return out


# ----------------------------------------------------------------------------------------------------
# the report card: REPORT.json, and REPORT.md made from it, with the loss curves of every stage in loss.png

def hardware(plan):
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor()) if os.path.isfile("/proc/cpuinfo") else platform.processor()
    hw = dict(cpu=f"{cpu}, {os.cpu_count()} cores", gpu=None, gpus=0)
    if plan["engine"] == "gpu":                 # the engine's own profile (emulated where NANOEULER_EMULATE says)
        d = engine_of(plan).device()
        hw.update(gpu=f"{d.name} ({d.total / 2**30:.0f} GiB, bf16 peak {d.peak_tflops:g} TFLOP/s)", gpus=1)
    return hw


def commit():
    try:
        git = lambda *args: subprocess.run(["git", "-C", HERE, *args], capture_output=True, text=True).stdout.strip()
        sha, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
        return (sha + (" (with uncommitted changes)" if dirty else "")) or "unknown"
    except OSError:
        return "unknown (no git)"


def write_card(run, plan, figures, argv):
    seconds = sum(f["seconds"] for f in figures.values())
    hw = hardware(plan)
    gpu_hours = seconds / 3600 * hw["gpus"]
    card = dict(command="python3 speedrun.py " + " ".join(argv), commit=commit(), hardware=hw, plan=plan,
                stages=figures, seconds=round(seconds, 1), gpu_hours=round(gpu_hours, 4),
                cost_usd=round(gpu_hours * plan["price"], 2), price_per_gpu_hour=plan["price"],
                finished=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    try:
        import evaluate
        evaluate.plot([os.path.join(run, s) for s in ("pretrain", "sft", "dpo")], os.path.join(run, "loss.png"))
        card["plot"] = "loss.png"
    except pl.UserError as e:
        card["plot"] = f"(no plot: {e})"
    pl.atomic_write(os.path.join(run, "REPORT.json"), json.dumps(card, indent=1) + "\n")
    pl.atomic_write(os.path.join(run, "REPORT.md"), card_md(card, run))


def card_md(c, run):
    p, s, hw = c["plan"], c["stages"], c["hardware"]
    f = lambda v, fmt="{:.4f}": "-" if v is None else fmt.format(v)
    lines = [f"# NanoEuler speedrun: {p['config']} on the {p['engine'].upper()}", "",
             f"- hardware: {hw['gpu'] + ', ' if hw['gpu'] else ''}{hw['cpu']}", f"- commit: {c['commit']}",
             f"- command: `{c['command']}`",
             f"- budget: {p['budget_minutes']:g} min; pretraining {p['tokens']:,} tokens ({p['steps']:,} steps x "
             f"{p['batch']} x {p['seq']}) at an assumed {p['rate']:,.0f} tokens/s ({p['rate_source']})"
             + (f"; {s['pretrain']['steps']:,} steps ({MAX_EPOCHS} passes over the text at most)"
                if s["pretrain"]["steps"] < p["steps"] else ""),
             f"- whole run: {c['seconds'] / 60:.1f} min; cost {c['gpu_hours']:.3f} GPU-hours x "
             f"${c['price_per_gpu_hour']:.2f} (--price) = ${c['cost_usd']:.2f}", f"- finished: {c['finished']}", "",
             "## Stages", "", "| stage | time | tokens | tokens/s | MFU | figures |", "|---|---|---|---|---|---|"]
    d, t, pre, sft, dpo, ev = (s[k] for k in STAGES)
    rows = [("data", d, d.get("skipped") and "skipped: " + d["skipped"] or f"make data: {d['text']} ({d['mb']} MB)"),
            ("tokenizer", t, f"vocab {t['vocab']}, {t['bytes_per_token']} bytes/token"),
            ("pretrain", pre, f"val loss {f(pre['val_loss_before'])} -> {f(pre['val_loss'])}, val bpb "
                              f"{f(pre['val_bpb'])}, {pre['steps']:,} steps"),
            ("sft", sft, f"val loss {f(sft['val_loss_before'])} -> {f(sft['val_loss'])}, {sft['steps']} steps on "
                         f"{sft['data']}"),
            ("dpo", dpo, f"held-out preference accuracy {f(dpo['pref_acc_before'], '{:.1%}')} -> "
                         f"{f(dpo['pref_acc'], '{:.1%}')}, margin {f(dpo['margin'], '{:+.4f}')}, {dpo['steps']} steps on "
                         f"{dpo['data']}"),
            ("eval", ev, "HellaSwag " + (ev["hellaswag"].get("skipped") and "skipped: " + ev["hellaswag"]["skipped"] or
                                         f"acc {ev['hellaswag']['acc']:.4f} ({ev['hellaswag']['n']} items)") +
             f"; {len(ev['samples'])} prompts x 3 models")]
    for name, r, text in rows:
        lines.append(f"| {name} | {r['seconds']:.1f} s | {f(r.get('tokens'), '{:,}')} | "
                     f"{f(r.get('tokens_per_s'), '{:,}')} | {f(r.get('mfu'), '{:.1%}')} | {text} |")
    h = ev["hellaswag"]
    lines += ["", "## Evaluation", "", "| what | model | value |", "|---|---|---|",
              f"| validation loss (head 0, nats) | base | {f(pre['val_loss'])} |",
              f"| bits per byte (validation split) | base | {f(pre['val_bpb'])} |",
              "| HellaSwag acc / acc_norm | base | " + (f"skipped: {h['skipped']}" if "skipped" in h else
                                                       f"{h['acc']:.4f} / {h['acc_norm']:.4f} ({h['n']} items; chance 0.25)")
              + " |",
              f"| SFT validation loss | chat | {f(sft['val_loss_before'])} -> {f(sft['val_loss'])} |",
              f"| DPO held-out preference accuracy | DPO | {f(dpo['pref_acc_before'], '{:.1%}')} -> "
              f"{f(dpo['pref_acc'], '{:.1%}')} |", "", "## Loss curves", "",
              "![loss curves of every stage](loss.png)" if c["plot"] == "loss.png" else c["plot"], "",
              "## Chat samples (greedy, SFT template)", ""]
    for q, by in ev["samples"].items():             # as JSON strings: newlines and spaces show
        lines += [f"**{q}**", ""] + [f"- {name}: {pl.printable(json.dumps(by[name], ensure_ascii=False))}"
                                     for name in ("pretrain", "sft", "dpo")] + [""]
    lines += ["## Next", "", "```", *next_steps(p, run), "```"]
    return "\n".join(lines) + "\n"


def next_steps(plan, run):
    prog = "nanoeuler_cuda.py" if plan["engine"] == "gpu" else "nanoeuler.py"
    dpo = os.path.join(run, "dpo")
    dpo = os.path.relpath(dpo) if dpo.startswith(os.getcwd() + os.sep) else dpo
    return [f"python3 {prog} chat --ckpt {dpo}", f"python3 {prog} serve --ckpt {dpo}    # http://127.0.0.1:8000/"]


# ----------------------------------------------------------------------------------------------------
# running the stages: markers, resumption, progress and each stage's log

class Tee:
    """A stream that writes to the terminal and to the stage's log."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, s):
        self.log.write(s)
        return self.stream.write(s)

    def flush(self):
        self.log.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def logged(path):
    with open(path, "a", encoding="utf-8") as log:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = Tee(out, log), Tee(err, log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = out, err


@contextlib.contextmanager
def clock(path, every=10.0):
    """Seconds spent in a stage over all its attempts: the last attempt's count in path, kept up to date every
    `every` seconds (a kill loses at most that). Yields a function giving the total so far."""
    before = json.load(open(path))["seconds"] if os.path.isfile(path) else 0.0
    t0, stop = time.time(), threading.Event()
    total = lambda: before + time.time() - t0

    def beat():
        while not stop.wait(every):
            pl.atomic_write(path, json.dumps({"seconds": total()}))
    threading.Thread(target=beat, daemon=True).start()
    try:
        yield total
    finally:
        stop.set()
        pl.atomic_write(path, json.dumps({"seconds": total()}))


def eta_line(plan, figures):
    est = dict(plan["estimates"])
    if "tokenizer" in figures:                      # the pretraining's steps, capped by the text (pretrain_steps)
        est["pretrain"] *= pretrain_steps(plan, figures["tokenizer"]["tokens"]) / plan["steps"]
    left = sum(est[s] for s in STAGES if s not in figures)       # the stages not yet done
    return f"whole run ETA {left / 60:.1f} min (at {time.strftime('%H:%M', time.localtime(time.time() + left))})"


def run_stage(run, plan, figures, name, fn):
    marker = os.path.join(run, "stages", f"{name}.done.json")
    i = STAGES.index(name) + 1
    if os.path.isfile(marker):
        figures[name] = json.load(open(marker))
        print(f"[speedrun {i}/{len(STAGES)}] {name}: done before ({figures[name]['seconds']:.1f} s), skipped", flush=True)
        return
    print(f"[speedrun {i}/{len(STAGES)}] {name}: starting | {eta_line(plan, figures)}", flush=True)
    log = os.path.join(run, "stages", f"{name}.log")
    with clock(os.path.join(run, "stages", f"{name}.seconds.json")) as spent, logged(log):
        result = fn(log)
    result["seconds"] = round(spent(), 2)
    pl.atomic_write(marker, json.dumps(result, indent=1))
    figures[name] = result
    print(f"[speedrun {i}/{len(STAGES)}] {name}: done in {result['seconds']:.1f} s | {eta_line(plan, figures)}", flush=True)


def parse(argv):
    p = pl.Parser(prog="speedrun.py", description="from nothing to a chat model in one command: data, tokenizer, "
                  "pretraining, SFT, DPO and evaluation, with one report card (REPORT.md); run it again to resume")
    p.add_argument("--out", default="speedrun", metavar="DIR", help="the speedrun's folder (default speedrun)")
    p.add_argument("--data", metavar="FILE", help="pretrain on this UTF-8 text, no download (default: make data's "
                                                  "corpora; offline, the embedded corpus)")
    p.add_argument("--offline", action="store_true", help="download nothing: the embedded corpus and built-in sets")
    p.add_argument("--sft-data", dest="sft_data", metavar="FILE",
                   help="SFT on this Alpaca JSON (default: make data's, else built-in)")
    p.add_argument("--dpo-data", dest="dpo_data", metavar="FILE",
                   help="DPO on this preference JSONL (default: make data's, else built-in)")
    p.add_argument("--engine", choices=("auto", "gpu", "cpu"), default="auto",
                   help="auto: the GPU engine when CuPy sees a GPU, else the CPU engine (default auto)")
    p.add_argument("--config", metavar="NAME", help="model config: " + ", ".join(f"{c} ({e.upper()})" for e, c in SETUPS)
                   + " (default big on the GPU, small on the CPU)")
    p.add_argument("--budget-minutes", dest="budget_minutes", type=float, default=60.0, metavar="MIN",
                   help="the whole run's length, downloads aside: pretraining gets 80%% (default 60)")
    p.add_argument("--rate", type=float, metavar="TOKENS_PER_S", help="training tokens/s to plan with (default: the "
                                                                       "engine and config's, from bench; printed at the start)")
    p.add_argument("--price", type=float, default=3.50, metavar="USD",
                   help="USD per GPU-hour of the cost estimate (default 3.50)")
    p.add_argument("--hellaswag", metavar="FILE", help=f"HellaSwag JSONL (default {HELLASWAG}; skipped when absent)")
    p.add_argument("--hellaswag-items", dest="hellaswag_items", type=int, metavar="N",
                   help="HellaSwag items scored (default all on the GPU, 500 on the CPU)")
    p.add_argument("--stop-after", dest="stop_after", choices=STAGES, help="stop after this stage (run again to go on)")
    a = p.parse_args(argv)
    if a.hellaswag_items is not None:
        pl.check_positive(a, "hellaswag_items")
    return a


def speedrun(argv):
    a = parse(argv)
    run = os.path.abspath(pl.writable(a.out, "--out", folder=True))   # "" is refused, not the current folder
    plan, plan_path = make_plan(a), os.path.join(run, "plan.json")
    if os.path.isfile(plan_path):
        kept = json.load(open(plan_path))
        changed = [k for k in ("engine", "config", "steps", "sft_steps", "dpo_steps", "data") if kept[k] != plan[k]]
        if changed:
            raise pl.UserError(f"{a.out} holds a speedrun of another plan ({', '.join(changed)} differ); run it with its "
                               "own flags to go on, or give another --out")
        plan = kept
    card = os.path.join(run, "REPORT.md")
    if os.path.isfile(card) and all(os.path.isfile(os.path.join(run, "stages", f"{s}.done.json")) for s in STAGES):
        print(open(card, encoding="utf-8").read(), end="")
        return
    os.makedirs(os.path.join(run, "stages"), exist_ok=True)
    pl.atomic_write(plan_path, json.dumps(plan, indent=1))
    print(f"speedrun: {plan['config']} on the {plan['engine'].upper()} engine, budget {plan['budget_minutes']:g} min "
          f"(downloads aside) -> pretraining on {plan['tokens']:,} tokens ({plan['steps']:,} steps x {plan['batch']} x "
          f"{plan['seq']}) at an assumed {plan['rate']:,.0f} tokens/s ({plan['rate_source']}); SFT {plan['sft_steps']} "
          f"steps, DPO {plan['dpo_steps']} steps; data: {plan['data']['why']}", flush=True)
    figures = {}
    recipe = {"data": lambda log: stage_data(plan, run),
              "tokenizer": lambda log: stage_tokenizer(plan, run),
              "pretrain": lambda log: stage_pretrain(plan, run, figures["tokenizer"], log),
              "sft": lambda log: stage_sft(plan, run, log),
              "dpo": lambda log: stage_dpo(plan, run),
              "eval": lambda log: stage_eval(plan, run)}
    for name in STAGES:
        run_stage(run, plan, figures, name, recipe[name])
        if name == a.stop_after and name != STAGES[-1]:
            print(f"stopped after {name} (--stop-after); run it again to go on")
            return
    write_card(run, plan, figures, argv)
    print(open(card, encoding="utf-8").read(), end="")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(x) for x in argv]
    try:
        speedrun(argv)
    except pl.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Failed as e:                              # the stage's mode printed its error line
        return e.args[0]
    except KeyboardInterrupt:
        print("\n[speedrun] stopped; run the same command again to go on from here")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""
test_speedrun.py -- issue 35: `make speedrun` (speedrun.py) on the CPU engine, in this process, offline on the embedded
corpus with a tiny batch: every stage's figures in the card (REPORT.md and REPORT.json) and in agreement with the run
folders' own logs, a Ctrl-C during pretraining that the next run resumes from the engine's checkpoint, a run stopped
after pretraining that resumes at SFT with the finished stages' figures unchanged, a finished run that prints its
card and touches nothing, and one-line errors.
"""
import json
import math
import os
import signal

import numpy as np
import pytest

import nanoeuler as ne
import pipeline as pl
import speedrun
from conftest import ROOT

FIXTURE = ROOT / "data" / "fixtures" / "hellaswag_val.jsonl"      # 5 items


@pytest.fixture
def args(tmp_path, monkeypatch):
    """The speedrun's flags with batches of 4 x 64 to pretrain and 2 to fine-tune (seconds, not minutes), 24 SFT
    examples and 24 DPO pairs."""
    monkeypatch.setitem(speedrun.SETUPS, ("cpu", "small"), (4, 64, 16_000, "test: a tiny batch"))
    monkeypatch.setitem(pl.SFT_DEFAULTS, "cpu", dict(pl.SFT_DEFAULTS["cpu"], batch=2))   # the engines' defaults
    monkeypatch.setitem(pl.DPO_DEFAULTS, "batch", 2)                                   # of the sft and dpo flags
    sft, prefs = tmp_path / "sft.json", tmp_path / "prefs.jsonl"
    sft.write_text(json.dumps(pl.builtin_sft_examples()[:24]))
    prefs.write_text("".join(json.dumps(p) + "\n" for p in pl.builtin_prefs()[:24]))
    return ["--offline", "--engine", "cpu", "--budget-minutes", 0.005, "--out", tmp_path / "run", "--sft-data", sft,
            "--dpo-data", prefs, "--hellaswag", FIXTURE]


def files(folder):
    return {os.path.join(d, f): (os.stat(os.path.join(d, f)).st_mtime_ns, os.path.getsize(os.path.join(d, f)))
            for d, _, fs in os.walk(folder) for f in fs}


def test_speedrun_card_resume_and_rerun(args, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    # 1: Ctrl-C during the 8th step of pretraining: the engine checkpoints it, the speedrun stops (130)
    step, calls = ne.Trainer.step, []

    def ctrl_c_at_step_8(self, x, y, lr):
        step(self, x, y, lr)
        calls.append(1)
        if len(calls) == 8:
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(ne.Trainer, "step", ctrl_c_at_step_8)
    assert speedrun.main(args) == 130
    monkeypatch.setattr(ne.Trainer, "step", step)
    out = capsys.readouterr().out
    assert "data: offline (--offline)" in out
    assert "pretraining on 3,840 tokens (15 steps x 4 x 64) at an assumed 16,000 tokens/s" in out   # 80% of 0.3 s
    assert "pretrain: starting | whole run ETA" in out and "run the same command again" in out
    assert sorted(os.listdir(run / "stages")) == ["data.done.json", "data.log", "data.seconds.json", "pretrain.log",
                                                 "pretrain.seconds.json", "tokenizer.done.json", "tokenizer.log",
                                                 "tokenizer.seconds.json"]
    with np.load(run / "pretrain" / "ckpt.npz") as z:
        assert int(z["step"]) == 8
    # 2: run again, stopped after pretraining (as by a crash between two stages): it resumes from step 8
    assert speedrun.main(args + ["--stop-after", "pretrain"]) == 0
    out = capsys.readouterr().out
    assert "data: done before" in out and "tokenizer: done before" in out and "step 8/15" in out
    assert "pretrain: done in" in out and "sft: starting" not in out and not (run / "REPORT.md").exists()
    assert [json.loads(l)["step"] for l in (run / "pretrain" / pl.LOG).read_text().splitlines()] == list(range(1, 16))
    done = {s: json.loads((run / "stages" / f"{s}.done.json").read_text()) for s in ("data", "tokenizer", "pretrain")}
    ckpt = {k: v for k, v in files(run / "pretrain").items() if not k.endswith("evals.jsonl")}   # eval adds its scores
    # 3: run again: it goes on at SFT, and the finished stages keep their figures
    assert speedrun.main(args) == 0
    out = capsys.readouterr().out
    assert all(f"{s}: done before" in out for s in done) and "sft: starting" in out and "pretrain: starting" not in out
    assert {k: v for k, v in files(run / "pretrain").items() if k in ckpt} == ckpt
    card, md = json.loads((run / "REPORT.json").read_text()), (run / "REPORT.md").read_text()
    assert out.endswith(md) and "nanoeuler.py chat --ckpt" in md and "nanoeuler.py serve --ckpt" in md
    st = card["stages"]
    assert {s: st[s] for s in done} == done
    # every stage's figures, against the run folders' logs (what the engines wrote, read here apart)
    assert "skipped: offline (--offline)" in md and st["tokenizer"]["vocab"] == 512
    pre, sft, dpo, ev = st["pretrain"], st["sft"], st["dpo"], st["eval"]
    log = [json.loads(l) for l in (run / "pretrain" / pl.LOG).read_text().splitlines()]
    assert pre["steps"] == 15 and pre["tokens"] == sum(r["tokens"] for r in log) == 15 * 4 * 64
    assert pre["val_loss"] == [r for r in log if "val_loss" in r][-1]["val_loss"] == log[-1]["val_loss"]
    assert pre["val_bpb"] == log[-1]["val_bpb"] and pre["val_loss"] < pre["val_loss_before"] < math.log(512) + 1
    assert pre["tokens_per_s"] > 0 and pre["mfu"] is None                    # MFU: the GPU engine's report only
    slog = [json.loads(l) for l in (run / "sft" / pl.LOG).read_text().splitlines()]
    assert sft["steps"] == 5 and sft["val_loss"] == slog[-1]["val_loss"] and sft["val_loss_before"] > 0
    assert dpo["steps"] == 5 and dpo["pref_acc_before"] == 0.5               # policy = reference: every pair ties
    assert dpo["pref_acc"] == [json.loads(l) for l in (run / "dpo" / pl.LOG).read_text().splitlines()][-1]["pref_acc"]
    assert ev["hellaswag"]["n"] == 5 and ev["hellaswag"]["acc"] in (0, .2, .4, .6, .8, 1)
    assert set(ev["samples"]) == set(speedrun.CHAT_PROMPTS)
    assert all(set(a) == {"pretrain", "sft", "dpo"} for a in ev["samples"].values())
    for text in (f"{pre['val_loss']:.4f}", f"{pre['val_bpb']:.4f}", f"{pre['val_loss_before']:.4f}", f"{sft['val_loss']:.4f}",
                 f"{sft['val_loss_before']:.4f}", f"{dpo['pref_acc']:.1%}", f"{ev['hellaswag']['acc']:.4f} / ",
                 *speedrun.CHAT_PROMPTS):
        assert text in md, text
    for s in speedrun.STAGES:
        assert f"| {s} | {st[s]['seconds']:.1f} s |" in md
    assert card["seconds"] == pytest.approx(sum(st[s]["seconds"] for s in speedrun.STAGES), abs=0.1)
    assert card["gpu_hours"] == card["cost_usd"] == 0 and card["commit"]
    # 4: a finished run, run again, prints its card and changes nothing
    before = files(run)
    assert speedrun.main(args) == 0
    assert capsys.readouterr().out == md and files(run) == before


def test_speedrun_bad_input_is_one_line(args, tmp_path, capsys):
    (tmp_path / "bad.json").write_text('[{"instruction": "a", ')
    for more, words in ((["--data", tmp_path / "missing.txt"], "--data not found"),
                        (["--budget-minutes", 0], "--budget-minutes"),
                        (["--out", ""], "the path is empty"),                  # not the current folder
                        (["--config", "tiny"], "no speedrun setup for tiny"),
                        (["--hellaswag-items", 0], "--hellaswag-items 0"),
                        (["--stop-after", "nothing"], "invalid choice"),
                        (["--sft-data", tmp_path / "bad.json"], "is not valid JSON"),          # before any stage
                        (["--dpo-data", tmp_path / "bad.json"], "is not JSON"),
                        (["--hellaswag", tmp_path / "bad.json"], "is not JSON")):
        assert speedrun.main(args + more) == 1
        err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], (more, err)
        assert not (tmp_path / "run" / "stages").exists()
    assert speedrun.main(args + ["--stop-after", "data"]) == 0              # a plan in the folder, then another plan
    capsys.readouterr()
    assert speedrun.main(args + ["--budget-minutes", 1]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "another plan" in err and "\n" not in err


def test_pretraining_takes_at_most_max_epochs_of_a_small_text(args, tmp_path, capsys):
    """A budget that buys more passes over --data than MAX_EPOCHS trains MAX_EPOCHS (an H200 run of 27 epochs
    over docs.txt ended with a worse validation loss than at 8), says so, and the card shows the steps run."""
    text = tmp_path / "small.txt"
    text.write_text(pl.default_corpus()[0][:3000], encoding="utf-8")
    assert speedrun.main(args + ["--data", text, "--stop-after", "pretrain"]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "run"
    tokens = json.loads((run / "stages" / "tokenizer.done.json").read_text())["tokens"]
    steps = int(speedrun.MAX_EPOCHS * 0.9 * tokens // (4 * 64))
    assert speedrun.MIN_STEPS < steps < 15                        # the budget buys 15 steps of 4 x 64
    assert f"pretraining small: {steps:,} steps x 4 x 64" in out and "the budget buys 15 steps" in out
    log = [json.loads(l) for l in (run / "pretrain" / pl.LOG).read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, steps + 1))
    assert json.loads((run / "stages" / "pretrain.done.json").read_text())["steps"] == steps


def test_the_download_holds_the_budget_in_max_epochs_passes(tmp_path, monkeypatch, capsys):
    """Where the speedrun downloads, FineWeb-Edu comes in the megabytes that its pretraining tokens need in
    MAX_EPOCHS passes (an hour on an H200: 1,584 MB), never fewer than make data's 100; a web.txt already
    there is kept."""
    monkeypatch.setattr(speedrun, "HERE", str(tmp_path))
    (tmp_path / "data").mkdir()
    calls = []

    def shell(cmd, env=None):
        calls.append(cmd)
        for p in cmd[3:] if cmd[0] == "make" else ():
            (tmp_path / p).write_text("text")
    monkeypatch.setattr(speedrun, "shell", shell)
    (tmp_path / "hellaswag.jsonl").write_text("")
    plan = dict(data=dict(why="make data", text=str(tmp_path / speedrun.CORPORA[0])),
                hellaswag=str(tmp_path / "hellaswag.jsonl"),
                tokens=int(0.8 * 3600 * 550_000) // (64 * 512) * 64 * 512)     # gpu big, the default 60 minutes
    speedrun.stage_data(plan, str(tmp_path / "run"))
    assert calls == [["bash", str(tmp_path / "data" / "get_web.sh"), "1584"],
                     ["make", "-C", str(tmp_path), *speedrun.CORPORA]]
    assert "FineWeb-Edu: 1,584 MB" in capsys.readouterr().out
    for p in speedrun.CORPORA:
        os.remove(tmp_path / p)
    calls.clear()
    speedrun.stage_data(dict(plan, tokens=1_000_000), str(tmp_path / "run"))     # 1 MB would do: make data's 100
    assert calls[0][2] == "100"
    os.remove(tmp_path / speedrun.CORPORA[0])
    (tmp_path / "data" / "web.txt").write_text("kept")
    calls.clear()
    speedrun.stage_data(plan, str(tmp_path / "run"))
    assert calls == [["make", "-C", str(tmp_path), speedrun.CORPORA[0]]]

"""evaluate.py and the eval/plot modes: HellaSwag and bpb against independent computations, the plot and
report of a real short run, the data script, and one error line for each bad input."""
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import bpe
import evaluate
from conftest import ROOT, one_error_line, run_engine, run_here
import nanoeuler as ne
import pipeline as pl

FIX = ROOT / "data" / "fixtures" / "hellaswag_val.jsonl"


@pytest.fixture(scope="module")
def model():
    cfg = pl.get_config("tiny")
    return pl.Params.init(cfg, 3), bpe.Tokenizer([])


def _logp_by_hand(P, ids):
    """Independent: one forward per sequence, numpy float64 log-softmax, the log-prob of each next id."""
    logits = ne.forward(P, np.array([ids], np.int32)).astype(np.float64)
    z = logits - logits.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return np.array([logp[t, ids[t + 1]] for t in range(len(ids) - 1)])


def test_hellaswag_fixture_item_for_item(model):
    P, tok = model
    items = evaluate.load_hellaswag(str(FIX))
    assert len(items) == 5
    r = evaluate.hellaswag(tok, items, ne.cpu_logprobs(P), P.cfg.ctx)
    for item, (pred, pred_norm, label) in zip(items, r["preds"]):
        c = tok.encode(item["ctx"])
        sums = []
        for e in item["endings"]:
            t = tok.encode(" " + e)
            ids = (c + t)[-P.cfg.ctx:]
            sums.append(_logp_by_hand(P, ids)[-len(t):].sum())
        norm = [s / len(e) for s, e in zip(sums, item["endings"])]              # lm-evaluation-harness: len(choice)
        assert (pred, pred_norm, label) == (int(np.argmax(sums)), int(np.argmax(norm)), item["label"])
    assert r["acc"] == np.mean([p == l for p, _, l in r["preds"]])
    assert r["acc_norm"] == np.mean([q == l for _, q, l in r["preds"]])


def test_hellaswag_long_context_truncated_once(model):
    P, tok = model
    item = dict(ctx="word " * 200, endings=["a b", "c d e f", "g", "h i j"], label=0)
    notes = []
    seqs, ns, cut = evaluate.hellaswag_sequences(tok, item, P.cfg.ctx)
    assert cut and all(len(s) == P.cfg.ctx for s in seqs)
    r = evaluate.hellaswag(tok, [item, item], ne.cpu_logprobs(P), P.cfg.ctx, warn=notes.append)
    assert len(notes) == 1 and r["truncated"] == 2


@pytest.mark.parametrize("n_chars", [40, 500])          # within one window; several windows (ctx 64)
def test_bpb_by_hand(model, n_chars):
    P, tok = model
    text = ("héllo wörld, the quick brown fox. " * 20)[:n_chars]
    bpb, nats, n, n_bytes = evaluate.bpb(tok, text, ne.cpu_logprobs(P), P.cfg.ctx)
    ids, T = tok.encode(text), P.cfg.ctx
    nll = -sum(_logp_by_hand(P, ids[s:s + T]).sum() for s in range(0, len(ids) - 1, T - 1))
    assert n == len(ids) - 1 and n_bytes == len(text.encode("utf-8"))
    assert bpb == pytest.approx(nll / math.log(2) / n_bytes, rel=1e-6)


def _main(argv, capsys):
    rc = ne.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error(rc, err):
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


def test_bad_inputs_one_error_line(tmp_path, capsys, monkeypatch, model):
    P, tok = model
    ckpt = tmp_path / "ckpt.npz"
    pl.save_checkpoint(str(ckpt), P, tok)
    monkeypatch.setattr(evaluate, "DEFAULT_HELLASWAG", str(tmp_path / "none.jsonl"))
    assert "get_hellaswag.sh" in _one_error(*_main(["eval", "--ckpt", str(ckpt)], capsys)[::2])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "x"}\n')
    for argv in (["eval", "--ckpt", str(ckpt), "--data", str(bad)],
                 ["eval", "--ckpt", str(ckpt), "--data", str(tmp_path / "missing.jsonl")],
                 ["eval", "--ckpt", str(ckpt), "--task", "bpb"],
                 ["eval", "--ckpt", str(ckpt), "--task", "bpb", "--data", str(tmp_path / "missing.txt")],
                 ["eval", "--ckpt", str(tmp_path / "nockpt.npz"), "--data", str(FIX)],
                 ["eval", "--ckpt", str(ckpt), "--data", str(FIX), "--limit", "0"],
                 ["plot", str(tmp_path / "no_run")],
                 ["plot", str(tmp_path)]):                # a folder without train_log.jsonl
        _one_error(*_main(argv, capsys)[::2])
    rc, out, err = _main(["eval", "--ckpt", str(ckpt), "--data", str(FIX), "--limit", "2"], capsys)
    assert rc == 0 and out.strip().splitlines()[-1].startswith("hellaswag: 2 items | acc ")
    assert "acc_norm" in out.strip().splitlines()[-1]
    assert json.loads((tmp_path / "evals.jsonl").read_text().splitlines()[-1])["n"] == 2


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    (tmp_path / "train_log.jsonl").write_text('{"step": 1, "loss": 5.0, "ms": 10, "tok_s": 100}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib -> ImportError
    with pytest.raises(pl.UserError, match="pip install matplotlib"):
        evaluate.plot([str(tmp_path)], str(tmp_path / "x.png"))


def _train_tiny(tmp_path, *args, plots=True):
    """nanoeuler.py train tiny on a small text with args (batch 2, seq 16, an eval every 2 steps) -> its run
    folder; in this process (conftest.run_here), as without matplotlib if not plots."""
    data = tmp_path / "text.txt"
    data.write_text("The cat sat on the mat. A dog ran in the park. " * 60)
    run = tmp_path / "run"
    r = run_here("nanoeuler.py", "train", "tiny", "--batch", 2, "--seq", 16, "--eval-every", 2, "--sample-every", 0,
                 "--data", data, "--out", run, *args, env={"NANOEULER_CACHE": str(tmp_path / "cache")}, plots=plots)
    assert r.returncode == 0, r.stderr
    return run


def test_train_writes_report_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib import image
    run = _train_tiny(tmp_path, "--steps", 4)
    report = (run / "report.md").read_text()
    for want in ("parameters: 75,488", "tokens seen: 128", "GFLOP/s", "final validation loss", "## Sample",
                 "![loss curves](loss.png)"):
        assert want in report, want
    png = tmp_path / "plot.png"
    r = run_here("nanoeuler.py", "plot", run, run, "--out", png)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = image.imread(str(png))
    assert img.shape[0] > 100 and img.shape[1] > 300 and img[..., :3].std() > 0.01   # not blank
    c = evaluate.curves(str(run))
    assert list(c["step"]) == [1, 2, 3, 4] and list(c["tokens"]) == [32, 64, 96, 128]
    assert list(c["val_step"]) == [2, 4] and np.all(np.diff(c["wall"]) >= 0)


def test_report_counts_grad_accum_tokens(tmp_path):
    """--grad-accum 2: a step sees 2 micro-batches, and the report and the curves count both."""
    run = _train_tiny(tmp_path, "--steps", 2, "--grad-accum", 2, plots=False)
    assert "tokens seen: 128 (2 steps x 64)" in (run / "report.md").read_text()
    assert list(evaluate.curves(str(run))["tokens"]) == [64, 128]


def _script(out, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("HELLASWAG_SOURCE", "OUT", "FORCE")}
    e.update(OUT=str(out), PYTHON=sys.executable, **{k: str(v) for k, v in env.items()})
    return subprocess.run(["bash", str(ROOT / "data" / "get_hellaswag.sh")], env=e, capture_output=True, text=True,
                          timeout=60)


def test_get_hellaswag_fixture_idempotent_and_bad_source(tmp_path):
    out = tmp_path / "h.jsonl"
    r = _script(out, HELLASWAG_SOURCE=FIX)
    assert r.returncode == 0 and "5 items" in r.stdout and out.read_bytes() == FIX.read_bytes()
    os.utime(out, ns=(10**18, 10**18))
    r = _script(out, HELLASWAG_SOURCE=FIX)
    assert r.returncode == 0 and "already exists" in r.stdout and out.stat().st_mtime_ns == 10**18
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "a", "endings": ["x"], "label": 0}\n')
    for src in (bad, tmp_path / "nothing.jsonl"):
        o = tmp_path / "b.jsonl"
        r = _script(o, HELLASWAG_SOURCE=src)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:") and not o.exists(), r.stderr
        assert not list(tmp_path.glob("*.tmp"))


# ----------------------------------------------------------------------------------------------------
# the GPU engine's eval and plot modes (nanoeuler_cuda.py); tests marked gpu skip without CuPy and a device



def test_gpu_engine_eval_without_cupy_and_plot_without_a_gpu(tmp_path, monkeypatch):
    """In this process, where `import cupy` fails (None in sys.modules; test_cli.py's
    test_without_cupy_every_mode_says_so runs the engine in a process with a cupy that fails to import)."""
    import nanoeuler_cuda as nc
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(nc, "cp", None)
    for args, words in ((["eval"], "CuPy"), (["eval", "--limit", "0"], "--limit"), (["eval", "--task", "bpb"], "--data"),
                        (["plot", tmp_path / "no_run"], "run folder not found")):
        r = run_here("nanoeuler_cuda.py", *args)
        assert r.returncode == 1 and one_error_line(r, words), r.stderr
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s, "ms": 10, "tok_s": 100}) + "\n"
                                                 for s in (1, 2, 3)))
    r = run_here("nanoeuler_cuda.py", "plot", run, "--out", tmp_path / "p.png")
    assert r.returncode == 0 and (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr


@pytest.mark.gpu
def test_gpu_eval_agrees_with_the_cpu_engine_item_for_item(model, tmp_path):
    import nanoeuler_cuda as nc
    P, tok = model
    items = evaluate.load_hellaswag(str(FIX))
    cpu = evaluate.hellaswag(tok, items, ne.cpu_logprobs(P), P.cfg.ctx)
    gpu = evaluate.hellaswag(tok, items, nc.gpu_hellaswag_logprobs(P, "fp32", "naive"), P.cfg.ctx, batch_items=None)
    assert gpu["preds"] == cpu["preds"] and (gpu["acc"], gpu["acc_norm"]) == (cpu["acc"], cpu["acc_norm"])
    seqs = [s for item in items for s in evaluate.hellaswag_sequences(tok, item, P.cfg.ctx)[0]]
    want = ne.cpu_logprobs(P)(seqs)
    got = nc.gpu_logprobs(P, 3, P.cfg.ctx, "fp32", "naive")(seqs)       # 3 rows a forward: the last one part-full
    assert [len(g) for g in got] == [len(w) for w in want] == [len(s) - 1 for s in seqs]
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) < 1e-4
    # the modes on a checkpoint: the same last line as the CPU engine's, HellaSwag and bits per byte
    ckpt, text = tmp_path / "ckpt.npz", tmp_path / "t.txt"
    pl.save_checkpoint(str(ckpt), P, tok)
    text.write_text("héllo wörld, the quick brown fox. " * 20, encoding="utf-8")
    for args in (["--data", FIX], ["--task", "bpb", "--data", text]):
        c = run_engine("nanoeuler.py", "eval", "--ckpt", ckpt, *args)
        g = run_engine("nanoeuler_cuda.py", "eval", "--ckpt", ckpt, *args, "--precision", "fp32", "--attn", "naive")
        assert c.returncode == g.returncode == 0, g.stderr
        assert g.stdout.splitlines()[-1] == c.stdout.splitlines()[-1]


# ----------------------------------------------------------------------------------------------------
# issue 36: HellaSwag's scores and the report's tokens against definitions written apart from the code

def _stub_logprobs(tok, ctx, totals):
    """A logprobs_fn whose sequences score each context token -20 and spread the chosen total log-prob of
    an ending evenly over its tokens: the sums are then known by hand, whatever the model."""
    c = tok.encode(ctx)
    tails = {tuple(tok.encode(" " + e)): s for e, s in totals.items()}

    def logprobs_fn(seqs):
        out = []
        for s in seqs:
            assert s[:len(c)] == c, "the context comes first, whole"
            tail = tuple(s[len(c):])
            out.append(np.array([-20.0] * (len(c) - 1) + [tails[tail] / len(tail)] * len(tail)))
        return out
    return logprobs_fn


def test_hellaswag_acc_and_acc_norm_of_a_hand_computed_item():
    """Authority: lm-evaluation-harness (lm_eval/api/task.py, multiple_choice): acc takes the argmax of
    each ending's summed log-likelihood, acc_norm the argmax of that sum / len(choice), the ending's length in
    CHARACTERS (completion_len = [float(len(i)) for i in choices]; bytes are its separate acc_bytes, tokens
    no metric of it), the ending scored as the continuation " " + ending after the context. The endings
    differ in tokens, characters and bytes (a 'zz' merge, accented letters), so that a norm by tokens or by
    bytes, or a sum over the context too, picks another ending than the characters do."""
    tok = bpe.Tokenizer([(ord("z"), ord("z"))])
    ctx = "A man sits down."
    endings = ["zzzzzzzzzz", "éé", "ok then", "no"]
    totals = dict(zip(endings, [-11.0, -3.0, -5.5, -9.5]))
    n_tokens = [len(tok.encode(" " + e)) for e in endings]
    assert n_tokens == [6, 5, 8, 3] and [len(e) for e in endings] == [10, 2, 7, 2]     # unequal both ways
    assert [len(e.encode()) for e in endings] == [10, 4, 7, 2]
    # by hand: sums -11, -3, -5.5, -9.5 -> acc picks 1 (-3); per character -1.1, -1.5, -0.786, -4.75 ->
    # acc_norm picks 2. (Per token: -1.83, -0.6, -0.69, -3.17 would pick 1; per byte of " " + ending 1 too;
    # a sum that took in the context's tokens too, at -20 each, or just its last, would pick 0.)
    item = dict(ctx=ctx, endings=endings, label=2)
    r = evaluate.hellaswag(tok, [item], _stub_logprobs(tok, ctx, totals), 64)
    assert r["preds"] == [(1, 2, 2)]
    assert (r["acc"], r["acc_norm"], r["n"], r["truncated"]) == (0.0, 1.0, 1, 0)
    wrong = dict(item, label=1)                                     # the same item, labelled the other way
    r = evaluate.hellaswag(tok, [item, wrong], _stub_logprobs(tok, ctx, totals), 64, batch_items=None)
    assert r["preds"] == [(1, 2, 2), (1, 2, 1)] and (r["acc"], r["acc_norm"]) == (0.5, 0.5)


def test_hellaswag_acc_norm_excludes_the_leading_space():
    """Authority: lm-evaluation-harness: the request is (context, " " + choice) (target_delimiter " "), but
    completion_len = len(choice), the ending alone. 'a' (1 character) at -1 and 'abcd' (4) at -3.2: per
    character -1 and -0.8, so acc_norm picks 'abcd'; dividing by len(" " + ending) gives -0.5 and -0.64
    and picks 'a'."""
    tok = bpe.Tokenizer([(ord("z"), ord("z"))])
    ctx = "A man sits down."
    totals = {"a": -1.0, "abcd": -3.2, "zz": -50.0, "q": -50.0}
    item = dict(ctx=ctx, endings=list(totals), label=1)
    r = evaluate.hellaswag(tok, [item], _stub_logprobs(tok, ctx, totals), 64)
    assert r["preds"] == [(0, 1, 1)]


def _write_log(run, recs):
    with open(run / evaluate.LOG, "w") as f:
        for r in recs:
            f.write(json.dumps(dict(r, loss=5.0, ms=10.0)) + "\n")


def test_report_tokens_sum_each_steps_own_and_count_a_repeated_step_once(tmp_path):
    """Authority: the definition of tokens seen, the tokens the final weights were trained on: each step's
    own count ("tokens" in its log line, the tokens of that step's batch), summed over the steps, a step
    counted once. A run logged steps 1-4 at 32 tokens, died after its step-2 checkpoint, and resumed from it
    with a larger batch: steps 3-6 at 64. Seen: 2 x 32 + 4 x 64 = 320 (not 6 x 64 = 384, the last step's
    count times the steps, nor 448, every line)."""
    recs = [dict(step=s, tokens=32) for s in (1, 2, 3, 4)] + [dict(step=s, tokens=64) for s in (3, 4, 5, 6)]
    _write_log(tmp_path, recs)
    cfg = pl.get_config("tiny")
    path = evaluate.write_report(str(tmp_path), {"seq": 16, "config": "tiny"}, cfg, 4.0, 2.0, "sample")
    report = open(path, encoding="utf-8").read()
    assert re.search(r"- steps: 6\b", report), report
    assert re.search(r"- tokens seen: 320\b", report), report


def test_report_tokens_sum_steps_of_unequal_size(tmp_path):
    """Authority: as above, without a resume: steps of 16, 16, 48 tokens (a batch changed between runs that
    each ran to their end) saw 80 tokens, not 3 x 48."""
    _write_log(tmp_path, [dict(step=1, tokens=16), dict(step=2, tokens=16), dict(step=3, tokens=48)])
    path = evaluate.write_report(str(tmp_path), {"seq": 16, "config": "tiny"}, pl.get_config("tiny"), 4.0, 2.0, "s")
    assert re.search(r"- tokens seen: 80\b", open(path, encoding="utf-8").read())


def test_time_to_loss_table_from_hand_made_logs(tmp_path):
    """bench/time_to_loss.py (issue 34's table): the target is the best AdamW run's final validation loss; a run
    reaches it at its first validation at or below it; wall time sums the steps' ms, the first 5 (compilation)
    counted at the run's median; ratios are against that AdamW run."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("time_to_loss", ROOT / "bench" / "time_to_loss.py")
    ttl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ttl)

    def run(name, optim, lr, vals):
        d = tmp_path / name
        d.mkdir()
        with open(d / "train_log.jsonl", "w") as f:
            for s in range(1, 11):                   # steps 1-2 compile (1 s each), then 10 ms; 20 ms for Muon
                rec = {"step": s, "loss": 5.0, "ms": 1000.0 if s <= 2 else 10.0 * (1 + (optim == "muon")),
                       "tokens": 8}
                if s in vals:
                    rec.update(val_loss=vals[s], val_bpb=vals[s] / 2)
                f.write(json.dumps(rec) + "\n")
        np.savez(d / "ckpt.npz", train_state=np.array(json.dumps({"train": {"optim": optim, "lr": lr, "muon_lr": 0.02}})))
        return str(d)
    runs = [run("a1", "adamw", 1e-3, {5: 4.0, 10: 3.0}), run("a2", "adamw", 2e-3, {5: 2.0, 10: 3.5}),
            run("m", "muon", 1e-3, {5: 2.9, 10: 2.5}), run("m2", "muon", 1e-3, {5: 3.1, 10: 3.01})]
    lines, verdict = ttl.table([ttl.run_info(d) for d in runs])
    assert lines[0].startswith("target: 3.0000, the final validation loss of a1 (AdamW, lr 0.001)")
    rows = {l.split(" | ")[0][2:]: l for l in lines[4:]}
    assert rows["a1"].endswith("| 3.0000 | 1.5000 | 10.0 | 10 | 0.10 | 1.00 | 1.00 |")
    assert rows["a2"].endswith("| 5 | 0.05 | 0.50 | 0.50 |")          # a validation at or below counts
    assert rows["m"].startswith("| m | muon | 0.02 | 2.5000") and rows["m"].endswith("| 5 | 0.10 | 0.50 | 1.00 |")
    assert rows["m2"].endswith("not reached | - | - | - |")
    assert verdict.startswith("best Muon run m: 0.50 of the steps and 1.00 of the wall time") and "NOT met" in verdict

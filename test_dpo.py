"""
test_dpo.py -- DPO on the CPU engine (issue 15, CONTRACT.md "DPO"): the preference data and its checks, the
built-in pairs, the template and its masks, the sequence log-probs and the loss against independent
computations, the gradient through the whole model (and broken backwards that the check catches), a short run of
`nanoeuler.py dpo` to a chat checkpoint, its one-line errors, and data/get_prefs.sh on its fixture.
"""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import bpe
import gradcheck
from conftest import ROOT, one_error_line, run_engine, run_here
import nanoeuler as ne
import pipeline as pl

CFG = dataclasses.replace(pl.CONFIGS["tiny"], ctx=160)      # tiny, with room for the SFT template (~120 tokens)
PAIRS = [{"prompt": f"Name colour number {i}.", "chosen": f"Colour {i} is red.", "rejected": f"{i} is seven."}
         for i in range(18)]


@pytest.fixture(scope="module")
def tok():
    return bpe.Tokenizer.train(pl.default_corpus()[0][:20_000], CFG.vocab)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def run_main(capsys, *args):
    rc = ne.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, [l for l in err.splitlines() if l.strip()]


# ----------------------------------------------------------------------------------------------------
# data: the file format, the built-in pairs, the template

@pytest.mark.parametrize("line,words", [
    ({"prompt": "a", "chosen": "", "rejected": "c"}, "line 2: chosen is missing or empty"),
    ({"prompt": "a", "chosen": "b"}, "line 2: rejected is missing or empty"),
    ({"prompt": " ", "chosen": "b", "rejected": "c"}, "line 2: prompt is missing or empty"),
    ({"prompt": "a", "chosen": "same", "rejected": "same"}, "line 2: chosen equals rejected"),
    ({"prompt": "a", "input": 3, "chosen": "b", "rejected": "c"}, "line 2: input must be a string"),
    ('{"prompt": "a",', "line 2 is not JSON"),
    ('["a", "b", "c"]', "line 2 is not an object"),
])
def test_load_prefs_names_the_bad_line(tmp_path, line, words):
    path = write_jsonl(tmp_path / "p.jsonl", [PAIRS[0], line])
    with pytest.raises(pl.UserError, match=words):
        pl.load_prefs(str(path))


def test_load_prefs_reads_pairs_and_refuses_empty_files(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [PAIRS[0], "", dict(PAIRS[1], input="ctx")])
    assert pl.load_prefs(str(path)) == [dict(PAIRS[0], input=""), dict(PAIRS[1], input="ctx")]
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(pl.UserError, match="holds no pairs"):
        pl.load_prefs(str(tmp_path / "e.jsonl"))
    (tmp_path / "b.jsonl").write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(pl.UserError, match="not UTF-8"):
        pl.load_prefs(str(tmp_path / "b.jsonl"))


def test_builtin_pairs_reject_the_answer_fallen_into_a_loop():
    sft, pairs = pl.builtin_sft_examples(), pl.load_prefs(None)
    assert len(pairs) == len(sft) == 237
    periods = []
    for e, p in zip(sft, pairs):
        assert (p["prompt"], p["input"], p["chosen"]) == (e["instruction"], e["input"], e["output"])
        words, loop = e["output"].split(" "), p["rejected"].split(" ")
        period = next(k for k in range(1, len(loop) + 1) if all(w == loop[i % k] for i, w in enumerate(loop)))
        assert loop[:period] == words[:period] and period <= max(1, len(words) // 2) and len(loop) >= len(words)
        assert p["rejected"] != p["chosen"] and len(loop) >= 2 * period              # it repeats, at least once
        periods.append(period)
    assert len(set(periods)) > 20                                                   # loops of many lengths


def test_pref_pair_masks_the_prompt_and_keeps_both_answers_whole(tok):
    pair = dict(PAIRS[3], input="")
    prompt = tok.encode(pl.format_prompt(pair["prompt"]))
    answers = [tok.encode(pair[k]) + [tok.eot] for k in ("chosen", "rejected")]
    rows, cut = pl.pref_pair(tok, pair, 160)
    assert not cut
    for (ids, targets), answer in zip(rows, answers):
        assert ids.tolist() == (prompt + answer)[:-1]
        assert targets.tolist() == [-1] * (len(prompt) - 1) + answer          # the answer and its <|endoftext|>
    T = len(prompt) + len(answers[0]) - 11                                     # 10 prompt tokens too many
    rows, cut = pl.pref_pair(tok, pair, T)
    assert cut and len(rows[0][0]) == T
    for (ids, targets), answer in zip(rows, answers):
        assert ids.tolist() == (prompt[10:] + answer)[:-1] and targets[targets >= 0].tolist() == answer
    assert pl.pref_pair(tok, pair, len(answers[0]) - 1) is None               # no room left for the prompt


def test_pref_batches_put_chosen_rows_first_with_their_reference(tok):
    b = pl.PrefBatches(tok, PAIRS[:5], 3, 160, seed=0)
    b.ref = np.arange(10.0).reshape(5, 2)
    x, (y, ref) = b.next()
    assert x.shape == y.shape and x.shape[0] == 6
    picked = [ref[r] // 2 for r in range(3)]                                   # pair index of each chosen row
    assert ref[3:].tolist() == [2 * p + 1 for p in picked]
    for r, p in enumerate(map(int, picked)):
        for k in (0, 1):
            ids, targets = b.pairs[p][k]
            assert x[k * 3 + r, :len(ids)].tolist() == ids.tolist() and (y[k * 3 + r, len(ids):] == -1).all()
    fixed = pl.PrefBatches(tok, PAIRS[:5], 4, 160, fixed=True).batch([0, 1])
    assert fixed[0].shape == (8, 160) and (fixed[1][[2, 3, 6, 7]] == -1).all()  # unused rows count nothing


# ----------------------------------------------------------------------------------------------------
# the numbers: sequence log-probs, loss, metrics, gradient

def _case(dtype=np.float64, rows=4, T=20, seed=0):
    rng = np.random.default_rng(seed)
    P = pl.Params.init(CFG, seed, dtype)
    idx = rng.integers(0, CFG.vocab, (rows, T)).astype(np.int32)
    targets = rng.integers(0, CFG.vocab, (rows, T)).astype(np.int32)
    targets[:, :6] = -1                                                        # prompt
    targets[1, 15:] = -1                                                       # padding
    return P, idx, targets, rng


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-4)])
def test_seq_logps_against_numpy_logsumexp_of_the_engines_logits(dtype, tol):
    P, idx, targets, _ = _case(dtype)
    logits = ne.forward(P.astype(np.float64), idx).reshape(*idx.shape, -1)    # head 0, (B, T, V)
    m = logits.max(-1, keepdims=True)
    logprobs = logits - (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))
    expected = [sum(logprobs[b, t, targets[b, t]] for t in range(idx.shape[1]) if targets[b, t] >= 0)
                for b in range(len(idx))]
    got = ne.seq_logps(P, idx, targets)
    assert got.dtype == np.float64 and np.allclose(got, expected, rtol=tol, atol=0)


def test_dpo_loss_and_its_gradient_against_the_formula():
    rng = np.random.default_rng(1)
    logp, ref, beta = rng.normal(-30, 10, 6), rng.normal(-30, 10, 6), 0.3
    loss, grad = pl.dpo_loss(logp, ref, beta)
    z = beta * ((logp[:3] - ref[:3]) - (logp[3:] - ref[3:]))
    assert loss == pytest.approx(np.mean(-np.log(1 / (1 + np.exp(-z)))), rel=1e-12)
    h = 1e-6
    numeric = [(pl.dpo_loss(logp + h * e, ref, beta)[0] - pl.dpo_loss(logp - h * e, ref, beta)[0]) / (2 * h)
               for e in np.eye(6)]
    assert np.allclose(grad, numeric, rtol=1e-6) and (grad[:3] < 0).all() and (grad[3:] > 0).all()
    big = pl.dpo_loss(np.array([1e4, -1e4]), np.zeros(2), 1.0)                 # no overflow either way
    assert np.isfinite(big[0]) and np.isfinite(big[1]).all() and pl.dpo_loss(np.array([-1e4, 1e4]), np.zeros(2), 1.0)[0] == pytest.approx(2e4)


def test_dpo_metrics_count_a_tie_as_half():
    ref = np.array([[-10.0, -10.0], [-5.0, -8.0], [-7.0, -7.0], [-1.0, -1.0]])
    logp = ref + np.array([[1.0, -1.0], [0.0, 0.0], [-2.0, 0.0], [-3.0, -1.0]])
    m = pl.dpo_metrics(logp, ref, 0.5)
    assert m["pref_acc"] == (1 + 0.5 + 0 + 0) / 4
    assert m["margin"] == pytest.approx(0.5 * np.mean([2.0, 0.0, -2.0, -2.0]))
    assert (m["drift_chosen"], m["drift_rejected"]) == (pytest.approx(-1.0), pytest.approx(-0.5))
    assert pl.dpo_metrics(ref, ref, 0.1) == {"pref_acc": 0.5, "margin": 0.0, "drift_chosen": 0.0,
                                             "drift_rejected": 0.0, "dpo_loss": pytest.approx(np.log(2))}


def test_gradcheck_dpo_every_tensor():
    results = gradcheck.check_dpo(samples=6)
    assert len(results) == len(pl.param_shapes(pl.CONFIGS["tiny"])) + 1
    for name, err in results:
        assert err < 1e-4, (name, err)


BROKEN_DPO = {   # each flips or drops one term of the DPO backward
    "sign": (ne, "seq_logp_backward", lambda f: lambda lg, t, lse, d, V: f(lg, t, lse, -d, V)),
    "softmax dropped": (ne, "seq_logp_backward", lambda f: lambda lg, t, lse, d, V: f(lg, t, lse + 30.0, d, V)),
    "rejected's coefficient": (pl, "dpo_loss", lambda f: lambda lp, ref, beta: (
        lambda r: (r[0], np.concatenate([r[1][:len(lp) // 2], -r[1][len(lp) // 2:]])))(f(lp, ref, beta))),
}


@pytest.mark.parametrize("case", sorted(BROKEN_DPO))
def test_gradcheck_catches_a_broken_dpo_backward(monkeypatch, case):
    module, name, breaker = BROKEN_DPO[case]
    original = getattr(module, name)
    monkeypatch.setattr(module, name, breaker(original))      # dpo_loss: its loss stays right, its gradient not
    assert max(err for _, err in gradcheck.check_dpo(samples=3)) > 1e-2


def test_dpo_gradient_does_not_depend_on_how_rows_are_sharded(monkeypatch):
    P, idx, targets, rng = _case(rows=4)
    ref = ne.seq_logps(P, idx, targets) + rng.normal(0, 2, 4)
    out = []
    for k in (1, 3):                                 # 3 shards of 4 rows: a pair's rows in different shards
        monkeypatch.setattr(ne, "n_threads", lambda: k)
        loss, G = ne.dpo_loss_and_grads(P, idx, targets, ref, 0.5)
        out.append((loss, G.flat.copy()))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-12) and np.allclose(out[0][1], out[1][1], rtol=1e-9, atol=1e-15)


def test_dpo_steps_raise_the_margin_they_train_on(tok):
    P = pl.Params.init(CFG, 0)
    b = pl.PrefBatches(tok, PAIRS[:4], 4, CFG.ctx)
    logps = lambda x, y: ne.seq_logps(P, x, y)
    b.ref = pl.pair_logps(b, logps)
    trainer = ne.DPOTrainer(P, 0.1)
    for _ in range(10):
        trainer.step(*b.next(), 3e-3)
    m = pl.dpo_metrics(pl.pair_logps(b, logps), b.ref, 0.1)
    losses = [loss for loss, _, _ in trainer.results()]
    assert losses[0] == pytest.approx(np.log(2), abs=1e-4) and losses[-1] < 0.5
    assert m["pref_acc"] == 1.0 and m["margin"] > 0.5 and m["dpo_loss"] < 0.5


# ----------------------------------------------------------------------------------------------------
# the mode: a short run to a chat checkpoint, and one line for each mistake

@pytest.fixture(scope="module")
def ckpts(tok, tmp_path_factory):
    """A chat and a base checkpoint of CFG (random weights: DPO needs no trained model to run)."""
    d = tmp_path_factory.mktemp("dpo")
    P = pl.Params.init(CFG, 0)
    pl.save_checkpoint(str(d / "chat.npz"), P, tok, extra={"kind": "chat"})
    pl.save_checkpoint(str(d / "base.npz"), P, tok, extra={"kind": "base"})
    long_answer = dict(PAIRS[0], chosen="word " * 200)                          # longer than the context: skipped
    long_prompt = dict(PAIRS[1], input="context " * 40)                         # its prompt is cut
    write_jsonl(d / "prefs.jsonl", PAIRS + [long_answer, long_prompt])
    return d


def test_cli_dpo_writes_a_chat_checkpoint_with_its_metrics(ckpts, tmp_path):
    out = tmp_path / "dpo"
    args = ("dpo", "--ckpt", ckpts / "chat.npz", "--data", ckpts / "prefs.jsonl", "--steps", 4, "--batch", 2,
            "--lr", 1e-3, "--out", out)
    r = run_here("nanoeuler.py", *args)                    # in this process (conftest.run_here)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "20 pairs, 2 held out, beta 0.1" in r.stdout
    assert ("pairs longer than the context of 160 tokens: 1 kept their answers and lost the start of their prompt, "
            "1 skipped") in r.stdout
    assert "held-out: preference accuracy 50.0% | reward margin +0.0000" in r.stdout
    assert "DPO held-out preference accuracy: before 50.0% -> after" in r.stdout
    P, _, _, extra = pl.load_checkpoint(str(out))
    assert extra == {"kind": "chat", "stage": "dpo"}
    assert not np.array_equal(P.flat, pl.load_checkpoint(str(ckpts / "chat.npz"))[0].flat)
    log = [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[0] == {"step": 0, "pref_acc": 0.5, "margin": 0.0, "drift_chosen": 0.0, "drift_rejected": 0.0,
                      "dpo_loss": round(np.log(2), 5)}
    assert [l["step"] for l in log[1:]] == [1, 2, 3, 4] and log[1]["loss"] == pytest.approx(np.log(2), abs=1e-4)
    evals = [l for l in log[1:] if "pref_acc" in l]
    assert evals and evals[-1]["step"] == 4 and evals[-1]["val_loss"] == evals[-1]["dpo_loss"]
    assert all(set(l) >= {"pref_acc", "margin", "drift_chosen", "drift_rejected"} for l in evals)


def test_cli_dpo_warns_on_a_base_checkpoint_and_goes_on(ckpts, tmp_path, capsys):
    rc, out, err = run_main(capsys, "dpo", "--ckpt", ckpts / "base.npz", "--data", ckpts / "prefs.jsonl",
                            "--steps", 1, "--batch", 2, "--out", tmp_path / "b")
    assert rc == 0 and len(err) == 1 and err[0].startswith("warning: ") and "base checkpoint" in err[0], err
    assert pl.load_checkpoint(str(tmp_path / "b"))[3]["kind"] == "chat"


@pytest.mark.parametrize("rows,flags,words", [
    ([PAIRS[0], dict(PAIRS[1], chosen="")], (), "line 2: chosen is missing or empty"),
    ([PAIRS[0], dict(PAIRS[1], rejected=PAIRS[1]["chosen"])], (), "chosen equals rejected"),
    ([dict(p, chosen="word " * 200) for p in PAIRS[:3]], (), "too few pairs fit the context of 160"),
    (PAIRS[:1], (), "holds 1 pair"),
    (PAIRS, ("--beta", 0), "--beta 0.0"),
    (PAIRS, ("--steps", 0), "--steps 0"),
])
def test_cli_dpo_bad_input_is_one_error_line(ckpts, tmp_path, capsys, rows, flags, words):
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    rc, _, err = run_main(capsys, "dpo", "--ckpt", ckpts / "chat.npz", "--data", data, "--out", tmp_path / "o", *flags)
    assert rc == 1 and len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert not (tmp_path / "o" / "ckpt.npz").exists()


def test_cli_dpo_keeps_an_existing_checkpoint_and_says_what_it_is(ckpts, tmp_path, capsys):
    (tmp_path / "ckpt.npz").write_bytes(b"x")
    rc, _, err = run_main(capsys, "dpo", "--ckpt", ckpts / "chat.npz", "--data", ckpts / "prefs.jsonl",
                          "--out", tmp_path)
    assert rc == 1 and err == [f"error: {tmp_path / 'ckpt.npz'} exists: use another --out or --force"]
    with pytest.raises(SystemExit):
        ne.main(["dpo", "--help"])
    help_text = capsys.readouterr().out
    help_text = " ".join(help_text.split())
    assert "built-in pairs" in help_text and "loop of its opening words" in help_text and "nothing of helpfulness" in help_text


# ----------------------------------------------------------------------------------------------------
# data/get_prefs.sh on its fixture (no network)

FIX = ROOT / "data" / "fixtures" / "hh-rlhf.jsonl.gz"


def get_prefs(out, *args, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("PREFS_SOURCE", "OUT", "FORCE")}
    e.update(OUT=str(out), PYTHON=sys.executable, **{k: str(v) for k, v in env.items()})
    return subprocess.run(["bash", str(ROOT / "data" / "get_prefs.sh"), *map(str, args)], env=e,
                          capture_output=True, text=True, timeout=60)


def test_get_prefs_converts_the_fixture_idempotently(tmp_path):
    out = tmp_path / "prefs.jsonl"
    r = get_prefs(out, PREFS_SOURCE=FIX)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "4 pairs (3 skipped" in r.stdout
    pairs = pl.load_prefs(str(out))                                           # what dpo --data reads
    assert pairs[0] == {"prompt": "What is a good name for a cat?", "input": "",
                        "chosen": "Many people like Luna, Milo or Oliver.", "rejected": "I don't know."}
    assert pairs[2]["prompt"].startswith("Human: Can you help me plan a trip?\n\nAssistant: Sure")
    assert pairs[2]["prompt"].endswith("Human: To Paris in May.") and pairs[2]["rejected"] == "Paris is in France."
    assert pairs[3]["chosen"] == "Merci — « merci beaucoup » is stronger."
    os.utime(out, ns=(10 ** 18, 10 ** 18))
    r = get_prefs(out, PREFS_SOURCE=FIX)
    assert "already exists" in r.stdout and out.stat().st_mtime_ns == 10 ** 18
    before = out.read_bytes()
    r = get_prefs(out, 2, PREFS_SOURCE=FIX, FORCE=1)
    assert r.returncode == 0 and out.read_bytes().splitlines() == before.splitlines()[:2]
    assert "prefs.jsonl" in (ROOT / "Makefile").read_text().split("\ndata:", 1)[1].split("\n", 1)[0]


@pytest.mark.parametrize("source,content", [
    ("http://127.0.0.1:9/x", None),                                          # offline
    ("nothing.jsonl", None),
    ("bad.jsonl", '{"chosen": "\\n\\nHuman: a\\n\\nAssistant: b",\n'),
    ("notHH.jsonl", '{"prompt": "a", "chosen": 1, "rejected": "c"}\n'),
    ("same.jsonl", '{"chosen": "\\n\\nHuman: a\\n\\nAssistant: b", "rejected": "\\n\\nHuman: a\\n\\nAssistant: b"}\n'),
    ("empty.jsonl", ""),
])
def test_get_prefs_bad_source_is_one_error_line(tmp_path, source, content):
    src = source if source.startswith("http") else tmp_path / source
    if content is not None:
        src.write_text(content)
    out = tmp_path / "out" / "prefs.jsonl"
    r = get_prefs(out, PREFS_SOURCE=src)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert not out.exists() and not list(out.parent.glob("*.tmp"))


# ----------------------------------------------------------------------------------------------------
# the GPU engine's dpo mode (nanoeuler_cuda.py): its gradient against the CPU engine's, the same run on both
# engines; tests marked gpu skip without CuPy and a device



def test_gpu_dpo_mode_without_cupy_is_one_error_line(monkeypatch):
    """In this process, where `import cupy` fails (None in sys.modules; test_cli.py's
    test_without_cupy_every_mode_says_so runs the engine in a process with a cupy that fails to import)."""
    import nanoeuler_cuda as nc
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(nc, "cp", None)
    for args, words in ((["d"], "CuPy"), (["dpo", "--steps", "0"], "--steps 0"), (["gradcheck", "--dpo"], "CuPy")):
        r = run_here("nanoeuler_cuda.py", *args)
        assert r.returncode == 1 and one_error_line(r, words), r.stderr
    r = run_here("nanoeuler_cuda.py", "d", "--help")
    assert r.returncode == 0 and "--beta" in r.stdout and "--precision" in r.stdout


@pytest.mark.gpu
def test_gpu_dpo_gradient_matches_the_cpu_engine():
    r = run_engine("nanoeuler_cuda.py", "gradcheck", "--dpo")
    assert r.returncode == 0 and "DPO gradient check: PASS" in r.stdout, r.stdout + r.stderr


@pytest.mark.gpu
def test_gpu_dpo_run_follows_the_cpu_run(ckpts, tmp_path):
    """The same run on both engines (fp32): the same log to float32 rounding, and a chat checkpoint."""
    args = ("--ckpt", ckpts / "chat.npz", "--data", ckpts / "prefs.jsonl", "--steps", 4, "--batch", 2, "--lr", 1e-3)
    r = run_engine("nanoeuler.py", "dpo", *args, "--out", tmp_path / "cpu")
    assert r.returncode == 0, r.stderr
    r = run_engine("nanoeuler_cuda.py", "d", *args, "--out", tmp_path / "gpu", "--precision", "fp32", "--attn", "naive")
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    assert "held-out: preference accuracy 50.0% | reward margin +0.0000" in r.stdout
    assert "DPO held-out preference accuracy: before 50.0% -> after" in r.stdout
    assert pl.load_checkpoint(str(tmp_path / "gpu"))[3] == {"kind": "chat", "stage": "dpo"}
    cpu, gpu = ([json.loads(l) for l in (tmp_path / k / "train_log.jsonl").read_text().splitlines()] for k in ("cpu", "gpu"))
    assert len(cpu) == len(gpu) == 5 and gpu[1]["loss"] == pytest.approx(np.log(2), abs=1e-4)
    for c, g in zip(cpu, gpu):
        assert c.keys() == g.keys()
        for k in set(c) - {"ms", "tok_s", "tokens"}:      # the engine's work: the GPU pads pairs to the context
            assert g[k] == pytest.approx(c[k], rel=1e-3, abs=1e-4), (c["step"], k)

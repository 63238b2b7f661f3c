"""
test_cpu_engine.py -- the CPU engine (nanoeuler.py, on pipeline.py): the model's shapes and numerics, its
gradients, sampling and speculative decoding, checkpoints, training and bit-exact resume, SFT and chat.

Authorities: CONTRACT.md (configs, parameter layout, checkpoint file, SFT template); float64 finite
differences (gradcheck.py), with broken backwards it must catch; plain decoding, to the bit, for speculative
decoding, and the exact joint law (chi-square) for speculative sampling. test_reference.py holds the same
engine to references written apart from it; test_cli.py checks its usage mistakes.
"""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

import bpe
import gradcheck
from conftest import (ROOT, assert_one_line_error, cli_here, ctrl_c_as_from_a_shell, run_cli, run_here,
                      shift_model as _shift_model, train_cpu as _train)
import nanoeuler as ne
import pipeline as pl


# ----------------------------------------------------------------------------------------------------
# the model: configs, the parameter buffer, targets, schedule, attention

def test_configs_match_spec():
    assert pl.num_params(pl.CONFIGS["small"]) == 1_049_728
    assert pl.num_params(pl.CONFIGS["big"]) == 116_417_280
    assert 9e6 < pl.num_params(pl.CONFIGS["medium"]) < 12e6
    for cfg in pl.CONFIGS.values():                   # F = 8/3 D rounded up to a multiple of 128
        assert cfg.ffn == -(-8 * cfg.dim // 3 // 128) * 128 or cfg is pl.CONFIGS["tiny"]


def test_params_are_views_of_one_buffer():
    cfg = pl.CONFIGS["tiny"]
    P = pl.Params.init(cfg, 0)
    names = [n for n, _ in pl.param_shapes(cfg)]
    assert names[:3] == ["tok_emb", "layers.0.attn_norm", "layers.0.wq"] and names[-1] == "heads.2"
    assert P["layers.1.wk"].shape == (cfg.n_kv_heads * cfg.head_dim, cfg.dim)
    P["layers.1.wk"][0, 0] = 123.0
    assert 123.0 in P.flat                            # a view, not a copy
    qkv = P.rows("layers.1.wq", "layers.1.wv")
    assert qkv.shape == ((cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, cfg.dim)
    assert np.shares_memory(qkv, P.flat)
    assert np.all(P["norm"] == 1) and abs(P["layers.0.wo"].std() - 0.02 / np.sqrt(2 * cfg.n_layers)) < 2e-3


def test_mtp_targets_shift_and_mask():
    y = np.array([[1, 2, 3, 4], [5, -1, 7, 8]], np.int32)
    t = pl.mtp_targets(y, 3)
    assert t[0].tolist() == y.tolist()
    assert t[1].tolist() == [[2, 3, 4, -1], [-1, 7, 8, -1]]
    assert t[2].tolist() == [[3, 4, -1, -1], [7, 8, -1, -1]]


def test_lr_schedule_warmup_then_cosine_to_ten_percent():
    lrs = [pl.lr_at(s, 1000, 1.0, 100) for s in range(1000)]
    assert lrs[0] == pytest.approx(0.01) and lrs[99] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[100:], lrs[101:]))
    assert pl.lr_at(1000, 1000, 1.0, 100) == pytest.approx(0.1)


def test_attention_causal_chunks_change_nothing():
    rng = np.random.default_rng(0)
    B, T = 2, 130
    q, k, v = rng.standard_normal((B * T, 4, 8)), rng.standard_normal((B * T, 2, 8)), rng.standard_normal((B * T, 2, 8))
    dout = rng.standard_normal((B * T, 4, 8))
    one, cache1 = ne.attention_forward(q, k, v, B, T, n_chunks=1)
    four, cache4 = ne.attention_forward(q, k, v, B, T, n_chunks=4)
    assert np.allclose(one, four, atol=1e-12)
    for g1, g4 in zip(ne.attention_backward(dout, cache1, B, T), ne.attention_backward(dout, cache4, B, T)):
        assert np.allclose(g1, g4, atol=1e-12)
    k2, v2 = k.copy(), v.copy()                       # causality: the last key and value change only the last output
    k2[T - 1] += 1.0
    v2[T - 1] += 1.0
    other, _ = ne.attention_forward(q, k2, v2, B, T)
    assert np.allclose(other[:T - 1], one[:T - 1], atol=1e-12) and not np.allclose(other[T - 1], one[T - 1])


# ----------------------------------------------------------------------------------------------------
# gradients: every backward against float64 finite differences, and broken ones the check catches

def test_gradcheck_every_op_and_tensor(monkeypatch):
    """gradcheck.py all (make check) passes and prints its report; the checks it ran, each op's and the
    whole model's, kept as it ran them, each under 1e-4 (and the DPO check's, all its samples, under TOL)."""
    ran = {}
    for name in ("check_ops", "check_model"):
        monkeypatch.setattr(gradcheck, name, lambda *a, fn=getattr(gradcheck, name), name=name:
                            ran.setdefault(name, fn(*a)))
    r = run_here("gradcheck.py", "all")
    assert r.returncode == 0 and ">>> backward OK" in r.stdout, r.stdout + r.stderr
    assert "layers.2.w2" in r.stdout and "mtp.logits" in r.stdout and "DPO loss" in r.stdout
    ops, model = ran["check_ops"], ran["check_model"]
    assert len(model) == len(pl.param_shapes(pl.CONFIGS["tiny"])) + 1
    for name, err in ops + model:
        assert err < 1e-4, (name, err)


def _drop_term(fn, fix):
    def broken(*args):
        out = fn(*args)
        fix(out, *args)
        return out
    return broken


BROKEN = {  # op -> (function to replace, broken version): each drops or flips one term
    "swiglu": ("swiglu_backward", lambda f: _drop_term(f, lambda dgu, dact, gu: dgu.__setitem__(
        (slice(None), slice(dact.shape[1], None)), 0.0))),
    "rope": ("rope_backward", lambda f: lambda du, pos, cos, sin: f(du, pos, cos, -sin)),
    "attention": ("attention_backward", lambda f: lambda dout, cache, B, T: (lambda g: (g[0], 0 * g[1], g[2]))(
        f(dout, cache, B, T))),
    "rmsnorm": ("rmsnorm_backward", lambda f: lambda dy, x, w, rstd, dx, dw: f(dy, x, w, rstd * 1.01, dx, dw)),
}


@pytest.mark.parametrize("op", sorted(BROKEN))
def test_gradcheck_catches_a_broken_backward(monkeypatch, op):
    """Each op alone, and the whole model (tiny with one layer: 0.7 s, three take 2.8), catch the broken op."""
    name, breaker = BROKEN[op]
    monkeypatch.setattr(ne, name, breaker(getattr(ne, name)))
    worst_name, worst = max(gradcheck.check_ops(), key=lambda r: r[1])
    assert worst > 1e-2 and worst_name.startswith(op + "."), (worst_name, worst)
    one_layer = pl.Config(**{**pl.asdict(pl.CONFIGS["tiny"]), "n_layers": 1})
    assert max(err for _, err in gradcheck.check_model(one_layer)) > 1e-2


def test_float32_gradients_match_float64():
    cfg = pl.CONFIGS["tiny"]
    P64 = pl.Params.init(cfg, 1, np.float64)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab, (2, 12)).astype(np.int32)
    y = rng.integers(0, cfg.vocab, (2, 12)).astype(np.int32)
    l64, _, g64 = ne.loss_and_grads(P64, x, y)
    l32, _, g32 = ne.loss_and_grads(P64.astype(np.float32), x, y)
    assert abs(l64 - l32) < 1e-5
    assert np.abs(g64.flat - g32.flat).max() < 1e-4 * np.abs(g64.flat).max()


def test_batch_shards_add_up_to_the_whole_batch(monkeypatch):
    """One thread per shard of rows: the shards' losses and gradients must add up to those of the whole
    batch in one piece (with uneven shards and -1 targets, so that the per-head counts differ by shard)."""
    cfg = pl.CONFIGS["tiny"]
    P = pl.Params.init(cfg, 2, np.float64)
    rng = np.random.default_rng(1)
    x = rng.integers(0, cfg.vocab, (5, 16)).astype(np.int32)
    y = rng.integers(0, cfg.vocab, (5, 16)).astype(np.int32)
    y[1, 3:] = -1
    y[4, :10] = -1
    results = {}
    for n in (1, 3):
        monkeypatch.setattr(ne, "n_threads", lambda: n)
        obj, ces, G = ne.loss_and_grads(P, x, y)
        results[n] = obj, ces, G.flat.copy(), ne.forward_loss(P, x, y)
    (o1, c1, g1, f1), (o3, c3, g3, f3) = results[1], results[3]
    assert o3 == pytest.approx(o1, rel=1e-12) and c3 == pytest.approx(c1, rel=1e-12)
    assert f3[0] == pytest.approx(o1, rel=1e-12) and f3[1] == pytest.approx(c1, rel=1e-12)
    assert f1[0] == pytest.approx(o1, rel=1e-12)
    assert np.abs(g1 - g3).max() < 1e-12 * np.abs(g1).max()


# ----------------------------------------------------------------------------------------------------
# sampling and generation: speculative decoding equals plain decoding, the KV cache equals none

def test_speculative_greedy_equals_plain_greedy():
    """The engine's guesses (from ids, and from logits with a repetition penalty) and a chain of drafts from
    heads 1 and 2 (the GPU's way), kept (head 1 is right), refused (head 2 is wrong) and on a random model:
    plain decoding's ids."""
    def chain(P, prompt, n, stats):
        cache = ne.KVCache(P.cfg, 1, P.flat.dtype)
        return list(pl.speculative_decode(lambda ids: ne.forward_cached(P, ids, cache, heads=P.cfg.n_mtp), cache.keep,
                                          prompt, n, pl.Sampling(0), None, stats, P.cfg.n_mtp, P.cfg.ctx))
    for P in (_shift_model([1, 2, 5], 20.0), pl.Params.init(pl.CONFIGS["tiny"], 3)):
        for prompt, n in (([3, 4], 30), ([1], 61), (list(range(40)) + [7] * 20, 10)):   # the last two hit the context
            for sampling in (pl.Sampling(temperature=0), pl.Sampling(temperature=0, repetition_penalty=1.3)):
                plain = list(ne.generate(P, prompt, n, sampling=sampling))
                assert list(ne.generate(P, prompt, n, sampling=sampling, speculative=True)) == plain
                assert len(plain) == min(n, P.cfg.ctx - len(prompt))
            assert chain(P, prompt, n, {}) == list(ne.generate(P, prompt, n, sampling=pl.Sampling(temperature=0)))
    P = _shift_model([1, 2, 5], 20.0)
    drafts, guesses = {}, {}
    chain(P, [3], 40, drafts)
    list(ne.generate(P, [3], 40, sampling=pl.Sampling(temperature=0), speculative=True, stats=guesses))
    assert 0.4 < drafts["accepted"] / drafts["drafted"] < 0.6            # head 1 always right, head 2 never
    assert guesses["accepted"] == guesses["drafted"] > 0                  # one of head 1's is always right


@pytest.mark.parametrize("small", [True, False])
def test_decode_rows_are_computed_as_alone(small, monkeypatch):
    """A row of a decode step gets the logits, to the bit, that it gets in a step of its own after the same
    tokens: drafts in a chain, guesses at one position, both, a plain step; so greedy speculation cannot
    change an id. small=False: every product as a larger model's, one matrix-vector product per row."""
    if not small:
        monkeypatch.setattr(ne, "_SMALL", 0)
    P = pl.Params.init(pl.CONFIGS["small"], 4)
    prompt, rows = list(range(30, 50)), [7, 9, 11, 13]

    def alone(history, token):                       # heads 0 and 1 at token, one step each after the prompt
        cache = ne.KVCache(P.cfg)
        for ids in [prompt] + [[r] for r in history + [token]]:
            out = ne.forward_cached(P, ids, cache, heads=2)
        return out[-1]
    chain = [alone(rows[:t], rows[t]) for t in range(len(rows))]
    guesses = chain[:1] + [alone(rows[:1], r) for r in rows[1:]]             # each after z = rows[0]
    for offsets, want in (([0, 1, 2, 3], chain), ([0, 1, 1, 1], guesses), ([0, 1, 2, 1], chain[:3] + guesses[3:])):
        cache = ne.KVCache(P.cfg)
        ne.forward_cached(P, prompt, cache)
        got = ne.forward_cached(P, rows, cache, offsets=offsets, heads=2)
        assert all(np.array_equal(g, w) for g, w in zip(got, want)), offsets


def test_speculative_sampling_has_plain_sampling_distribution():
    """Three tokens after a prompt, top-k 3 at temperature 1: the exact joint law of (t1, t2, t3) from
    head 0's distributions, against the frequencies of 3000 speculative draws (chi-square, p = 0.001)."""
    P = _shift_model([1, 2, 3], 0.6)                     # soft heads: drafts are kept about 40% of the time
    s = pl.Sampling(temperature=1.0, top_k=3)
    prompt = [10]

    def p0(ids):
        return s.probs(ne.forward_cached(P, ids, ne.KVCache(P.cfg, 1, np.float64))[-1])
    law = {}
    p1 = p0(prompt)
    for a in np.flatnonzero(p1):
        p2 = p0(prompt + [a])
        for b in np.flatnonzero(p2):
            p3 = p0(prompt + [a, b])
            for c in np.flatnonzero(p3):
                law[(a, b, c)] = p1[a] * p2[b] * p3[c]
    rng, stats, n = np.random.default_rng(0), {}, 3000
    counts = Counter(tuple(ne.generate(P, prompt, 3, sampling=s, rng=rng, speculative=True, stats=stats))
                     for _ in range(n))
    assert set(counts) <= set(law)
    assert 0.2 < stats["accepted"] / stats["drafted"] < 0.9
    keys = sorted(law, key=law.get, reverse=True)
    big = [k for k in keys if law[k] * n >= 5]            # cells with enough expected counts; the rest pooled
    obs = [counts[k] for k in big] + [n - sum(counts[k] for k in big)]
    exp = [law[k] * n for k in big] + [n * (1 - sum(law[k] for k in big))]
    chi2, df = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0), len(obs) - 1
    bound = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3   # Wilson-Hilferty, p = 0.001
    assert chi2 < bound, (chi2, df)


def test_batched_generation_is_independent_streams():
    P = pl.Params.init(pl.CONFIGS["tiny"], 3)
    P.flat *= 10
    greedy = pl.Sampling(temperature=0)
    plain = list(ne.generate(P, [5, 6], 20, sampling=greedy))
    assert ne.generate_batch(P, [5, 6], 3, 20, greedy, np.random.default_rng(0)) == [plain] * 3
    s = pl.Sampling(temperature=1.0, top_k=0)
    a = ne.generate_batch(P, [5, 6], 4, 20, s, np.random.default_rng(1))
    assert a == ne.generate_batch(P, [5, 6], 4, 20, s, np.random.default_rng(1))      # the seed fixes them
    assert len({tuple(x) for x in a}) == 4                                           # and they differ
    # each stream is a plain decode: stream r's logits do not depend on the other streams, bit for bit (a batch
    # whose other streams hold other ids, against one whose every stream holds r's ids: the products have the
    # same width, so any difference is a leak between streams)
    ids = [[5, 6] + x[:-1] for x in a]
    got = ne.forward_cached(P, ids, ne.KVCache(P.cfg, 4))[2, -1]
    ref = ne.forward_cached(P, [ids[2]] * 4, ne.KVCache(P.cfg, 4))[2, -1]
    assert np.array_equal(got, ref)
    # and they equal a single-stream cache's on r's ids up to float32 rounding: BLAS rounds a product of 21
    # columns and one of 84 differently (OpenBLAS 0.3.31: 2.3e-5 on logits of magnitude 5 to 30, x10 weights)
    alone = ne.forward_cached(P, ids[2], ne.KVCache(P.cfg, 1))[-1]
    assert np.allclose(got, alone, rtol=1e-5, atol=1e-4)


def test_a_prefill_may_run_the_head_on_its_last_row_alone():
    """forward_cached(last=True), the CPU Decoder's prefill, runs head 0 and the last layer past its keys and
    values on the last row only: its logits are the whole forward's last row to float32 rounding (products
    of one column, not of five) and its cache holds the same bits; also for a prompt narrower than the
    products' padded columns."""
    P = pl.Params.init(pl.CONFIGS["tiny"], 3)
    P.flat *= 4
    for ids in ([5, 17, 42, 7, 9], [5, 17]):
        a, b = ne.KVCache(P.cfg), ne.KVCache(P.cfg)
        whole = ne.forward_cached(P, ids, a)
        last = ne.forward_cached(P, ids, b, last=True)
        assert last.shape == (P.cfg.vocab,) and np.allclose(last, whole[-1], rtol=1e-5, atol=1e-4)
        assert not np.allclose(last, whole[-2], rtol=1e-2, atol=1e-2)
        assert a.len == b.len == len(ids) and np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)


def test_top_p_and_repetition_penalty_by_hand():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    assert pl.Sampling(1.0, 0, top_p=0.7).probs(logits) == pytest.approx([0.625, 0.375, 0, 0])
    assert pl.Sampling(1.0, 0, top_p=0.5).probs(logits) == pytest.approx([1, 0, 0, 0])
    assert pl.Sampling(1.0, 0, top_p=0.96).probs(logits) == pytest.approx([0.5, 0.3, 0.15, 0.05])
    z = np.array([2.0, -1.0, 0.5, 0.0])
    p = pl.Sampling(1.0, 0, repetition_penalty=2.0).probs(z, history=[0, 1, 1])       # 2 -> 1, -1 -> -2
    assert p == pytest.approx(np.exp([1.0, -2.0, 0.5, 0.0]) / np.exp([1.0, -2.0, 0.5, 0.0]).sum())
    assert pl.Sampling(0.0, repetition_penalty=5.0).sample(z, [0], None) == 2          # 2/5 < 0.5


def test_sample_cli_samples_and_speed_line(one_step_ckpt):
    r = cli_here("sample", "--ckpt", one_step_ckpt, "--samples", 3, "--tokens", 8, "--prompt", "The")
    assert r.returncode == 0 and r.stdout.count("--- sample ") == 3 and "in 3 streams" in r.stderr, r.stderr
    r = cli_here("sample", "--ckpt", one_step_ckpt, "--tokens", 8, "--prompt", "The", "--no-speculative")
    assert r.returncode == 0 and "tokens/s, speculative off]" in r.stderr, r.stderr
    r = cli_here("sample", "--ckpt", one_step_ckpt, "--tokens", 8, "--prompt", "The", "--temperature", 0)
    assert r.returncode == 0 and "drafts accepted" in r.stderr, r.stderr            # greedy, small: on by default
    r = cli_here("sample", "--ckpt", one_step_ckpt, "--tokens", 8, "--prompt", "The", "--speculative")
    assert r.returncode == 0 and "drafts accepted" in r.stderr, r.stderr
    assert [ne.speculation_pays(pl.CONFIGS[n]) for n in ("tiny", "small", "medium", "big")] == [True, True, False, False]
    assert_one_line_error(cli_here("sample", "--ckpt", one_step_ckpt, "--top-p", 0), "--top-p 0")
    assert_one_line_error(cli_here("sample", "--ckpt", one_step_ckpt, "--samples", 0), "--samples 0")


def test_speculative_without_mtp_heads_says_it_is_off(tmp_path):
    """--speculative on a checkpoint of head 0 alone (an import with --mtp none) has nothing to draft with: the
    speed line says off, where it said nothing of it."""
    cfg = pl.Config(**{**pl.asdict(pl.CONFIGS["tiny"]), "n_mtp": 1})
    pl.save_checkpoint(str(tmp_path / "one.npz"), pl.Params.init(cfg, 0), bpe.Tokenizer([]))
    r = cli_here("sample", "--ckpt", tmp_path / "one.npz", "--tokens", 8, "--temperature", 0, "--speculative")
    assert r.returncode == 0 and r.stderr.rstrip().endswith(", speculative off]"), r.stderr


def test_model_text_shown_to_a_person_escapes_control_bytes(tmp_path, monkeypatch, capsys):
    """Issue 31 item 5: NUL, ESC and the other C0/C1 controls (not newline, tab) reach the terminal and report.md
    as \\xNN, through pl.stream (sample), print_sample (training's samples), chat and the report."""
    assert pl.printable("a\x00b\x1b[31mc\n\td\r\x7f\x9bé€") == "a\\x00b\\x1b[31mc\n\td\\x0d\\x7f\\x9bé€"
    assert pl.printable(pl.printable("\x1b")) == "\\x1b"
    tok = bpe.Tokenizer([])
    bad = tok.encode("A\x00\x1b[2J\x07\nB")
    assert pl.stream(tok, iter(bad), "p\x1b") == len(bad)
    assert capsys.readouterr().out == "p\\x1bA\\x00\\x1b[2J\\x07\nB\n"
    text = pl.print_sample(tok, lambda ids, n, rng: iter(bad), "", 8)
    assert text == "A\\x00\\x1b[2J\\x07\nB" and "\x1b" not in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO("hi\n"))
    pl.chat_repl(tok, lambda ids, n: iter(bad + [tok.eot]), True, 16, 512)
    assert "A\\x00\\x1b[2J\\x07\nB" in capsys.readouterr().out
    import evaluate
    (tmp_path / pl.LOG).write_text(json.dumps(dict(step=1, loss=5.0, ms=10.0, tokens=32)) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)            # no loss plot (1-3 s): the text is checked
    report = evaluate.write_report(str(tmp_path), {"seq": 16, "config": "tiny"}, pl.CONFIGS["tiny"], 4.0, 2.0,
                                   tok.decode(bad))
    raw = open(report, "rb").read()
    assert b"A\\x00\\x1b[2J" in raw and not set(raw) & (set(range(32)) - {9, 10})


def test_kv_cache_generation_equals_uncached():
    cfg = pl.CONFIGS["tiny"]
    P = pl.Params.init(cfg, 3)
    for v in P.flat, :
        v *= 10                                        # a peaked, input-dependent distribution
    prompt = [5, 17, 42, 7]
    cached = list(ne.generate(P, prompt, 40, 0.8, 20, np.random.default_rng(7)))
    uncached = list(ne.generate(P, prompt, 40, 0.8, 20, np.random.default_rng(7), cached=False))
    assert cached == uncached
    assert len(set(cached)) > 3


def test_prompt_longer_than_context_keeps_its_end(one_step_ckpt):
    r = cli_here("sample", "--ckpt", one_step_ckpt, "--prompt", "word " * 600 + "END", "--tokens", 5)
    assert r.returncode == 0 and "kept its last 507 to fit the context of 512" in r.stderr, r.stderr


# ----------------------------------------------------------------------------------------------------
# checkpoints, training and resume

def test_checkpoint_round_trip_and_corruption(tmp_path):
    import bpe
    tok = bpe.Tokenizer.train("hello world, " * 50, 300)
    cfg = pl.Config(**{**pl.asdict(pl.CONFIGS["tiny"]), "vocab": tok.vocab_size})
    P = pl.Params.init(cfg, 0)
    path = tmp_path / "c.npz"
    pl.save_checkpoint(str(path), P, tok, extra={"kind": "base"})
    P2, tok2, state, extra = pl.load_checkpoint(str(path))
    assert np.array_equal(P.flat, P2.flat) and tok2.to_string() == tok.to_string() and extra == {"kind": "base"}
    assert not list(tmp_path.glob("*.tmp"))
    with np.load(path) as z:                         # CONTRACT.md: float32 tensors by name, config JSON, tokenizer
        assert z["layers.2.w3"].dtype == np.float32 and json.loads(str(z["config"]))["n_mtp"] == 3
    bad = tmp_path / "bad.npz"
    bad.write_bytes(path.read_bytes()[:5000])
    assert_one_line_error(cli_here("sample", "--ckpt", bad, "--prompt", "hi"), "corrupt")
    with np.load(path) as z:                         # tensors of one config under the config JSON of another
        arrays = {k: z[k] for k in z.files}
    arrays["config"] = np.array(pl.Config(**{**pl.asdict(cfg), "dim": 16}).to_json())
    other = tmp_path / "other.npz"
    np.savez(other, **arrays)
    assert_one_line_error(cli_here("sample", "--ckpt", other, "--prompt", "hi"), "shape")


def _losses(out):
    return [json.loads(l)["loss"] for l in open(os.path.join(out, "train_log.jsonl"))]


def test_resume_is_bit_exact(tmp_path, corpus):
    a, b = tmp_path / "a", tmp_path / "b"
    r = _train(a, corpus, "--steps", 8)
    assert r.returncode == 0, r.stderr
    assert "1,049,728 parameters" in r.stdout
    r = _train(b, corpus, "--steps", 8, "--stop-after", 4)
    assert r.returncode == 0, r.stderr
    assert len(_losses(b)) == 4
    r = run_cli("train", "--out", b, "--resume", env_extra=corpus[1])    # a fresh process: nothing kept in memory
    assert r.returncode == 0, r.stderr
    assert _losses(a) == _losses(b)
    za, zb = np.load(a / "ckpt.npz"), np.load(b / "ckpt.npz")
    assert all(np.array_equal(za[k], zb[k]) for k in za.files if k.startswith(("layers", "adam_m")))


def test_nan_loss_stops_and_keeps_the_checkpoint(tmp_path, corpus, one_step_ckpt):
    out = shutil.copytree(one_step_ckpt, tmp_path / "n")          # a run of one step, resumed
    before = (out / "ckpt.npz").read_bytes()
    r = cli_here("train", "--out", out, "--resume", "--steps", 50, "--lr", 1e30, env_extra=corpus[1])
    assert_one_line_error(r, "loss is")
    assert (out / "ckpt.npz").read_bytes() == before


def test_resume_refuses_another_config_and_extends_at_the_floor(tmp_path, corpus):
    out = tmp_path / "r"
    assert _train(out, corpus, "--steps", 4, "--warmup", 2, "--lr", 1e-3).returncode == 0
    assert_one_line_error(cli_here("resume", "big", "--out", out, env_extra=corpus[1]), "config small", "not big")
    assert_one_line_error(cli_here("train", "--resume", "--out", out, env_extra=corpus[1]), "raise --steps")
    r = cli_here("resume", "--out", out, "--steps", 7, env_extra=corpus[1])
    assert r.returncode == 0, r.stderr
    lrs = [json.loads(l)["lr"] for l in open(out / "train_log.jsonl")]
    cos = 1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))  # step 3 of a 4-step schedule, warm-up 2
    assert lrs[:4] == pytest.approx([5e-4, 1e-3, 1e-3, cos], rel=1e-12)
    assert lrs[4:] == pytest.approx([1e-4] * 3, rel=1e-12)      # no jump: the floor of the first schedule


def test_stop_flag_restores_the_previous_handler(tmp_path):
    import signal
    cfg = pl.CONFIGS["tiny"]
    P, tok = pl.Params.init(cfg), bpe.Tokenizer([])

    class Fake:
        sync_every_step = True

        def step(self, x, y, lr):
            pass

        def results(self):
            return [(1.0, [1.0, 1.0, 1.0], 0.5)]

        def host_state(self):
            return P, pl.Params(cfg), pl.Params(cfg)

    mine = lambda s, f: None
    old = signal.signal(signal.SIGINT, mine)
    try:
        batches = pl.Batches(np.arange(1000, dtype=np.uint16) % 256, 2, 8)
        args = dict(pl.TRAIN_DEFAULTS, steps=2, schedule_steps=2, log_every=1, ckpt_every=1)
        pl.train_loop(Fake(), tok, batches, args, str(tmp_path))
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, old)


class _ObjectiveTrainer:
    """A train_loop trainer whose step k (1-based, counted from the run's start) has the objective
    objectives[k - 1]; it changes no weights."""
    sync_every_step = True

    def __init__(self, objectives, start=0, nan_from=None):
        self.cfg = pl.CONFIGS["tiny"]
        self.P, self.objectives, self.k = pl.Params.init(self.cfg), objectives, start
        self.nan_from = nan_from                     # the step after which the weights are NaN, the loss not yet

    def step(self, x, y, lr):
        self.k += 1

    def results(self):
        o = self.objectives[self.k - 1]
        return [(o, [o] * 3, 0.5)]

    def host_state(self):
        if self.nan_from is not None and self.k >= self.nan_from:
            self.P.flat[7] = np.nan
        return self.P, pl.Params(self.cfg), pl.Params(self.cfg)


def _fake_run(out, objectives, start=0, nan_from=None, **args):
    batches = pl.Batches(np.arange(1000, dtype=np.uint16) % 256, 2, 8)
    args = dict(pl.TRAIN_DEFAULTS, **{"steps": len(objectives), "schedule_steps": len(objectives), "log_every": 1,
                                      "ckpt_every": 1000, **args})
    pl.train_loop(_ObjectiveTrainer(objectives, start, nan_from), bpe.Tokenizer([]), batches, args, str(out),
                  start=start)


def _logged_steps(out):
    return [json.loads(l)["step"] for l in open(out / pl.LOG)]


def test_non_finite_flags_are_refused_in_one_line(one_step_ckpt, tmp_path, corpus):
    """Issue 31 item 2: --lr inf and nan are refused as --lr -1 is, and every other float flag of the training
    modes and of sampling likewise."""
    for flags in (["--lr", "inf"], ["--lr", "nan"], ["--ckpt-minutes", "inf"], ["--ckpt-minutes", -1]):
        r = cli_here("train", "--out", tmp_path / "t", "--steps", 3, *flags, env_extra=corpus[1])
        assert_one_line_error(r, " ".join(map(str, flags)))
    assert not (tmp_path / "t").exists()
    for mode, flag, value in (("sft", "--lr", "inf"), ("dpo", "--lr", "nan"), ("dpo", "--beta", "inf")):
        r = cli_here(mode, "--ckpt", one_step_ckpt, "--out", tmp_path / mode, "--steps", 1, flag, value)
        assert_one_line_error(r, f"{flag} {value}")
    for flag in ("--temperature", "--repetition-penalty"):
        assert_one_line_error(cli_here("sample", "--ckpt", one_step_ckpt, flag, "inf"), f"{flag} inf")


def test_the_default_seq_fits_a_shorter_context(tmp_path, corpus):
    """train tiny without --seq: the default 256 is cut to tiny's context of 64, not refused as if given."""
    path, env = corpus
    r = cli_here("train", "tiny", "--data", path, "--out", tmp_path, "--steps", 1, "--batch", 2, "--sample-every", 0,
                 env_extra=env, plots=False)
    assert r.returncode == 0, r.stderr
    assert pl.load_checkpoint(str(tmp_path), want_state=True)[2]["train"]["seq"] == 64


def test_nan_loss_names_only_a_checkpoint_that_exists(tmp_path):
    """Issue 31 items 2 and 9: a NaN before the first checkpoint says none was written; a run checkpoints by
    time too (--ckpt-minutes, 10 by default), and a NaN then names the checkpoint of that step, which exists."""
    assert pl.TRAIN_DEFAULTS["ckpt_minutes"] == 10
    with pytest.raises(pl.UserError, match=r"loss is nan at step 2; stopped, no checkpoint was written yet") as e:
        _fake_run(tmp_path / "a", [3.0, math.nan, 3.0])
    assert "ckpt.npz" not in str(e.value) and not (tmp_path / "a" / "ckpt.npz").exists()
    with pytest.raises(pl.UserError, match=r"at step 3; stopped, the checkpoint of step 2 is kept \(.*ckpt.npz\)"):
        _fake_run(tmp_path / "b", [3.0, 3.0, math.nan], ckpt_minutes=1e-9)     # every step is 'due'
    assert pl.load_checkpoint(str(tmp_path / "b"), want_state=True)[2]["step"] == 2


def test_weights_gone_nan_never_replace_the_last_checkpoint(tmp_path):
    """The weights go NaN a step or two before the loss shows it: a checkpoint of them would replace the last
    good one with one that nothing can load. The run stops there, and the message is true."""
    with pytest.raises(pl.UserError, match=r"NaN or infinite values after step 3; stopped, the checkpoint of step 2 "
                                           r"is kept \(.*ckpt.npz\)"):
        _fake_run(tmp_path, [3.0] * 5, nan_from=3, ckpt_every=1)
    assert pl.load_checkpoint(str(tmp_path), want_state=True)[2]["step"] == 2


def test_a_forced_run_keeps_the_old_runs_log_until_its_first_checkpoint(tmp_path):
    """train --force over a finished run: a failure before the new run's first checkpoint leaves the folder's
    checkpoint, log and evals all of the old run (so a resume goes on from them); its first checkpoint
    replaces all three."""
    out = tmp_path / "run"
    _fake_run(out, [3.0] * 4)
    (out / pl.EVALS).write_text('{"task": "bpb", "bpb": 1.0}\n')
    old = {name: (out / name).read_bytes() for name in ("ckpt.npz", pl.LOG, pl.EVALS)}
    with pytest.raises(pl.UserError, match="loss is nan at step 2; stopped, no checkpoint was written yet"):
        _fake_run(out, [5.0, math.nan, 5.0], ckpt_every=2)
    assert {name: (out / name).read_bytes() for name in old} == old
    _fake_run(out, [5.0, 5.0, 5.0], ckpt_every=2)
    assert _logged_steps(out) == [1, 2, 3] and [json.loads(l)["loss"] for l in open(out / pl.LOG)] == [5.0] * 3
    assert sorted(os.listdir(out)) == ["ckpt.npz", pl.LOG]      # the evals of the old checkpoint are gone


def test_a_run_removes_the_temporary_file_of_a_killed_checkpoint_write(tmp_path):
    """SIGKILL between a checkpoint's write and its rename leaves ckpt.npz.PID.tmp (as big as the checkpoint);
    the folder's next run removes it."""
    tmp_path.joinpath("ckpt.npz.4242.tmp").write_bytes(b"x" * 100)
    _fake_run(tmp_path, [3.0] * 2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.npz", pl.LOG]


def test_ctrl_c_in_a_forced_sft_keeps_the_finished_model(tmp_path):
    """sft and dpo do not resume: a Ctrl-C in a --force run over a finished one, before its first checkpoint,
    keeps the finished model (and its log) where the partial one would have replaced it."""
    _fake_run(tmp_path, [3.0] * 4)
    before = {name: (tmp_path / name).read_bytes() for name in ("ckpt.npz", pl.LOG)}
    trainer = _ObjectiveTrainer([5.0] * 6)
    step = trainer.step

    def ctrl_c_at_2(x, y, lr):
        step(x, y, lr)
        if trainer.k == 2:
            os.kill(os.getpid(), signal.SIGINT)
    trainer.step = ctrl_c_at_2
    args = dict(pl.TRAIN_DEFAULTS, steps=6, schedule_steps=6, log_every=1, ckpt_every=10 ** 9)
    with pytest.raises(KeyboardInterrupt):
        pl.train_loop(trainer, bpe.Tokenizer([]), pl.Batches(np.arange(1000, dtype=np.uint16) % 256, 2, 8), args,
                      str(tmp_path), extra={"kind": "chat"})
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def test_a_run_logs_each_step_once_and_one_run_only(tmp_path):
    """Issue 31 item 3: a new run in a folder with a dead run's log (no checkpoint) starts the log afresh, and
    drops the old checkpoint's evals; a resume from step 4 of a log that went on to step 6 logs 5 and 6 once."""
    out = tmp_path / "run"
    out.mkdir()
    (out / pl.LOG).write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(1, 73)) + '{"st')
    (out / pl.EVALS).write_text('{"task": "bpb", "bpb": 1.0}\n')
    _fake_run(out, [3.0] * 3)
    assert _logged_steps(out) == [1, 2, 3] and not (out / pl.EVALS).exists()
    (out / pl.LOG).write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(1, 7)))
    _fake_run(out, [3.0] * 6, start=4)
    assert _logged_steps(out) == [1, 2, 3, 4, 5, 6]
    assert [json.loads(l)["loss"] for l in open(out / pl.LOG)] == [9.0] * 4 + [3.0] * 2
    assert sorted(os.listdir(out)) == ["ckpt.npz", pl.LOG]        # no temporary file left


def test_new_run_report_counts_its_own_wall_time(tmp_path, corpus):
    """Issue 31 item 3 on the command line: a dead run's 72 logged steps of 1000 s each are not this run's."""
    out = tmp_path / "run"
    out.mkdir()
    (out / pl.LOG).write_text("".join(json.dumps({"step": s, "loss": 9.0, "ms": 1e6, "tokens": 64}) + "\n"
                                      for s in range(1, 73)))
    r = _train(out, corpus, "--steps", 2)
    assert r.returncode == 0 and "starts the log afresh" in r.stdout, r.stdout + r.stderr
    assert _logged_steps(out) == [1, 2]
    report = (out / "report.md").read_text()
    wall = float(re.search(r"wall time: ([\d.]+) s", report).group(1))
    assert wall < 100 and "tokens seen: 128 (2 steps x 64)" in report, report


def test_resume_refuses_another_batch_seq_or_grad_accum(tmp_path, corpus, one_step_ckpt):
    """Issue 31 item 4: the README promises an exact continuation, so a resume that would change what a step
    sees is refused in one line that names the run's values."""
    out = shutil.copytree(one_step_ckpt, tmp_path / "r")          # a run of one step
    for flag, value in (("--batch", 4), ("--seq", 16), ("--grad-accum", 2)):
        r = cli_here("resume", "--out", out, "--steps", 4, flag, value, env_extra=corpus[1])
        assert_one_line_error(r, f"{flag} {value}", "--batch 2, --seq 32, --grad-accum 1")
    assert _logged_steps(out) == [1]


def test_curves_count_each_steps_own_tokens_and_never_run_backwards(tmp_path):
    """Issue 31 item 4: tokens seen are the sum of each step's own (SFT's batches differ in length), a step
    a resume repeated (a log from before start_log) counts once, and the tokens axis only goes forward."""
    import evaluate
    recs = [(1, 16), (2, 16), (3, 48), (4, 8), (3, 48), (4, 8), (5, 8)]
    (tmp_path / pl.LOG).write_text("".join(json.dumps({"step": s, "loss": 5.0, "ms": 10.0, "tokens": n}) + "\n"
                                           for s, n in recs))
    c = evaluate.curves(str(tmp_path))
    assert list(c["step"]) == [1, 2, 3, 4, 5] and list(c["tokens"]) == [16, 32, 80, 88, 96]
    assert list(c["wall"]) == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])


def test_failed_start_leaves_no_out_folder_and_checks_out_first(tmp_path, corpus):
    """Issue 31 items 8 and 1: a token file too short to train on leaves no --out folder behind; an --out that
    is a file, or a token cache that cannot be written, is one error line before any slow work."""
    tok = bpe.Tokenizer([])
    tok.save(str(tmp_path / "three.bpe"))
    np.array([1, 2, 3], "<u2").tofile(tmp_path / "three.bin")
    r = cli_here("train", "--data", tmp_path / "three.bin", "--out", tmp_path / "o", "--steps", 2)
    assert_one_line_error(r, "too few")
    assert not (tmp_path / "o").exists()
    note = tmp_path / "note.txt"
    note.write_text("mine")
    for mode in ("train", "resume"):
        assert_one_line_error(cli_here(mode, "--out", note, "--steps", 2, env_extra=corpus[1]), "--out", "is a file")
    r = cli_here("train", "--data", corpus[0], "--out", tmp_path / "p", "--steps", 2,
                env_extra={"NANOEULER_CACHE": str(note / "cache")})
    assert_one_line_error(r, "token cache")
    assert note.read_text() == "mine" and not (tmp_path / "p").exists()


def test_train_says_what_it_does_before_the_slow_work(tmp_path, capsys):
    path = tmp_path / "t.txt"
    path.write_text(pl.default_corpus()[0][:20_000])
    pl.prepare_data(str(path), pl.CONFIGS["small"], "small", str(tmp_path / "cache"))
    first = capsys.readouterr().out.splitlines()[0]
    assert "training a 512-id tokenizer" in first


def test_two_corpora_of_one_name_size_and_time_are_cached_apart(tmp_path):
    """The token cache is keyed by content: a file of the same name, size and modification second as a cached
    one (a copy edited within a second, another folder's) is tokenised anew, not read from the other's cache."""
    texts = {"k1": "abcdefgh " * 3000, "k2": "qrstuvwz " * 3000}
    for d, text in texts.items():
        (tmp_path / d).mkdir()
        (tmp_path / d / "corpus.txt").write_text(text)
        os.utime(tmp_path / d / "corpus.txt", (1e9, 1e9))
    for d, text in texts.items():
        tokens, tok = pl.prepare_data(str(tmp_path / d / "corpus.txt"), pl.CONFIGS["tiny"], "tiny", str(tmp_path / "c"))
        assert text.startswith(tok.decode(tokens[:50].tolist()))


# ----------------------------------------------------------------------------------------------------
# SFT and chat

def test_sft_loss_mask_is_exact():
    import bpe
    tok = bpe.Tokenizer.train(pl.default_corpus()[0][:50_000], 300)
    ex = {"instruction": "Say hi.", "input": "", "output": "hi there"}
    prompt = tok.encode(pl.format_prompt("Say hi."))
    response = tok.encode("hi there") + [tok.eot]
    ids, targets = pl.sft_example(tok, ex, 512)
    assert ids.tolist() == (prompt + response)[:-1]
    assert targets.tolist() == [-1] * (len(prompt) - 1) + response
    assert tok.decode(prompt).endswith("### Instruction:\nSay hi.\n\n### Response:\n")
    with_input = pl.format_prompt("Sum.", "1 2")
    assert "paired with an input" in with_input and with_input.endswith("### Input:\n1 2\n\n### Response:\n")
    ids, targets = pl.sft_example(tok, ex, len(prompt) + 1)             # truncated to the context
    assert len(ids) == len(prompt) + 1 and targets.tolist()[-2:] == response[:2]


def test_chat_ctrl_c_stops_only_the_answer(tmp_path):
    import signal
    out = tmp_path / "c"
    out.mkdir()
    cfg = pl.Config(**{**pl.asdict(pl.CONFIGS["medium"]), "vocab": 257})  # medium's layers, the byte tokenizer's ids
    pl.save_checkpoint(str(out / "ckpt.npz"), pl.Params.init(cfg, 0), bpe.Tokenizer([]))
    # greedy, so the answer is the same every run (no early <|endoftext|>) and long enough to interrupt: the
    # 10M model writes its 500 tokens in 1-6 s (small wrote them in 0.2 s, and a loaded machine lost the race).
    # The next answer is stopped as well (it ran its 500 tokens, most of the test's time), then stdin ends.
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "nanoeuler.py"), "chat", "--ckpt", str(out / "ckpt.npz"),
                          "--tokens", "500", "--temperature", "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                         preexec_fn=ctrl_c_as_from_a_shell)

    def read_answer(seen, question, n=5):     # -> seen and the output up to the first n characters after question
        while (question not in seen or len(seen.split(question, 1)[1]) < n) and (c := p.stdout.read(1)):
            seen += c
        return seen
    try:
        p.stdin.write("The\n")
        p.stdin.flush()
        # a dozen characters: several decode steps done, so Numba has compiled them. On a fresh clone's cold
        # cache a Ctrl-C sent after 5 (the first step) did not stop the answer (CI, 2026-12-02)
        read_answer("", "> ", 12)
        p.send_signal(signal.SIGINT)
        p.stdin.write("A\n")
        p.stdin.flush()
        after = read_answer("", "\n> A\n")
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=120)
    finally:
        p.kill()
    after += rest
    assert p.returncode == 0 and "\n> A\n" in after, err + after
    assert "[stopped]" in after.split("\n> A\n")[0], after           # the session went on to the next question
    assert "[stopped]" in after.split("\n> A\n")[1], after           # and that answer stops too


def _fake_chat(monkeypatch, capsys, lines, ctx, max_new=4):
    """Runs the chat loop on piped lines with a model that answers ' ok'; -> (prompts it saw, stdout)."""
    import io
    tok = bpe.Tokenizer([])
    seen = []

    def gen(ids, n):
        seen.append(list(ids))
        yield from tok.encode(" ok") + [tok.eot]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(l + "\n" for l in lines)))
    pl.chat_repl(tok, gen, True, max_new, ctx)
    return tok, seen, capsys.readouterr().out


def test_chat_keeps_the_conversation_and_echoes_piped_questions(monkeypatch, capsys):
    tok, seen, out = _fake_chat(monkeypatch, capsys, ["first", "second"], ctx=512)
    assert "> first\n ok\n> second\n ok\n" in out
    turn1 = tok.encode(pl.format_prompt("first"))
    assert seen[0] == turn1
    assert seen[1] == turn1 + tok.encode(" ok") + [tok.eot] + tok.encode(pl.format_prompt("second"))
    tok, seen, out = _fake_chat(monkeypatch, capsys, ["a", "b", "c", "d"], ctx=300)
    assert "dropped the 1 oldest turn(s)" in out
    assert all(len(s) <= 300 - 4 for s in seen) and len(seen) == 4
    assert tok.decode(seen[-1]).count("### Instruction") == 2


def test_chat_edits_lines_in_a_terminal():
    """In a terminal, input() has readline's line editing: a left arrow moves the cursor."""
    import pty
    import select
    import signal
    from time import monotonic
    code = ("import pipeline as pl, bpe; tok = bpe.Tokenizer([]);"
            "pl.chat_repl(tok, lambda ids, n: print('GOT', repr(tok.decode(ids))) or iter(()), False, 5, 512)")
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-c", code])
    out = b""

    def read_until(pattern, limit=30):
        nonlocal out
        end = monotonic() + limit
        while not re.search(pattern, out) and monotonic() < end:
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    out += os.read(fd, 1024)
                except OSError:
                    return
    try:
        read_until(rb"> ")
        os.write(fd, b"abc\x1b[DX\r")
        read_until(rb"GOT .*\n(.|\n)*> ")
        os.write(fd, b"\x04")
        read_until(rb"\$^")                          # reads until the child closes the terminal
    finally:
        end = monotonic() + 10
        while not (done := os.waitpid(pid, os.WNOHANG)[0]) and monotonic() < end:
            select.select([], [], [], 0.1)
        if not done:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert b"GOT 'abXc'" in out and done, out


def test_pretrain_sft_chat_end_to_end(tmp_path):
    """The README's three commands on the embedded data, in small: train, sft (its validation loss falls: 6.1
    -> 5.6 in 10 steps), chat on each checkpoint. No loss plots (test_evaluate.py's)."""
    env = {"NANOEULER_CACHE": str(tmp_path / "cache")}
    base, chat = tmp_path / "base", tmp_path / "chat"
    r = cli_here("train", "--steps", 10, "--batch", 4, "--seq", 64, "--eval-every", 5, "--out", base, env_extra=env,
                 plots=False)
    assert r.returncode == 0, r.stderr
    assert "embedded default corpus" in r.stdout and "final: val loss" in r.stdout
    r = cli_here("sft", "--ckpt", base / "ckpt.npz", "--steps", 10, "--batch", 4, "--seq", 128, "--out", chat,
                 env_extra=env, plots=False)
    assert r.returncode == 0, r.stderr
    before, after = map(float, re.search(r"before ([\d.]+) -> after ([\d.]+)", r.stdout).groups())
    assert after < before
    # issue 31 item 8: the last checkpoint is kept, and the final line says which evaluation was best
    assert re.search(r"after [\d.]+, (the best evaluation|the best was [\d.]+ at step \d+)", r.stdout), r.stdout
    assert "(step 10, the last)" in r.stdout
    r = cli_here("chat", "--ckpt", chat / "ckpt.npz", "--tokens", 20, stdin="What is a statement?\n" + "x " * 600 + "\n",
                env_extra=env)
    assert r.returncode == 0, r.stderr
    assert "instruction model" in r.stdout and "kept its last" in r.stderr
    r = run_cli("chat", "--ckpt", base / "ckpt.npz", "--tokens", 10, stdin="The\n", env_extra=env)   # a real process
    assert r.returncode == 0 and "base model" in r.stdout


# ----------------------------------------------------------------------------------------------------
# issue 36 (H-tests36b): batched streams against single streams, chat history, SFT examples without a
# response, the last step's validation, the checkpoint under a crash between write and rename

def _replay_streams(logits_of, prompt, n, max_new, temperature, penalty, seed):
    """The batch's contract written apart from pipeline.Sampling: stream r is stream r sampled alone, from the
    logits of r's own ids (logits_of(ids), one sequence, uncached) and with the repetition penalty (CTRL's rule:
    positive logits of seen ids / penalty, negative x penalty) of r's own history; one generator, each step
    drawing one uniform per stream in stream order and inverting the cumulative distribution (greedy: the first
    argmax, no draw)."""
    rng = np.random.default_rng(seed)
    ids = [list(prompt) for _ in range(n)]
    for _ in range(max_new):
        for r in range(n):
            z = np.array(logits_of(ids[r]), np.float64)
            seen = sorted(set(ids[r]))
            z[seen] = np.where(z[seen] > 0, z[seen] / penalty, z[seen] * penalty)
            if temperature <= 0:
                ids[r].append(int(np.argmax(z)))
                continue
            p = np.exp((z - z.max()) / temperature)
            cdf = np.cumsum(p / p.sum())
            ids[r].append(int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(z) - 1)))
    return [x[len(prompt):] for x in ids]


@pytest.mark.parametrize("temperature, penalty", [(0.0, 1.0), (0.0, 1.5), (1.0, 1.0), (1.0, 1.5)])
def test_batched_streams_sample_their_own_logits_and_history(temperature, penalty):
    """Authority: each stream alone (one forward per stream on its own ids, uncached) and the sampling rule
    written out here (_replay_streams): a batch that draws every stream from stream 0's logits, penalises with
    stream 0's history, or feeds stream 0's token to all, gives other ids once the streams part."""
    P = pl.Params.init(pl.CONFIGS["tiny"], 3)
    P.flat *= 3                                  # logits of a few units: streams part, no near-ties to round
    prompt, n, max_new = [5, 6, 7], 4, 24
    sampling = pl.Sampling(temperature, top_k=0, repetition_penalty=penalty)
    got = ne.generate_batch(P, prompt, n, max_new, sampling, np.random.default_rng(11))
    want = _replay_streams(lambda ids: ne.forward(P, np.array([ids], np.int32))[-1], prompt, n, max_new,
                           temperature, penalty, 11)
    assert got == want
    if temperature > 0:
        assert len({tuple(g) for g in got}) == n, got               # the streams part: the test has teeth
    else:
        assert got == [list(ne.generate(P, prompt, max_new, sampling=sampling))] * n


@pytest.mark.gpu
def test_gpu_batched_streams_sample_their_own_logits_and_history():
    """Authority: as test_batched_streams_sample_their_own_logits_and_history, for the GPU engine's batch
    sampler (nanoeuler_cuda.Sampler.generate_batch): each stream equals its own stream alone, from the CPU
    engine's uncached forward of its own ids and its own history, drawing in stream order. Peaked weights
    (as test_gpu_generation_matches_cpu_engine) leave no near-ties for the device's rounding to flip."""
    import nanoeuler_cuda as nc
    P = nc.gradcheck_params(pl.CONFIGS["tiny"], np.random.default_rng(2), scale=0.3)
    prompt, n, max_new = list(range(5, 21)), 4, 40
    sampler = nc.Sampler(P, streams=n)
    logits_of = lambda ids: ne.forward(P, np.array([ids], np.int32))[-1]
    for temperature, penalty in ((0.0, 1.5), (1.0, 1.0), (1.0, 1.5)):
        sampling = pl.Sampling(temperature, top_k=0, repetition_penalty=penalty)
        got = sampler.generate_batch(prompt, n, max_new, sampling, np.random.default_rng(11))
        assert got == _replay_streams(logits_of, prompt, n, max_new, temperature, penalty, 11), (temperature, penalty)
        if temperature > 0:
            assert len({tuple(g) for g in got}) > 1, got                # the streams part: the test has teeth


def test_chat_history_drops_the_oldest_turns_when_the_context_is_full():
    """Authority: CONTRACT.md (a chat's blocks run oldest first) and the chat convention of every chat front
    end (llama.cpp's context shift, OpenAI's guidance to trim the earliest messages): the next answer depends
    on the newest turns, so the oldest go first; a conversation that fits the budget, max(ctx - max_new,
    ctx / 2), loses nothing, even at the budget exactly."""
    turns = [([10, 11], [12, 13]), ([20, 21], [22, 23]), ([30, 31], [32, 33])]      # 4 ids a turn
    user = [40, 41, 42]
    # ctx 20, 8 to answer: a budget of 12; all 15 ids do not fit, the newest turn and the question (7) do,
    # and so do the two newest (11): only the oldest goes
    assert pl.fit_turns(turns, user, 20, 8) == ([20, 21, 22, 23, 30, 31, 32, 33, 40, 41, 42], 1)
    # a budget of 15 (ctx 23): everything fits exactly
    assert pl.fit_turns(turns, user, 23, 8) == ([t for u, a in turns for t in u + a] + user, 0)
    # a budget of 7 (ctx 14, max_new 7): the newest turn and the question alone
    assert pl.fit_turns(turns, user, 14, 7) == ([30, 31, 32, 33, 40, 41, 42], 2)
    # a budget of 3: every turn goes, the question stays whole (fit_prompt cuts it, not fit_turns)
    assert pl.fit_turns(turns, user, 6, 3) == (user, 3)
    # 16 to answer in a context of 20 would leave 4: the history keeps half the context (10), the newest turn
    assert pl.fit_turns(turns, user, 20, 16) == ([30, 31, 32, 33, 40, 41, 42], 2)


def test_sft_example_without_a_counted_response_token_is_skipped():
    """Authority: CONTRACT.md (SFT template): the loss counts the response tokens and the closing
    <|endoftext|>, every other target is -1. An example cut so short that no response token is left would
    train on nothing: sft_example refuses it (None), SFTBatches skips it, and when none is left says why.
    One position more and it counts exactly the response's first token."""
    tok = bpe.Tokenizer([])
    ex = {"instruction": "Say hi.", "output": "hi"}
    prompt = tok.encode(pl.format_prompt(ex["instruction"]))
    assert pl.sft_example(tok, ex, len(prompt) - 1) is None         # the prompt fills every position
    assert pl.sft_example(tok, dict(ex, output=""), len(prompt) - 1) is None
    ids, targets = pl.sft_example(tok, ex, len(prompt))            # one position to spare: "h" counts
    assert ids.tolist() == prompt and targets[-1] == ord("h") and (targets >= 0).sum() == 1
    ids, targets = pl.sft_example(tok, dict(ex, output=""), len(prompt) + 5)   # no output: <|endoftext|> alone counts
    assert targets[targets >= 0].tolist() == [tok.eot]
    short = {"instruction": "Hi.", "output": "hi"}
    n_short = len(tok.encode(pl.format_prompt("Hi.")))
    long_ = {"instruction": "Hi. " + "x" * 40, "output": "hi"}
    b = pl.SFTBatches(tok, [long_, short, long_], 4, n_short + 1)
    assert len(b.examples) == 1
    x, y = b.next()
    assert ((y >= 0).sum(1) > 0).all()                              # every row trains on something
    with pytest.raises(pl.UserError, match="--seq"):
        pl.SFTBatches(tok, [long_], 4, n_short + 1)


class _FakeTrainer:
    """A trainer that learns nothing (the loop's bookkeeping is what is checked)."""
    sync_every_step = True

    def __init__(self, P):
        self.P, self.pending = P, []

    def step(self, x, y, lr):
        self.pending.append((3.0, [3.0], 1.0))

    def results(self):
        done, self.pending = self.pending, []
        return done

    def host_state(self):
        return self.P, self.P, self.P


@pytest.mark.parametrize("steps, eval_every", [(5, 2), (7, 3), (4, 2)])
def test_last_step_is_validated(tmp_path, steps, eval_every, capsys):
    """Authority: the report's 'final validation loss' is the final weights': the last step logs a val loss
    even when steps % eval_every != 0, besides every eval_every-th step."""
    P, tok = pl.Params.init(pl.CONFIGS["tiny"], 0), bpe.Tokenizer([])
    batches = pl.Batches(np.arange(4000) % 256, 2, 8)
    args = dict(steps=steps, lr=1e-3, warmup=0, eval_every=eval_every, sample_every=0, ckpt_every=1000,
                log_every=1000)
    pl.train_loop(_FakeTrainer(P), tok, batches, args, str(tmp_path), val_fn=lambda: (2.5, 1.0))
    recs = [json.loads(line) for line in open(tmp_path / "train_log.jsonl")]
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    want = sorted({s for s in range(1, steps + 1) if s % eval_every == 0} | {steps})
    assert [r["step"] for r in recs if "val_loss" in r] == want
    assert recs[-1]["val_loss"] == 2.5


def _ckpt(P0, seed):
    P = pl.Params.init(P0.cfg, seed)
    return P, {"step": seed, "adam_m": P, "adam_v": P, "data": None, "train": {}}


def test_checkpoint_survives_a_crash_between_write_and_rename(tmp_path, monkeypatch):
    """Authority: CONTRACT.md (checkpoint file: written to a temporary file in the same folder and renamed
    over the old one, so that a crash never leaves a half-written checkpoint) and POSIX rename(2), which
    replaces the name atomically. A crash before the rename (os.replace raises) or in the middle of the write
    (np.savez raises half-way) leaves the previous checkpoint whole and loadable, and no other file."""
    tok = bpe.Tokenizer([])
    path = str(tmp_path / "ckpt.npz")
    old, state = _ckpt(pl.Params.init(pl.CONFIGS["tiny"], 0), 1)
    pl.save_checkpoint(path, old, tok, state)
    new, new_state = _ckpt(old, 2)

    def crash(*a, **k):
        raise OSError("simulated crash")
    real_savez = np.savez

    def half_write(f, **arrays):                 # the first half of the arrays, then the crash
        real_savez(f, **dict(list(arrays.items())[:len(arrays) // 2]))
        raise OSError("simulated crash")
    for target, fake in ((os, "replace"), (np, "savez")):
        with monkeypatch.context() as m:
            m.setattr(target, fake, crash if fake == "replace" else half_write)
            with pytest.raises(OSError, match="simulated crash"):
                pl.save_checkpoint(path, new, tok, new_state)
        assert os.listdir(tmp_path) == ["ckpt.npz"], fake            # no partial or temporary file is left
        P, _, st, _ = pl.load_checkpoint(path, want_state=True)
        assert np.array_equal(P.flat, old.flat) and st["step"] == 1, fake
    pl.save_checkpoint(path, new, tok, new_state)                     # and the next write goes through
    assert np.array_equal(pl.load_checkpoint(path)[0].flat, new.flat)


def test_checkpoint_replaces_the_file_a_reader_holds_by_rename(tmp_path):
    """Authority: POSIX rename(2): the new checkpoint is a new file put in the old one's place, so a reader
    that opened the old one (a sampler, an export) goes on reading it whole; a write in place or a copy over
    it would change the bytes under the reader."""
    tok = bpe.Tokenizer([])
    path = tmp_path / "ckpt.npz"
    old, state = _ckpt(pl.Params.init(pl.CONFIGS["tiny"], 0), 1)
    pl.save_checkpoint(str(path), old, tok, state)
    want = path.read_bytes()
    with open(path, "rb") as reader:
        new, new_state = _ckpt(old, 2)
        pl.save_checkpoint(str(path), new, tok, new_state)
        assert reader.read() == want
    assert path.read_bytes() != want and os.listdir(tmp_path) == ["ckpt.npz"]

"""
test_reference.py -- the engine held to references written apart from it (issue 11).

gradcheck.py proves that each backward matches its own forward. These tests prove that the forward, the
objective, the optimiser, the schedule, the data and SFT paths, sampling and checkpoints are the ones
CONTRACT.md describes: the model and the optimiser are re-derived below in plain float64 numpy (no Numba, no
flat buffer, nothing of the engine's math imported), the rest is checked against hand-computed values.
`python3 mutate.py` plants bugs in the engine and reports which of them these tests miss.

Sections: reference model | reference optimiser and schedule | the model against the reference | training
against the reference | schedule and init | data and SFT | sampling and generation | checkpoints |
tokenizer. (Its command-line mistakes are checked in test_cli.py.)
"""
import io
import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import bpe
from conftest import ROOT
import nanoeuler as ne
import pipeline as pl

TINY = pl.CONFIGS["tiny"]

# ====================================================================================================
# reference model: CONTRACT.md's "Model" and "Multi-token prediction" sections, one sequence at a time


def ref_shapes(cfg):
    """CONTRACT.md's parameter table: name -> shape (matrices out x in)."""
    D, hd, F, V = cfg.dim, cfg.dim // cfg.n_heads, cfg.ffn, cfg.vocab
    shapes = {"tok_emb": (V, D), "norm": (D,)}
    for i in range(cfg.n_layers):
        shapes.update({f"layers.{i}.attn_norm": (D,), f"layers.{i}.wq": (cfg.n_heads * hd, D),
                       f"layers.{i}.wk": (cfg.n_kv_heads * hd, D), f"layers.{i}.wv": (cfg.n_kv_heads * hd, D),
                       f"layers.{i}.wo": (D, cfg.n_heads * hd), f"layers.{i}.ffn_norm": (D,),
                       f"layers.{i}.w1": (F, D), f"layers.{i}.w3": (F, D), f"layers.{i}.w2": (D, F)})
    shapes.update({f"heads.{k}": (V, D) for k in range(cfg.n_mtp)})
    return shapes


def ref_rmsnorm(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * w


def ref_rope(u):
    """u (T, H, hd): pair (i, i + hd/2) at position t turns by t * 10000^(-2i/hd) (half-split)."""
    T, _, hd = u.shape
    half = hd // 2
    angle = np.arange(T)[:, None, None] * 10000.0 ** (-2.0 * np.arange(half) / hd)
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = u[..., :half], u[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def ref_attention(q, k, v):
    """q (T, Hq, hd), k and v (T, Hkv, hd): causal softmax attention; query head j reads kv head j // (Hq/Hkv)."""
    T, Hq, hd = q.shape
    group = Hq // k.shape[1]
    out = np.zeros_like(q)
    for j in range(Hq):
        s = q[:, j] @ k[:, j // group].T / math.sqrt(hd)
        s[np.triu_indices(T, 1)] = -np.inf                     # position t sees 0..t
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, j] = p / p.sum(axis=1, keepdims=True) @ v[:, j // group]
    return out


def ref_logits(W, cfg, idx):
    """W: {name: float64 array}; idx (B, T) -> logits of every head, (n_mtp, B, T, V)."""
    hd = cfg.dim // cfg.n_heads
    out = []
    for row in idx:
        T, x = len(row), W["tok_emb"][row]
        for i in range(cfg.n_layers):
            w = {n.split(".")[-1]: a for n, a in W.items() if n.startswith(f"layers.{i}.")}
            h = ref_rmsnorm(x, w["attn_norm"])
            q = ref_rope((h @ w["wq"].T).reshape(T, cfg.n_heads, hd))
            k = ref_rope((h @ w["wk"].T).reshape(T, cfg.n_kv_heads, hd))
            v = (h @ w["wv"].T).reshape(T, cfg.n_kv_heads, hd)
            x = x + ref_attention(q, k, v).reshape(T, -1) @ w["wo"].T
            h = ref_rmsnorm(x, w["ffn_norm"])
            gate = h @ w["w1"].T
            x = x + (gate / (1.0 + np.exp(-gate)) * (h @ w["w3"].T)) @ w["w2"].T
        h = ref_rmsnorm(x, W["norm"])
        out.append([h @ W[f"heads.{k}"].T for k in range(cfg.n_mtp)])
    return np.array(out).transpose(1, 0, 2, 3)


def ref_losses(W, cfg, idx, targets, mtp_weight):
    """(objective, [CE_k]): head k at t is scored on targets[t+k] when t+k < T; -1 is never scored;
    CE_k is the mean over its scored positions (0 with none); objective CE_0 + w * mean(CE_1..)."""
    logits = ref_logits(W, cfg, idx)
    B, T = targets.shape
    ces = []
    for k in range(cfg.n_mtp):
        nll = []
        for b in range(B):
            for t in range(T - k):
                y = targets[b, t + k]
                if y >= 0:
                    z = logits[k, b, t]
                    nll.append(z.max() + math.log(np.exp(z - z.max()).sum()) - z[y])
        ces.append(float(np.mean(nll)) if nll else 0.0)
    return ces[0] + (mtp_weight * float(np.mean(ces[1:])) if cfg.n_mtp > 1 else 0.0), ces


# ====================================================================================================
# reference optimiser and schedule: PyTorch's documented AdamW (decoupled decay, bias-corrected moments,
# eps outside the square root) and clip_grad_norm_ (one global L2 norm, coefficient max/(norm + 1e-6)
# clamped at 1); CONTRACT.md's defaults; decay on matrices and the embedding only

def ref_lr(step, total, peak, warmup):
    """Linear warm-up reaching the peak at step warmup-1, then cosine from the peak to 10% of it at total."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (total - warmup))
    return 0.1 * peak + 0.9 * peak * (1 + math.cos(math.pi * progress)) / 2


class RefAdamW:
    def __init__(self, W, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_norm=1.0):
        self.m = {n: np.zeros_like(a) for n, a in W.items()}
        self.v = {n: np.zeros_like(a) for n, a in W.items()}
        self.beta1, self.beta2, self.eps, self.wd, self.max_norm, self.t = beta1, beta2, eps, weight_decay, max_norm, 0

    def step(self, W, grads, lr):
        """One step in place; returns the gradient norm before clipping."""
        norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
        coef = min(1.0, self.max_norm / (norm + 1e-6))
        self.t += 1
        for n, p in W.items():
            g = grads[n] * coef
            if p.ndim == 2:                                    # matrices and tok_emb; never norm weights
                p *= 1.0 - lr * self.wd
            self.m[n] = self.beta1 * self.m[n] + (1 - self.beta1) * g
            self.v[n] = self.beta2 * self.v[n] + (1 - self.beta2) * g * g
            m_hat = self.m[n] / (1 - self.beta1 ** self.t)
            v_hat = self.v[n] / (1 - self.beta2 ** self.t)
            p -= lr * m_hat / (np.sqrt(v_hat) + self.eps)
        return norm


def ref_orthogonalise(U, steps=5):
    """Newton-Schulz as Keller Jordan's Muon (github.com/KellerJordan/modded-nanogpt) and nanochat's muon.py
    write it: U over its Frobenius norm (+1e-7), then 5 steps X <- 3.4445 X - 4.7750 (X X^T) X + 2.0315 (X X^T)^2 X,
    on U^T when U has more rows than columns."""
    X = U.T if U.shape[0] > U.shape[1] else U
    X = X / (np.linalg.norm(X) + 1e-7)
    for _ in range(steps):
        S = X @ X.T
        X = 3.4445 * X - 4.7750 * S @ X + 2.0315 * S @ S @ X
    return X.T if U.shape[0] > U.shape[1] else X


class RefMuon(RefAdamW):
    """CONTRACT.md's --optim muon: Muon (Nesterov momentum 0.95, orthogonalised, times max(1, rows/cols)^0.5, no
    decay) on each of a block's wq, wk, wv, wo, w1, w3, w2 at lr_muon; RefAdamW's step on every other tensor."""

    def __init__(self, W, muon_ratio):
        super().__init__(W)
        self.muon_ratio = muon_ratio
        self.matrices = {n for n in W if n.startswith("layers.") and n.split(".")[-1] in
                         ("wq", "wk", "wv", "wo", "w1", "w3", "w2")}

    def step(self, W, grads, lr):
        norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
        coef = min(1.0, self.max_norm / (norm + 1e-6))
        rest = {n: p for n, p in W.items() if n not in self.matrices}
        adam = RefAdamW.__new__(RefAdamW)
        adam.__dict__.update(self.__dict__, max_norm=math.inf)          # the clip is applied below, once
        RefAdamW.step(adam, rest, {n: grads[n] * coef for n in rest}, lr)
        self.t = adam.t
        for n in self.matrices:
            g = grads[n] * coef
            self.m[n] = 0.95 * self.m[n] + 0.05 * g
            rows, cols = W[n].shape
            W[n] -= lr * self.muon_ratio * max(1.0, rows / cols) ** 0.5 * ref_orthogonalise(0.05 * g + 0.95 * self.m[n])
        return norm


# ====================================================================================================
# the model against the reference

def random_weights(cfg, seed):
    """Weights of unit-scale activations (larger than the init, so every constant shows), norms near 1."""
    rng = np.random.default_rng(seed)
    return {n: (1.0 + 0.3 * rng.standard_normal(s)) if len(s) == 1 else rng.standard_normal(s) / math.sqrt(s[1])
            for n, s in ref_shapes(cfg).items()}


def to_params(W, cfg):
    """The engine's float64 Params holding W; its names and shapes must be the contract's."""
    P = pl.Params(cfg, np.float64)
    assert {n: v.shape for n, v in P.items()} == ref_shapes(cfg)
    for n, a in W.items():
        P[n][:] = a
    return P


OTHER = pl.Config(dim=24, n_heads=6, n_kv_heads=2, n_layers=2, ctx=160, vocab=61, ffn=40, n_mtp=4)    # 3 q per kv
MQA = pl.Config(dim=16, n_heads=2, n_kv_heads=1, n_layers=1, ctx=16, vocab=37, ffn=24, n_mtp=1)
WEIGHTED = pl.Config(dim=16, n_heads=4, n_kv_heads=4, n_layers=2, ctx=16, vocab=40, ffn=32, n_mtp=2, mtp_weight=0.7)
# (config, B, T, the mtp_weight the contract gives it): OTHER's T=130 spans three of the engine's attention chunks
CASES = {"tiny": (TINY, 3, 12, 0.3), "other": (OTHER, 2, 130, 0.3), "mqa": (MQA, 2, 9, 0.3),
         "weighted": (WEIGHTED, 2, 10, 0.7)}


def masked_batch(cfg, B, T, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, cfg.vocab, (B, T)).astype(np.int32)
    y = rng.integers(0, cfg.vocab, (B, T)).astype(np.int32)
    y[0, 2] = y[0, -1] = -1                                    # holes, the last target, a masked prompt
    y[1, :T // 2] = -1
    return x, y


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_losses_match_the_reference(case):
    cfg, B, T, weight = CASES[case]
    W = random_weights(cfg, 1)
    P = to_params(W, cfg)
    x, y = masked_batch(cfg, B, T, 2)
    ref = ref_logits(W, cfg, x)
    assert np.abs(ne.forward(P, x) - ref[0].reshape(B * T, -1)).max() <= 1e-10
    for k in range(1, cfg.n_mtp):                              # head k's logits: the engine's head 0 set to it
        Q = to_params({**W, "heads.0": W[f"heads.{k}"]}, cfg)
        assert np.abs(ne.forward(Q, x) - ref[k].reshape(B * T, -1)).max() <= 1e-10
    objective, ces = ref_losses(W, cfg, x, y, weight)
    for obj, got in (ne.forward_loss(P, x, y), ne.loss_and_grads(P, x, y)[:2]):
        assert abs(obj - objective) <= 1e-10 and np.abs(np.subtract(got, ces)).max() <= 1e-10, (obj, got, ces)


def test_a_head_without_targets_counts_zero():
    """Only t=0 has a target: heads 1.. score nothing, so CE_k = 0 and the objective is CE_0 alone."""
    W = random_weights(TINY, 3)
    x, y = masked_batch(TINY, 2, 8, 4)
    y[:, 1:] = -1
    objective, ces = ref_losses(W, TINY, x, y, 0.3)
    assert ces[1:] == [0.0, 0.0] and objective == ces[0]
    obj, got = ne.forward_loss(to_params(W, TINY), x, y)
    assert abs(obj - objective) <= 1e-10 and got[1:] == [0.0, 0.0] and abs(got[0] - ces[0]) <= 1e-10


@pytest.mark.parametrize("name", sorted(CASES))
def test_sampling_forward_with_its_cache_matches_the_reference(name):
    cfg = CASES[name][0]
    W = random_weights(cfg, 5)
    P = to_params(W, cfg)
    ids = list(np.random.default_rng(6).integers(0, cfg.vocab, 10))
    cache = ne.KVCache(cfg, dtype=np.float64)
    assert np.abs(ne.forward_cached(P, ids[:5], cache) - ref_logits(W, cfg, np.array([ids[:5]]))[0, 0]).max() <= 1e-10
    for t in range(5, 10):                                     # one token at a time, after the prompt
        got = ne.forward_cached(P, ids[t:t + 1], cache)[-1]
        assert np.abs(got - ref_logits(W, cfg, np.array([ids[:t + 1]]))[0, 0, -1]).max() <= 1e-10
    z, guesses = 3, [8, 1, 4]                                  # guesses at one position see z, not each other
    got = ne.forward_cached(P, [z] + guesses, cache, offsets=[0, 1, 1, 1])
    for row, tail in zip(got, [[z]] + [[z, g] for g in guesses]):
        assert np.abs(row - ref_logits(W, cfg, np.array([ids + tail]))[0, 0, -1]).max() <= 1e-10


def ref_greedy(W, cfg, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(np.argmax(ref_logits(W, cfg, np.array([ids]))[0, 0, -1])))
    return ids


def test_generation_is_head_0_greedy_and_stops_at_the_context():
    """temperature 0, and top-k 1 at any temperature, give the reference's argmax chain, with or without
    self-speculative drafts; a prompt 3 short of the context gets exactly 3 tokens, whatever max_new."""
    W = random_weights(TINY, 7)
    P = to_params(W, TINY)
    prompt = list(np.random.default_rng(8).integers(0, TINY.vocab, TINY.ctx - 3))
    expected = ref_greedy(W, TINY, prompt, 3)[len(prompt):]
    assert list(ne.generate(P, prompt, 10, temperature=0.0)) == expected
    assert list(ne.generate(P, prompt, 10, temperature=1.0, top_k=1, rng=np.random.default_rng(0))) == expected
    assert list(ne.generate(P, prompt[:10], 4, temperature=0.0)) == ref_greedy(W, TINY, prompt[:10], 4)[10:]
    stats = {}                                                 # CONTRACT.md: drafts never change greedy head-0 output
    assert list(ne.generate(P, prompt[:10], 12, temperature=0.0, speculative=True, stats=stats)) == ref_greedy(
        W, TINY, prompt[:10], 12)[10:] and stats["drafted"] > 0


def test_sampled_generation_draws_from_the_reference_with_the_callers_rng():
    """With temperature and top-k, each token is sample_token on the reference's head-0 logits with the
    caller's generator: another seed gives another text."""
    W = random_weights(TINY, 9)
    P = to_params(W, TINY)
    for seed in (1, 2):
        ids, rng = [3, 1, 4, 1, 5], np.random.default_rng(seed)
        for _ in range(12):
            ids.append(pl.sample_token(ref_logits(W, TINY, np.array([ids]))[0, 0, -1], 0.7, 5, rng))
        assert list(ne.generate(P, [3, 1, 4, 1, 5], 12, 0.7, 5, np.random.default_rng(seed))) == ids[5:]
    assert ids[5:] != list(ne.generate(P, [3, 1, 4, 1, 5], 12, 0.7, 5, np.random.default_rng(1)))


# ====================================================================================================
# training against the reference: 20 steps of the engine's train_loop and Trainer in float64 against
# RefAdamW and ref_lr. The reference's gradients come from the engine's loss_and_grads, evaluated at the
# reference's own weights: gradcheck holds them to finite differences of the forward, which the tests above
# hold to ref_logits. Clipping acts on the early steps (norm > 1) and not on the late ones.

class ListBatches:
    def __init__(self, batches):
        self.batches, self.i = batches, 0

    def next(self):
        self.i += 1
        return self.batches[self.i - 1]

    def state(self):
        return {"i": self.i}


def test_twenty_training_steps_match_reference_adamw(tmp_path):
    steps, peak, warmup = 20, 3e-2, 5
    x = np.random.default_rng(0).integers(0, 20, (2, 16)).astype(np.int32)
    y = x + 1                                                  # one batch, learnt fast: the norm falls below 1
    y[0, :5] = -1
    batches = [(x, y)] * steps
    P = pl.Params.init(TINY, 0, np.float64)
    W = {n: v.copy() for n, v in P.items()}

    def grads_at(W, x, y):
        G = ne.loss_and_grads(to_params(W, TINY), x, y)[2]
        return {n: G[n].copy() for n in W}

    opt, norms, lrs = RefAdamW(W), [], [ref_lr(s, steps, peak, warmup) for s in range(steps)]
    for (x, y), lr in zip(batches, lrs):
        norms.append(opt.step(W, grads_at(W, x, y), lr))
    assert max(norms) > 1.5 and min(norms) < 0.5               # clipped steps and free steps

    trainer = ne.Trainer(P)
    args = dict(steps=steps, schedule_steps=steps, lr=peak, warmup=warmup, eval_every=10 ** 9, sample_every=0,
                ckpt_every=10 ** 9, log_every=10 ** 9, stop_after=0)
    pl.train_loop(trainer, bpe.Tokenizer([]), ListBatches(batches), args, str(tmp_path))
    for n in W:
        assert np.abs(P[n] - W[n]).max() <= 1e-8, n
        assert np.abs(trainer.opt.m[n] - opt.m[n]).max() <= 1e-8, n
    log = [json.loads(line) for line in open(tmp_path / "train_log.jsonl")]
    assert [r["lr"] for r in log] == pytest.approx(lrs, rel=1e-12, abs=0)
    assert [r["grad_norm"] for r in log] == pytest.approx(norms, abs=1e-4)


def test_torch_adamw_agrees_with_the_reference():
    """Where PyTorch is installed (not in CI: its wheels are gigabytes), RefAdamW is checked against it."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    W = {"m": rng.standard_normal((4, 3)), "n": 1 + rng.standard_normal(3)}
    T = {n: torch.tensor(a.copy(), requires_grad=True) for n, a in W.items()}
    topt = torch.optim.AdamW([{"params": [T["m"]], "weight_decay": 0.1}, {"params": [T["n"]], "weight_decay": 0.0}],
                             lr=1.0, betas=(0.9, 0.95), eps=1e-8)
    ref = RefAdamW(W)
    for s in range(6):
        g = {n: rng.standard_normal(a.shape) * (3.0 if s % 2 else 0.1) for n, a in W.items()}
        lr = 0.01 * (s + 1)
        for n, t in T.items():
            t.grad = torch.tensor(g[n])
        torch.nn.utils.clip_grad_norm_(list(T.values()), 1.0)
        for group in topt.param_groups:
            group["lr"] = lr
        topt.step()
        ref.step(W, g, lr)
    for n in W:
        assert np.abs(T[n].detach().numpy() - W[n]).max() <= 1e-12


def test_a_nan_step_changes_nothing():
    """A step whose loss is not finite leaves the weights, the moments and the step count as they were."""
    P = pl.Params.init(TINY, 0, np.float64)
    P["tok_emb"][7] = np.inf
    before, trainer = P.flat.copy(), ne.Trainer(P)
    x = np.full((2, 8), 7, np.int32)
    trainer.step(x, x, 1e-2)
    assert not math.isfinite(trainer.results()[0][0])
    assert np.array_equal(P.flat, before) and trainer.opt.step_count == 0 and not trainer.opt.m.flat.any()


def _muon_step_inputs(seed=0):
    """Tiny's float64 weights, a gradient of norm > 1 (so the step clips), random moments, as after two steps."""
    rng = np.random.default_rng(seed)
    W = random_weights(TINY, seed)
    G = {n: rng.standard_normal(a.shape) * 0.2 for n, a in W.items()}
    M = {n: rng.standard_normal(a.shape) * 0.01 for n, a in W.items()}
    V = {n: rng.random(a.shape) * 1e-3 for n, a in W.items()}
    return W, G, M, V


def _engine_muon_step(W, G, M, V, lr, ratio):
    P = to_params(W, TINY)
    opt = ne.Muon(P, ratio)
    for n in W:
        opt.m[n][:], opt.v[n][:] = M[n], V[n]
    opt.step_count = 2
    norm = opt.step(P, to_params(G, TINY), lr)
    return P, opt, norm


def test_one_muon_step_matches_the_reference():
    """--optim muon's step on the CPU engine in float64 (clip, AdamW on the embedding, norms and heads, Muon on
    each block matrix, momenta) equals RefMuon's to 1e-12 relative, tensor by tensor."""
    W, G, M, V = _muon_step_inputs()
    P, opt, norm = _engine_muon_step(W, G, M, V, 3e-3, 0.02 / 3e-3)
    ref = RefMuon({n: a.copy() for n, a in W.items()}, 0.02 / 3e-3)
    ref.m, ref.v, ref.t = {n: a.copy() for n, a in M.items()}, {n: a.copy() for n, a in V.items()}, 2
    Wr = {n: a.copy() for n, a in W.items()}
    assert ref.step(Wr, G, 3e-3) == pytest.approx(norm, rel=1e-12) and norm > 1
    for n in W:
        step, ref_step = P[n] - W[n], Wr[n] - W[n]
        assert np.abs(step - ref_step).max() <= 1e-12 * np.abs(ref_step).max(), n
        assert np.abs(opt.m[n] - ref.m[n]).max() <= 1e-12 * np.abs(ref.m[n]).max(), n


def test_muon_orthogonalises_each_block_matrix_and_nothing_else():
    """Each block matrix moves by lr_muon * max(1, rows/cols)^0.5 times a matrix whose singular values lie in
    Newton-Schulz's band around 1 (0.6 .. 1.2 after 5 steps), though its momentum's are ~1e-5: not if the
    orthogonalisation were skipped, nor if q|k|v or w1|w3 went through it as one matrix (each block's share of
    an orthogonal stack has singular values below 1). The embedding, the heads and the norm weights move by
    AdamW's step, which is not orthogonal."""
    W, G, M, V = _muon_step_inputs(1)
    rng = np.random.default_rng(2)
    for n, g in G.items():                  # no clipping; each block matrix's gradient of singular values 1e-4 .. 5e-4
        if n.startswith("layers.") and g.ndim == 2:
            U, _, Vt = np.linalg.svd(rng.standard_normal(g.shape), full_matrices=False)
            G[n] = U * rng.uniform(1e-4, 5e-4, min(g.shape)) @ Vt
            M[n] = np.zeros_like(g)         # the Nesterov mix 0.05 g + 0.95 (0.05 g) keeps them so
        else:
            G[n] = g * 1e-3
    lr, ratio = 1e-3, 10.0
    P, _, _ = _engine_muon_step(W, G, M, V, lr, ratio)
    for n in W:
        step = W[n] - P[n]
        if n.startswith("layers.") and W[n].ndim == 2:
            rows, cols = W[n].shape
            sv = np.linalg.svd(step / (lr * ratio * max(1.0, rows / cols) ** 0.5), compute_uv=False)
            assert 0.6 < sv.min() and sv.max() < 1.2, (n, sv.min(), sv.max())
        else:
            m = 0.9 * M[n] + 0.1 * G[n]
            v = 0.95 * V[n] + 0.05 * G[n] ** 2
            want = lr * (m / (1 - 0.9 ** 3)) / (np.sqrt(v / (1 - 0.95 ** 3)) + 1e-8) + lr * 0.1 * (W[n].ndim == 2) * W[n]
            assert np.abs(step - want).max() <= 1e-9 * np.abs(want).max(), n     # p - (p - step): p's rounding


# ====================================================================================================
# schedule and init

def test_schedule_at_interior_points():
    """Warm-up 100, total 1000, peak 1: hand-computed values, the cosine's quarter points included."""
    expected = {0: 0.01, 49: 0.5, 99: 1.0, 100: 1.0, 325: 0.1 + 0.45 * (1 + math.sqrt(0.5)), 550: 0.55,
                775: 0.1 + 0.45 * (1 - math.sqrt(0.5)), 1000: 0.1, 3000: 0.1}
    for step, lr in expected.items():
        assert pl.lr_at(step, 1000, 1.0, 100) == pytest.approx(lr, rel=1e-12), step
        assert ref_lr(step, 1000, 1.0, 100) == pytest.approx(lr, rel=1e-12), step
    assert pl.lr_at(325, 1000, 3e-3, 100) == pytest.approx(3e-3 * 0.8681980515339464, rel=1e-12)
    assert pl.lr_at(0, 100, 2.0, 0) == 2.0 and pl.lr_at(50, 100, 2.0, 0) == pytest.approx(1.1, rel=1e-12)


def test_init_follows_spec():
    """N(0, 0.02) for matrices and tok_emb, N(0, 0.02/sqrt(2L)) for wo and w2, norms 1 (small config)."""
    cfg = pl.CONFIGS["small"]
    P = pl.Params.init(cfg, 0)
    for name, v in P.items():
        if v.ndim == 1:
            assert np.all(v == 1.0), name
            continue
        std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith((".wo", ".w2")) else 0.02
        assert abs(v.std() / std - 1) < 0.04 and abs(v.mean()) < 0.1 * std, name


def test_decay_mask_and_optimiser_defaults_follow_spec():
    P = pl.Params(TINY)
    mask = pl.Params(TINY, np.float32, pl.decay_mask(TINY))
    for name, v in mask.items():
        assert np.all(v == (0.0 if P[name].ndim == 1 else 1.0)), name
    opt = ne.AdamW(P, 1e-3)
    assert (opt.beta1, opt.beta2, opt.eps, opt.wd, opt.clip) == (0.9, 0.95, 1e-8, 0.1, 1.0)
    assert TINY.mtp_weight == 0.3


# ====================================================================================================
# data and SFT

def test_batches_shift_by_one_and_splits_are_disjoint():
    tokens = np.arange(1000, dtype=np.uint16)                 # token i at position i: windows show themselves
    train, val = pl.Batches(tokens, 4, 10, seed=3), pl.Batches(tokens, 4, 10, seed=3, split="val")
    for _ in range(50):
        x, y = train.next()
        assert x.shape == y.shape == (4, 10) and x.dtype == np.int32
        assert np.all(y == x + 1) and np.all(np.diff(x, axis=1) == 1)
        assert x.min() >= 0 and y.max() < 900                  # the first 90% trains
        x, y = val.next()
        assert np.all(y == x + 1) and x.min() >= 900 and y.max() < 1000
    small = pl.Batches(np.arange(100, dtype=np.uint16), 8, 20, split="val")   # validation gets at least T+2
    assert small.next()[0].min() >= 78
    short = pl.Batches(np.arange(100, dtype=np.uint16), 4, 10)  # trains on tokens 0..87: 78 window starts
    assert 87 in {int(short.next()[1].max()) for _ in range(400)}   # the split's last token is a target too


def test_validation_reads_the_validation_split():
    tokens = np.arange(1000, dtype=np.uint16)
    seen = []

    def batch_loss(x, y):
        seen.append((x, y))
        return 2.0
    loss, bpb = pl.validation_loss(batch_loss, tokens, 2, 8, 5, 4.0)
    assert len(seen) == 5 and all(x.min() >= 900 and np.all(y == x + 1) for x, y in seen)
    assert loss == 2.0 and bpb == pytest.approx(2.0 / math.log(2) / 4.0, rel=1e-12)


def test_bytes_per_token_counts_utf8_bytes():
    """Bits per byte divide by UTF-8 bytes, not characters: 'é' is 2 bytes, its id 256 one token."""
    tok = bpe.Tokenizer([(0xC3, 0xA9)])
    assert pl.bytes_per_token(tok, np.array([256, 256, 97, 32], np.uint16)) == 6 / 4


PROMPT = ("Below is an instruction that describes a task.\n"
          "Write a response that appropriately completes the request.\n\n"
          "### Instruction:\nName a colour.\n\n"
          "### Response:\n")
PROMPT_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context.\n"
                     "Write a response that appropriately completes the request.\n\n"
                     "### Instruction:\nAdd the numbers.\n\n"
                     "### Input:\n2 3\n\n"
                     "### Response:\n")


def test_chat_template_is_spec_text():
    assert pl.format_prompt("Name a colour.") == PROMPT
    assert pl.format_prompt("Add the numbers.", "2 3") == PROMPT_WITH_INPUT


def test_sft_batches_pad_with_eot_and_ignore_padding_and_prompt():
    tok = bpe.Tokenizer([])                                    # one id per byte: expectations by hand
    examples = [{"instruction": "Name a colour.", "output": "red"},
                {"instruction": "Add the numbers.", "input": "2 3", "output": "5"}]
    rows = []
    for prompt, answer in ((PROMPT, b"red"), (PROMPT_WITH_INPUT, b"5")):
        seq = list(prompt.encode()) + list(answer) + [256]
        rows.append((seq[:-1], [-1] * (len(prompt) - 1) + list(answer) + [256]))
    batches = pl.SFTBatches(tok, examples, 3, 256, fixed=True)
    x, y = batches.batch([0, 1])
    assert x.shape == y.shape == (3, 256)
    for r, (ids, targets) in enumerate(rows):
        assert x[r, :len(ids)].tolist() == ids and y[r, :len(ids)].tolist() == targets
        assert np.all(x[r, len(ids):] == 256) and np.all(y[r, len(ids):] == -1)
    assert np.all(x[2] == 256) and np.all(y[2] == -1)          # a row no example fills
    x, y = pl.SFTBatches(tok, examples, 2, 256).batch([1, 0])  # padded to the longest only
    assert x.shape == (2, len(rows[1][0])) and y[1].tolist() == rows[0][1] + [-1] * (x.shape[1] - len(rows[0][0]))
    T = len(PROMPT) + 1                                        # room for the prompt and 'r': cut, not padded
    x, y = pl.SFTBatches(tok, examples[:1], 1, T, fixed=True).batch([0])
    assert x[0].tolist() == rows[0][0][:T] and y[0].tolist() == rows[0][1][:T] and y[0, -2:].tolist() == [114, 101]


def test_chat_stops_at_endoftext(monkeypatch, capsys):
    """The answer ends at <|endoftext|>: nothing after it is drawn or printed. Each turn reaches the next
    closed by <|endoftext|>, also one that max_new cut short (the second: it never says it)."""
    tok = bpe.Tokenizer([])
    seen, drawn = [], []

    def generate(ids, n):
        seen.append(list(ids))
        answer = tok.encode(" blue") + ([tok.eot] + tok.encode("LEAK") if len(seen) != 2 else [])
        for t in answer:
            drawn.append(t)
            yield t
    monkeypatch.setattr(sys, "stdin", io.StringIO("Name a colour.\nAgain.\nMore.\n"))
    pl.chat_repl(tok, generate, True, 50, 1024)
    out = capsys.readouterr().out
    assert "> Name a colour.\n blue\n> Again.\n blue\n> More.\n blue\n" in out and "LEAK" not in out
    assert "endoftext" not in out and tok.encode("L")[0] not in drawn
    turn = lambda line: tok.encode(pl.format_prompt(line)) + tok.encode(" blue") + [tok.eot]
    assert tok.encode(pl.format_prompt("Name a colour.")) == tok.encode(PROMPT)
    assert seen[1] == turn("Name a colour.") + tok.encode(pl.format_prompt("Again."))
    assert seen[2] == turn("Name a colour.") + turn("Again.") + tok.encode(pl.format_prompt("More."))


# ====================================================================================================
# sampling: pipeline.sample_token's distribution, with fixed seeds; chi-square bounds at p = 0.001

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
CHI2_999 = {2: 13.816, 7: 24.322}


def draw(n, temperature, top_k, seed=0):
    rng = np.random.default_rng(seed)
    return np.bincount([pl.sample_token(LOGITS, temperature, top_k, rng) for _ in range(n)], minlength=len(LOGITS))


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def chi2(counts, p):
    keep = p > 0
    assert counts[~keep].sum() == 0                            # nothing drawn outside the support
    expected = counts.sum() * p[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum())


def test_greedy_and_top_1_are_argmax():
    assert draw(200, 0.0, 40).tolist() == [200] + [0] * 7
    for temperature in (0.7, 1.0, 5.0):
        assert draw(200, temperature, 1)[0] == 200


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_sampling_frequencies_match_softmax(temperature):
    counts = draw(20000, temperature, 0)
    assert chi2(counts, softmax(LOGITS / temperature)) < CHI2_999[7]


def test_top_k_samples_only_the_k_likeliest_in_their_proportions():
    counts = draw(20000, 1.0, 3)
    p = np.where(np.isin(np.arange(8), [0, 6, 1]), softmax(LOGITS), 0.0)   # logits 2.0, 1.5, 1.0
    assert chi2(counts, p / p.sum()) < CHI2_999[2]
    assert draw(5000, 1.0, 8).min() > 0                        # k >= vocabulary: every id can come


def test_draw_inverts_the_cumulative_sum():
    """pl.draw's id is the inverse of the cumulative sum at the generator's uniform, as searchsorted finds
    it, zeros and ties included."""
    rng = np.random.default_rng(0)
    for V in (2, 8, 300, 4096):
        p = rng.random((9, V)) ** 4
        p[:, rng.random(V) < 0.5] = 0.0                         # ids that can never come
        p[3] = 0.0
        p[3, V // 2] = 1.0                                      # a one-hot row
        p /= np.maximum(p.sum(axis=1, keepdims=True), 1e-300)
        for seed in range(20):
            for i, row in enumerate(p):
                c = np.cumsum(row)
                point = np.random.default_rng((seed, i)).random() * c[-1]
                want = min(int(np.searchsorted(c, point, side="right")), V - 1)
                assert pl.draw(row, np.random.default_rng((seed, i))) == want


def test_low_temperature_concentrates():
    shares = [draw(4000, t, 0)[0] / 4000 for t in (2.0, 1.0, 0.3, 0.05)]
    assert shares == sorted(shares) and shares[-1] > 0.999 and shares[0] < 0.3


# ====================================================================================================
# checkpoints: atomic writes, and everything resuming needs

def test_a_failing_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    tok, path = bpe.Tokenizer([]), tmp_path / "ckpt.npz"
    P = pl.Params.init(TINY, 0)
    pl.save_checkpoint(str(path), P, tok)
    before = path.read_bytes()

    def disk_full(f, **arrays):
        f.write(b"PK\x03\x04" + bytes(4096))                   # half a file, then the disk is full
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(np, "savez", disk_full)
    with pytest.raises(OSError):
        pl.save_checkpoint(str(path), pl.Params.init(TINY, 1), tok)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ckpt.npz"]   # no temporary file left
    monkeypatch.undo()
    assert np.array_equal(pl.load_checkpoint(str(path))[0].flat, P.flat)


KILL_MID_WRITE = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
import numpy.lib.format as fmt, bpe, pipeline as pl
write_array, calls = fmt.write_array, []
def dying(*args, **kw):             # the process dies in the middle of np.savez: some arrays written
    calls.append(1)
    if len(calls) == 6:
        os.kill(os.getpid(), signal.SIGKILL)
    return write_array(*args, **kw)
fmt.write_array = dying
pl.save_checkpoint(sys.argv[1], pl.Params.init(pl.CONFIGS["tiny"], 1), bpe.Tokenizer([]))
"""


def test_a_process_killed_mid_write_keeps_the_previous_checkpoint(tmp_path):
    tok, path = bpe.Tokenizer([]), tmp_path / "ckpt.npz"
    P = pl.Params.init(TINY, 0)
    pl.save_checkpoint(str(path), P, tok)
    before = path.read_bytes()
    r = subprocess.run([sys.executable, "-c", KILL_MID_WRITE, str(path), str(ROOT)], capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr
    partial = [f for f in os.listdir(tmp_path) if f != "ckpt.npz"]
    # killed, nothing can clean up: the half-written file is a *.tmp (git-ignored), never the checkpoint
    assert len(partial) == 1 and partial[0].endswith(".tmp") and (tmp_path / partial[0]).stat().st_size > 0
    assert path.read_bytes() == before
    assert np.array_equal(pl.load_checkpoint(str(path))[0].flat, P.flat)


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_checkpoint_round_trip_resumes_the_same_run(tmp_path, optim):
    """Weights, both Adam moments (under Muon: the matrices' momentum in adam_m), the step and the data position
    come back exactly, so a Trainer and Batches built from the file (with another seed) continue as the original
    would; a resume that names the other optimiser is refused."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 257, 3000).astype(np.uint16)
    P = pl.Params.init(TINY, 0)
    run = {"steps": 6, "config": "tiny", "optim": optim, "lr": 1e-3, "muon_lr": 0.02}
    trainer, batches = ne.Trainer(P, None, run), pl.Batches(tokens, 2, 16, seed=5)
    assert isinstance(trainer.opt, ne.Muon) == (optim == "muon")
    for s in range(3):
        trainer.step(*batches.next(), 1e-3 * (s + 1))
    path = str(tmp_path / "ckpt.npz")
    pl.save_checkpoint(path, P, bpe.Tokenizer([]), {"step": 3, "adam_m": trainer.opt.m, "adam_v": trainer.opt.v,
                                                    "data": batches.state(), "train": run})
    P2, _, state, _ = pl.load_checkpoint(path, want_state=True)
    assert np.array_equal(P2.flat, P.flat) and state["step"] == 3 and state["train"] == run
    assert np.array_equal(state["adam_m"].flat, trainer.opt.m.flat) and np.abs(state["adam_m"].flat).max() > 0
    assert np.array_equal(state["adam_v"].flat, trainer.opt.v.flat) and not np.array_equal(
        state["adam_v"].flat, state["adam_m"].flat ** 2)
    p = pl.Parser()
    pl.add_train_flags(p, "out", pl.TRAIN_DEFAULTS)
    other = p.parse_args(["--out", str(tmp_path), "--optim", {"adamw": "muon", "muon": "adamw"}[optim]])
    with pytest.raises(pl.UserError, match=f"trains with {optim}"):
        pl.start_run(other, pl.TRAIN_DEFAULTS, resume=True)
    resumed, batches2 = ne.Trainer(P2, state, state["train"]), pl.Batches(tokens, 2, 16, seed=99)
    batches2.set_state(state["data"])
    for s in range(3, 6):
        x, y = batches.next()
        x2, y2 = batches2.next()
        assert np.array_equal(x, x2) and np.array_equal(y, y2)
        trainer.step(x, y, 1e-3 * (s + 1))
        resumed.step(x2, y2, 1e-3 * (s + 1))
    assert np.array_equal(P.flat, P2.flat) and np.array_equal(trainer.opt.v.flat, resumed.opt.v.flat)
    assert np.array_equal(trainer.opt.m.flat, resumed.opt.m.flat)


# ====================================================================================================
# tokenizer: decoded text is always valid Unicode (the surrogate bug of issue 11)

BYTES = bpe.Tokenizer([])


def test_streamed_samples_print_whatever_the_bytes(capsys):
    """sample streams ids as their characters complete; invalid bytes print as U+FFFD, a cut character whole."""
    ids = [0xED, 0xAF, 0xBB, 104] + list("é".encode()) + [0xE6]
    assert pl.stream(BYTES, iter(ids), "> ") == 7
    assert capsys.readouterr().out == "> \ufffd\ufffd\ufffdhé\ufffd\n"


def test_decoded_surrogate_bytes_print():
    """ED AF BB spells a UTF-16 surrogate, which is not text: it decodes to U+FFFD and prints."""
    assert BYTES.decode([0xED, 0xAF, 0xBB]) == "\ufffd" * 3
    r = subprocess.run([sys.executable, "-c", "import bpe; print(bpe.Tokenizer([]).decode([0xED, 0xAF, 0xBB]))"],
                       cwd=ROOT, capture_output=True, env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    assert r.returncode == 0 and r.stdout == "\ufffd\ufffd\ufffd\n".encode(), r.stderr


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(st.integers(0, 255), max_size=40))
def test_byte_ids_decode_as_utf8_with_replacement(ids):
    assert BYTES.decode(ids) == bytes(ids).decode("utf-8", "replace")


TRAINED = bpe.Tokenizer.train("naïve café 東京 😀 the theory " * 20, 300)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(st.one_of(st.integers(0, 255), st.integers(0xC0, 0xFF), st.integers(-3, 310)), max_size=40))
def test_any_ids_decode_to_printable_text(ids):
    text = TRAINED.decode(ids)
    assert text.encode("utf-8").decode("utf-8") == text
    assert text == TRAINED.decode_bytes(ids).decode("utf-8", "replace")

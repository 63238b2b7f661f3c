"""
gradcheck.py -- every hand-written backward of nanoeuler.py against central finite differences in float64.

    python gradcheck.py          # the whole model: every parameter tensor and the path into the embeddings
    python gradcheck.py ops      # each op alone, so that a failure names the op
    python gradcheck.py dpo      # the DPO loss (CONTRACT.md) through the whole model
    python gradcheck.py all      # all three (make check)

Relative error of one entry: |analytic - numeric| / max(|analytic|, |numeric|, 1e-6); a tensor's error is
the largest over its checked entries (all of them for small tensors, a random sample for large ones).
In float64 a right backward lands near 1e-7; a dropped term lands near 1.
"""
import sys
import time

import numpy as np

import nanoeuler as ne
import pipeline as pl

TOL = 1e-2
H = 1e-4            # central-difference step: truncation error ~H^2, rounding ~1e-16/H
SAMPLES = 24        # entries checked per large tensor


def rel_err(analytic, numeric):
    return float(np.max(np.abs(analytic - numeric) / np.maximum(np.maximum(np.abs(analytic), np.abs(numeric)), 1e-6)))


def numeric_grad(f, x, entries):
    """Central differences of the scalar f() with respect to the listed flat entries of x (changed in place)."""
    flat = x.reshape(-1)
    out = np.empty(len(entries))
    for j, i in enumerate(entries):
        old = flat[i]
        flat[i] = old + H
        fp = f()
        flat[i] = old - H
        fm = f()
        flat[i] = old
        out[j] = (fp - fm) / (2 * H)
    return out


def pick(size, rng, n=SAMPLES):
    return np.arange(size) if size <= n else rng.choice(size, n, replace=False)


# ----------------------------------------------------------------------------------------------------
# whole model

def check_model(cfg=None, B=2, T=16, seed=0):
    """-> [(tensor name, max rel err)] for every parameter tensor, plus 'tok_emb (unused rows)' which must
    get an exactly zero gradient."""
    P, idx, targets, rng = _model_case(cfg, B, T, seed)
    _, _, G = ne.loss_and_grads(P, idx, targets)
    return check_tensors(P, G, lambda: ne.forward_loss(P, idx, targets)[0], idx, rng)


def check_dpo(cfg=None, B=2, T=16, seed=0, beta=0.5, samples=SAMPLES):
    """The DPO loss of B pairs through the whole model: ne.dpo_loss_and_grads against central differences of
    pl.dpo_loss over ne.seq_logps; -> [(tensor name, max rel err)] as check_model."""
    P, idx, targets, rng = _model_case(cfg, 2 * B, T, seed)        # rows [:B] chosen answers, [B:] rejected
    targets[:, :4] = -1                                            # the prompt
    ref = ne.seq_logps(P, idx, targets) + rng.normal(0.0, 3.0, 2 * B)   # pairs away from z = 0, each its own sigmoid
    _, G = ne.dpo_loss_and_grads(P, idx, targets, ref, beta)
    return check_tensors(P, G, lambda: pl.dpo_loss(ne.seq_logps(P, idx, targets), ref, beta)[0], idx, rng, samples)


def _model_case(cfg, B, T, seed):
    """A float64 model of cfg (default tiny) with random ids and targets, some targets masked (-1)."""
    cfg = cfg or pl.CONFIGS["tiny"]
    rng = np.random.default_rng(seed)
    P = pl.Params.init(cfg, seed, np.float64)
    for name, view in P.items():                   # norm weights away from 1, so their gradient paths matter
        if view.ndim == 1:
            view[:] = 1.0 + 0.3 * rng.standard_normal(view.shape)
    idx = rng.integers(0, cfg.vocab, (B, T)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab, (B, T)).astype(np.int32)
    targets[0, :3] = -1                            # masked positions, as SFT prompts and padding
    targets[1, T // 2] = -1
    return P, idx, targets, rng


def check_tensors(P, G, f, idx, rng, samples=SAMPLES):
    """The gradient G of the scalar f() against central differences, tensor by tensor (see check_model), at
    `samples` entries of each large tensor."""
    cfg = P.cfg
    results = []
    for name, view in P.items():
        if name == "tok_emb":                      # the path into the embeddings: rows of tokens in idx
            used = np.unique(idx)
            entries = (used[rng.integers(0, len(used), samples)] * cfg.dim + rng.integers(0, cfg.dim, samples))
            unused = np.setdiff1d(np.arange(cfg.vocab), used)
            results.append(("tok_emb (unused rows)", float(np.abs(G[name][unused]).max())))
        else:
            entries = pick(view.size, rng, samples)
        results.append((name, rel_err(G[name].reshape(-1)[entries], numeric_grad(f, view, entries))))
    return results


# ----------------------------------------------------------------------------------------------------
# each op alone: loss = sum(out * R) for a fixed random R, so d loss / d out = R

def _op_cases(rng):
    B, T, Hq, Hkv, hd, D = 2, 8, 4, 2, 8, 12
    N = B * T
    r = lambda *s: rng.standard_normal(s)
    pos = np.tile(np.arange(T, dtype=np.int32), B)
    cos, sin = pl.rope_tables(T, hd, np.float64)

    def rmsnorm(x, w):
        R = r(N, D)
        y, rstd = ne.rmsnorm_forward(x, w)
        dx, dw = np.zeros_like(x), np.zeros_like(w)
        ne.rmsnorm_backward(R, x, w, rstd, dx, dw)
        return (lambda: float((ne.rmsnorm_forward(x, w)[0] * R).sum())), {"x": dx, "w": dw}

    def rope(u):
        R = r(N, Hq, hd)
        return (lambda: float((ne.rope_forward(u, pos, cos, sin) * R).sum())), {"u": ne.rope_backward(R, pos, cos, sin)}

    def attention(q, k, v):                        # 3 query chunks, so the causal blocking is checked too
        R = r(N, Hq, hd)
        _, cache = ne.attention_forward(q, k, v, B, T, n_chunks=3)
        dq, dk, dv = ne.attention_backward(R, cache, B, T)
        f = lambda: float((ne.attention_forward(q, k, v, B, T, n_chunks=3)[0] * R).sum())
        return f, {"q": dq, "k": dk, "v": dv}

    def swiglu(gu):
        R = r(N, D)
        return (lambda: float((ne.swiglu_forward(gu) * R).sum())), {"gu": ne.swiglu_backward(R, gu)}

    def embedding(tok_emb):
        R, idx = r(N, D), rng.integers(0, 20, N).astype(np.int32)
        d = np.zeros_like(tok_emb)
        ne.embedding_backward(R, idx, d)
        return (lambda: float((ne.embedding_forward(tok_emb, idx) * R).sum())), {"tok_emb": d}

    def xent(logits, n_mtp, weight):
        targets = rng.integers(0, logits.shape[1] // n_mtp, (B, T)).astype(np.int32)
        targets[0, :3] = -1
        f = lambda: ne.mtp_loss(logits.copy(), targets, n_mtp, weight, want_grad=False)[0]
        g = logits.copy()
        ne.mtp_loss(g, targets, n_mtp, weight, want_grad=True)
        return f, {"logits": g}

    return {
        "rmsnorm": (rmsnorm, {"x": r(N, D), "w": 1 + 0.3 * r(D)}),
        "rope": (rope, {"u": r(N, Hq, hd)}),
        "attention": (attention, {"q": r(N, Hq, hd), "k": r(N, Hkv, hd), "v": r(N, Hkv, hd)}),
        "swiglu": (swiglu, {"gu": r(N, 2 * D)}),
        "embedding": (embedding, {"tok_emb": r(20, D)}),
        "cross_entropy": (lambda logits: xent(logits, 1, 0.0), {"logits": 2 * r(N, 11)}),
        "mtp": (lambda logits: xent(logits, 3, 0.3), {"logits": 2 * r(N, 3 * 11)}),
    }


def check_ops(ops=None, seed=0):
    """-> [(op.input, max rel err)] for each op's backward alone."""
    rng = np.random.default_rng(seed)
    results = []
    for op, (build, inputs) in _op_cases(rng).items():
        if ops and op not in ops:
            continue
        f, grads = build(**inputs)
        for name, x in inputs.items():
            entries = pick(x.size, rng, 64)
            results.append((f"{op}.{name}", rel_err(grads[name].reshape(-1)[entries], numeric_grad(f, x, entries))))
    return results


# ----------------------------------------------------------------------------------------------------

def report(title, results):
    print(f"== {title}")
    for name, err in results:
        print(f"{name:28s}: max rel err {err:.2e}")
    worst = max(results, key=lambda r: r[1])
    print(f"overall max rel err {worst[1]:.2e} ({worst[0]})")
    return worst


def check(mode, argv):
    """One mode: the checks it names; -> 1 when a backward fails (its exit status), None when all pass."""
    pl.Parser(prog=f"gradcheck.py {mode}", description=MODES[mode][0]).parse_args(argv)   # --help; no flags
    t0 = time.time()
    worst = ("", 0.0)
    if mode in ("ops", "all"):
        worst = max(worst, report("each op alone (float64)", check_ops()), key=lambda r: r[1])
    if mode in ("model", "all"):
        cfg = pl.CONFIGS["tiny"]
        worst = max(worst, report(f"whole model (float64), {cfg}", check_model(cfg)), key=lambda r: r[1])
    if mode in ("dpo", "all"):
        worst = max(worst, report("DPO loss, whole model (float64), beta 0.5", check_dpo()), key=lambda r: r[1])
    if worst[1] >= TOL:
        print(f">>> backward FAIL: {worst[0]} max rel err {worst[1]:.2e} (>= {TOL:g})")
        return 1
    print(f">>> backward OK (error < {TOL:g}; worst {worst[1]:.2e} in {worst[0]}; {time.time() - t0:.1f} s)")


MODES = {mode: (text, lambda argv, mode=mode: check(mode, argv)) for mode, text in (
    ("model", "the whole model: every parameter tensor and the path into the embeddings (the mode run without one)"),
    ("ops", "each op alone, so that a failure names the op"),
    ("dpo", "the DPO loss (CONTRACT.md) through the whole model"),
    ("all", "the three (make check)"))}


def main(argv=None):
    """As the engines' modes (pl.run_main): 0 when every check passes, 1 for a failed check or a mistake (one
    error line), 130 for Ctrl-C."""
    return pl.run_main("gradcheck.py", "\n\n".join(__doc__.strip().split("\n\n")[::2]), MODES, {"": "model"},
                       sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())

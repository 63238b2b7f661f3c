"""
nanoeuler.py -- a GPT-class language model trained from scratch on the CPU.

The CPU engine and the reference of the project: every forward and backward pass is written by hand
(numpy for the big matrix products, Numba for everything else), checked in float64 by gradcheck.py; the
GPU engine (nanoeuler_cuda.py) is checked against it. The model is the one of CONTRACT.md: a decoder-only
transformer whose residual stream is integrated by forward-Euler steps x = x + f(x), with RMSNorm, RoPE,
grouped-query attention, SwiGLU and multi-token-prediction (MTP) heads. What both engines share (configs,
parameter layout, data, checkpoints, the training loop, the flags) is in pipeline.py.

Sections: CPU set-up | exp and sigmoid | layers (forward next to backward) | model | optimiser |
sampling | trainer | modes | main.
"""
import ctypes
import functools
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import pipeline as pl
from pipeline import RMS_EPS, Params, mtp_objective, mtp_scales, mtp_targets, rope_tables

try:
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic, overload
    from threadpoolctl import threadpool_limits
except ImportError as e:  # one clear line (pipeline prints a UserError raised at import that way)
    raise pl.UserError(f"{e.name} is not installed (pip install -r requirements.txt)") from None

# ----------------------------------------------------------------------------------------------------
# CPU set-up. How the CPU is used (each measured on 2 cores, small model, B=8, T=256):
# - Threads: a batch is cut into one shard of rows per core, and one thread runs the whole forward and
#   backward of its shard, with a BLAS held to one thread and serial Numba kernels that release the GIL.
#   No pool hands work to another between ops (119 ms per step against 169 with BLAS and Numba each
#   parallel inside every op). NANOEULER_THREADS overrides the number of threads.
# - Memory: glibc hands big freed blocks back to the OS at once, and every step then faults its fresh
#   activation pages back in (17% of a step). mallopt keeps blocks up to 32 MB and 1 GB of free heap.
# - Kernels: fastmath lets LLVM vectorise the reductions, and error_model="numpy" drops the zero-division
#   checks that kept it from vectorising any loop with a division (SwiGLU: 6x faster).
threadpool_limits(1, user_api="blas")
try:
    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallopt(-3, 32 << 20)                    # M_MMAP_THRESHOLD
    _libc.mallopt(-1, 1 << 30)                     # M_TRIM_THRESHOLD
except OSError:                                    # not glibc: nothing to tune
    pass
KERNEL_OPTIONS = dict(nogil=True, cache=True, fastmath=True, error_model="numpy")


@functools.cache
def n_threads():
    """NANOEULER_THREADS, or the usable cores."""
    value = os.environ.get("NANOEULER_THREADS", "")
    if value and not (value.isdigit() and int(value) > 0):
        raise pl.UserError(f"NANOEULER_THREADS={value!r} is not a positive whole number; unset it or give one")
    return int(value or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


# ----------------------------------------------------------------------------------------------------
# exp and sigmoid: the scalar exp of libm does not vectorise and dominated the float32 kernels. In float32, exp(x) is
# 2^n * 2^f with n = round(x log2 e) and 2^f, |f| <= 1/2, by its Taylor polynomial of degree 7 (relative
# error ~1e-7, float32 rounding); 2^n is built from its IEEE bits. In float64 (the gradient checks) it is
# the exact np.exp, so the checks see the true function.

@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose IEEE-754 bits are the int32 bits: 2^n for bits = (n + 127) << 23."""
    return types.float32(types.int32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.FloatType())


_EXP2_TAYLOR = [math.log(2) ** k / math.factorial(k) for k in range(8)]


def fexp(x):
    return math.exp(x)


@overload(fexp, jit_options=KERNEL_OPTIONS)
def _fexp(x):
    if x != types.float32:
        return lambda x: np.exp(x)
    c0, c1, c2, c3, c4, c5, c6, c7 = [np.float32(c) for c in _EXP2_TAYLOR]

    def exp32(x):
        t = min(max(x * np.float32(1.4426950408889634), np.float32(-126.0)), np.float32(126.0))
        n = np.floor(t + np.float32(0.5))
        f = t - n
        p = c0 + f * (c1 + f * (c2 + f * (c3 + f * (c4 + f * (c5 + f * (c6 + f * c7))))))
        return p * _float32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))   # a NaN x: p is NaN
    return exp32


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


@overload(sigmoid, jit_options=KERNEL_OPTIONS)
def _sigmoid(x):
    if x != types.float32:
        return lambda x: 1.0 / (1.0 + np.exp(-x))
    one = np.float32(1.0)                              # a float64 literal would turn the math to float64
    return lambda x: one / (one + fexp(-x))


# ----------------------------------------------------------------------------------------------------
# layers: each forward next to its backward. N = B*T rows; kernels work in the dtype they are given
# (float32 to train, float64 for the gradient check); reductions accumulate in float64.

# --- embedding ---

def embedding_forward(tok_emb, idx):
    return tok_emb[idx.reshape(-1)]                                # (N, D)


@njit(**KERNEL_OPTIONS)
def embedding_backward(dx, idx, dtok_emb):
    """dtok_emb[idx[n]] += dx[n]; serial, since two rows may hit the same token."""
    N, D = dx.shape
    for n in range(N):
        t = idx[n]
        for d in range(D):
            dtok_emb[t, d] += dx[n, d]


# --- RMSNorm: y = x / sqrt(mean(x^2) + eps) * w ---

@njit(**KERNEL_OPTIONS)
def _rmsnorm_fwd(x, w, y, rstd):
    N, D = x.shape
    for n in range(N):
        ss = 0.0
        for d in range(D):
            ss += x[n, d] * x[n, d]
        rstd[n] = 1.0 / np.sqrt(ss / D + RMS_EPS)
        r = rstd[n]                                    # in x's dtype, so the row below stays in it
        for d in range(D):
            y[n, d] = x[n, d] * r * w[d]


def rmsnorm_forward(x, w):
    y, rstd = np.empty_like(x), np.empty(x.shape[0], x.dtype)
    _rmsnorm_fwd(x, w, y, rstd)
    return y, rstd


@njit(**KERNEL_OPTIONS)
def rmsnorm_backward(dy, x, w, rstd, dx, dw):
    """dx += d/dx (accumulates into the residual gradient); dw = sum_n dy * x * rstd.
    With g = dy*w: dx = r*g - r^3 * x * mean(g*x)."""
    N, D = x.shape
    dw_sum = np.zeros(D)                                           # float64
    for n in range(N):
        r = rstd[n]
        gx = 0.0
        for d in range(D):
            gx += dy[n, d] * w[d] * x[n, d]
        c = r * r * r * gx / D
        for d in range(D):
            dx[n, d] += r * dy[n, d] * w[d] - c * x[n, d]
            dw_sum[d] += dy[n, d] * x[n, d] * r
    dw[:] = dw_sum


# --- RoPE, half-split: u'[i] = u[i] cos - u[i+h] sin, u'[i+h] = u[i+h] cos + u[i] sin ---

@njit(**KERNEL_OPTIONS)
def _rope(u, pos, cos, sin, sign):
    """Rotates u (N, H, hd) in place by +angle (forward) or -angle (backward: R^T = R(-a))."""
    N, H, hd = u.shape
    half = hd // 2
    for n in range(N):
        p = pos[n]
        for h in range(H):
            for i in range(half):
                c, s = cos[p, i], sign * sin[p, i]
                a, b = u[n, h, i], u[n, h, i + half]
                u[n, h, i] = a * c - b * s
                u[n, h, i + half] = b * c + a * s


def rope_forward(u, pos, cos, sin):
    u = np.ascontiguousarray(u).copy()
    _rope(u, pos, cos, sin, 1.0)
    return u


def rope_backward(du, pos, cos, sin):
    du = np.ascontiguousarray(du).copy()
    _rope(du, pos, cos, sin, -1.0)
    return du


# --- causal grouped-query attention ---
# Layout: the G = Hq/Hkv query heads that read one kv head are interleaved into one tall matrix,
# q (B, Hkv, T*G, hd) with row r = t*G + g, so the score products are plain batched GEMMs (numpy -> BLAS)
# with no copy of k or v per query head. Causality is used by blocks: the queries are cut into chunks of
# positions, and chunk c (positions t0 .. t1-1) is multiplied with the keys 0 .. t1-1 only. Chunks of 64
# positions skip (n-1)/2n of the score and value products for n chunks (T=256: 4 chunks, 7% faster
# training steps than 2); shorter chunks make the GEMMs too small to pay (measured).

@njit(**KERNEL_OPTIONS)
def _max(x, n):
    """max(x[:n]), n >= 1, as four running maxima: one chain of max() does not vectorise."""
    m0 = m1 = m2 = m3 = x[0]
    for j in range(0, n - n % 4, 4):
        m0, m1, m2, m3 = max(m0, x[j]), max(m1, x[j + 1]), max(m2, x[j + 2]), max(m3, x[j + 3])
    for j in range(n - n % 4, n):
        m0 = max(m0, x[j])
    return max(max(m0, m1), max(m2, m3))


@njit(**KERNEL_OPTIONS)
def _softmax(row, n, scale):
    """row[:n] unscaled scores -> softmax(scale * row[:n]) in place; row[n:] -> 0."""
    m = _max(row, n)
    for j in range(n):                                 # then the sum, apart: exp vectorises in the row's width
        row[j] = fexp((row[j] - m) * scale)
    z = 0.0
    for j in range(n):
        z += row[j]
    inv = 1.0 / z
    for j in range(n):
        row[j] *= inv
    row[n:] = 0.0


@njit(**KERNEL_OPTIONS)
def _causal_softmax(S, t0, G, scale):
    """S (B, Hkv, R, K) unscaled scores of the query rows of positions t0.. -> softmax(scale * S) in place.
    Row r is position t = t0 + r // G and sees keys 0..t (the rest become 0)."""
    B, H, R, _ = S.shape
    for b, h, r in np.ndindex(B, H, R):
        _softmax(S[b, h, r], t0 + r // G + 1, scale)


@njit(**KERNEL_OPTIONS)
def _softmax_backward(P, dP, scale, t0, G):
    """dP (probability gradient) -> score gradient in place: dS = P * (dP - sum_j P dP) * scale."""
    B, H, R, _ = P.shape
    for b, h, r in np.ndindex(B, H, R):
        p, d = P[b, h, r], dP[b, h, r]
        t = t0 + r // G
        s = 0.0
        for j in range(t + 1):
            s += p[j] * d[j]
        for j in range(t + 1):
            d[j] = p[j] * (d[j] - s) * scale
        d[t + 1:] = 0.0


def _to_groups(u, B, T, Hkv):
    """(N, Hkv*G, hd) -> (B, Hkv, T*G, hd), row t*G + g."""
    hd, G = u.shape[-1], u.shape[1] // Hkv
    return np.ascontiguousarray(u.reshape(B, T, Hkv, G * hd).transpose(0, 2, 1, 3)).reshape(B, Hkv, T * G, hd)


def _from_groups(ug, B, T):
    """(B, Hkv, T*G, hd) -> (N, Hkv*G, hd)."""
    Hkv, hd = ug.shape[1], ug.shape[-1]
    G = ug.shape[2] // T
    return np.ascontiguousarray(ug.reshape(B, Hkv, T, G * hd).transpose(0, 2, 1, 3)).reshape(B * T, Hkv * G, hd)


def attention_forward(q, k, v, B, T, n_chunks=None):
    """q (N, Hq, hd), k and v (N, Hkv, hd), already rotated -> out (N, Hq, hd), cache for backward.
    n_chunks: query chunks (default: chunks of 64 positions)."""
    Hkv, hd = k.shape[1], q.shape[2]
    G = q.shape[1] // Hkv
    qg, kg, vg = _to_groups(q, B, T, Hkv), _to_groups(k, B, T, Hkv), _to_groups(v, B, T, Hkv)
    out = np.empty_like(qg)
    C = -(-T // n_chunks) if n_chunks else 64                      # positions per chunk
    scale = qg.dtype.type(1.0 / math.sqrt(hd))                     # in the scores' dtype
    probs = []
    for t0 in range(0, T, C):
        t1 = min(T, t0 + C)
        P = np.matmul(qg[:, :, t0 * G:t1 * G], kg[:, :, :t1].transpose(0, 1, 3, 2))   # (B, Hkv, C*G, t1)
        _causal_softmax(P, t0, G, scale)
        np.matmul(P, vg[:, :, :t1], out=out[:, :, t0 * G:t1 * G])
        probs.append(P)
    return _from_groups(out, B, T), (qg, kg, vg, probs, C)


def attention_backward(dout, cache, B, T):
    qg, kg, vg, probs, C = cache
    hd, G = kg.shape[3], qg.shape[2] // T
    scale = qg.dtype.type(1.0 / math.sqrt(hd))
    dog = _to_groups(dout, B, T, kg.shape[1])                       # (B, Hkv, T*G, hd)
    dqg, dkg, dvg = np.empty_like(qg), np.zeros_like(kg), np.zeros_like(vg)
    for t0, P in zip(range(0, T, C), probs):
        t1 = min(T, t0 + C)
        rows = slice(t0 * G, t1 * G)
        dvg[:, :, :t1] += np.matmul(P.transpose(0, 1, 3, 2), dog[:, :, rows])   # sums over query heads
        dS = np.matmul(dog[:, :, rows], vg[:, :, :t1].transpose(0, 1, 3, 2))     # dP, then dS in place
        _softmax_backward(P, dS, scale, t0, G)
        np.matmul(dS, kg[:, :, :t1], out=dqg[:, :, rows])
        dkg[:, :, :t1] += np.matmul(dS.transpose(0, 1, 3, 2), qg[:, :, rows])
    return _from_groups(dqg, B, T), _from_groups(dkg, B, T), _from_groups(dvg, B, T)


# --- SwiGLU: act = silu(g) * u, with gu = [g | u] from one product against w1|w3 ---

@njit(**KERNEL_OPTIONS)
def swiglu_forward(gu):
    N, F2 = gu.shape
    F = F2 // 2
    act = np.empty((N, F), gu.dtype)
    for n in range(N):
        for f in range(F):
            g = gu[n, f]
            act[n, f] = g * sigmoid(g) * gu[n, F + f]
    return act


@njit(**KERNEL_OPTIONS)
def swiglu_backward(dact, gu):
    N, F = dact.shape
    dgu = np.empty((N, 2 * F), gu.dtype)
    for n in range(N):
        for f in range(F):
            g, u = gu[n, f], gu[n, F + f]
            sig = sigmoid(g)
            sg = sig * g
            dgu[n, f] = dact[n, f] * u * (sig + sg - sg * sig)             # silu'(g) = sig (1 + g (1 - sig))
            dgu[n, F + f] = dact[n, f] * sg
    return dgu


# --- cross-entropy with -1 targets ignored, over the n_mtp heads side by side in one logits buffer ---

@njit(**KERNEL_OPTIONS)
def _xent(logits, targets, scales, losses, want_grad):
    """logits (N, K*V): head k's logits of row n are logits[n, k*V:(k+1)*V]; targets (K, N), -1 ignored.
    losses[k, n] = -log softmax[target] (0 when ignored). With want_grad, each head's logits become
    scales[k] * (softmax - onehot), or 0 where ignored. One exp per logit: the softmax is built in place."""
    K, N = targets.shape
    V = logits.shape[1] // K
    for n in range(N):
        for k in range(K):
            row = logits[n, k * V:(k + 1) * V]
            t = targets[k, n]
            if t < 0:
                losses[k, n] = 0.0
                if want_grad:
                    row[:] = 0.0
                continue
            m = _max(row, V)
            if not want_grad:
                z = 0.0
                for v in range(V):
                    z += fexp(row[v] - m)
                losses[k, n] = m + np.log(z) - row[t]
                continue
            target_logit = row[t]
            z = 0.0
            for v in range(V):
                e = fexp(row[v] - m)
                row[v] = e
                z += e
            losses[k, n] = m + np.log(z) - target_logit
            c = scales[k] / z
            for v in range(V):
                row[v] *= c
            row[t] -= scales[k]


def mtp_loss(logits, targets, n_mtp, mtp_weight, want_grad=True, counts=None):
    """Cross-entropy of the MTP heads: head k at position t predicts targets[t+k].
    logits (N, n_mtp*V). Returns the objective CE_0 + mtp_weight * mean(CE_1..CE_{n-1}) and the per-head
    means; with want_grad the logits are replaced, in place, by d(objective)/d(logits). For a shard of a
    batch, counts are the whole batch's: the shards' objectives, means and gradients then add up to it."""
    tk = mtp_targets(targets, n_mtp).reshape(n_mtp, -1)
    counts, scales = mtp_scales(targets, n_mtp, mtp_weight, counts)
    losses = np.empty(tk.shape, np.float64)
    _xent(logits, tk, scales.astype(logits.dtype), losses, want_grad)
    ces = [float(losses[k].sum() / counts[k]) if counts[k] else 0.0 for k in range(n_mtp)]
    return mtp_objective(ces, mtp_weight), ces


# --- DPO: a sequence's log-prob under head 0, summed over its counted targets (CONTRACT.md "DPO") ---

def token_logp(z, t):
    """z (N, V) head-0 logits, t (N,) targets, -1 not counted -> (log softmax(z_n)[t_n], 0 where t_n < 0, (N,)
    float64; the log-sum-exp (N,) for the backward)."""
    m = z.max(1)
    lse = m + np.log(np.exp(z - m[:, None]).sum(1, dtype=np.float64))           # log-sum-exp, (N,) float64
    return np.where(t >= 0, z[np.arange(len(t)), np.maximum(t, 0)] - lse, 0.0), lse


def seq_logp_forward(logits, targets, V):
    """logits (N, n_mtp*V), head 0 in [:, :V]; targets (B, T), N = B*T, -1 not counted.
    -> (logp (B,) float64, the sum over t of log softmax(logits_t)[targets_t]; lse (N,) for the backward)."""
    logp, lse = token_logp(logits[:, :V], targets.reshape(-1))
    return logp.reshape(targets.shape).sum(1), lse


def seq_logp_backward(logits, targets, lse, dlogp, V):
    """In place, logits (N, n_mtp*V) -> d loss / d logits, from dlogp (B,) = d loss / d logp of each sequence:
    dlogp_b * (onehot(y_t) - softmax(logits_t)) on head 0 where y_t counts; 0 on the other heads and elsewhere."""
    t = targets.reshape(-1)
    g = np.where(t >= 0, np.repeat(dlogp, targets.shape[1]), 0.0).astype(logits.dtype)   # (N,)
    logits[:, :V] = -g[:, None] * np.exp(logits[:, :V] - lse[:, None].astype(logits.dtype))
    logits[:, V:] = 0.0
    n = np.flatnonzero(t >= 0)
    logits[n, t[n]] += g[n]


# ----------------------------------------------------------------------------------------------------
# model: forward saves what backward needs; backward writes the gradients into a Params of the same layout

def _dims(cfg):
    hd = cfg.head_dim
    return hd, cfg.n_heads * hd, cfg.n_kv_heads * hd              # hd, Cq = Hq*hd, Ck = Hkv*hd


def forward(P, idx, targets=None, want_grad=False, counts=None):
    """idx (B, T) int32. Without targets: returns head-0 logits of every position (N, V).
    With targets: returns (objective, per-head CE, acts); with want_grad the logits in acts hold dlogits.
    counts: the whole batch's target counts per head when idx is a shard of it (see mtp_loss)."""
    cfg = P.cfg
    B, T = idx.shape
    N = B * T
    hd, Cq, Ck = _dims(cfg)
    cos, sin = rope_tables(cfg.ctx, hd, P.flat.dtype)
    pos = np.tile(np.arange(T, dtype=np.int32), B)
    x = embedding_forward(P["tok_emb"], idx)
    layers = []
    for i in range(cfg.n_layers):
        L = f"layers.{i}."
        s = {"x_in": x}
        h, s["rstd1"] = rmsnorm_forward(x, P[L + "attn_norm"])
        qkv = h @ P.rows(L + "wq", L + "wv").T                       # (N, Cq + 2 Ck)
        q = rope_forward(qkv[:, :Cq].reshape(N, cfg.n_heads, hd), pos, cos, sin)
        k = rope_forward(qkv[:, Cq:Cq + Ck].reshape(N, cfg.n_kv_heads, hd), pos, cos, sin)
        v = np.ascontiguousarray(qkv[:, Cq + Ck:]).reshape(N, cfg.n_kv_heads, hd)
        a, s["att"] = attention_forward(q, k, v, B, T)
        a = a.reshape(N, Cq)
        x = x + a @ P[L + "wo"].T                                    # forward-Euler step 1
        s.update(h1=h, a=a, x_mid=x)
        h, s["rstd2"] = rmsnorm_forward(x, P[L + "ffn_norm"])
        gu = h @ P.rows(L + "w1", L + "w3").T                        # (N, 2F)
        act = swiglu_forward(gu)
        x = x + act @ P[L + "w2"].T                                  # forward-Euler step 2
        s.update(h2=h, gu=gu, act=act)
        layers.append(s)
    hf, rstd_f = rmsnorm_forward(x, P["norm"])
    if targets is None:
        return hf @ P["heads.0"].T
    logits = hf @ P.rows("heads.0", f"heads.{cfg.n_mtp - 1}").T      # (N, n_mtp*V), one GEMM for all heads
    objective, ces = mtp_loss(logits, targets, cfg.n_mtp, cfg.mtp_weight, want_grad, counts)
    acts = dict(idx=idx, B=B, T=T, pos=pos, cos=cos, sin=sin, layers=layers, x=x, hf=hf, rstd_f=rstd_f,
                dlogits=logits)
    return objective, ces, acts


def backward(P, acts, G):
    cfg = P.cfg
    B, T = acts["B"], acts["T"]
    N = B * T
    hd, Cq, Ck = _dims(cfg)
    last = f"heads.{cfg.n_mtp - 1}"
    dlogits, hf = acts["dlogits"], acts["hf"]
    np.matmul(dlogits.T, hf, out=G.rows("heads.0", last))
    dhf = dlogits @ P.rows("heads.0", last)
    dx = np.zeros_like(hf)                                           # gradient of the residual stream
    rmsnorm_backward(dhf, acts["x"], P["norm"], acts["rstd_f"], dx, G["norm"])
    pos, cos, sin = acts["pos"], acts["cos"], acts["sin"]
    for i in reversed(range(cfg.n_layers)):
        L, s = f"layers.{i}.", acts["layers"][i]
        # step 2: x = x + swiglu(h2) @ w2.T
        np.matmul(dx.T, s["act"], out=G[L + "w2"])
        dgu = swiglu_backward(dx @ P[L + "w2"], s["gu"])
        np.matmul(dgu.T, s["h2"], out=G.rows(L + "w1", L + "w3"))
        rmsnorm_backward(dgu @ P.rows(L + "w1", L + "w3"), s["x_mid"], P[L + "ffn_norm"], s["rstd2"],
                         dx, G[L + "ffn_norm"])
        # step 1: x = x + attention(h1) @ wo.T
        np.matmul(dx.T, s["a"], out=G[L + "wo"])
        da = (dx @ P[L + "wo"]).reshape(N, cfg.n_heads, hd)
        dq, dk, dv = attention_backward(da, s["att"], B, T)
        dqkv = np.concatenate([rope_backward(dq, pos, cos, sin).reshape(N, Cq),
                               rope_backward(dk, pos, cos, sin).reshape(N, Ck), dv.reshape(N, Ck)], axis=1)
        np.matmul(dqkv.T, s["h1"], out=G.rows(L + "wq", L + "wv"))
        rmsnorm_backward(dqkv @ P.rows(L + "wq", L + "wv"), s["x_in"], P[L + "attn_norm"], s["rstd1"],
                         dx, G[L + "attn_norm"])
    G["tok_emb"][:] = 0
    embedding_backward(dx, acts["idx"].reshape(-1), G["tok_emb"])


@functools.cache
def _thread_pool():
    return ThreadPoolExecutor(n_threads(), thread_name_prefix="nanoeuler")


os.register_at_fork(after_in_child=_thread_pool.cache_clear)   # (a fork has none of the pool's threads: serve's
                                                                # engine process would wait on them forever)


def per_part(fn, n):
    """[fn(i, part) for each part i of range(n)] (slices, in order), one part per thread (n_threads()):
    the shards of rows of a batch, or the parts of a flat buffer."""
    k = min(n, n_threads())
    parts = [slice(i * n // k, (i + 1) * n // k) for i in range(k)]
    rest = [_thread_pool().submit(fn, i, parts[i]) for i in range(1, k)]
    return [fn(0, parts[0])] + [f.result() for f in rest]      # part 0 on this thread, not waiting idle


def _batch_losses(cfg, shard_ces):
    """The batch's objective and per-head CE: the shards' partial means add up (mtp_loss)."""
    ces = [float(sum(c[k] for c in shard_ces)) for k in range(cfg.n_mtp)]
    return mtp_objective(ces, cfg.mtp_weight), ces


def loss_and_grads(P, idx, targets, grads=None):
    """(objective, per-head CE, gradient) of one batch. Each shard's gradient goes to its own buffer in the
    list grads (kept between steps by the caller; grown here as needed); they are summed into grads[0] in
    shard order, so the result does not depend on the timing of the threads."""
    grads = [] if grads is None else grads
    grads += [Params(P.cfg, P.flat.dtype) for _ in range(min(len(idx), n_threads()) - len(grads))]
    counts, _ = mtp_scales(targets, P.cfg.n_mtp, P.cfg.mtp_weight)

    def shard(i, rows):
        objective, ces, acts = forward(P, idx[rows], targets[rows], want_grad=True, counts=counts)
        if math.isfinite(objective):                 # a NaN step is dropped whole (Trainer.step)
            backward(P, acts, grads[i])
        return ces

    shard_ces = per_part(shard, len(idx))
    _sum_shards(grads, len(shard_ces))
    return (*_batch_losses(P.cfg, shard_ces), grads[0])


def _sum_shards(grads, k):
    """grads[0] += grads[1..k-1], in shard order, each thread adding up its part of the buffer."""
    def add(i, part):
        for G in grads[1:k]:
            grads[0].flat[part] += G.flat[part]

    if k > 1:
        per_part(add, grads[0].flat.size)


def forward_loss(P, idx, targets):
    """(objective, per-head CE) of one batch, no gradient."""
    counts, _ = mtp_scales(targets, P.cfg.n_mtp, P.cfg.mtp_weight)
    shard_ces = per_part(lambda i, rows: forward(P, idx[rows], targets[rows], counts=counts)[1], len(idx))
    return _batch_losses(P.cfg, shard_ces)


def seq_logp_acts(P, idx, targets):
    """idx, targets (B, T) -> (logp (B,) of each sequence under head 0, acts for backward, with the logits' lse).
    Targets all -1 make forward skip its cross-entropy, so acts["dlogits"] keeps the raw logits."""
    acts = forward(P, idx, np.full_like(targets, -1))[2]
    logp, acts["lse"] = seq_logp_forward(acts["dlogits"], targets, P.cfg.vocab)
    return logp, acts


def seq_logps(P, idx, targets):
    """(B,) float64 sequence log-probs of one batch, no gradient (DPO's reference and evaluation)."""
    return np.concatenate(per_part(lambda i, rows: seq_logp_acts(P, idx[rows], targets[rows])[0], len(idx)))


def dpo_loss_and_grads(P, idx, targets, ref, beta, grads=None):
    """(DPO loss, gradient) of a batch of pairs: idx, targets (2B, T), the chosen answers in rows [:B] and the
    rejected in [B:]; ref (2B,) their reference log-probs. A pair's two rows may lie in different shards, so
    each shard keeps its forward until pl.dpo_loss has given every row's d loss / d logp; then its backward.
    grads as in loss_and_grads."""
    grads = [] if grads is None else grads
    grads += [Params(P.cfg, P.flat.dtype) for _ in range(min(len(idx), n_threads()) - len(grads))]
    shards = per_part(lambda i, rows: seq_logp_acts(P, idx[rows], targets[rows]), len(idx))
    loss, dlogp = pl.dpo_loss(np.concatenate([logp for logp, _ in shards]), ref, beta)

    def shard(i, rows):
        acts = shards[i][1]
        seq_logp_backward(acts["dlogits"], targets[rows], acts["lse"], dlogp[rows], P.cfg.vocab)
        backward(P, acts, grads[i])

    if math.isfinite(loss):                          # a NaN step is dropped whole (DPOTrainer.step)
        per_part(shard, len(idx))
        _sum_shards(grads, len(shards))
    return loss, grads[0]


# ----------------------------------------------------------------------------------------------------
# optimiser: AdamW with decoupled weight decay on matrices and embeddings, global grad-norm clipping
# (the learning-rate schedule is pipeline.lr_at)

@njit(**KERNEL_OPTIONS)
def adamw_step(p, g, m, v, mask, lr, beta1, beta2, eps, wd, step, grad_scale):
    """One AdamW update over flat buffers (or a part of them); step counts from 1; grad_scale applies the
    clipping. p -= lr * (m / bc1) / (sqrt(v / bc2) + eps) + lr * wd * mask * p, with the constants in the
    buffers' dtype, so that the loop runs in it (a float64 loop over float32 buffers took twice as long)."""
    c = np.array((beta1, 1.0 - beta1, beta2, 1.0 - beta2, lr / (1.0 - beta1 ** step),
                  1.0 / math.sqrt(1.0 - beta2 ** step), eps, lr * wd, grad_scale)).astype(p.dtype)
    b1, one_b1, b2, one_b2, lr_bc1, inv_sqrt_bc2, eps_, lr_wd, scale = c
    for i in range(p.shape[0]):
        gi = g[i] * scale
        m[i] = b1 * m[i] + one_b1 * gi
        v[i] = b2 * v[i] + one_b2 * gi * gi
        p[i] -= lr_bc1 * m[i] / (np.sqrt(v[i]) * inv_sqrt_bc2 + eps_) + lr_wd * mask[i] * p[i]


@njit(**KERNEL_OPTIONS)
def _sum_squares(a):
    """sum(a^2), accumulated in float64."""
    s = 0.0
    for i in range(a.size):
        s += a[i] * a[i]
    return s


def grad_norm(G):
    """The global L2 norm, each thread summing its part of the buffer."""
    return math.sqrt(sum(per_part(lambda i, part: _sum_squares(G.flat[part]), G.flat.size)))


class AdamW:
    def __init__(self, P, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0):
        self.m, self.v = Params(P.cfg, P.flat.dtype), Params(P.cfg, P.flat.dtype)
        self.mask = pl.decay_mask(P.cfg, P.flat.dtype)
        self.lr, self.beta1, self.beta2, self.eps, self.wd, self.clip = lr, beta1, beta2, eps, weight_decay, clip
        self.step_count = 0

    def step(self, P, G, lr):
        """Clips the global gradient norm to self.clip and updates P in place; returns the norm."""
        norm = grad_norm(G)
        scale = min(1.0, self.clip / (norm + 1e-6))
        self.step_count += 1
        self.update(P, G, lr, scale)
        return norm

    def update(self, P, G, lr, scale, a=0, b=None):
        """The AdamW update of P.flat[a:b] (all of it by default), its elements split over the cores."""
        b = P.flat.size if b is None else b
        per_part(lambda i, part: adamw_step(P.flat[a:b][part], G.flat[a:b][part], self.m.flat[a:b][part],
                                            self.v.flat[a:b][part], self.mask[a:b][part], lr, self.beta1,
                                            self.beta2, self.eps, self.wd, self.step_count, scale), b - a)


def newton_schulz(U, steps=pl.MUON_NS_STEPS):
    """Muon's orthogonalisation of a matrix U, in U's dtype (float64 in the checks, float32 in training):
    X = U / (|U|_F + eps), then `steps` quintic iterations X <- a X + (b A + c A A) X with A = X X^T, on the
    wide orientation (a tall U is transposed, so A is min(rows, cols) square), as nanochat's muon.py and
    modded-nanogpt do (bf16 there and on this project's GPU; CONTRACT.md)."""
    a, b, c = pl.MUON_NS_COEFFS
    tall = U.shape[0] > U.shape[1]
    X = U.T if tall else U
    X = X / U.dtype.type(math.sqrt(_sum_squares(U.ravel())) + pl.MUON_NS_EPS)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.T if tall else X


class Muon(AdamW):
    """--optim muon: Muon on the blocks' matrices, AdamW (this class's parent: its clip of the whole gradient,
    moments and bias corrections) on the rest. A matrix's momentum buffer lives in self.m at the matrix's place
    (so the checkpoint's adam_m holds it; self.v stays 0 there). Per matrix (nanochat's muon.py):
    m <- mu m + (1 - mu) g; u = (1 - mu) g + mu m (Nesterov); p <- p - lr_muon * max(1, rows/cols)^0.5 *
    newton_schulz(u), no weight decay. lr_muon = lr * muon_ratio: the matrices follow AdamW's schedule."""

    def __init__(self, P, muon_ratio, momentum=pl.MUON_MOMENTUM, **kw):
        super().__init__(P, 0.0, **kw)
        self.muon_ratio, self.momentum = muon_ratio, momentum
        self.ranges = pl.adamw_ranges(P.cfg)
        self.matrices = pl.muon_matrices(P.cfg)

    def update(self, P, G, lr, scale):
        for a, b in self.ranges:
            super().update(P, G, lr, scale, a, b)
        mu, lr_muon = self.momentum, lr * self.muon_ratio

        def matrix(name):                              # one matrix; BLAS and the Numba sum release the GIL
            g, m, p = G[name] * scale, self.m[name], P[name]
            m *= mu
            m += (1 - mu) * g
            p -= (lr_muon * pl.muon_scale(p.shape)) * newton_schulz((1 - mu) * g + mu * m)
        list(_thread_pool().map(matrix, self.matrices))


# ----------------------------------------------------------------------------------------------------
# sampling: head 0 with a KV cache of rotated keys and values per layer, for a batch of streams; the
# MTP heads draft tokens that head 0 verifies in one forward (self-speculative decoding, CONTRACT.md);
# serve's Decoder, rows of their own positions decoded together

class KVCache:
    """Per layer and stream: the rotated keys and the values, both transposed, (hd, ctx), so that a query's
    scores and its weighted sum of values are passes over contiguous rows."""
    def __init__(self, cfg, n=1, dtype=np.float32):
        shape = (cfg.n_layers, n, cfg.n_kv_heads, cfg.head_dim, cfg.ctx)
        self.k, self.v, self.len = np.zeros(shape, dtype), np.zeros(shape, dtype), 0
        self.cos, self.sin = rope_tables(cfg.ctx, cfg.head_dim, dtype)

    def keep(self, n, src=None):
        """Keeps the first n positions; src: a later position whose keys and values become the n-th's."""
        if src is not None:
            self.k[..., n - 1], self.v[..., n - 1] = self.k[..., src], self.v[..., src]
        self.len = n


# A decode step's rows are columns of feature-major activations (D, C), at least 4 (the few rows padded
# with zero columns), and a product is W @ h in one call for W of at most 2^17 entries: OpenBLAS's
# small-matrix kernel then reads W once for all 4 columns, in the time of a matrix-vector product (bound
# by reading W), so a step verifying 3 guesses costs what a plain step costs. A larger W (medium) takes one
# matrix-vector product per row: OpenBLAS packs it for 4 columns, at 1.5-1.8x the time of one. Either way
# a row is computed the same way whatever the step's other rows: the same ids with and without speculation.
DECODE_COLUMNS, _SMALL = 4, 1 << 17


def _mm(W, h, N, out=None):
    """W (M, K) @ h (K, C) -> out (M, C), h's first N columns the rows (the rest padding)."""
    out = np.empty((W.shape[0], h.shape[1]), h.dtype) if out is None else out
    if W.size <= _SMALL or N > DECODE_COLUMNS:
        return np.matmul(W, h, out=out)
    for c in range(N):
        np.matmul(W, h[:, c], out=out[:, c])
    out[:, N:] = 0.0
    return out


@njit(**KERNEL_OPTIONS)
def _cache_attention(qkv, K, V, start, off, cos, sin, out):
    """A decode step's attention over a KVCache layer: qkv (Cq + 2 Ck, C) feature-major, column s*Tn + t is
    stream s's row t, at position start + off[t] in cache slot start + t. Stores the rows' rotated keys and
    their values in K and V (n, Hkv, hd, ctx); row t attends to the first `start` slots, to itself and to
    the step's earlier rows of lower position (a chain of drafts sees the drafts before it, guesses at one
    position see none of the others) -> out (Cq, C). The row's slots are first swapped into place after
    the cache's, so that it reads slots 0..e-1 as plain decoding at its position does: the same sums."""
    n, Hkv, hd, ctx = K.shape
    Tn, Hq = len(off), out.shape[0] // hd
    G = Hq // Hkv
    pos = np.empty(n * Tn, np.int32)
    q, k = np.empty((n * Tn, Hq, hd), K.dtype), np.empty((n * Tn, Hkv, hd), K.dtype)
    for c in range(n * Tn):
        pos[c] = start + off[c % Tn]
        for h in range(Hq):
            q[c, h] = qkv[h * hd:(h + 1) * hd, c]
        for h in range(Hkv):
            k[c, h] = qkv[(Hq + h) * hd:(Hq + h + 1) * hd, c]
    _rope(q, pos, cos, sin, 1.0)
    _rope(k, pos, cos, sin, 1.0)
    for c in range(n * Tn):
        s, slot = c // Tn, start + c % Tn
        for h in range(Hkv):
            K[s, h, :, slot] = k[c, h]
            V[s, h, :, slot] = qkv[(Hq + Hkv + h) * hd:(Hq + Hkv + h + 1) * hd, c]
    scale = K.dtype.type(1.0 / math.sqrt(hd))
    rows, o, seen = np.empty((2, ctx), K.dtype), np.empty((2, hd), K.dtype), np.empty(Tn, np.int64)
    for c in range(n * Tn):
        s, t = c // Tn, c % Tn
        m = 0                                                   # the step's rows that row t sees, in order
        for u in range(t + 1):
            if u == t or off[u] < off[t]:
                seen[m] = u
                m += 1
        for i in range(m):
            if seen[i] != i:
                _swap_slots(K[s], V[s], start + i, start + seen[i])
        e = start + m
        E = min(ctx, e + (-e) % 8)                              # whole vectors; the scores past e are unused
        for kv in range(Hkv):
            for g in range(0, G, 2):                            # its query heads in pairs (an odd last one twice)
                h, h2 = kv * G + g, kv * G + min(g + 1, G - 1)
                _scores2(q[c, h], q[c, h2], K[s, kv], rows, E)
                _softmax(rows[0, :E], e, scale)
                _softmax(rows[1, :E], e, scale)
                _values2(rows, V[s, kv], o, E)
                out[h * hd:(h + 1) * hd, c] = o[0]
                out[h2 * hd:(h2 + 1) * hd, c] = o[1]
        for i in range(m - 1, -1, -1):
            if seen[i] != i:
                _swap_slots(K[s], V[s], start + i, start + seen[i])


@njit(**KERNEL_OPTIONS)
def _swap_slots(K, V, a, b):
    """Swaps slots a and b of K and V (..., hd, ctx)."""
    for h in range(K.shape[0]):
        for i in range(K.shape[1]):
            K[h, i, a], K[h, i, b] = K[h, i, b], K[h, i, a]
            V[h, i, a], V[h, i, b] = V[h, i, b], V[h, i, a]


@njit(**KERNEL_OPTIONS)
def _scores2(qa, qb, KT, rows, E):
    """rows[0, :E], rows[1, :E] = qa . KT[:, :E], qb . KT[:, :E] (KT (hd, ctx)), four dimensions a pass (hd
    is a multiple of 4 in every config)."""
    a, b = rows[0], rows[1]
    a[:E] = 0.0
    b[:E] = 0.0
    for i in range(0, len(qa), 4):
        a0, a1, a2, a3, b0, b1, b2, b3 = qa[i], qa[i + 1], qa[i + 2], qa[i + 3], qb[i], qb[i + 1], qb[i + 2], qb[i + 3]
        k0, k1, k2, k3 = KT[i], KT[i + 1], KT[i + 2], KT[i + 3]
        for j in range(E):
            x0, x1, x2, x3 = k0[j], k1[j], k2[j], k3[j]
            a[j] += a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3
            b[j] += b0 * x0 + b1 * x1 + b2 * x2 + b3 * x3


@njit(**KERNEL_OPTIONS)
def _values2(p, VT, o, E):
    """o (2, hd) = p (2, E) . VT[:, :E].T (VT (hd, ctx)), four dimensions a pass."""
    for i in range(0, o.shape[1], 4):
        v0, v1, v2, v3 = VT[i], VT[i + 1], VT[i + 2], VT[i + 3]
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = o.dtype.type(0.0)
        for j in range(E):
            x, y = p[0, j], p[1, j]
            a0, a1, a2, a3 = a0 + x * v0[j], a1 + x * v1[j], a2 + x * v2[j], a3 + x * v3[j]
            b0, b1, b2, b3 = b0 + y * v0[j], b1 + y * v1[j], b2 + y * v2[j], b3 + y * v3[j]
        o[0, i], o[0, i + 1], o[0, i + 2], o[0, i + 3] = a0, a1, a2, a3
        o[1, i], o[1, i + 1], o[1, i + 2], o[1, i + 3] = b0, b1, b2, b3


def forward_cached(P, ids, cache, offsets=None, heads=None, last=False):
    """Runs ids (Tn,) or (n, Tn) at positions cache.len + offsets (default 0..Tn-1) through the model,
    appending their keys and values to the cache (a smaller cache.len drops what follows it); a row sees the
    cache, itself and the earlier rows of lower position. -> head-0 logits (Tn, V) or (n, Tn, V), or with
    heads = k the first k heads', (..., k, V); last (ids (Tn,), head 0): the last row's alone, (V,). The
    layer ops of training; products by _mm, attention over the cache."""
    cfg = P.cfg
    ids = np.asarray(ids, np.int32)
    single = ids.ndim == 1
    ids = ids.reshape(-1, ids.shape[-1])
    n, Tn = ids.shape
    N, C = n * Tn, max(n * Tn, DECODE_COLUMNS)
    off = np.arange(Tn, dtype=np.int32) if offsets is None else np.asarray(offsets, np.int32)
    start = cache.len
    assert start + Tn <= cfg.ctx and n == cache.k.shape[1] and (single or not last)    # (last: one prompt)
    x = embedding_forward(P["tok_emb"], ids)                                    # (N, D), row-major
    h, a = np.zeros((cfg.dim, C), x.dtype), np.zeros((cfg.n_heads * cfg.head_dim, C), x.dtype)   # feature-major
    hN, rstd = h[:, :N].T, np.empty(N, x.dtype)                                 # h's rows, for the norms to write
    for i in range(cfg.n_layers):
        L = f"layers.{i}."
        _rmsnorm_fwd(x, P[L + "attn_norm"], hN, rstd)
        qkv = _mm(P.rows(L + "wq", L + "wv"), h, N)
        _cache_attention(qkv, cache.k[i], cache.v[i], start, off, cache.cos, cache.sin, a)
        if last and i == cfg.n_layers - 1:       # a prefill: past the cache's keys and values, the last layer
            x, a, h, hN, rstd, N, C = x[-1:], a[:, N - 1:N], h[:, N - 1:N], hN[-1:], rstd[-1:], 1, 1   # needs
        x += _mm(P[L + "wo"], a, N)[:, :N].T                                   # its last row alone
        _rmsnorm_fwd(x, P[L + "ffn_norm"], hN, rstd)
        gu = _mm(P.rows(L + "w1", L + "w3"), h, N)                              # (2F, C): [g; u], flat [g | u]
        x += _mm(P[L + "w2"], swiglu_forward(gu.reshape(1, -1)).reshape(-1, C), N)[:, :N].T
    cache.len = start + Tn
    _rmsnorm_fwd(x, P["norm"], hN, rstd)
    if last:                                      # and so the head (the other rows' logits were 5% of it)
        return _mm(P["heads.0"], h, 1)[:, 0]
    k = heads or 1
    logits = np.empty((k, cfg.vocab, C), x.dtype)
    _mm(P["heads.0"], h, N, logits[0])                                         # head 0 alone, as in plain decoding
    if k > 1:
        _mm(P.rows("heads.1", f"heads.{k - 1}"), h, N, logits[1:].reshape(-1, C))
    logits = logits[:, :, :N].transpose(2, 0, 1).reshape(n, Tn, k, cfg.vocab)
    logits = logits if heads else logits[:, :, 0]
    return logits[0] if single else logits


def generate(P, prompt_ids, max_new, temperature=0.8, top_k=40, rng=None, cached=True, sampling=None,
             speculative=False, stats=None):
    """Yields up to max_new sampled ids (stops at the context). sampling (a pipeline.Sampling) overrides
    temperature and top_k. speculative: head 0 verifies drafts of the MTP heads (greedy: also of the
    context, see _generate_speculative), the same distribution of texts, the same ids when greedy; stats
    (a dict) then gets 'drafted' and 'accepted'.
    cached=False reruns the whole sequence through the training forward at every step: slow, kept to
    check the cache."""
    rng = rng if rng is not None else np.random.default_rng(0)
    sampling = sampling or pl.Sampling(temperature, top_k)
    if speculative and P.cfg.n_mtp > 1 and cached:
        yield from _generate_speculative(P, prompt_ids, max_new, sampling, rng, stats)
        return
    ids = list(prompt_ids)
    cache = KVCache(P.cfg, 1, P.flat.dtype)
    logits = forward_cached(P, ids, cache)[-1] if cached else None
    for _ in range(max_new):
        if not cached:
            logits = forward(P, np.array([ids], np.int32))[-1]
        t = sampling.sample(logits, ids, rng)
        yield t
        ids.append(t)
        if len(ids) >= P.cfg.ctx:
            return
        if cached:
            logits = forward_cached(P, [t], cache)[-1]


def _generate_speculative(P, prompt_ids, max_new, sampling, rng, stats):
    """Speculative decoding over this engine's KV cache. Greedy: guess_decode, 3 drafts a step (what followed
    z last time, then head 1's likeliest as guesses after z): with z, the 4 columns a decode step computes
    anyway, and heads 0 and 1 alone. On the default run's checkpoint a step makes 1.83 tokens (heads 1 and
    2 drafting a chain, pipeline.speculative_decode's greedy rule: 1.42; head 1's 3 likeliest alone: 1.53);
    without a repetition penalty the forward hands over ids, not logits. Sampling: speculative_decode."""
    cache = KVCache(P.cfg, 1, P.flat.dtype)
    if sampling.temperature > 0:
        yield from pl.speculative_decode(lambda ids: forward_cached(P, ids, cache, None, P.cfg.n_mtp), cache.keep,
                                         prompt_ids, max_new, sampling, rng, stats, P.cfg.n_mtp, P.cfg.ctx)
        return
    g = DECODE_COLUMNS - 1

    def forward(ids, offsets):
        z = forward_cached(P, ids, cache, offsets, 2)                             # (rows, heads 0 and 1, V)
        return _guess_ids(z, g) if sampling.repetition_penalty == 1.0 else z
    yield from guess_decode(forward, cache.keep, prompt_ids, max_new, sampling, stats, P.cfg.ctx, g)


def guess_decode(forward, cut, prompt_ids, max_new, sampling, stats, ctx, guesses):
    """Greedy speculative decoding with drafts of the context and of head 1 (pipeline.speculative_decode's
    rounds, other drafts): a round drafts `guesses` rows after the decided, not yet cached token z: a chain
    of what followed z where z last occurred (up to guesses - 1 ids), then head 1's likeliest ids as guesses
    at the position after z, each a row that sees z alone. forward(ids, offsets) runs the rows at their
    positions after z's, [0, 1, 2, 1] (a row sees the earlier rows of lower position), and returns the
    logits of heads 0 and 1 at least, or ids (len, 1 + guesses): head 0's argmax, then head 1's likeliest,
    largest first. Head 0 walks the chain while it agrees, or keeps the guess that is its argmax; cut(n)
    keeps the cache's first n positions, cut(n, src) also makes position src the n-th (a kept guess).
    Yields up to max_new ids (stops at the context); stats (a dict) gets 'drafted' and 'accepted'."""
    def first(row, history):                    # head 0's id: an argmax the forward made, else by the rule
        return int(row) if argmaxes else sampling.greedy(row, history)
    ids = list(prompt_ids)
    heads = forward(ids, None)[-1]                                         # heads 0 and 1 at the last position
    argmaxes = np.ndim(heads[0]) == 0                                      # forward hands over ids
    cached = len(ids)
    z = first(heads[0], ids)
    ids.append(z)
    produced = 1
    yield z
    last, paired = {}, 0                        # each id's last position in ids[:paired]
    while produced < max_new and len(ids) < ctx:
        for i in range(paired, len(ids) - 1):
            last[ids[i]] = i
        paired = len(ids) - 1
        room = min(guesses, ctx - len(ids))                                # z's forward must fit the context
        chain = ids[last[z] + 1:last[z] + room] if z in last else []       # what followed z last time
        likely = heads[1:].tolist() if argmaxes else sampling.likeliest(heads[1], ids, guesses)
        alts = [d for d in likely if d not in chain[:1]][:room - len(chain)]
        out = forward([z] + chain + alts, list(range(len(chain) + 1)) + [1] * len(alts))
        row = n_ok = 0
        while True:                                     # head 0 walks the chain or takes a guess after z
            z = first(out[row, 0], ids)
            ids.append(z)
            produced += 1
            yield z
            if row < len(chain) and z == chain[row]:
                nxt = row + 1
            elif row == 0 and z in alts:
                nxt = 1 + len(chain) + alts.index(z)
            else:
                break
            row, n_ok = nxt, n_ok + 1
            if produced >= max_new or len(ids) >= ctx:
                break
        if stats is not None:
            stats["drafted"] = stats.get("drafted", 0) + len(chain or alts[:1])   # the positions drafted
            stats["accepted"] = stats.get("accepted", 0) + n_ok
        cached += 1 + n_ok                                                 # z and the kept drafts
        if row == n_ok:
            cut(cached)
        else:                                                              # a guess was kept: its row goes after z
            cut(cached, cached - 2 + row)
        heads = out[row]                                                   # at the last cached position


@njit(**KERNEL_OPTIONS)
def _guess_ids(z, g):
    """z (rows, 2, V) logits of heads 0 and 1 -> (rows, 1 + g) ids: head 0's first argmax, then head 1's g
    largest, largest first (ties: the smaller id first)."""
    out = np.empty((len(z), 1 + g), np.int64)
    for r in range(len(z)):
        z0, z1, top = z[r, 0], z[r, 1], out[r, 1:]
        m, j = _max(z0, len(z0)), 0
        while j < len(z0) - 1 and z0[j] != m:          # (NaN logits: the last id)
            j += 1
        out[r, 0] = j
        top[:] = -1
        low = -np.inf
        for v in range(len(z1)):                       # each id larger than the g-th so far, inserted
            if z1[v] > low:
                i = g - 1
                while i > 0 and (top[i - 1] < 0 or z1[v] > z1[top[i - 1]]):
                    top[i] = top[i - 1]
                    i -= 1
                top[i] = v
                low = z1[top[g - 1]] if top[g - 1] >= 0 else -np.inf
    return out


def generate_batch(P, prompt_ids, n, max_new, sampling, rng, arrivals=None):
    """n independent continuations of one prompt in one batch (plain decoding); -> n lists of ids. arrivals
    (a list) gets (ids so far in all streams, time.perf_counter()) after each step (sample's speed line)."""
    cfg = P.cfg
    ids = [list(prompt_ids) for _ in range(n)]
    cache = KVCache(cfg, n, P.flat.dtype)
    logits = forward_cached(P, [prompt_ids] * n, cache)[:, -1]
    outs = [[] for _ in range(n)]
    for _ in range(min(max_new, cfg.ctx - len(prompt_ids))):
        for r in range(n):
            outs[r].append(sampling.sample(logits[r], ids[r], rng))
            ids[r].append(outs[r][-1])
        if arrivals is not None:
            arrivals.append((n * len(outs[0]), time.perf_counter()))
        if len(ids[0]) >= cfg.ctx:
            break
        logits = forward_cached(P, [[o[-1]] for o in outs], cache)[:, -1]
    return outs


# --- serve's decoder: rows of their own prompts and positions, decoded a step at a time together ---
# The interface is serve.py's Decoder. A step's rows are rows of (n, features) activations, padded to a
# multiple of 4 with zero rows: _rows_mm reads each weight row once for four rows (the cache-resident
# small model's step is bound by the multiply-adds: four rows cost about what one costs) and sums each
# row's products in one fixed order whatever the other rows are and however many; a BLAS product whose
# width is the batch rounds widths differently. So a request's ids never depend on the batch around it.

@njit(**KERNEL_OPTIONS)
def _rows_mm(W, x, out):
    """out (n, M) = x (n, K) @ W (M, K).T, n a multiple of 4: each row of W read once (into L1) for every
    four rows."""
    M, K = W.shape
    for m in range(M):
        w = W[m]
        for c in range(0, x.shape[0], 4):
            x0, x1, x2, x3 = x[c], x[c + 1], x[c + 2], x[c + 3]
            s0 = s1 = s2 = s3 = out.dtype.type(0.0)
            for k in range(K):
                s0 += w[k] * x0[k]
                s1 += w[k] * x1[k]
                s2 += w[k] * x2[k]
                s3 += w[k] * x3[k]
            out[c, m], out[c + 1, m], out[c + 2, m], out[c + 3, m] = s0, s1, s2, s3
    return out


@njit(**KERNEL_OPTIONS)
def rows_mm(W, x):
    return _rows_mm(W, x, np.empty((x.shape[0], W.shape[0]), x.dtype))


@njit(**KERNEL_OPTIONS)
def _rows_attention(qkv, K, V, slots, pos, cos, sin, out):
    """One decode step's attention, row r (qkv (n, Cq + 2 Ck), row-major) at position pos[r] of cache slot
    slots[r] of K and V (slots, Hkv, ctx, hd): stores its rotated key and its value there and attends to
    positions 0..pos[r] -> out[r] (Cq,). Position-major, a row's keys are one block read in order: the
    caches of a step's rows are out of the CPU's caches (the weights pass between), and the prefetcher
    streams a block faster than hd strided rows (KVCache's layout): 0.63 against 0.90 ms a step of 8."""
    Hkv, ctx, hd = K.shape[1:]
    Hq = out.shape[1] // hd
    G = Hq // Hkv
    n = len(slots)
    q, k = np.empty((n, Hq, hd), K.dtype), np.empty((n, Hkv, hd), K.dtype)
    for r in range(n):
        for h in range(Hq):
            q[r, h] = qkv[r, h * hd:(h + 1) * hd]
        for h in range(Hkv):
            k[r, h] = qkv[r, (Hq + h) * hd:(Hq + h + 1) * hd]
    _rope(q, pos, cos, sin, 1.0)
    _rope(k, pos, cos, sin, 1.0)
    scale, zero = K.dtype.type(1.0 / math.sqrt(hd)), K.dtype.type(0.0)
    p = np.empty(ctx, K.dtype)
    for r in range(n):
        s, e = slots[r], pos[r] + 1
        for h in range(Hkv):
            K[s, h, e - 1] = k[r, h]
            V[s, h, e - 1] = qkv[r, (Hq + Hkv + h) * hd:(Hq + Hkv + h + 1) * hd]
        for h in range(Hq):
            Kh, Vh, qh = K[s, h // G], V[s, h // G], q[r, h]
            for j in range(0, e - 3, 4):           # four positions a pass: the loop's overhead (and below, o's
                K0, K1, K2, K3 = Kh[j], Kh[j + 1], Kh[j + 2], Kh[j + 3]     # loads and stores) shared by four
                a0 = a1 = a2 = a3 = zero
                for i in range(hd):
                    a0 += qh[i] * K0[i]
                    a1 += qh[i] * K1[i]
                    a2 += qh[i] * K2[i]
                    a3 += qh[i] * K3[i]
                p[j], p[j + 1], p[j + 2], p[j + 3] = a0, a1, a2, a3
            for j in range(e - e % 4, e):
                acc = zero
                for i in range(hd):
                    acc += qh[i] * Kh[j, i]
                p[j] = acc
            _softmax(p, e, scale)
            o = out[r, h * hd:(h + 1) * hd]
            o[:] = 0.0
            for j in range(0, e - 3, 4):
                p0, p1, p2, p3 = p[j], p[j + 1], p[j + 2], p[j + 3]
                V0, V1, V2, V3 = Vh[j], Vh[j + 1], Vh[j + 2], Vh[j + 3]
                for i in range(hd):
                    o[i] += p0 * V0[i] + p1 * V1[i] + p2 * V2[i] + p3 * V3[i]
            for j in range(e - e % 4, e):
                pj = p[j]
                for i in range(hd):
                    o[i] += pj * Vh[j, i]


@njit(**KERNEL_OPTIONS)
def _rows_forward(ids, slots, pos, emb, mats, norms, K, V, cos, sin):
    """Rows ids (n,) at positions pos of cache slots through the layers -> head 0's logits (N, V), N = n
    padded to 4 rows. mats: each layer's wq|wk|wv, wo, w1|w3, w2, then head 0; norms: each layer's two,
    then the final one. The layers' loop in one call, not in Python (a step of 1 row: 0.15-0.19 against
    0.23-0.31 ms)."""
    n, N = len(ids), len(ids) + (-len(ids)) % 4
    x = np.zeros((N, emb.shape[1]), emb.dtype)
    for r in range(n):
        x[r] = emb[ids[r]]
    h, rstd, a = np.empty_like(x), np.empty(N, x.dtype), np.zeros((N, mats[1].shape[1]), x.dtype)
    for i in range(K.shape[0]):
        _rmsnorm_fwd(x, norms[2 * i], h, rstd)
        _rows_attention(rows_mm(mats[4 * i], h), K[i], V[i], slots, pos, cos, sin, a)
        x += rows_mm(mats[4 * i + 1], a)
        _rmsnorm_fwd(x, norms[2 * i + 1], h, rstd)
        x += rows_mm(mats[4 * i + 3], swiglu_forward(rows_mm(mats[4 * i + 2], h)))
    _rmsnorm_fwd(x, norms[-1], h, rstd)
    return rows_mm(mats[-1], h)


@njit(**KERNEL_OPTIONS)
def _draw_plain(logits, temperature, top_k, u):
    """pl.Sampling(temperature[r], top_k[r]).sample of each row r of logits (n, V) at its uniform number u[r]
    (pl.draw): in float64, exp(z - max z) of z = logits / temperature over the ids at or above the top_k-th
    largest z (0: all), over their sum; the id is the count of cumulative sums at or below u[r] times the
    last, capped at V - 1. The same ids as pl.Sampling's numpy (8 rows of 512 ids: 27-36 against 86-115 us)
    unless a point lands within a rounding of a boundary."""
    n, V = logits.shape
    out, z, c = np.empty(n, np.int64), np.empty(V), np.empty(V)
    for r in range(n):
        for v in range(V):
            z[v] = logits[r, v] / temperature[r]
        k = top_k[r]
        cut = np.partition(z, V - k)[V - k] if 0 < k < V else z.min()
        top, s = z.max(), 0.0
        for v in range(V):
            c[v] = np.exp(z[v] - top) if z[v] >= cut else 0.0
            s += c[v]
        acc = 0.0
        for v in range(V):
            acc += c[v] / s
            c[v] = acc
        point, m = u[r] * c[V - 1], 0
        for v in range(V):
            m += c[v] <= point
        out[r] = min(m, V - 1)
    return out


SERVE_BATCH = 8                # serve's rows by default (--max-batch)


class Decoder:
    """serve's decoder on this engine (serve.py's Decoder): `capacity` rows, each a KV cache slot, its own
    position, sampling rule, history and random generator. starts() prefills each row alone (forward_cached,
    as generate does, then its keys and values go to the row's slot); step() runs every given row's next
    token, its rows in fours split over the threads (per_part), a _rows_forward call a part (a row's sums
    are the same in any part). A row samples as generate does, by its pl.Sampling with its own generator
    (_draw_plain for temperature and top-k alone): one uniform a sampled token, none greedy; so a row alone
    follows generate with the same seed draw for draw (the logits agree to float32 rounding:
    generate's step is a BLAS product and attention over KVCache's layout, this one _rows_mm and
    _rows_attention)."""

    def __init__(self, P, capacity):
        cfg = P.cfg
        self.P, self.capacity, self.ctx = P, capacity, cfg.ctx
        self.ones = [KVCache(cfg, 1, P.flat.dtype) for _ in range(min(n_threads(), capacity))]   # a prefill a thread
        shape = (cfg.n_layers, capacity, cfg.n_kv_heads, cfg.ctx, cfg.head_dim)
        self.k, self.v = np.zeros(shape, P.flat.dtype), np.zeros(shape, P.flat.dtype)   # position-major rows
        self.len = np.zeros(capacity, np.int32)                # each row's cached positions
        layers = [f"layers.{i}." for i in range(cfg.n_layers)]
        self.mats = tuple(W for L in layers for W in (P.rows(L + "wq", L + "wv"), P[L + "wo"],
                                                      P.rows(L + "w1", L + "w3"), P[L + "w2"])) + (P["heads.0"],)
        self.norms = tuple(w for L in layers for w in (P[L + "attn_norm"], P[L + "ffn_norm"])) + (P["norm"],)
        self.rows = [None] * capacity                          # each row's [sampling, rng, ids so far]
        self.start(0, [0], pl.Sampling(temperature=0.0), 0)   # compiles the step's kernels now (Numba), so
        self.step([0])                                         # serve is ready when it says so and a Ctrl-C
        self.free(0)                                           # meets no compiler

    def start(self, row, ids, sampling, seed):
        return self.starts([(row, ids, sampling, seed)])[0]

    def starts(self, items):
        """start() of each (row, ids, sampling, seed) -> their first ids. The prompts' prefills run a part
        of them per thread (per_part), each alone, as generate's but for the head on the last row alone (8
        prompts of 70 ids on 2 cores: 10-12 against 19-21 ms one by one); their first ids are drawn after."""
        logits = [None] * len(items)

        def prefill(i, part):
            one = self.ones[i]
            for k in range(part.start, part.stop):
                row, ids = items[k][:2]
                one.len, n = 0, len(ids)
                logits[k] = forward_cached(self.P, ids, one, last=True)
                self.k[:, row, :, :n] = one.k[:, 0, :, :, :n].transpose(0, 1, 3, 2)
                self.v[:, row, :, :n] = one.v[:, 0, :, :, :n].transpose(0, 1, 3, 2)
        per_part(prefill, len(items))
        for row, ids, sampling, seed in items:
            self.len[row] = len(ids)
            self.rows[row] = [sampling, np.random.default_rng(seed), list(ids)]
        return [int(t) for t in self._sample([it[0] for it in items], np.stack(logits))]

    def step(self, rows):
        slots = np.asarray(rows, np.int64)
        pos = self.len[slots]
        assert pos.max() < self.ctx, "a row past the context"      # (the kernels write its key unchecked)
        ids, c, n = np.array([self.rows[r][2][-1] for r in rows]), self.ones[0], len(rows)

        def part(i, fours):                              # rows of whole passes of four, a part per thread
            p = slice(4 * fours.start, min(4 * fours.stop, n))
            return _rows_forward(ids[p], slots[p], pos[p], self.P["tok_emb"], self.mats, self.norms, self.k, self.v,
                                 c.cos, c.sin)
        logits = np.concatenate(per_part(part, (n + 3) // 4))         # (only the last part has padding rows)
        self.len[slots] += 1
        return self._sample(rows, logits)

    def _sample(self, rows, logits):
        """Each row's next id by its own pl.Sampling, its history and its generator (-1: logits not finite):
        rows of a plain rule (temperature and top-k alone) by _draw_plain, the others by the rule's sample()."""
        out = np.full(len(rows), -1, np.int64)
        finite = np.isfinite(logits[:len(rows)]).all(axis=1)
        plain = []
        for j, r in enumerate(rows):
            s, rng, ids = self.rows[r]
            if not finite[j]:
                continue
            if s.temperature > 0 and s.top_p == 1.0 and s.repetition_penalty == 1.0:
                plain.append(j)
            else:
                out[j] = s.sample(logits[j], ids, rng)
        if plain:
            rules = [self.rows[rows[j]] for j in plain]
            out[plain] = _draw_plain(logits[plain], np.array([s.temperature for s, _, _ in rules]),
                                     np.array([s.top_k for s, _, _ in rules]),
                                     np.array([g.random() for _, g, _ in rules]))
        for j, r in enumerate(rows):
            if out[j] >= 0:
                self.rows[r][2].append(int(out[j]))
        return out

    def free(self, row):
        self.rows[row] = None


# ----------------------------------------------------------------------------------------------------
# trainer: the CPU engine's side of pipeline.train_loop

class Trainer:
    """The CPU engine's side of train_loop: step() runs one AdamW step, results() hands back the losses.
    The GPU engine has a class with the same methods whose steps run ahead of the host."""
    sync_every_step = True

    def __init__(self, P, state=None, args=None):
        """args: the run's (optim, lr, muon_lr); None: AdamW (SFT, DPO, bench)."""
        muon = args is not None and args["optim"] == "muon"
        self.P, self.opt, self.pending = P, Muon(P, args["muon_lr"] / args["lr"]) if muon else AdamW(P, 0.0), []
        self.grads = []                                  # one gradient buffer per shard (loss_and_grads)
        if state is not None:
            self.opt.m.flat[:], self.opt.v.flat[:] = state["adam_m"].flat, state["adam_v"].flat
            self.opt.step_count = state["step"]

    def step(self, x, y, lr):
        objective, ces, G = loss_and_grads(self.P, x, y, self.grads)
        norm = float("nan")
        if math.isfinite(objective):                     # a NaN step changes nothing; the loop stops on it
            norm = self.opt.step(self.P, G, lr)
        self.pending.append((objective, ces, norm))

    def results(self):
        """[(objective, per-head CE, grad norm)] of the steps since the last call."""
        done, self.pending = self.pending, []
        return done

    def host_state(self):
        """(parameters, Adam m, Adam v) as host Params, for checkpoints and samples."""
        return self.P, self.opt.m, self.opt.v


class DPOTrainer(Trainer):
    """Trainer's AdamW steps on the DPO gradient: step(x, (y, ref), lr) takes a batch of pl.PrefBatches."""

    def __init__(self, P, beta):
        super().__init__(P)
        self.beta = beta

    def step(self, x, y_ref, lr):
        loss, G = dpo_loss_and_grads(self.P, x, *y_ref, self.beta, self.grads)
        norm = self.opt.step(self.P, G, lr) if math.isfinite(loss) else float("nan")
        self.pending.append((loss, [loss], norm))


SPECULATIVE_HELP = ("on when greedy for tiny and small, whose decode products read each matrix once for the verifying "
                    "step's 4 rows: 1.4x on make train's model; off when sampling, or for larger models, where the "
                    "extra rows cost more than they save")


def speculation_pays(cfg):
    """Greedy speculation is on by default where a decode step's 4 rows cost what one costs: every matrix of
    the verifying step (q|k|v, w1|w3 and heads 0|1 stacked; wo and w2 are smaller) has at most _SMALL
    entries (tiny, small; see _mm)."""
    D = cfg.dim
    return max((cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * D, 2 * cfg.ffn * D, 2 * cfg.vocab * D) <= _SMALL


def speculative_of(P, a, sampling):
    return pl.speculative_for(a.speculative, sampling, P.cfg.n_mtp, speculation_pays(P.cfg))


def cpu_generate(P, a, stats=None):
    """generate_fn(ids, n, rng) for the pipeline's sample and chat loops, with a's sampling flags."""
    sampling = pl.sampling_of(a)
    spec = speculative_of(P, a, sampling)
    return lambda ids, n, rng: generate(P, ids, n, rng=rng, sampling=sampling, speculative=spec, stats=stats)


# ----------------------------------------------------------------------------------------------------
# modes: each takes its command-line words and builds its own parser; serve, export and evaluate are
# imported by the modes that use them, so `import nanoeuler` loads the engine alone

PROG = "nanoeuler.py"


def cmd_train(argv, mode="train"):
    text = {"train": "pretrain (on the embedded default corpus unless --data)",
            "resume": "continue the run in --out from its checkpoint (train --resume)"}[mode]
    p = pl.Parser(prog=f"{PROG} {mode}", description=text)
    pl.add_train_flags(p, out=pl.RUN_DIRS["train"], defaults=pl.TRAIN_DEFAULTS, lr_note=" for small, 0.001 for the other configs")
    a = p.parse_args(argv)
    a.resume = a.resume or mode == "resume"
    a.config = pl.config_arg(a)
    name = a.config or "small"
    defaults = dict(pl.TRAIN_DEFAULTS, config=name, **({"lr": 1e-3} if name != "small" else {}))
    P, tok, tokens, args, state, extra = pl.start_run(a, defaults, a.resume)
    # --grad-accum K: this engine takes the K micro-batches as one batch of K x batch rows (the same mean gradient)
    batches = pl.Batches(tokens, args["batch"] * args["grad_accum"], args["seq"], seed=args["seed"])
    if state is not None:
        batches.set_state(state["data"])
    bpt = pl.bytes_per_token(tok, tokens)
    val_fn = lambda: pl.validation_loss(lambda x, y: forward_loss(P, x, y)[1][0], tokens, args["batch"], args["seq"], 8, bpt)
    gen = lambda ids, n, rng: generate(P, ids, n, 0.8, 40, rng)
    if state is None:
        print("step 0: validating (the first run compiles the Numba kernels, ~10 s; cached after)", flush=True)
        print("step 0: val loss {:.4f}, val bpb {:.3f}".format(*val_fn()), flush=True)
    pl.train_loop(Trainer(P, state, args), tok, batches, args, a.out, val_fn, extra, start=state["step"] if state else 0,
                  sample_fn=lambda step: pl.print_sample(tok, gen, "\n", 64, seed=step))
    loss, bpb = val_fn()
    print(f"final: val loss {loss:.4f} | val bpb {bpb:.3f} | {bpt:.2f} bytes/token")
    sample = pl.print_sample(tok, gen, "\n", 200, seed=args["seed"])
    import evaluate
    print(f"report: {evaluate.write_report(a.out, args, P.cfg, loss, bpb, sample)}")


def cpu_logprobs(P):
    """logprobs_fn for evaluate.py: sequences (lists of ids, at most ctx) -> per-token head-0 log-probs,
    one forward per call (shorter sequences padded at the end: causal attention keeps them exact)."""
    def fn(seqs):
        T = max(len(s) for s in seqs)
        if T > P.cfg.ctx:
            raise ValueError(f"a sequence of {T} tokens is longer than the context of {P.cfg.ctx}")
        idx, targets = np.zeros((len(seqs), T), np.int32), np.full((len(seqs), T), -1)
        for r, s in enumerate(seqs):
            idx[r, :len(s)], targets[r, :len(s) - 1] = s, s[1:]
        logp, _ = token_logp(forward(P, idx).astype(np.float64), targets.reshape(-1))
        logp = logp.reshape(len(seqs), T)
        return [logp[r, :len(s) - 1] for r, s in enumerate(seqs)]
    return fn


def cmd_eval(argv):
    import evaluate
    p = pl.Parser(prog=f"{PROG} eval", description=evaluate.EVAL_HELP)
    evaluate.add_eval_flags(p, pl.run_ckpt("train"))
    a = p.parse_args(argv)
    evaluate.check_eval_args(a)
    P, tok, _, _ = pl.load_checkpoint(a.ckpt)
    evaluate.run_eval(a, tok, P.cfg.ctx, cpu_logprobs(P))


def cmd_plot(argv):
    import evaluate
    p = pl.Parser(prog=f"{PROG} plot", description=evaluate.PLOT_HELP)
    evaluate.add_plot_flags(p)
    a = p.parse_args(argv)
    print(f"wrote {evaluate.plot(a.runs, evaluate.plot_out(a.out))}")


def cmd_sample(argv):
    p = pl.Parser(prog=f"{PROG} sample", description="generate text from a checkpoint")
    pl.add_prompt_arg(p)
    p.add_argument("--samples", type=int, default=1, help="continuations drawn in one batch (default 1)")
    pl.add_sample_flags(p, ckpt=pl.run_ckpt("train"), temperature=0.8, speculative_help=SPECULATIVE_HELP)
    a = p.parse_args(argv)
    prompt = pl.prompt_arg(a)
    pl.check_sampling(a)
    P, tok, _, _ = pl.load_checkpoint(a.ckpt)
    if a.samples > 1:
        sampling = pl.sampling_of(a)
        arrivals = pl.samples_to_stdout(tok, lambda ids, k, m, rng, arrivals: generate_batch(
            P, ids, k, m, sampling, rng, arrivals), prompt, a, P.cfg.ctx)
        print(pl.speed_line(arrivals, False, {}, a.samples), file=sys.stderr)
        return
    stats = {}
    arrivals = pl.sample_to_stdout(tok, cpu_generate(P, a, stats), prompt, a, P.cfg.ctx)
    print(pl.speed_line(arrivals, speculative_of(P, a, pl.sampling_of(a)), stats), file=sys.stderr)


def cmd_sft(argv):
    p = pl.Parser(prog=f"{PROG} sft",
                  description="fine-tune a base checkpoint on instructions (Alpaca template of CONTRACT.md)")
    pl.add_sft_flags(p, ckpt=pl.run_ckpt("train"), out=pl.RUN_DIRS["sft"], **pl.SFT_DEFAULTS["cpu"])
    a = p.parse_args(argv)
    P, tok, _, _ = pl.load_checkpoint(a.ckpt)
    pl.run_sft(a, P, tok, lambda: Trainer(P), lambda x, y: forward_loss(P, x, y)[1][0])


def cmd_dpo(argv):
    p = pl.Parser(prog=f"{PROG} dpo", description="direct preference optimisation (CONTRACT.md \"DPO\") of a chat "
                  "checkpoint on pairs of a chosen and a rejected answer, against itself frozen; writes a chat checkpoint")
    pl.add_dpo_flags(p, ckpt=pl.run_ckpt("sft"), out=pl.RUN_DIRS["dpo"])
    a = p.parse_args(argv)
    P, tok, _, extra = pl.load_checkpoint(a.ckpt)
    pl.run_dpo(a, P, tok, extra, lambda: DPOTrainer(P, a.beta), lambda x, y: seq_logps(P, x, y))


def cmd_chat(argv):
    p = pl.Parser(prog=f"{PROG} chat", description="talk to a checkpoint: a chat checkpoint (sft) wraps each line "
                  "in the SFT template, a base model continues your text; the conversation is kept within the context")
    pl.add_sample_flags(p, ckpt=pl.run_ckpt("sft"), temperature=0.7, speculative_help=SPECULATIVE_HELP)
    a = p.parse_args(argv)
    P, tok, _, extra = pl.load_checkpoint(a.ckpt)
    pl.check_sampling(a)
    rng = np.random.default_rng(a.seed)
    gen = cpu_generate(P, a)
    pl.chat_repl(tok, lambda ids, n: gen(ids, n, rng), extra.get("kind") == "chat", a.tokens, P.cfg.ctx)


def cmd_serve(argv):
    import serve
    p = pl.Parser(prog=f"{PROG} serve", description=serve.DESCRIPTION)
    serve.add_serve_flags(p, ckpt=pl.run_ckpt("sft"), max_batch_help=f"default {SERVE_BATCH}: on 2 cores a "
                          "step of small's 8 rows makes 4x the tokens of one row's")
    a = p.parse_args(argv)
    P, tok, _, extra = pl.load_checkpoint(a.ckpt)
    serve.run(a, tok, P.cfg, extra.get("kind") == "chat", lambda rows: Decoder(P, rows or SERVE_BATCH), "CPU")


def cmd_export(argv):
    import export                                    # its packages (safetensors, gguf) serve these modes alone
    export.cmd_export(argv, PROG)


def cmd_import(argv):
    import export
    export.cmd_import(argv, PROG)


def cmd_bench(argv):
    """Training steps on real batches of the embedded corpus (a repeated batch would be memorised, and
    its vanishing probabilities underflow into slow denormal floats); then sampling with the KV cache."""
    p = pl.Parser(prog=f"{PROG} bench", description="training and sampling speed")
    pl.add_config_arg(p, "small")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 256, or the context if shorter)")
    p.add_argument("--steps", type=int, default=12, help="timed steps (default 12)")
    p.add_argument("--ckpt", help="time generation with this checkpoint, so the MTP heads' drafts mean something "
                                  "(default: the random weights of the timed config)")
    a = p.parse_args(argv)
    name = pl.config_arg(a) or "small"
    cfg = pl.get_config(name)
    a.seq = min(256, cfg.ctx) if a.seq is None else a.seq
    pl.check_positive(a, "batch", "seq", "steps")
    B, T = a.batch, a.seq
    if T > cfg.ctx:
        raise pl.UserError(f"--seq {T} is longer than the context of {cfg.ctx} of config {name}")
    tokens, _ = pl.prepare_data(None, cfg, name)
    batches = pl.Batches(tokens, B, T)
    P = Params.init(cfg)
    trainer = Trainer(P)
    t0 = time.time()
    trainer.step(*batches.next(), 1e-3)
    print(f"config {name}: {pl.num_params(cfg):,} parameters, B={B}, T={T}; first step (JIT load) {time.time() - t0:.2f} s")
    for _ in range(2):
        trainer.step(*batches.next(), 1e-3)
    times = []
    for _ in range(a.steps):
        x, y = batches.next()
        t0 = time.perf_counter()
        trainer.step(x, y, 1e-3)
        times.append(time.perf_counter() - t0)
    ms = float(np.median(times)) * 1e3
    flops = pl.model_flops_per_token(cfg, T) * B * T
    print(f"train: {ms:.1f} ms/step (median of {a.steps}, min {min(times) * 1e3:.1f}) | "
          f"{B * T / ms * 1e3:,.0f} tokens/s | {flops / ms / 1e6:.1f} GFLOP/s")
    bench_sampling(*(pl.load_checkpoint(a.ckpt)[:2] if a.ckpt else (P, None)), batches)


def bench_sampling(P, tok, batches, n=200, streams=8):
    """Greedy generation of n tokens after a 16-token prompt of the validation text: plain, speculative
    (drafts of the context and of head 1; the same ids) and `streams` continuations in one batch. With
    random weights (no --ckpt) head 1 agrees with head 0 by chance only, and the text soon repeats one id,
    which the context's drafts get: neither tells what a trained model gets."""
    prompt = batches.next()[0][0, :16].tolist() if tok is None else \
        tok.encode(pl.default_corpus()[0][20_000:21_000])[:16]
    greedy, runs = pl.Sampling(temperature=0), {}
    for spec in (False, True, False, True):              # twice each, alternately: the second of each is timed
        stats = {}
        t0 = time.perf_counter()
        out = list(generate(P, prompt, n, sampling=greedy, speculative=spec, stats=stats))
        runs[spec] = (time.perf_counter() - t0, out, stats)
    (t_plain, plain, _), (t_spec, spec_out, stats) = runs[False], runs[True]
    assert spec_out == plain, "speculative decoding changed the greedy text"
    t0 = time.perf_counter()
    outs = generate_batch(P, prompt, streams, n, greedy, np.random.default_rng(0))
    t_batch = time.perf_counter() - t0
    print(f"sample ({'checkpoint' if tok is not None else 'random weights'}, greedy, {len(plain)} tokens after a "
          f"16-token prompt): plain {len(plain) / t_plain:,.0f} tokens/s | speculative "
          f"{len(spec_out) / t_spec:,.0f} tokens/s ({t_plain / t_spec:.2f}x; {stats['accepted'] / max(stats['drafted'], 1):.0%} "
          f"of drafts accepted; the same ids) | {streams} streams in a batch {sum(map(len, outs)) / t_batch:,.0f} tokens/s")


# ----------------------------------------------------------------------------------------------------
# main

MODES = {   # name: (one line of the mode list, fn(argv)); each mode's --help gives its flags
    "train": ("pretrain (on the embedded default corpus unless --data)", cmd_train),
    "resume": ("continue the run in --out from its checkpoint (train --resume)", lambda argv: cmd_train(argv, "resume")),
    "sample": ("generate text from a checkpoint", cmd_sample),
    "chat": ("talk to a checkpoint (a base model continues your text)", cmd_chat),
    "serve": ("an OpenAI-compatible API and a chat page in the browser (serve.py)", cmd_serve),
    "sft": ("fine-tune a base checkpoint on instructions (Alpaca template)", cmd_sft),
    "dpo": ("align a chat checkpoint with preference pairs (DPO)", cmd_dpo),
    "eval": ("score a checkpoint: HellaSwag (acc, acc_norm) or bits per byte of a text", cmd_eval),
    "plot": ("PNG of train/val loss against steps, tokens and wall time", cmd_plot),
    "bench": ("training and sampling speed", cmd_bench),
    "export": ("write a checkpoint for transformers (hf) or llama.cpp (gguf)", cmd_export),
    "import": ("a Hugging Face Llama folder -> a checkpoint (sample, chat, sft)", cmd_import),
}
LETTERS = {"t": "train", "tr": "resume", "i": "sample", "s": "sft", "c": "chat", "d": "dpo"}   # as nanoeuler_cuda.py


def main(argv=None):
    def checked(fn):        # a bad NANOEULER_THREADS is an error in every mode, not only in those that start threads
        return lambda argv: (n_threads(), fn(argv))[1]
    return pl.run_main(PROG, "NanoEuler: a GPT-class model trained from scratch on the CPU. The model and its files: "
                       "CONTRACT.md. The GPU engine, with the same modes: nanoeuler_cuda.py.",
                       {name: (text, checked(fn)) for name, (text, fn) in MODES.items()}, LETTERS,
                       sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())

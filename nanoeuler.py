"""
nanoeuler.py -- a GPT-class language model trained from scratch on the CPU.

The CPU engine and the reference of the project: every forward and backward pass is written by hand
(numpy for the big matrix products, Numba for everything else), checked in float64 by gradcheck.py, and
the GPU engine (nanoeuler_cuda.py) is checked against it. The model contract is SPEC.md: a decoder-only
transformer whose residual stream is integrated by forward-Euler steps x = x + f(x), with RMSNorm, RoPE,
grouped-query attention, SwiGLU and multi-token-prediction (MTP) heads.

Sections: config | parameters | layers (forward next to backward) | model | optimiser | data |
checkpoints | sampling | SFT | chat | training | bench | main.
"""
import argparse
import ctypes
import functools
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields

import numpy as np

try:
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic, overload
    from threadpoolctl import threadpool_limits
except ImportError as e:  # one clear line instead of a traceback
    sys.exit(f"error: {e.name} is not installed (pip install -r requirements.txt)")

# How the CPU is used (each measured on 2 cores, small model, B=8, T=256):
# - Threads: a batch is cut into one shard of rows per core, and one thread runs the whole forward and
#   backward of its shard, with a BLAS held to one thread and serial Numba kernels that release the GIL.
#   No pool hands work to another between ops (119 ms per step against 169 with BLAS and Numba each
#   parallel inside every op). NANOEULER_THREADS overrides the number of threads.
# - Memory: glibc hands big freed blocks back to the OS at once, and every step then faults its fresh
#   activation pages back in (17% of a step). mallopt keeps blocks up to 32 MB and 1 GB of free heap.
# - Kernels: fastmath lets LLVM vectorise the reductions, and error_model="numpy" drops the zero-division
#   checks that kept it from vectorising any loop with a division (SwiGLU: 6x faster).
threadpool_limits(1, user_api="blas")
_threads = os.environ.get("NANOEULER_THREADS", "")
if _threads and not (_threads.isdigit() and int(_threads) > 0):
    sys.exit(f"error: NANOEULER_THREADS={_threads!r} is not a positive whole number")
N_THREADS = int(_threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                             else os.cpu_count() or 1))
try:
    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallopt(-3, 32 << 20)                    # M_MMAP_THRESHOLD
    _libc.mallopt(-1, 1 << 30)                     # M_TRIM_THRESHOLD
except OSError:                                    # not glibc: nothing to tune
    pass
KERNEL_OPTIONS = dict(nogil=True, cache=True, fastmath=True, error_model="numpy")

import bpe

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.environ.get("NANOEULER_CACHE", os.path.join(HERE, "data", "cache"))   # tokenizers and token files
EOT = "<|endoftext|>"


def die(msg):
    """Bad input ends the program with one line on stderr and a non-zero exit, never a traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


# ----------------------------------------------------------------------------------------------------
# config

@dataclass
class Config:
    dim: int          # D, width of the residual stream
    n_heads: int      # Hq query heads
    n_kv_heads: int   # Hkv key/value heads (query head j reads kv head j // (Hq/Hkv))
    n_layers: int     # L
    ctx: int          # longest sequence
    vocab: int        # V
    ffn: int          # F, SwiGLU hidden width
    n_mtp: int        # output heads: head k predicts token t+1+k
    mtp_weight: float = 0.3

    @property
    def head_dim(self):
        return self.dim // self.n_heads

    def to_json(self):
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(s):
        d = json.loads(s)
        known = {f.name for f in fields(Config)}
        return Config(**{k: v for k, v in d.items() if k in known})


CONFIGS = {
    "tiny": Config(dim=32, n_heads=4, n_kv_heads=2, n_layers=3, ctx=64, vocab=300, ffn=96, n_mtp=3),
    "small": Config(dim=128, n_heads=4, n_kv_heads=2, n_layers=4, ctx=512, vocab=512, ffn=384, n_mtp=3),
    "big_cpu": Config(dim=256, n_heads=4, n_kv_heads=2, n_layers=8, ctx=512, vocab=4096, ffn=768, n_mtp=3),
    "big": Config(dim=768, n_heads=12, n_kv_heads=4, n_layers=16, ctx=512, vocab=4096, ffn=2048, n_mtp=4),
}


# ----------------------------------------------------------------------------------------------------
# parameters: one flat buffer, named views in SPEC order

def param_shapes(cfg):
    D, hd, F = cfg.dim, cfg.head_dim, cfg.ffn
    shapes = [("tok_emb", (cfg.vocab, D))]
    for i in range(cfg.n_layers):
        shapes += [(f"layers.{i}.attn_norm", (D,)),
                   (f"layers.{i}.wq", (cfg.n_heads * hd, D)),
                   (f"layers.{i}.wk", (cfg.n_kv_heads * hd, D)),
                   (f"layers.{i}.wv", (cfg.n_kv_heads * hd, D)),
                   (f"layers.{i}.wo", (D, cfg.n_heads * hd)),
                   (f"layers.{i}.ffn_norm", (D,)),
                   (f"layers.{i}.w1", (F, D)),
                   (f"layers.{i}.w3", (F, D)),
                   (f"layers.{i}.w2", (D, F))]
    shapes += [("norm", (D,))] + [(f"heads.{k}", (cfg.vocab, D)) for k in range(cfg.n_mtp)]
    return shapes


def num_params(cfg):
    return sum(int(np.prod(s)) for _, s in param_shapes(cfg))


class Params:
    """One flat buffer holding every tensor; p[name] is a view of it with the SPEC shape.
    Gradients and Adam moments use the same class, so they share the layout."""

    def __init__(self, cfg, dtype=np.float32, flat=None):
        self.cfg = cfg
        self.flat = np.zeros(num_params(cfg), dtype) if flat is None else flat
        assert self.flat.shape == (num_params(cfg),)
        self.offsets, self.views, off = {}, {}, 0
        for name, shape in param_shapes(cfg):
            n = int(np.prod(shape))
            self.offsets[name] = (off, off + n)
            self.views[name] = self.flat[off:off + n].reshape(shape)
            off += n

    def __getitem__(self, name):
        return self.views[name]

    @property
    def names(self):
        return list(self.views)

    def items(self):
        return self.views.items()

    def rows(self, first, last):
        """Consecutive matrices with the same input width as one (rows, in) view: wq|wk|wv, w1|w3, heads."""
        start, end = self.offsets[first][0], self.offsets[last][1]
        return self.flat[start:end].reshape(-1, self.views[first].shape[1])

    def astype(self, dtype):
        return Params(self.cfg, dtype, self.flat.astype(dtype))

    @staticmethod
    def init(cfg, seed=0, dtype=np.float32):
        rng = np.random.default_rng(seed)
        P = Params(cfg, dtype)
        for name, view in P.items():
            if view.ndim == 1:
                view[:] = 1.0                                   # norm weights
            else:
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith((".wo", ".w2")) else 0.02
                view[:] = rng.normal(0.0, std, view.shape)
        return P


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
        rstd[n] = 1.0 / np.sqrt(ss / D + 1e-5)
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

@functools.cache                                   # read-only tables, made once per shape and dtype
def rope_tables(ctx, hd, dtype):
    freqs = 10000.0 ** (-np.arange(0, hd // 2) * 2.0 / hd)         # f_i = theta^(-2i/hd)
    angles = np.arange(ctx)[:, None] * freqs[None, :]              # (ctx, hd/2)
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    cos.flags.writeable = sin.flags.writeable = False                # shared by every caller
    return cos, sin


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
def _causal_softmax(S, t0, G, scale):
    """S (B, Hkv, R, K) unscaled scores of the query rows of positions t0.. -> softmax(scale * S) in place.
    Row r is position t = t0 + r // G and sees keys 0..t (the rest become 0)."""
    B, H, R, _ = S.shape
    for b, h, r in np.ndindex(B, H, R):
        row = S[b, h, r]
        t = t0 + r // G
        m = row[0]
        for j in range(1, t + 1):
            m = max(m, row[j])
        z = 0.0
        for j in range(t + 1):
            e = fexp((row[j] - m) * scale)
            row[j] = e
            z += e
        inv = 1.0 / z
        for j in range(t + 1):
            row[j] *= inv
        row[t + 1:] = 0.0


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
            m = row[0]
            for v in range(1, V):
                m = max(m, row[v])
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


def mtp_targets(targets, n_mtp):
    """targets (B, T) -> (n_mtp, B, T): head k's target at t is targets[t+k] when t+k < T, else -1."""
    B, T = targets.shape
    out = np.full((n_mtp, B, T), -1, np.int32)
    for k in range(n_mtp):
        out[k, :, :T - k] = targets[:, k:]
    return out


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


def mtp_scales(targets, n_mtp, mtp_weight, counts=None):
    """Per head k: the number of counted targets, and the scale weight_k / count_k of its softmax gradient
    (weight 1 for head 0, mtp_weight / (n_mtp - 1) for the others; 0 for a head with no target)."""
    if counts is None:
        counts = np.array([int((targets[:, k:] >= 0).sum()) for k in range(n_mtp)])
    weights = np.array([1.0] + [mtp_weight / max(n_mtp - 1, 1)] * (n_mtp - 1))
    return counts, np.where(counts > 0, weights / np.maximum(counts, 1), 0.0)


def mtp_objective(ces, mtp_weight):
    """CE_0 + mtp_weight * mean(CE_1 .. CE_{n-1}) from the per-head means."""
    return ces[0] + (mtp_weight * float(np.mean(ces[1:])) if len(ces) > 1 else 0.0)


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
    return ThreadPoolExecutor(N_THREADS, thread_name_prefix="nanoeuler")


def per_part(fn, n):
    """[fn(i, part) for each part i of range(n)] (slices, in order), one part per thread (N_THREADS):
    the shards of rows of a batch, or the parts of a flat buffer."""
    k = min(n, N_THREADS)
    parts = [slice(i * n // k, (i + 1) * n // k) for i in range(k)]
    if k == 1:
        return [fn(0, parts[0])]
    return list(_thread_pool().map(fn, range(k), parts))


def _batch_losses(cfg, shard_ces):
    """The batch's objective and per-head CE: the shards' partial means add up (mtp_loss)."""
    ces = [float(sum(c[k] for c in shard_ces)) for k in range(cfg.n_mtp)]
    return mtp_objective(ces, cfg.mtp_weight), ces


def loss_and_grads(P, idx, targets, grads=None):
    """(objective, per-head CE, gradient) of one batch. Each shard's gradient goes to its own buffer in the
    list grads (kept between steps by the caller; grown here as needed); they are summed into grads[0] in
    shard order, so the result does not depend on the timing of the threads."""
    grads = [] if grads is None else grads
    grads += [Params(P.cfg, P.flat.dtype) for _ in range(min(len(idx), N_THREADS) - len(grads))]
    counts, _ = mtp_scales(targets, P.cfg.n_mtp, P.cfg.mtp_weight)

    def shard(i, rows):
        objective, ces, acts = forward(P, idx[rows], targets[rows], want_grad=True, counts=counts)
        if math.isfinite(objective):                 # a NaN step is dropped whole (Trainer.step)
            backward(P, acts, grads[i])
        return ces

    shard_ces = per_part(shard, len(idx))

    def add_shards(i, part):
        for G in grads[1:len(shard_ces)]:
            grads[0].flat[part] += G.flat[part]

    if len(shard_ces) > 1:
        per_part(add_shards, grads[0].flat.size)
    return (*_batch_losses(P.cfg, shard_ces), grads[0])


def forward_loss(P, idx, targets):
    """(objective, per-head CE) of one batch, no gradient."""
    counts, _ = mtp_scales(targets, P.cfg.n_mtp, P.cfg.mtp_weight)
    shard_ces = per_part(lambda i, rows: forward(P, idx[rows], targets[rows], counts=counts)[1], len(idx))
    return _batch_losses(P.cfg, shard_ces)


def model_flops_per_token(cfg, T):
    """Training FLOPs per token: 6 per matrix weight (forward + backward) plus attention's score and value
    products (6 * 2 * T * D per layer: the full T x T products, as usual, though the causal chunks skip
    part of them)."""
    matrix = num_params(cfg) - cfg.vocab * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim   # no embedding/norms
    return 6 * matrix + 12 * cfg.n_layers * T * cfg.n_heads * cfg.head_dim


# ----------------------------------------------------------------------------------------------------
# optimiser: AdamW with decoupled weight decay on matrices and embeddings, global grad-norm clipping,
# linear warm-up then cosine decay to 10% of the peak rate

def decay_mask(cfg, dtype=np.float32):
    """1 where weight decay applies (every matrix and the embedding), 0 on norm weights."""
    mask = Params(cfg, dtype)
    for name, view in mask.items():
        view[:] = 0.0 if view.ndim == 1 else 1.0
    return mask.flat


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


def lr_at(step, total_steps, peak_lr, warmup):
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


class AdamW:
    def __init__(self, P, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0):
        self.m, self.v = Params(P.cfg, P.flat.dtype), Params(P.cfg, P.flat.dtype)
        self.mask = decay_mask(P.cfg, P.flat.dtype)
        self.lr, self.beta1, self.beta2, self.eps, self.wd, self.clip = lr, beta1, beta2, eps, weight_decay, clip
        self.step_count = 0

    def step(self, P, G, lr):
        """Clips the global gradient norm to self.clip and updates P in place; returns the norm."""
        norm = grad_norm(G)
        scale = min(1.0, self.clip / (norm + 1e-6))
        self.step_count += 1
        per_part(lambda i, part: adamw_step(P.flat[part], G.flat[part], self.m.flat[part], self.v.flat[part],
                                            self.mask[part], lr, self.beta1, self.beta2, self.eps, self.wd,
                                            self.step_count, scale), P.flat.size)
        return norm


# ----------------------------------------------------------------------------------------------------
# data: uint16 token files read through a memmap, a train/validation split, the embedded default corpus

def read_text(path):
    """A corpus file as str; missing, empty or non-text files end the program with one line."""
    if not os.path.isfile(path):
        die(f"data file not found: {path}")
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.strip():
        die(f"data file is empty: {path}")
    if b"\x00" in raw[:1 << 20]:
        die(f"data file is not text (NUL bytes): {path}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        die(f"data file is not UTF-8 text ({e.reason} at byte {e.start}): {path}")


def load_tokens(path, vocab=None):
    """A raw little-endian uint16 token file (nanoGPT's train.bin) as a read-only memmap."""
    if not os.path.isfile(path):
        die(f"token file not found: {path}")
    size = os.path.getsize(path)
    if size == 0:
        die(f"token file is empty: {path}")
    if size % 2:
        die(f"token file has an odd number of bytes, not uint16 tokens: {path}")
    tokens = np.memmap(path, dtype="<u2", mode="r")
    if vocab is not None:
        top = int(tokens.max())
        if top >= vocab:
            die(f"token file {path} holds id {top}, outside the vocabulary of {vocab}")
    return tokens


def default_corpus():
    """English prose that ships with the interpreter: the pydoc topics (statements, types, operators)."""
    from pydoc_data.topics import topics
    text = f"\n{EOT}\n".join(topics[k].strip() for k in sorted(topics))
    return text, f"embedded default corpus: Python's pydoc_data topics ({len(text) / 1e6:.2f} MB, no download)"


def load_tokenizer(path):
    try:
        return bpe.Tokenizer.load(path)
    except (OSError, ValueError) as e:
        die(f"bad tokenizer file: {e}")


def prepare_data(data_path, vocab, cache_dir):
    """Corpus -> (uint16 tokens, tokenizer of at most vocab ids). A .bin file is taken as tokens and needs
    its tokenizer beside it (NAME.bpe or tokenizer.bpe); a text file (or the embedded default, for None) is
    tokenised once and cached under cache_dir."""
    if data_path and data_path.endswith(".bin"):
        tok_path = next((p for p in (data_path[:-4] + ".bpe", os.path.join(os.path.dirname(data_path), "tokenizer.bpe"))
                         if os.path.isfile(p)), None)
        if tok_path is None:
            die(f"no tokenizer for {data_path}: put it beside it as {os.path.basename(data_path)[:-4]}.bpe or tokenizer.bpe")
        tok = load_tokenizer(tok_path)
        print(f"data: {data_path} (tokenizer {tok_path})")
        return load_tokens(data_path, tok.vocab_size), tok
    if data_path:
        text, what = read_text(data_path), f"data: {data_path}"
        key = f"{os.path.basename(data_path)}.{os.path.getsize(data_path)}.{int(os.path.getmtime(data_path))}"
    else:
        text, what = default_corpus()
        key = f"default.{len(text)}"
    print(what)
    os.makedirs(cache_dir, exist_ok=True)
    base = os.path.join(cache_dir, f"{key}.v{vocab}")
    if os.path.exists(base + ".bin") and os.path.exists(base + ".bpe"):
        tok = load_tokenizer(base + ".bpe")
        return load_tokens(base + ".bin", vocab), tok
    t0 = time.time()
    # the tokenizer learns its merges from the first 20 MB: enough for a 4096 vocabulary, and quick
    tok = bpe.Tokenizer.train(text[:20_000_000], vocab, verbose=len(text) > 5e6)
    if data_path:                                    # every core, streamed from the file
        n_tokens, n_bytes, _ = bpe.encode_file_parallel(tok, data_path, base + ".bin", verbose=len(text) > 5e6)
    else:
        ids = np.array(tok.encode(text, allowed_special="all"), dtype="<u2")
        with open(base + ".bin.tmp", "wb") as f:
            f.write(ids.tobytes())
        os.replace(base + ".bin.tmp", base + ".bin")
        n_tokens, n_bytes = len(ids), len(text.encode())
    tok.save(base + ".bpe.tmp")
    os.replace(base + ".bpe.tmp", base + ".bpe")
    print(f"tokenizer: vocab {tok.vocab_size}, {n_tokens:,} tokens, {n_bytes / n_tokens:.2f} bytes/token "
          f"({time.time() - t0:.1f} s)")
    return load_tokens(base + ".bin", vocab), tok


class Batches:
    """Random windows of T+1 tokens from one split (the first 1-val_frac of the file trains, the rest
    validates). The generator state is the data position, saved in checkpoints for exact resumption."""

    def __init__(self, tokens, B, T, seed=0, split="train", val_frac=0.1):
        n_val = max(T + 2, int(len(tokens) * val_frac))
        self.tokens = tokens[:len(tokens) - n_val] if split == "train" else tokens[len(tokens) - n_val:]
        if len(self.tokens) < T + 2:
            die(f"{split} split has {len(self.tokens)} tokens, too few for windows of {T}; use more data or a smaller --seq")
        self.B, self.T = B, T
        self.rng = np.random.default_rng(seed)

    def next(self):
        starts = self.rng.integers(0, len(self.tokens) - self.T - 1, self.B)
        w = np.stack([np.asarray(self.tokens[s:s + self.T + 1]) for s in starts]).astype(np.int32)
        return w[:, :-1], w[:, 1:]

    def state(self):
        return self.rng.bit_generator.state

    def set_state(self, state):
        self.rng.bit_generator.state = state


# ----------------------------------------------------------------------------------------------------
# checkpoints: one .npz (SPEC.md), written to a temporary file and renamed, so a crash never leaves half

def save_checkpoint(path, P, tok, state=None, extra=None):
    """state (for resuming): {"step", "adam_m", "adam_v" (Params), "data" (loader state), "train" (args)}."""
    cfg_json = json.loads(P.cfg.to_json())
    cfg_json.update(extra or {})
    arrays = {name: np.asarray(view, np.float32) for name, view in P.items()}
    arrays["config"] = np.array(json.dumps(cfg_json))
    arrays["tokenizer"] = np.array(tok.to_string())
    if state is not None:
        arrays["step"] = np.array(state["step"], np.int64)
        for name in P.names:
            arrays[f"adam_m.{name}"] = np.asarray(state["adam_m"][name], np.float32)
            arrays[f"adam_v.{name}"] = np.asarray(state["adam_v"][name], np.float32)
        arrays["train_state"] = np.array(json.dumps({k: state[k] for k in state if k not in ("adam_m", "adam_v")}))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path, want_state=False):
    """-> (Params float32, tokenizer, state or None, config extras). Bad files end with one line."""
    if not os.path.isfile(path):
        die(f"checkpoint not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            files = set(z.files)
            meta = json.loads(str(z["config"]))
            cfg = Config.from_json(str(z["config"]))
            P = Params(cfg)
            for name, view in P.items():
                if name not in files:
                    die(f"checkpoint {path} lacks tensor {name}")
                arr = z[name]
                if arr.shape != view.shape:
                    die(f"checkpoint {path}: {name} has shape {arr.shape}, config says {view.shape}")
                view[:] = arr
            tok = bpe.Tokenizer.from_string(str(z["tokenizer"]))
            state = None
            if want_state and "train_state" in files:
                state = json.loads(str(z["train_state"]))
                state["step"] = int(z["step"])
                state["adam_m"], state["adam_v"] = Params(cfg), Params(cfg)
                for name in P.names:
                    state["adam_m"][name][:] = z[f"adam_m.{name}"]
                    state["adam_v"][name][:] = z[f"adam_v.{name}"]
    except SystemExit:
        raise
    except Exception as e:  # zip, JSON or tokenizer damage: say what, in one line
        die(f"checkpoint {path} is corrupt or not a NanoEuler checkpoint ({type(e).__name__}: {e})")
    if tok.vocab_size > cfg.vocab:
        die(f"checkpoint {path}: tokenizer has {tok.vocab_size} tokens, more than the config's {cfg.vocab}")
    if not np.isfinite(P.flat).all():
        die(f"checkpoint {path} holds NaN or infinite weights")
    extras = {k: v for k, v in meta.items() if k not in asdict(cfg)}
    return P, tok, state, extras


# ----------------------------------------------------------------------------------------------------
# sampling: head 0 only, with a KV cache of rotated keys and values per layer

def sample_token(logits, temperature, top_k, rng):
    """One id from a (V,) row of logits: greedy at temperature 0, else softmax(logits / T) over the top k."""
    logits = np.asarray(logits, np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits / temperature
    if top_k and top_k < len(z):
        z[z < np.partition(z, -top_k)[-top_k]] = -np.inf
    p = np.exp(z - z.max())
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(z) - 1))


class KVCache:
    def __init__(self, cfg, dtype=np.float32):
        shape = (cfg.n_layers, cfg.n_kv_heads, cfg.ctx, cfg.head_dim)
        self.k, self.v, self.len = np.zeros(shape, dtype), np.zeros(shape, dtype), 0
        self.cos, self.sin = rope_tables(cfg.ctx, cfg.head_dim, dtype)


def forward_cached(P, ids, cache):
    """Runs tokens ids (Tn,) at positions cache.len.. through the model, appending their keys and values
    to the cache; returns head-0 logits (Tn, V). The same layer ops as training, attention over the cache."""
    cfg = P.cfg
    hd, Cq, Ck = _dims(cfg)
    Hq, Hkv, G = cfg.n_heads, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads
    Tn, start = len(ids), cache.len
    end = start + Tn
    assert end <= cfg.ctx
    cos, sin = cache.cos, cache.sin
    pos = np.arange(start, end, dtype=np.int32)
    # query row (g, t) sees keys 0..start+t
    mask = np.arange(end)[None, :] > (start + np.arange(Tn))[:, None]          # (Tn, end)
    x = embedding_forward(P["tok_emb"], np.asarray(ids, np.int32))
    for i in range(cfg.n_layers):
        L = f"layers.{i}."
        h, _ = rmsnorm_forward(x, P[L + "attn_norm"])
        qkv = h @ P.rows(L + "wq", L + "wv").T
        q = rope_forward(qkv[:, :Cq].reshape(Tn, Hq, hd), pos, cos, sin)
        cache.k[i, :, start:end] = rope_forward(qkv[:, Cq:Cq + Ck].reshape(Tn, Hkv, hd), pos, cos, sin).transpose(1, 0, 2)
        cache.v[i, :, start:end] = qkv[:, Cq + Ck:].reshape(Tn, Hkv, hd).transpose(1, 0, 2)
        qg = q.reshape(Tn, Hkv, G, hd).transpose(1, 2, 0, 3)                     # (Hkv, G, Tn, hd)
        s = np.matmul(qg, cache.k[i, :, None, :end].transpose(0, 1, 3, 2)) / math.sqrt(hd)
        s[..., mask] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        a = np.matmul(p, cache.v[i, :, None, :end])                             # (Hkv, G, Tn, hd)
        x = x + a.transpose(2, 0, 1, 3).reshape(Tn, Cq) @ P[L + "wo"].T
        h, _ = rmsnorm_forward(x, P[L + "ffn_norm"])
        x = x + swiglu_forward(h @ P.rows(L + "w1", L + "w3").T) @ P[L + "w2"].T
    cache.len = end
    hf, _ = rmsnorm_forward(x, P["norm"])
    return hf @ P["heads.0"].T


def check_prompt(n_tokens, ctx):
    if n_tokens == 0:
        die("the prompt is empty")
    if n_tokens >= ctx:
        die(f"the prompt is {n_tokens} tokens, longer than the context of {ctx} minus one")


def generate(P, prompt_ids, max_new, temperature=0.8, top_k=40, rng=None, cached=True):
    """Yields up to max_new sampled ids (stops at the context). cached=False reruns the whole sequence
    through the training forward at every step: slow, kept to check the cache."""
    rng = rng if rng is not None else np.random.default_rng(0)
    ids = list(prompt_ids)
    cache = KVCache(P.cfg, P.flat.dtype)
    logits = forward_cached(P, ids, cache)[-1] if cached else None
    for _ in range(max_new):
        if not cached:
            logits = forward(P, np.array([ids], np.int32))[-1]
        t = sample_token(logits, temperature, top_k, rng)
        yield t
        ids.append(t)
        if len(ids) >= P.cfg.ctx:
            return
        if cached:
            logits = forward_cached(P, [t], cache)[-1]


# ----------------------------------------------------------------------------------------------------
# supervised fine-tuning: the Alpaca template of SPEC.md, loss on the response and the closing token only

def format_prompt(instruction, input=""):
    """The template up to and including '### Response:\\n'."""
    if input:
        return ("Below is an instruction that describes a task, paired with an input that provides further "
                "context.\nWrite a response that appropriately completes the request.\n\n"
                f"### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
    return ("Below is an instruction that describes a task.\nWrite a response that appropriately completes "
            f"the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def sft_example(tok, ex, T):
    """-> (ids, targets) of at most T positions; targets[t] = ids[t+1] where that token belongs to the
    response or its <|endoftext|>, else -1. None when not even one response token fits."""
    prompt = tok.encode(format_prompt(ex["instruction"], ex.get("input", "")))
    seq = prompt + tok.encode(ex["output"]) + [tok.eot]
    seq = seq[:T + 1]
    if len(seq) <= len(prompt):
        return None
    ids = np.array(seq[:-1], np.int32)
    targets = np.array(seq[1:], np.int32)
    targets[:len(prompt) - 1] = -1                                  # positions whose next token is prompt
    return ids, targets


def builtin_sft_examples():
    """A small instruction set that needs no download, made from the embedded corpus: each pydoc topic
    gives questions whose answers are its opening sentences."""
    from pydoc_data.topics import topics
    examples = []
    for key in sorted(topics):
        lines = [l.strip() for l in topics[key].strip().splitlines()]
        title = lines[0]
        body = " ".join(l for l in lines[1:] if l and not set(l) <= set("*=-^"))
        sentences = [s.strip() + "." for s in body.split(". ") if len(s.split()) > 3][:2]
        if not sentences:
            continue
        answer = " ".join(sentences)[:400]
        examples.append({"instruction": f"Explain {title[0].lower() + title[1:]}.", "input": "", "output": answer})
        examples.append({"instruction": "What is this topic about?", "input": title, "output": answer})
        examples.append({"instruction": "Give the title of this text.", "input": answer, "output": title})
    return examples


def load_sft_data(path):
    """Alpaca-style JSON list of {instruction, input, output}; None gives the built-in set."""
    if path is None:
        return builtin_sft_examples()
    if not os.path.isfile(path):
        die(f"SFT data not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        die(f"SFT data {path} is not valid JSON ({e})")
    if not isinstance(data, list) or not data or not all(
            isinstance(d, dict) and isinstance(d.get("instruction"), str) and isinstance(d.get("output"), str)
            for d in data):
        die(f"SFT data {path} must be a non-empty JSON list of objects with instruction, input, output")
    return data


class SFTBatches:
    """Batches of B examples padded with <|endoftext|> to the longest, or with fixed=True to exactly (B, T)
    (an engine with preallocated buffers); padding targets are -1. Same interface as Batches."""

    def __init__(self, tok, examples, B, T, seed=0, fixed=False):
        encoded = [sft_example(tok, ex, T) for ex in examples]
        self.examples = [e for e in encoded if e is not None]
        if not self.examples:
            die("no SFT example fits the context")
        self.B, self.T, self.fixed, self.eot = B, T, fixed, tok.eot
        self.rng = np.random.default_rng(seed)

    def batch(self, chosen):
        B, T = (self.B, self.T) if self.fixed else (len(chosen), max(len(self.examples[i][0]) for i in chosen))
        x = np.full((B, T), self.eot, np.int32)
        y = np.full((B, T), -1, np.int32)
        for r, i in enumerate(chosen):
            ids, targets = self.examples[i]
            x[r, :len(ids)], y[r, :len(ids)] = ids, targets
        return x, y

    def next(self):
        return self.batch(self.rng.integers(0, len(self.examples), self.B))

    def state(self):
        return self.rng.bit_generator.state

    def set_state(self, state):
        self.rng.bit_generator.state = state


# ----------------------------------------------------------------------------------------------------
# chat: a REPL that streams the model's answer; a chat checkpoint wraps the prompt in the template

def chat_repl(tok, generate_fn, template, max_new, ctx):
    """generate_fn(prompt_ids, max_new) yields ids. EOF ends the session; Ctrl-C stops only the answer."""
    import codecs
    kind = "instruction model: your line is wrapped in the SFT template" if template else \
        "base model: it continues your text"
    print(f"chat ({kind}); Ctrl-D ends, Ctrl-C stops an answer", flush=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print()
            continue
        if not line.strip():
            continue
        ids = tok.encode(format_prompt(line) if template else line)
        if len(ids) >= ctx:
            print(f"error: the prompt is {len(ids)} tokens, longer than the context of {ctx} minus one", flush=True)
            continue
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            for t in generate_fn(ids, max_new):
                if t == tok.eot:
                    break
                print(decoder.decode(tok.decode_bytes([t])), end="", flush=True)
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        print(decoder.decode(b"", final=True), flush=True)


# ----------------------------------------------------------------------------------------------------
# training: one loop for pretraining and SFT; progress lines, a JSONL log, atomic checkpoints

class StopFlag:
    """Ctrl-C sets a flag that the loop reads between steps, so a checkpoint never holds half a step."""

    def __init__(self):
        import signal
        self.stop = False
        self.previous = signal.signal(signal.SIGINT, self.handler)

    def handler(self, signum, frame):
        if self.stop:                                    # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.stop = True
        print("\n[Ctrl-C: finishing this step, then saving a checkpoint]", flush=True)


def evaluate(batch_loss, tokens, B, T, n_batches, bytes_per_token):
    """Head-0 validation loss over fixed batches of the validation split, and bits per byte.
    batch_loss(x, y) -> head-0 CE of one batch, on whichever engine."""
    val = Batches(tokens, B, T, seed=1234, split="val")
    loss = float(np.mean([batch_loss(*val.next()) for _ in range(n_batches)]))
    return loss, loss / math.log(2) / bytes_per_token


def bytes_per_token(tok, tokens):
    sample = np.asarray(tokens[-200_000:])
    return len(tok.decode_bytes(sample.tolist())) / len(sample)


class Trainer:
    """The CPU engine's side of train_loop: step() runs one AdamW step, results() hands back the losses.
    The GPU engine has a class with the same methods whose steps run ahead of the host."""
    sync_every_step = True

    def __init__(self, P, state=None):
        self.P, self.opt, self.pending = P, AdamW(P, 0.0), []
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


def train_loop(trainer, tok, batches, args, out_dir, val_fn=None, extra=None, start=0):
    """Steps start .. args['steps']-1 of any engine's trainer on batches.next(): one JSONL line per step,
    a progress line every log_every steps, validation, samples, checkpoints, Ctrl-C and NaN handling.
    args: steps, lr, warmup, eval_every, sample_every, ckpt_every, log_every, stop_after.
    val_fn() -> (val loss, bits per byte). Returns the last validation loss."""
    ckpt_path = os.path.join(out_dir, "ckpt.npz")
    log = open(os.path.join(out_dir, "train_log.jsonl"), "a")
    flag = StopFlag()
    steps, val_loss, t_start = args["steps"], None, time.time()

    def checkpoint(step):
        P, m, v = trainer.host_state()
        save_checkpoint(ckpt_path, P, tok, {"step": step, "adam_m": m, "adam_v": v, "data": batches.state(),
                                            "train": args}, extra)

    step, pending, t_last = start, [], time.time()
    t_print, tokens_since_print = t_last, 0                        # the progress line's rate: since the last one
    while step < steps:
        lr = lr_at(step, steps, args["lr"], args["warmup"])
        x, y = batches.next()
        trainer.step(x, y, lr)
        step += 1
        pending.append((step, lr, x.size))
        stopping = flag.stop or (args.get("stop_after") and step - start >= args["stop_after"])
        evaluating = val_fn is not None and (step % args["eval_every"] == 0 or step == steps)
        saving = step % args["ckpt_every"] == 0 or step == steps or stopping
        printing = step % args["log_every"] == 0 or step == steps or evaluating
        if not (trainer.sync_every_step or printing or saving or stopping):
            continue
        # read back the steps since the last sync: the device may have run ahead of the host until here
        results, now = trainer.results(), time.time()
        dt = (now - t_last) / len(pending)
        tokens_since_print += sum(n for _, _, n in pending)
        for (s, s_lr, n_tokens), (objective, ces, norm) in zip(pending, results):
            if not math.isfinite(objective):
                die(f"loss is {objective} at step {s}; stopped, the last good checkpoint is kept ({ckpt_path})")
            rec = {"step": s, "loss": round(ces[0], 5), "objective": round(objective, 5), "lr": s_lr,
                   "grad_norm": round(norm, 4), "ms": round(dt * 1e3, 2), "tok_s": round(n_tokens / dt)}
            if s == step and evaluating:
                val_loss, bpb = val_fn()
                rec.update(val_loss=round(val_loss, 5), **({"val_bpb": round(bpb, 5)} if bpb else {}))
            log.write(json.dumps(rec) + "\n")
        log.flush()
        if printing:
            eta = (steps - step) * (time.time() - t_start) / (step - start)
            rate = tokens_since_print / (now - t_print)
            t_print, tokens_since_print = time.time(), 0
            msg = (f"step {step:5d}/{steps} | loss {ces[0]:.4f} | lr {lr:.2e} | {rate:,.0f} tok/s | "
                   f"ETA {eta / 60:.1f} min")
            if evaluating:
                msg += f" | val loss {rec['val_loss']:.4f}" + (f" | val bpb {rec['val_bpb']:.3f}" if "val_bpb" in rec else "")
            print(msg, flush=True)
        if args.get("sample_every") and step % args["sample_every"] == 0 and step < steps:
            show_sample(trainer.host_state()[0], tok, "\n", 64, seed=step)
        if saving:
            checkpoint(step)
        pending, t_last = [], time.time()
        if stopping:
            break
    log.close()
    print(f"checkpoint: {ckpt_path} (step {step}/{steps}, {(time.time() - t_start) / 60:.1f} min)")
    if flag.stop:
        sys.exit(130)
    return val_loss


def show_sample(P, tok, prompt, n, seed=0, temperature=0.8, top_k=40):
    ids = tok.encode(prompt)
    out = list(generate(P, ids, n, temperature, top_k, np.random.default_rng(seed)))
    print("--- sample ---\n" + tok.decode(ids + out) + "\n--------------", flush=True)


# The small model's defaults: on the embedded corpus (~215K tokens) validation loss is lowest near 1000
# steps (~5 epochs) and climbs after; longer runs pay on larger corpora (--steps).
TRAIN_DEFAULTS = dict(steps=1000, batch=8, seq=256, lr=3e-3, warmup=100, eval_every=100, sample_every=500,
                      ckpt_every=500, log_every=50, seed=0, stop_after=0, data=None)


def start_run(a, defaults, resume):
    """The start of a training run, shared by both engines. Fresh: the config defaults['config'], SPEC init.
    Resumed: the checkpoint in a.out with its optimiser state and its own arguments (flags given now
    override them; --stop-after applies to this run only). -> (P, tok, tokens, args, state, extra)."""
    os.makedirs(a.out, exist_ok=True)
    ckpt_path = os.path.join(a.out, "ckpt.npz")
    given = {k: v for k, v in vars(a).items() if k in defaults and v is not None}
    if resume:
        given.pop("config", None)                        # the checkpoint knows its config
        P, tok, state, extra = load_checkpoint(ckpt_path, want_state=True)
        if state is None:
            die(f"{ckpt_path} holds no training state to resume")
        args = {**defaults, **state["train"], **given, "stop_after": given.get("stop_after", 0)}
        print(f"resuming {ckpt_path} at step {state['step']}/{args['steps']}")
    else:
        if os.path.exists(ckpt_path) and not a.force:
            die(f"{ckpt_path} exists: resume it, start over with --force, or pick another --out")
        args, state, extra = {**defaults, **given}, None, {"kind": "base"}
    cfg = P.cfg if resume else CONFIGS[args["config"]]
    tokens, tok_data = prepare_data(args["data"], cfg.vocab, CACHE)
    if resume and tok_data.to_string() != tok.to_string():
        die("the data's tokenizer differs from the checkpoint's; resume with the same --data")
    if not resume:
        tok, P = tok_data, Params.init(cfg, args["seed"])
    if min(args["batch"], args["seq"], args["steps"]) < 1:
        die("--batch, --seq and --steps must be positive")
    if args["seq"] > cfg.ctx:
        die(f"--seq {args['seq']} is longer than the context of {cfg.ctx}")
    print(f"model: {args['config']} {cfg}, {num_params(cfg):,} parameters")
    return P, tok, tokens, args, state, extra


def cmd_train(a):
    defaults = dict(TRAIN_DEFAULTS, config=a.config, **({"lr": 1e-3} if a.config != "small" else {}))
    P, tok, tokens, args, state, extra = start_run(a, defaults, a.resume)
    batches = Batches(tokens, args["batch"], args["seq"], seed=args["seed"])
    if state is not None:
        batches.set_state(state["data"])
    bpt = bytes_per_token(tok, tokens)
    val_fn = lambda: evaluate(lambda x, y: forward_loss(P, x, y)[1][0], tokens, args["batch"], args["seq"], 8, bpt)
    if state is None:
        print("step 0: val loss {:.4f}, val bpb {:.3f}".format(*val_fn()))
    train_loop(Trainer(P, state), tok, batches, args, a.out, val_fn, extra, start=state["step"] if state else 0)
    loss, bpb = val_fn()
    print(f"final: val loss {loss:.4f} | val bpb {bpb:.3f} | {bpt:.2f} bytes/token")
    show_sample(P, tok, "\n", 200, seed=args["seed"])


def stream(tok, ids_iter, prefix=""):
    """Prints prefix, then each sampled id as soon as its UTF-8 characters are complete; -> count."""
    import codecs
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sys.stdout.write(prefix)
    n = 0
    for t in ids_iter:
        sys.stdout.write(decoder.decode(tok.decode_bytes([t])))
        sys.stdout.flush()
        n += 1
    print(decoder.decode(b"", final=True))
    return n


def cmd_sample(a):
    P, tok, _, _ = load_checkpoint(a.ckpt)
    ids = tok.encode(a.prompt)
    check_prompt(len(ids), P.cfg.ctx)
    stream(tok, generate(P, ids, a.tokens, a.temperature, a.top_k, np.random.default_rng(a.seed)), a.prompt)


def add_sft_flags(p, ckpt, out, batch, seq, lr):
    p.add_argument("--ckpt", default=ckpt, help="the base checkpoint")
    p.add_argument("--data", help="Alpaca JSON (default: the built-in instruction set, no download)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=out)
    p.add_argument("--force", action="store_true", help="overwrite the checkpoint in --out")


def run_sft(a, P, tok, make_trainer, batch_loss, fixed_shape=False):
    """Fine-tunes the base model P on instructions, for either engine: make_trainer() -> a train_loop
    trainer over P, batch_loss(x, y) -> head-0 CE. 1/20 of the examples validate (loss before and after)."""
    examples = load_sft_data(a.data)
    print(f"SFT data: {a.data or 'built-in instruction set (no download)'}, {len(examples)} examples")
    order = np.random.default_rng(a.seed).permutation(len(examples))
    n_val = max(1, len(examples) // 20)
    T = min(a.seq, P.cfg.ctx)
    batches = SFTBatches(tok, [examples[i] for i in order[n_val:]], a.batch, T, a.seed, fixed_shape)
    val = SFTBatches(tok, [examples[i] for i in order[:n_val]], a.batch, T, fixed=fixed_shape)
    ckpt_path = os.path.join(a.out, "ckpt.npz")
    if os.path.exists(ckpt_path) and not a.force:
        die(f"{ckpt_path} exists: use another --out or --force")
    os.makedirs(a.out, exist_ok=True)

    def val_fn():
        n = len(val.examples)
        return float(np.mean([batch_loss(*val.batch(range(i, min(n, i + a.batch)))) for i in range(0, n, a.batch)])), None

    before = val_fn()[0]
    print(f"SFT validation loss before: {before:.4f}")
    args = dict(TRAIN_DEFAULTS, steps=a.steps, lr=a.lr, warmup=min(20, a.steps // 10 + 1), batch=a.batch, seq=T,
                eval_every=max(1, a.steps // 5), sample_every=0, ckpt_every=10 ** 9, log_every=10, data=a.data)
    train_loop(make_trainer(), tok, batches, args, a.out, val_fn, extra={"kind": "chat"})
    after = val_fn()[0]
    print(f"SFT validation loss: before {before:.4f} -> after {after:.4f}; chat checkpoint {ckpt_path}")


def cmd_sft(a):
    P, tok, _, _ = load_checkpoint(a.ckpt)
    run_sft(a, P, tok, lambda: Trainer(P), lambda x, y: forward_loss(P, x, y)[1][0])


def cmd_chat(a):
    P, tok, _, extra = load_checkpoint(a.ckpt)
    rng = np.random.default_rng(a.seed)
    gen = lambda ids, n: generate(P, ids, n, a.temperature, a.top_k, rng)
    chat_repl(tok, gen, extra.get("kind") == "chat", a.tokens, P.cfg.ctx)


# ----------------------------------------------------------------------------------------------------
# bench: training step and sampling speed of `small` at B=8, T=256

def cmd_bench(a):
    """Training steps on real batches of the embedded corpus (a repeated batch would be memorised, and
    its vanishing probabilities underflow into slow denormal floats)."""
    cfg = CONFIGS[a.config]
    B, T = a.batch, a.seq
    tokens, _ = prepare_data(None, cfg.vocab, CACHE)
    batches = Batches(tokens, B, T)
    P = Params.init(cfg)
    trainer = Trainer(P)
    t0 = time.time()
    trainer.step(*batches.next(), 1e-3)
    print(f"config {a.config}: {num_params(cfg):,} parameters, B={B}, T={T}; first step (JIT load) {time.time() - t0:.2f} s")
    for _ in range(2):
        trainer.step(*batches.next(), 1e-3)
    times = []
    for _ in range(a.steps):
        x, y = batches.next()
        t0 = time.perf_counter()
        trainer.step(x, y, 1e-3)
        times.append(time.perf_counter() - t0)
    ms = float(np.median(times)) * 1e3
    flops = model_flops_per_token(cfg, T) * B * T
    print(f"train: {ms:.1f} ms/step (median of {a.steps}, min {min(times) * 1e3:.1f}) | "
          f"{B * T / ms * 1e3:,.0f} tokens/s | {flops / ms / 1e6:.1f} GFLOP/s")
    rng = np.random.default_rng(0)
    n = 128
    prompt = list(rng.integers(0, cfg.vocab, 16))
    t0 = time.perf_counter()
    out = list(generate(P, prompt, n, 0.8, 40, np.random.default_rng(0)))
    dt = time.perf_counter() - t0
    print(f"sample: {len(out) / dt:,.0f} tokens/s with the KV cache ({len(out)} tokens after a 16-token prompt)")


# ----------------------------------------------------------------------------------------------------
# main

class Parser(argparse.ArgumentParser):
    def error(self, message):                            # one line, not usage + traceback
        die(f"{message} (see {self.prog} --help)")


def add_train_flags(p, out):
    """The flags of a training run (both engines); those not given come from the defaults or, when
    resuming, from the checkpoint's run."""
    p.add_argument("--data", help="a UTF-8 text file, or a uint16 .bin token file with its .bpe beside it")
    for flag, typ in (("--steps", int), ("--batch", int), ("--seq", int), ("--lr", float), ("--warmup", int),
                      ("--seed", int), ("--eval-every", int), ("--sample-every", int), ("--ckpt-every", int),
                      ("--log-every", int)):
        p.add_argument(flag, dest=flag[2:].replace("-", "_"), type=typ)
    p.add_argument("--stop-after", dest="stop_after", type=int, help="stop (and checkpoint) after N steps of this run")
    p.add_argument("--out", default=out, help=f"folder for ckpt.npz and train_log.jsonl (default {out})")
    p.add_argument("--force", action="store_true", help="start over even if --out holds a checkpoint")


def add_sample_flags(p, ckpt, temperature):
    p.add_argument("--ckpt", default=ckpt)
    p.add_argument("--tokens", type=int, default=200, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-k", dest="top_k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)


def main(argv=None):
    p = Parser(prog="nanoeuler.py", description="NanoEuler: a GPT-class model trained from scratch on the CPU.")
    sub = p.add_subparsers(dest="mode", metavar="{train,sample,chat,sft,bench}", parser_class=Parser)

    t = sub.add_parser("train", help="pretrain (on the embedded default corpus unless --data)")
    t.add_argument("config", nargs="?", default="small", choices=["small", "big"],
                   help="small (1.05M parameters) or big (the ~10M CPU config)")
    add_train_flags(t, out="out")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")

    s = sub.add_parser("sample", help="generate text from a checkpoint")
    s.add_argument("--prompt", default="\n")
    add_sample_flags(s, ckpt="out/ckpt.npz", temperature=0.8)

    c = sub.add_parser("chat", help="talk to a checkpoint (a base model continues your text)")
    add_sample_flags(c, ckpt="out/ckpt.npz", temperature=0.7)

    f = sub.add_parser("sft", help="fine-tune a base checkpoint on instructions (Alpaca template)")
    add_sft_flags(f, ckpt="out/ckpt.npz", out="out_chat", batch=8, seq=256, lr=1e-3)

    b = sub.add_parser("bench", help="training and sampling speed")
    b.add_argument("config", nargs="?", default="small", choices=["small", "big_cpu"])
    b.add_argument("--batch", type=int, default=8)
    b.add_argument("--seq", type=int, default=256)
    b.add_argument("--steps", type=int, default=12)

    a = p.parse_args(argv)
    if a.mode is None:
        p.print_help()
        sys.exit(1)
    if a.mode == "train" and a.config == "big":
        a.config = "big_cpu"
    {"train": cmd_train, "sample": cmd_sample, "chat": cmd_chat, "sft": cmd_sft, "bench": cmd_bench}[a.mode](a)


if __name__ == "__main__":
    main()

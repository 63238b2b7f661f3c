"""
pipeline.py -- what both engines share, in numpy alone: the model contract's configs and parameter layout,
the objective's weighting, the learning-rate schedule, data, checkpoints, sampling rules, SFT data, the
chat loop, the training loop with its Trainer protocol, run set-up and the command-line flags.

The engines are peers on top of it: nanoeuler.py (CPU, Numba) and nanoeuler_cuda.py (GPU, CuPy). Neither
imports the other for training; the GPU's self-test and gradient check borrow the CPU engine as their
float64 reference. CONTRACT.md describes the model and the files this module reads and writes.

Library code raises UserError with a message that says what to do; each engine's main() prints it as one
`error:` line and exits non-zero.

Sections: errors | config | parameters | objective and schedule | data | checkpoints | sampling rules |
SFT | DPO | chat | training | command line.
"""
import argparse
import contextlib
import difflib
import functools
import glob
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, fields

import numpy as np

import bpe

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.environ.get("NANOEULER_CACHE", os.path.join(HERE, "data", "cache"))   # tokenizers and token files
EOT = "<|endoftext|>"


# ----------------------------------------------------------------------------------------------------
# errors: one type for every mistake a user can make; main() turns it into one line

class UserError(Exception):
    """Bad input, or a run that cannot go on. The message says what to do."""


def _one_line_hook(kind, value, tb, _default=sys.excepthook):
    """A UserError raised outside main() (at import: a missing package) still prints one line; a Ctrl-C there
    (loading Numba and the kernels takes a second) none, and the interpreter still ends with status 130."""
    if issubclass(kind, UserError):
        print(f"error: {value}", file=sys.stderr)
    elif not issubclass(kind, KeyboardInterrupt):
        _default(kind, value, tb)


sys.excepthook = _one_line_hook


# ----------------------------------------------------------------------------------------------------
# config: the contract's models, one name each, accepted by every mode of both engines

# The contract's fixed numbers (CONTRACT.md), used by both engines (the GPU's CUDA sources get them as
# #defines) and export.py. Numba freezes them into nanoeuler.py's cached kernels: after changing one,
# delete __pycache__. The MTP weighting is Config.mtp_weight below.
RMS_EPS = 1e-5          # RMSNorm: y = x / sqrt(mean(x^2) + RMS_EPS) * w
ROPE_THETA = 10000.0    # RoPE: the angle of pair i at position pos is pos * ROPE_THETA^(-2i/hd)


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


CONFIGS = {   # tiny: the tests and gradient checks; small: the CPU showcase; medium: ~10M, the CPU's larger
    "tiny": Config(dim=32, n_heads=4, n_kv_heads=2, n_layers=3, ctx=64, vocab=300, ffn=96, n_mtp=3),
    "small": Config(dim=128, n_heads=4, n_kv_heads=2, n_layers=4, ctx=512, vocab=512, ffn=384, n_mtp=3),
    "medium": Config(dim=256, n_heads=4, n_kv_heads=2, n_layers=8, ctx=512, vocab=4096, ffn=768, n_mtp=3),
    "big": Config(dim=768, n_heads=12, n_kv_heads=4, n_layers=16, ctx=512, vocab=4096, ffn=2048, n_mtp=4),
    "large": Config(dim=1024, n_heads=16, n_kv_heads=4, n_layers=22, ctx=1024, vocab=4096, ffn=2816, n_mtp=4),
}


def get_config(name):
    if name not in CONFIGS:
        raise UserError(f"unknown config {name!r}; the configs are {', '.join(CONFIGS)} (CONTRACT.md)")
    return CONFIGS[name]


def config_name(cfg):
    """The name of a config in CONFIGS, or 'custom'."""
    return next((n for n, c in CONFIGS.items() if c == cfg), "custom")


# ----------------------------------------------------------------------------------------------------
# parameters: one flat buffer, named views in the contract's order

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
    """One flat buffer holding every tensor; p[name] is a view of it with the contract's shape.
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


def decay_mask(cfg, dtype=np.float32):
    """1 where weight decay applies (every matrix and the embedding), 0 on norm weights."""
    mask = Params(cfg, dtype)
    for name, view in mask.items():
        view[:] = 0.0 if view.ndim == 1 else 1.0
    return mask.flat


# --optim muon (CONTRACT.md "Optimiser and schedule"): the blocks' matrices take Muon's update, each matrix on its
# own (q, k, v, w1 and w3 are separate tensors of the layout), everything else AdamW. Muon's constants are those
# of Keller Jordan's Muon (github.com/KellerJordan/modded-nanogpt) and nanochat's nanochat/muon.py: Nesterov
# momentum 0.95, 5 steps of the quintic Newton-Schulz iteration X <- a X + (b A + c A^2) X, A = X X^T, with their
# (a, b, c), X first divided by its Frobenius norm + 1e-7.
OPTIMS = ("adamw", "muon")
MUON_MATRICES = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
MUON_MOMENTUM, MUON_NS_STEPS, MUON_NS_COEFFS, MUON_NS_EPS = 0.95, 5, (3.4445, -4.7750, 2.0315), 1e-7


def muon_matrices(cfg):
    """The names of the matrices that Muon trains, in the layout's order."""
    return [f"layers.{i}.{w}" for i in range(cfg.n_layers) for w in MUON_MATRICES]


def muon_scale(shape):
    """The factor of Muon's orthogonalised update, max(1, rows / cols)^0.5 (nanochat's muon.py), so that a
    tall matrix's update has the per-entry size of a square one's."""
    return max(1.0, shape[0] / shape[1]) ** 0.5


def adamw_ranges(cfg):
    """The (start, end) ranges of the flat layout that AdamW updates under Muon: what the block matrices leave
    (the embedding, the norm weights, the heads)."""
    muon, ranges, off = set(muon_matrices(cfg)), [], 0
    for name, shape in param_shapes(cfg):
        n = int(np.prod(shape))
        if name not in muon:
            if ranges and ranges[-1][1] == off:
                ranges[-1] = (ranges[-1][0], off + n)
            else:
                ranges.append((off, off + n))
        off += n
    return ranges


def model_flops_per_token(cfg, T):
    """Training FLOPs per token: 6 per matrix weight (forward + backward) plus attention's score and value
    products (6 * 2 * T * D per layer: the full T x T products, as usual, though causal kernels skip
    part of them)."""
    matrix = num_params(cfg) - cfg.vocab * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim   # no embedding/norms
    return 6 * matrix + 12 * cfg.n_layers * T * cfg.n_heads * cfg.head_dim


@functools.cache                                   # read-only tables, made once per shape and dtype
def rope_tables(ctx, hd, dtype):
    """RoPE, half-split: u'[i] = u[i] cos a - u[i+hd/2] sin a, with a = pos * ROPE_THETA^(-2i/hd)."""
    freqs = ROPE_THETA ** (-np.arange(0, hd // 2) * 2.0 / hd)      # f_i = theta^(-2i/hd)
    angles = np.arange(ctx)[:, None] * freqs[None, :]              # (ctx, hd/2)
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    cos.flags.writeable = sin.flags.writeable = False                # shared by every caller
    return cos, sin


# ----------------------------------------------------------------------------------------------------
# objective and schedule

def mtp_targets(targets, n_mtp):
    """targets (B, T) -> (n_mtp, B, T): head k's target at t is targets[t+k] when t+k < T, else -1."""
    B, T = targets.shape
    out = np.full((n_mtp, B, T), -1, np.int32)
    for k in range(n_mtp):
        out[k, :, :T - k] = targets[:, k:]
    return out


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


def lr_at(step, schedule_steps, peak_lr, warmup):
    """Linear warm-up over `warmup` steps, then cosine decay to 10% of the peak at step schedule_steps;
    10% after it (a run resumed with more --steps than it started with goes on at that floor)."""
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, schedule_steps - warmup))
    return peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------------------------------
# data: uint16 token files read through a memmap, a train/validation split, the embedded default corpus

def existing_file(path, what):
    """path, if it names a file; a clear UserError for a folder, a device or nothing."""
    if not path:
        raise UserError(f"{what}: the path is empty; give a file")
    if os.path.isdir(path):
        raise UserError(f"{what} {path} is a folder; give the file itself")
    if os.path.exists(path) and not os.path.isfile(path):
        raise UserError(f"{what} {path} is not a regular file (a device or a pipe?); give a file")
    if not os.path.isfile(path):
        raise UserError(f"{what} not found: {path}")
    return path


def writable(path, what, folder=False, force=False):
    """path, if it can be written: a folder (folder=True: a run folder, an HF export; an existing one is
    fine, a file is never replaced) or a file (its folder must exist; one already there only with force).
    Checked before any slow work by a probe that leaves nothing behind (a temporary folder made and removed
    in the nearest existing folder), so /proc, a read-only disk or a missing permission are found too.
    Makes nothing; a clear one-line UserError otherwise."""
    if not path:
        raise UserError(f"{what}: the path is empty; give a {'folder' if folder else 'file name'}")
    full = os.path.abspath(path)
    if folder and os.path.exists(full) and not os.path.isdir(full):
        raise UserError(f"{what} {path} is a file; give a folder (a new one, or one of yours to write into)")
    if not folder:
        if os.path.isdir(full):
            raise UserError(f"{what} {path} is a folder; give a file name")
        if os.path.exists(full) and not force:
            raise UserError(f"{what} {path} exists; give --force to replace it")
        parent = os.path.dirname(path) or "."
        if os.path.exists(os.path.dirname(full)) and not os.path.isdir(os.path.dirname(full)):
            raise UserError(f"{what} {path}: {parent} is a file, not a folder; give another path")
        if not os.path.isdir(os.path.dirname(full)):
            raise UserError(f"{what} {path}: the folder {parent} does not exist; make it first")
    probe = full if folder else os.path.dirname(full)
    while not os.path.exists(probe):                # the nearest existing part of the path
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UserError(f"{what} {path} cannot be made: {os.path.relpath(probe) if probe != full else path} "
                        "is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".nanoeuler-probe-", dir=probe))
    except OSError as e:
        raise UserError(f"{what} {path} cannot be written ({e.strerror} in {probe}); give another path") from None
    return path


def writable_run(out):
    """--out of a training run (train, sft, dpo): writable, and no folder where the run writes a file."""
    writable(out, "--out", folder=True)
    for name in ("ckpt.npz", LOG, EVALS, "report.md", "loss.png"):
        if os.path.isdir(os.path.join(out, name)):
            raise UserError(f"--out {out} holds a folder {name}, where the run writes its {name}; move it or give "
                            "another --out")
    return out


def read_jsonl(path, what):
    """Yields (line number, object) of a JSONL file, blank lines skipped; a missing file, non-UTF-8 text or a
    line that is not JSON raises UserError naming it."""
    with open(existing_file(path, what), encoding="utf-8") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError as e:
            raise UserError(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except ValueError as e:
                raise UserError(f"{path} line {n} is not JSON ({e})") from None


def read_text(path, tokens_too=False):
    """A corpus file as str; missing, empty or non-text files raise UserError (tokens_too: whose advice
    names the token files a training run takes too)."""
    with open(existing_file(path, "data file"), "rb") as f:
        raw = f.read()
    if not raw.strip():
        raise UserError(f"data file is empty: {path}")
    if b"\x00" in raw[:1 << 20]:
        raise UserError(f"data file is not text (NUL bytes): {path}; give UTF-8 text"
                        + (" or a uint16 token file named .bin" if tokens_too else ""))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"data file is not UTF-8 text ({e.reason} at byte {e.start}): {path}") from None


def load_tokens(path, vocab=None):
    """A raw little-endian uint16 token file (nanoGPT's train.bin) as a read-only memmap."""
    size = os.path.getsize(existing_file(path, "token file"))
    if size == 0:
        raise UserError(f"token file is empty: {path}")
    if size % 2:
        raise UserError(f"token file has an odd number of bytes, not uint16 tokens: {path}")
    tokens = np.memmap(path, dtype="<u2", mode="r")
    if vocab is not None:
        top = int(tokens.max())
        if top >= vocab:
            raise UserError(f"token file {path} holds id {top}, outside the vocabulary of {vocab}; "
                            "was it encoded with another tokenizer?")
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
        raise UserError(f"bad tokenizer file: {e}") from None


def check_vocab_fits(tok, cfg, name, source):
    """A tokenizer with more ids than the model's vocabulary cannot be trained on: say which config fits."""
    if tok.vocab_size > cfg.vocab:
        fits = [n for n, c in CONFIGS.items() if c.vocab >= tok.vocab_size]
        raise UserError(f"{source} has {tok.vocab_size} token ids, more than config {name}'s vocabulary of "
                        f"{cfg.vocab}; use a config that fits ({', '.join(fits) or 'none'}) or a smaller tokenizer")


def prepare_data(data_path, cfg, cfg_name, cache_dir=None):
    """Corpus -> (uint16 tokens, tokenizer of at most cfg.vocab ids). A .bin file is taken as tokens and
    needs its tokenizer beside it (NAME.bpe or tokenizer.bpe); a text file (or the embedded default, for
    None) is tokenised once and cached under cache_dir (default CACHE)."""
    cache_dir = cache_dir or CACHE
    if data_path is not None and data_path.endswith(".bin"):
        existing_file(data_path, "token file")
        tok_path = next((p for p in (data_path[:-4] + ".bpe", os.path.join(os.path.dirname(data_path), "tokenizer.bpe"))
                         if os.path.isfile(p)), None)
        if tok_path is None:
            raise UserError(f"no tokenizer for {data_path}: put it beside it as "
                            f"{os.path.basename(data_path)[:-4]}.bpe or tokenizer.bpe")
        tok = load_tokenizer(tok_path)
        check_vocab_fits(tok, cfg, cfg_name, f"tokenizer {tok_path}")
        print(f"data: {data_path} (tokenizer {tok_path})")
        return load_tokens(data_path, tok.vocab_size), tok
    if data_path is not None:
        text, what = read_text(data_path, tokens_too=True), f"data: {data_path}"
    else:
        text, what = default_corpus()
    # keyed by content: two files of one name, size and second (a copy, an edit) are two corpora
    key = f"{os.path.basename(data_path or 'default')}.{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    base = os.path.join(cache_dir, f"{key}.v{cfg.vocab}")
    if os.path.exists(base + ".bin") and os.path.exists(base + ".bpe"):
        print(f"{what} (tokens cached in {base}.bin)", flush=True)
        return load_tokens(base + ".bin", cfg.vocab), load_tokenizer(base + ".bpe")
    writable(cache_dir, "the token cache (NANOEULER_CACHE)", folder=True)
    os.makedirs(cache_dir, exist_ok=True)
    print(f"{what}; training a {cfg.vocab}-id tokenizer and encoding (once; cached after)", flush=True)
    t0 = time.time()
    # the tokenizer learns its merges from the first 20 MB: enough for a 4096 vocabulary, and quick
    tok = bpe.Tokenizer.train(text[:20_000_000], cfg.vocab, verbose=len(text) > 5e6)
    if data_path is not None:                        # every core, streamed from the file
        n_tokens, n_bytes, _ = bpe.encode_file_parallel(tok, data_path, base + ".bin", verbose=len(text) > 5e6)
    else:
        ids = np.array(tok.encode(text, allowed_special="all"), dtype="<u2")
        with open(base + ".bin.tmp", "wb") as f:
            f.write(ids.tobytes())
        os.replace(base + ".bin.tmp", base + ".bin")
        n_tokens, n_bytes = len(ids), len(text.encode())
    tok.save(base + ".bpe")                          # last: a cache without its .bpe is made again
    print(f"tokenizer: vocab {tok.vocab_size}, {n_tokens:,} tokens, {n_bytes / n_tokens:.2f} bytes/token "
          f"({time.time() - t0:.1f} s)")
    return load_tokens(base + ".bin", cfg.vocab), tok


VAL_FRAC = 0.1         # the tail of a token file that validates (Batches): the rest trains


class Batches:
    """Random windows of T+1 tokens from one split (the first 1-val_frac of the file trains, the rest
    validates). The generator state is the data position, saved in checkpoints for exact resumption.
    Several GPUs: every rank draws the windows of all `world` ranks (the same generator everywhere) and keeps
    rows rank*B .. rank*B+B-1, so one GPU with batch world*B draws exactly the batches of `world` GPUs."""

    def __init__(self, tokens, B, T, seed=0, split="train", val_frac=VAL_FRAC, rank=0, world=1):
        n_val = max(T + 2, int(len(tokens) * val_frac))
        self.tokens = tokens[:len(tokens) - n_val] if split == "train" else tokens[len(tokens) - n_val:]
        if len(self.tokens) < T + 2:
            raise UserError(f"the {split} split has {len(self.tokens)} tokens, too few for windows of {T}; "
                            "use more data or a smaller --seq")
        self.B, self.T, self.rank, self.world = B, T, rank, world
        self.rng = np.random.default_rng(seed)

    def next(self):
        # every rank's windows (the last start, n-T-1, included), then this rank's part
        starts = self.rng.integers(0, len(self.tokens) - self.T, self.B * self.world)
        starts = starts[self.rank * self.B:(self.rank + 1) * self.B]
        w = np.stack([np.asarray(self.tokens[s:s + self.T + 1]) for s in starts]).astype(np.int32)
        return w[:, :-1], w[:, 1:]

    def state(self):
        return self.rng.bit_generator.state

    def set_state(self, state):
        self.rng.bit_generator.state = state


def bytes_per_token(tok, tokens):
    sample = np.asarray(tokens[-200_000:])
    return len(tok.decode_bytes(sample.tolist())) / len(sample)


# ----------------------------------------------------------------------------------------------------
# checkpoints: one .npz (CONTRACT.md), written to a temporary file and renamed, so a crash never leaves half

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
    with replaced(path) as f:
        np.savez(f, **arrays)


@contextlib.contextmanager
def replaced(path):
    """A file written whole or not at all: yields a binary file; on success it is flushed to disk and renamed
    over path, so a Ctrl-C or a crash leaves the old file or the new one, never half of one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):                      # a failed write leaves the last good file, and no litter
            os.remove(tmp)


def atomic_write(path, data):
    """replaced() of a str (UTF-8) or bytes: logs, reports, plots, JSON."""
    with replaced(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def checkpoint_path(path):
    """A checkpoint file, or the ckpt.npz inside a run folder."""
    if os.path.isdir(path):
        inner = os.path.join(path, "ckpt.npz")
        if not os.path.isfile(inner):
            raise UserError(f"{path} is a folder without a ckpt.npz; give a checkpoint file or a run folder")
        return inner
    return existing_file(path, "checkpoint")


def load_checkpoint(path, want_state=False):
    """-> (Params float32, tokenizer, state or None, config extras). Bad files raise UserError."""
    path = checkpoint_path(path)
    if not zipfile.is_zipfile(path):
        raise UserError(f"{path} is corrupt or not a NanoEuler checkpoint (not a whole .npz file, as train and "
                        "sft write)")
    try:
        with np.load(path, allow_pickle=False) as z:
            files = set(z.files)
            meta = json.loads(str(z["config"]))
            cfg = Config.from_json(str(z["config"]))
            P = Params(cfg)
            for name, view in P.items():
                if name not in files:
                    raise UserError(f"checkpoint {path} lacks tensor {name}; it is damaged or from another program")
                arr = z[name]
                if arr.shape != view.shape:
                    raise UserError(f"checkpoint {path}: {name} has shape {arr.shape}, its config says {view.shape}")
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
    except UserError:
        raise
    except Exception as e:  # zip, JSON or tokenizer damage: say what, in one line
        raise UserError(f"checkpoint {path} is corrupt or not a NanoEuler checkpoint ({type(e).__name__}: {e})") from None
    if tok.vocab_size > cfg.vocab:
        raise UserError(f"checkpoint {path}: tokenizer has {tok.vocab_size} tokens, more than the config's {cfg.vocab}")
    if not np.isfinite(P.flat).all():
        raise UserError(f"checkpoint {path} holds NaN or infinite weights; use an earlier checkpoint")
    extras = {k: v for k, v in meta.items() if k not in asdict(cfg)}
    return P, tok, state, extras


# ----------------------------------------------------------------------------------------------------
# sampling rules: how both engines draw from head 0's logits, and what a too-long prompt keeps

@dataclass
class Sampling:
    """Greedy at temperature 0; else softmax(logits / temperature) over the top_k likeliest ids (0: all),
    cut to the smallest set whose mass reaches top_p (1: no cut). repetition_penalty > 1 divides the
    positive logits, and multiplies the negative ones, of ids already in the text (CTRL's rule; 1: off)."""
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def _penalised(self, logits, history):
        z = np.array(logits, np.float64)
        if self.repetition_penalty != 1.0 and len(history):
            seen = np.unique(np.asarray(history, np.int64))
            z[seen] = np.where(z[seen] > 0, z[seen] / self.repetition_penalty, z[seen] * self.repetition_penalty)
        return z

    def probs(self, logits, history=()):
        """The (V,) float64 distribution that sample() draws from (one-hot at the argmax when greedy)."""
        z = self._penalised(logits, history)
        if self.temperature <= 0:
            p = np.zeros_like(z)
            p[np.argmax(z)] = 1.0
            return p
        z /= self.temperature
        if self.top_k and self.top_k < len(z):
            z[z < np.partition(z, -self.top_k)[-self.top_k]] = -np.inf
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            keep = np.searchsorted(np.cumsum(p[order]), self.top_p) + 1       # the smallest prefix reaching top_p
            p[order[keep:]] = 0.0
            p /= p.sum()
        return p

    def greedy(self, logits, history=()):
        """The first argmax of the penalised logits."""
        return int(np.argmax(logits if self.repetition_penalty == 1.0 else self._penalised(logits, history)))

    def likeliest(self, logits, history, k):
        """The k ids of the largest penalised logits, largest first."""
        z = -self._penalised(logits, history)
        top = np.argpartition(z, k - 1)[:k]
        return [int(i) for i in top[np.argsort(z[top], kind="stable")]]

    def sample(self, logits, history, rng):
        if self.temperature <= 0:                        # greedy draws no random number
            return self.greedy(logits, history)
        return draw(self.probs(logits, history), rng)


def draw(p, rng):
    """One id from the distribution p (V,), by inverting its cumulative sum at one uniform number: the count
    of sums at or below the point (they never decrease: p >= 0), as searchsorted would find it
    (side="right"), capped at V - 1."""
    cdf = np.cumsum(p)
    return min(int((cdf <= rng.random() * cdf[-1]).sum()), len(p) - 1)


def speculative_decode(forward, cut, prompt_ids, max_new, sampling, rng, stats, n_mtp, ctx):
    """Speculative sampling with the model's own MTP heads as the draft model, over an engine's KV cache:
    forward(ids) runs ids at the cache's next positions (the whole prompt first) and returns every head's
    logits at each, (len, n_mtp, V) (the prompt: at least its last row), or, greedy without a repetition
    penalty, may return their argmaxes, (len, n_mtp) ids: all that rule needs. cut(n) keeps the cache's
    first n positions. Yields up to max_new ids (stops at the context).
    State: a token z that is decided but not yet cached, and every head's logits at the position before
    it (head k there predicted position pos(z) + k). Each round drafts d_k from head k, runs one forward
    over [z, d_1..d_m] and lets head 0 judge the drafts in order: d_i is kept with probability
    min(1, p(d_i) / q(d_i)), else replaced by a draw from max(0, p - q) normalised, which ends the round
    and becomes the next z (the cache is cut back to the kept tokens). When every draft is kept, head 0
    at the last position draws the next z. Greedy: p and q are one-hot, so a draft is kept exactly when
    it is head 0's argmax. (The CPU engine drafts greedy rounds its own way: nanoeuler.guess_decode.)
    stats (a dict) gets 'drafted' (positions) and 'accepted'."""
    greedy = sampling.temperature <= 0

    def first(row, history):                    # head 0's id: an argmax the forward made, else by the rule
        return int(row) if argmaxes else sampling.sample(row, history, rng)
    ids = list(prompt_ids)
    heads = forward(ids)[-1]                                               # (n_mtp, ...) at the last position
    argmaxes = np.ndim(heads[0]) == 0                                      # forward hands over ids
    cached = len(ids)
    z = first(heads[0], ids)
    ids.append(z)
    produced = 1
    yield z
    while produced < max_new and len(ids) < ctx:
        m = min(n_mtp - 1, max_new - produced, ctx - len(ids))             # z's forward must fit the context
        drafts, qs = [], []
        for k in range(1, m + 1):
            if greedy:
                drafts.append(first(heads[k], ids + drafts))
            else:
                qs.append(sampling.probs(heads[k], ids + drafts))
                drafts.append(draw(qs[-1], rng))
        out = forward([z] + drafts)                                        # (1 + m, n_mtp, ...)
        n_ok = 0
        for i, d in enumerate(drafts):
            if greedy:
                z = first(out[n_ok, 0], ids)
                kept = d == z
            else:
                p, q = sampling.probs(out[n_ok, 0], ids), qs[i]
                kept = rng.random() < p[d] / q[d]
                z = d
                if not kept:
                    residual = np.maximum(p - q, 0.0)
                    z = draw(residual if residual.sum() > 0 else p, rng)
            n_ok += kept
            ids.append(z)
            produced += 1
            yield z
            if not kept or produced >= max_new:
                break
        if stats is not None:
            stats["drafted"] = stats.get("drafted", 0) + len(drafts)
            stats["accepted"] = stats.get("accepted", 0) + n_ok
        cached += 1 + n_ok                                                 # z and the kept drafts
        cut(cached)
        heads = out[n_ok]                                                  # at the last cached position
        if n_ok == len(drafts) and produced < max_new and len(ids) < ctx:  # all kept: head 0 goes on
            z = first(heads[0], ids)
            ids.append(z)
            produced += 1
            yield z


def sample_token(logits, temperature, top_k, rng):
    """One id from a (V,) row of logits with temperature and top-k alone."""
    return Sampling(temperature, top_k).sample(logits, (), rng)


def speed_line(arrivals, speculative, stats, streams=1, warmup="compilation, prefill"):
    """The last line of sample. arrivals: (ids so far, seconds since the start) each time new ids came. The
    time to the first is the warm-up (compiling, prefill; on the GPU capturing graphs), reported apart; the
    rate after it is the least-squares slope of ids against time, which the bursts of a speculative or
    chunked decoder do not bias (it is (n - 1) / (t_last - t_first) for ids one at a time, evenly spaced)."""
    n, t_first = arrivals[-1][0], arrivals[0][1]
    ids, t = np.array(arrivals, float).T
    steady = f"then {np.polyfit(t - t_first, ids, 1)[0]:,.0f} tokens/s" if t[-1] > t_first else \
        "too few for a steady rate"
    line = f"[{n} token{'s' * (n != 1)}" + (f" in {streams} streams" if streams > 1 else "") + \
        f", {t_first:.{1 if t_first >= 0.1 else 3}f} s of warm-up ({warmup}), {steady}"
    if speculative and stats.get("drafted"):
        line += f", speculative: {stats['accepted'] / stats['drafted']:.0%} of {stats['drafted']} drafts accepted"
    return line + ("" if speculative or streams > 1 else ", speculative off") + "]"


def prompt_keep(ctx, room):
    """The tokens a prompt cut to fit keeps: `room` positions left to generate, at most half the context, at
    least one (fit_prompt's rule, and serve's)."""
    return ctx - max(1, min(room, ctx // 2))


def fit_prompt(ids, ctx, room):
    """A prompt longer than the context keeps its last tokens, leaving `room` positions to generate
    (at most half the context), and says so in one line. An empty prompt is refused."""
    if not len(ids):
        raise UserError("the prompt is empty; give some text (a newline will do)")
    keep = prompt_keep(ctx, room)
    if len(ids) > keep:
        print(f"[the prompt is {len(ids)} tokens: kept its last {keep} to fit the context of {ctx}]", file=sys.stderr)
        return list(ids[-keep:])
    return list(ids)


def check_sampling(a):
    """The sampling flags of sample and chat: a mistake is refused, not read as something else."""
    if a.tokens < 1:
        raise UserError(f"--tokens {a.tokens}: give how many tokens to generate, at least 1")
    if not 0 <= a.temperature < math.inf:
        raise UserError(f"--temperature {a.temperature}: give 0 (greedy) or a positive, finite number")
    if a.top_k < 0:
        raise UserError(f"--top-k {a.top_k}: give 0 (all tokens) or a positive number")
    if not 0 < a.top_p <= 1:
        raise UserError(f"--top-p {a.top_p}: give a probability mass in (0, 1]")
    if not 0 < a.repetition_penalty < math.inf:
        raise UserError(f"--repetition-penalty {a.repetition_penalty}: give a positive, finite factor (1: off)")
    if getattr(a, "samples", 1) < 1:
        raise UserError(f"--samples {a.samples}: give how many continuations to draw, at least 1")


def check_prompt(n_tokens, ctx):
    if n_tokens == 0:
        raise UserError("the prompt is empty")
    if n_tokens >= ctx:
        raise UserError(f"the prompt is {n_tokens} tokens, longer than the context of {ctx} minus one; shorten it")


# C0 and C1 control characters but newline and tab, each as its \xNN escape (for str.translate)
CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7f, *range(0x80, 0xa0)) if chr(c) not in "\n\t"}


def printable(text):
    """Model text as a person reads it (samples, chat, report.md): control characters (NUL, ESC, ...) escaped
    as \\x00, \\x1b, so a sample cannot drive the terminal or make a report binary. Programs get the raw ids
    or text (serve's JSON escapes by itself). Escaping twice changes nothing."""
    return text.translate(CONTROL_ESCAPES)


def stream(tok, ids_iter, prefix=""):
    """Prints prefix, then each sampled id as soon as its UTF-8 characters are complete, printable; -> count."""
    dec = tok.stream()
    sys.stdout.write(printable(prefix))
    n = 0
    for t in ids_iter:
        sys.stdout.write(printable(dec.text(t)))
        sys.stdout.flush()
        n += 1
    print(printable(dec.end()))
    return n


def sample_to_stdout(tok, generate_fn, prompt, a, ctx):
    """The sample mode of both engines: streams a.tokens ids after the prompt; says so when the context
    ends the text first. generate_fn(ids, n, rng) yields ids. -> speed_line's arrivals, one per id."""
    check_sampling(a)
    ids = fit_prompt(tok.encode(prompt), ctx, a.tokens)
    arrivals, t0 = [], time.perf_counter()

    def timed(ids_iter):
        for t in ids_iter:
            arrivals.append((len(arrivals) + 1, time.perf_counter() - t0))
            yield t
    n = stream(tok, timed(generate_fn(ids, a.tokens, np.random.default_rng(a.seed))), prompt)
    if n < a.tokens:
        print(f"[stopped after {n} tokens: the context of {ctx} tokens is full]", file=sys.stderr)
    return arrivals


def samples_to_stdout(tok, generate_batch_fn, prompt, a, ctx):
    """--samples N: N continuations of one prompt drawn in one batch, printed one after the other.
    generate_batch_fn(ids, N, n, rng, arrivals) -> N id lists; it appends (ids so far in all streams,
    time.perf_counter()) to arrivals as they come. -> speed_line's arrivals."""
    check_sampling(a)
    ids = fit_prompt(tok.encode(prompt), ctx, a.tokens)
    arrivals, t0 = [], time.perf_counter()
    outs = generate_batch_fn(ids, a.samples, a.tokens, np.random.default_rng(a.seed), arrivals)
    for i, out in enumerate(outs):
        print(f"--- sample {i + 1}/{len(outs)} ---\n{printable(prompt + tok.decode(out))}")
    return [(k, t - t0) for k, t in arrivals]


def decode_requests(dec, reqs):
    """Requests (arrival step, prompt ids, ids wanted, Sampling, seed) through a decoder (serve.py's
    interface: start or starts, step, free) as serve runs them: each joins at its arrival step (later while
    every row is taken) in the lowest free row, those of a step started together (starts(), where the decoder
    has it), and leaves once it has its ids; -> each one's ids. The schedule of the GPU self-test and of the
    tests that hold a row to the same ids alone or among others."""
    out, rows, t = [[] for _ in reqs], {}, 0                 # rows: row -> request
    waiting = sorted(range(len(reqs)), key=lambda i: reqs[i][0])

    def got(r, i, tok):
        out[i].append(int(tok))
        if len(out[i]) >= reqs[i][2]:
            dec.free(r)
            del rows[r]
    while waiting or rows:
        joining = []
        while waiting and reqs[waiting[0]][0] <= t and len(rows) < dec.capacity:
            i = waiting.pop(0)
            r = min(set(range(dec.capacity)) - set(rows))
            rows[r] = i
            joining.append((r, i))
        if joining:
            items = [(r, *reqs[i][1:2], *reqs[i][3:]) for r, i in joining]
            starts = getattr(dec, "starts", None)
            for (r, i), tok in zip(joining, starts(items) if starts else [dec.start(*it) for it in items]):
                got(r, i, tok)
        if rows:
            active = sorted(rows)
            for r, tok in zip(active, dec.step(active)):
                got(r, rows[r], tok)
        t += 1
    return out


# ----------------------------------------------------------------------------------------------------
# supervised fine-tuning: the Alpaca template of CONTRACT.md, loss on the response and the closing token only

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
    existing_file(path, "SFT data")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"SFT data {path} is not valid JSON ({e})") from None
    if not isinstance(data, list) or not data or not all(
            isinstance(d, dict) and isinstance(d.get("instruction"), str) and isinstance(d.get("output"), str)
            for d in data):
        raise UserError(f"SFT data {path} must be a non-empty JSON list of objects with instruction, input, output")
    return data


class SFTBatches:
    """Batches of B examples padded with <|endoftext|> to the longest, or with fixed=True to exactly (B, T)
    (an engine with preallocated buffers); padding targets are -1. Same interface as Batches."""

    def __init__(self, tok, examples, B, T, seed=0, fixed=False, ctx=None):
        encoded = [sft_example(tok, ex, T) for ex in examples]
        self.examples = [e for e in encoded if e is not None]
        if not self.examples:                        # ctx: the model's, when it is what limits T
            raise UserError(f"no SFT example fits the context of {T} tokens; " + (
                "raise --seq or shorten the prompts" if T != ctx else "shorten the prompts (the model's context)"))
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


def run_sft(a, P, tok, make_trainer, batch_loss, fixed_shape=False):
    """Fine-tunes the base model P on instructions, for either engine: make_trainer() -> a train_loop
    trainer over P, batch_loss(x, y) -> head-0 CE. 1/20 of the examples validate (loss before and after).
    The last step's checkpoint is kept; the final line says which evaluation was best."""
    writable_run(a.out)
    check_positive(a, "steps", "batch", "seq")
    if not 0 < a.lr < math.inf:
        raise UserError(f"--lr {a.lr}: give a positive, finite learning rate")
    examples = load_sft_data(a.data)
    if len(examples) < 2:                            # else the one example validates and none is left to train
        raise UserError(f"SFT data {a.data} holds 1 example; give at least 2 (1 in 20 validates, the rest train)")
    print(f"SFT data: {a.data or 'built-in instruction set (no download)'}, {len(examples)} examples")
    order = np.random.default_rng(a.seed).permutation(len(examples))
    n_val = max(1, len(examples) // 20)
    T = min(a.seq, P.cfg.ctx)
    batches = SFTBatches(tok, [examples[i] for i in order[n_val:]], a.batch, T, a.seed, fixed_shape, P.cfg.ctx)
    val = SFTBatches(tok, [examples[i] for i in order[:n_val]], a.batch, T, fixed=fixed_shape, ctx=P.cfg.ctx)
    ckpt_path = os.path.join(a.out, "ckpt.npz")
    if os.path.exists(ckpt_path) and not a.force:
        raise UserError(f"{ckpt_path} exists: use another --out or --force")

    def val_fn():
        n = len(val.examples)
        return float(np.mean([batch_loss(*val.batch(range(i, min(n, i + a.batch)))) for i in range(0, n, a.batch)])), None

    before = val_fn()[0]
    print(f"SFT validation loss before: {before:.4f}")
    args = dict(TRAIN_DEFAULTS, steps=a.steps, schedule_steps=a.steps, lr=a.lr, warmup=min(20, a.steps // 10 + 1),
                batch=a.batch, seq=T, eval_every=max(1, a.steps // 5), sample_every=0, ckpt_every=10 ** 9,
                log_every=10, data=a.data)
    train_loop(make_trainer(), tok, batches, args, a.out, val_fn, extra={"kind": "chat"})
    after = val_fn()[0]
    evals = [(r["val_loss"], r["step"]) for r in read_log(a.out) if "val_loss" in r]
    best, step = min(evals + [(before, 0)])
    note = ("the best evaluation" if step == a.steps else
            f"the best was {best:.4f} at step {step}" + (" (before training)" if step == 0 else ", an earlier one"))
    print(f"SFT validation loss: before {before:.4f} -> after {after:.4f}, {note}; chat checkpoint {ckpt_path} "
          f"(step {a.steps}, the last)")


# ----------------------------------------------------------------------------------------------------
# DPO: preference pairs in the SFT template and the loss of CONTRACT.md "DPO", for either engine. An engine
# gives seq_logps(x, y) -> (rows,) float64, head 0's log-probs of each row's counted targets summed, and a
# trainer whose step(x, (y, ref), lr) follows dpo_loss's d loss / d log-prob down to its logits.

def load_prefs(path):
    """JSONL, one {prompt, chosen, rejected[, input]} a line (prompt: the template's instruction) -> list of
    pairs; None gives the built-in set. A bad pair raises UserError with its line."""
    if path is None:
        return builtin_prefs()
    pairs = []
    for n, d in read_jsonl(path, "preference data"):
        where = f"{path} line {n}"
        if not isinstance(d, dict):
            raise UserError(f"{where} is not an object with prompt, chosen and rejected")
        for key in ("prompt", "chosen", "rejected"):
            if not isinstance(d.get(key), str) or not d[key].strip():
                raise UserError(f"{where}: {key} is missing or empty; every pair needs a prompt, a chosen and a "
                                "rejected text")
        if not isinstance(d.get("input", ""), str):
            raise UserError(f"{where}: input must be a string")
        if d["chosen"] == d["rejected"]:
            raise UserError(f"{where}: chosen equals rejected, a pair that prefers nothing; drop it")
        pairs.append({k: d.get(k, "") for k in ("prompt", "input", "chosen", "rejected")})
    if not pairs:
        raise UserError(f"preference data {path} holds no pairs")
    return pairs


def builtin_prefs():
    """The built-in SFT set as pairs: each example's answer is chosen, and the same answer fallen into a loop
    rejected (its opening words, from 1 to half of them, repeated to its length), the commonest failure of
    small models. The shared opening counts the same on both sides, so the pair teaches where to go on."""
    rng = np.random.default_rng(0)
    pairs = []
    for e in builtin_sft_examples():
        words = e["output"].split(" ")
        k = int(rng.integers(1, max(2, len(words) // 2)))
        loop = (words[:k] * (len(words) // k + 1))[:max(len(words), 2 * k)]
        pairs.append({"prompt": e["instruction"], "input": e["input"], "chosen": e["output"], "rejected": " ".join(loop)})
    return pairs


def pref_pair(tok, pair, T):
    """-> ([(ids, targets) of the chosen answer, of the rejected], cut) in the SFT template, each at most T
    positions, targets -1 but on the answer and its <|endoftext|>. A longer pair keeps both answers whole and
    loses the start of its prompt (cut); None when the longer answer alone leaves no room for the prompt."""
    prompt = tok.encode(format_prompt(pair["prompt"], pair.get("input", "")))
    answers = [tok.encode(pair[k]) + [tok.eot] for k in ("chosen", "rejected")]
    keep = T + 1 - max(map(len, answers))            # prompt tokens that fit (ids are seq[:-1])
    if keep < 1:
        return None
    cut, prompt = len(prompt) > keep, prompt[-keep:]
    rows = []
    for answer in answers:
        seq = prompt + answer
        targets = np.array(seq[1:], np.int32)
        targets[:len(prompt) - 1] = -1               # positions whose next token is prompt
        rows.append((np.array(seq[:-1], np.int32), targets))
    return rows, cut


class PrefBatches:
    """Batches of B pairs as 2B rows, the chosen answers in rows [:B] and the rejected in [B:], padded with
    <|endoftext|> to the longest (fixed=True: to exactly T), padding targets -1. ref (pairs, 2): the reference
    log-probs (chosen, rejected), set once; next() -> (x, (y, ref of its rows (2B,)))."""

    def __init__(self, tok, pairs, B, T, seed=0, fixed=False):
        encoded = [pref_pair(tok, p, T) for p in pairs]
        self.pairs = [e[0] for e in encoded if e is not None]
        self.skipped, self.cut = encoded.count(None), sum(e[1] for e in encoded if e is not None)
        self.B, self.T, self.fixed, self.eot = B, T, fixed, tok.eot
        self.rng = np.random.default_rng(seed)
        self.ref = None

    def batch(self, chosen):
        B = self.B if self.fixed else len(chosen)
        T = self.T if self.fixed else max(len(ids) for i in chosen for ids, _ in self.pairs[i])
        x = np.full((2 * B, T), self.eot, np.int32)
        y = np.full((2 * B, T), -1, np.int32)
        for r, i in enumerate(chosen):
            for k, (ids, targets) in enumerate(self.pairs[i]):
                x[k * B + r, :len(ids)], y[k * B + r, :len(ids)] = ids, targets
        return x, y

    def next(self):
        chosen = self.rng.integers(0, len(self.pairs), self.B)
        x, y = self.batch(chosen)
        return x, (y, self.ref[chosen].T.reshape(-1))

    def state(self):
        return self.rng.bit_generator.state

    def set_state(self, state):
        self.rng.bit_generator.state = state


def pair_logps(batches, seq_logps):
    """(pairs, 2) float64: seq_logps of the (chosen, rejected) answer of every pair, B pairs at a time."""
    out, n = [], len(batches.pairs)
    for i in range(0, n, batches.B):
        rows = range(i, min(n, i + batches.B))
        x, y = batches.batch(rows)
        lp, half = seq_logps(x, y), len(x) // 2
        out.append(np.stack([lp[:len(rows)], lp[half:half + len(rows)]], 1))
    return np.concatenate(out)


def dpo_loss(logp, ref, beta, xp=np):
    """logp, ref (2B,) float64 log-probs of the policy and the reference, chosen answers first. -> (the mean
    over pairs of -log sigmoid(z), z = beta ((logp_c - ref_c) - (logp_r - ref_r)); d loss / d logp (2B,)).
    xp: numpy, or cupy for device arrays (the loss then stays a device scalar: no sync)."""
    B = len(logp) // 2
    z = beta * ((logp[:B] - ref[:B]) - (logp[B:] - ref[B:]))
    s = beta * xp.exp(-xp.logaddexp(0.0, z)) / B     # beta sigmoid(-z) / B, without overflow
    loss = xp.logaddexp(0.0, -z).mean()
    return float(loss) if xp is np else loss, xp.concatenate([-s, s])


def dpo_metrics(logp, ref, beta):
    """The evaluation of (pairs, 2) log-probs against the reference's: preference accuracy (the chosen reward
    beta (logp - ref) above the rejected one; a tie, as at the start where policy = reference, counts half),
    the mean reward margin, the mean drift logp - ref of each answer, and the DPO loss."""
    d = logp - ref
    z = beta * (d[:, 0] - d[:, 1])
    return {"pref_acc": float(np.mean((z > 0) + 0.5 * (z == 0))), "margin": float(z.mean()),
            "drift_chosen": float(d[:, 0].mean()), "drift_rejected": float(d[:, 1].mean()),
            "dpo_loss": dpo_loss(logp.T.reshape(-1), ref.T.reshape(-1), beta)[0]}


def run_dpo(a, P, tok, extra, make_trainer, seq_logps, fixed_shape=False):
    """DPO from the chat checkpoint P, for either engine: make_trainer() -> a train_loop trainer over P whose
    step takes (x, (y, ref), lr); seq_logps(x, y) -> (rows,) summed head-0 log-probs. The reference log-probs
    come from P before the first step; 1 pair in 10 is held out and evaluated."""
    writable_run(a.out)
    check_positive(a, "steps", "batch")
    if not (0 < a.lr < math.inf and 0 < a.beta < math.inf):
        raise UserError(f"--lr {a.lr} and --beta {a.beta}: give positive, finite numbers")
    if extra.get("kind") != "chat":
        print(f"warning: {a.ckpt} is a base checkpoint, never fine-tuned on the SFT template; DPO goes on, "
              "but sft first gives a model that answers", file=sys.stderr, flush=True)
    pairs = load_prefs(a.data)
    if len(pairs) < 2:
        raise UserError(f"preference data {a.data} holds 1 pair; give at least 2 (1 in 10 is held out)")
    order = np.random.default_rng(a.seed).permutation(len(pairs))
    n_val, T = max(1, len(pairs) // 10), P.cfg.ctx
    train = PrefBatches(tok, [pairs[i] for i in order[n_val:]], a.batch, T, a.seed, fixed_shape)
    val = PrefBatches(tok, [pairs[i] for i in order[:n_val]], a.batch, T, fixed=fixed_shape)
    print(f"DPO data: {a.data or 'built-in pairs from the SFT set (no download)'}, {len(pairs)} pairs, "
          f"{len(val.pairs)} held out, beta {a.beta}")
    if train.cut + val.cut or train.skipped + val.skipped:
        print(f"pairs longer than the context of {T} tokens: {train.cut + val.cut} kept their answers and lost the "
              f"start of their prompt, {train.skipped + val.skipped} skipped (an answer alone too long)")
    if not train.pairs or not val.pairs:
        raise UserError(f"too few pairs fit the context of {T} tokens to train and to hold out; shorten the answers")
    ckpt_path = os.path.join(a.out, "ckpt.npz")
    if os.path.exists(ckpt_path) and not a.force:
        raise UserError(f"{ckpt_path} exists: use another --out or --force")
    t0 = time.time()
    train.ref, val.ref = pair_logps(train, seq_logps), pair_logps(val, seq_logps)
    print(f"reference log-probs of {len(train.pairs) + len(val.pairs)} pairs ({time.time() - t0:.1f} s); the "
          f"reference itself gives the chosen answer more probability in {np.mean(val.ref[:, 0] > val.ref[:, 1]):.0%} "
          "of the held-out pairs", flush=True)
    seen = []

    def val_fn():
        m = dpo_metrics(pair_logps(val, seq_logps), val.ref, a.beta)
        seen.append(m)
        print(f"held-out: preference accuracy {m['pref_acc']:.1%} | reward margin {m['margin']:+.4f} | log-prob "
              f"drift chosen {m['drift_chosen']:+.3f}, rejected {m['drift_rejected']:+.3f}", flush=True)
        return m["dpo_loss"], None, {k: round(v, 5) for k, v in m.items()}

    first = {"step": 0, **val_fn()[2]}
    args = dict(TRAIN_DEFAULTS, steps=a.steps, schedule_steps=a.steps, lr=a.lr, warmup=min(20, a.steps // 10 + 1),
                batch=a.batch, seq=T, eval_every=max(1, a.steps // 5), sample_every=0, ckpt_every=10 ** 9,
                log_every=10, data=a.data, beta=a.beta)
    train_loop(make_trainer(), tok, train, args, a.out, val_fn, extra={"kind": "chat", "stage": "dpo"}, first=[first])
    print(f"DPO held-out preference accuracy: before {seen[0]['pref_acc']:.1%} -> after {seen[-1]['pref_acc']:.1%}; "
          f"reward margin {seen[-1]['margin']:+.4f}; chat checkpoint {ckpt_path} ({time.time() - t0:.0f} s)")


def add_dpo_flags(p, ckpt, out):
    d = DPO_DEFAULTS
    add_finetune_flags(p, f"the SFT (chat) checkpoint or its run folder, also the frozen reference (default {ckpt})",
                       ckpt, out, d["steps"], (d["batch"], "pairs per step"), d["lr"], "held-out split and data order",
                       data="JSONL, one {prompt, chosen, rejected[, input]} a line, as data/get_prefs.sh writes "
                            "(default: the built-in pairs, no download: each answer of the built-in SFT set against "
                            "itself fallen into a loop of its opening words; they teach not to loop, nothing of "
                            "helpfulness or safety)")
    p.add_argument("--beta", type=float, default=d["beta"],
                   help=f"strength of the pull to the reference (default {d['beta']})")


# ----------------------------------------------------------------------------------------------------
# chat: a REPL that streams the model's answer and keeps the conversation within the context (serve.py's
# chat completions build and fit their conversations with the same two functions)

def user_turn(tok, text, template, first):
    """The ids of one user turn: its SFT block up to '### Response:\\n' for a chat checkpoint; for a base
    model the text itself, after a newline past the first turn (the answers continue the text)."""
    return tok.encode(format_prompt(text) if template else (text if first else "\n" + text))


def fit_turns(turns, user, ctx, max_new):
    """turns [(user ids, answer ids)] so far, oldest first, and the new turn's ids -> (prompt ids, how many of
    the oldest turns were dropped) so that max_new positions are left to answer in, when that costs no more
    than half the context. The new turn itself is never cut here (fit_prompt does that)."""
    budget = max(ctx - max_new, ctx // 2)
    dropped, total = 0, sum(len(u) + len(a) for u, a in turns) + len(user)
    while dropped < len(turns) and total > budget:
        total -= len(turns[dropped][0]) + len(turns[dropped][1])
        dropped += 1
    return [t for u, a in turns[dropped:] for t in u + a] + user, dropped


def chat_repl(tok, generate_fn, template, max_new, ctx):
    """generate_fn(prompt_ids, max_new) yields ids. EOF ends the session; Ctrl-C stops only the answer.
    Each turn sees the earlier ones (as SFT blocks for a chat checkpoint, as plain text for a base
    model); the oldest are dropped, with a notice, when the conversation outgrows the context."""
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  -- line editing and history for input()
        except ImportError:                          # not on every platform: plain input() still works
            pass
    kind = "instruction model: your line is wrapped in the SFT template" if template else \
        "base model: it continues your text"
    print(f"chat ({kind}); Ctrl-D ends, Ctrl-C stops an answer", flush=True)
    turns = []                                       # [(user ids, answer ids)] of the conversation so far
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print()
            continue
        if not interactive:
            print(f"> {line}", flush=True)           # piped questions are shown, so answers read in order
        if not line.strip():
            continue
        user = user_turn(tok, line, template, first=not turns)
        ids, dropped = fit_turns(turns, user, ctx, max_new)
        del turns[:dropped]
        if dropped:
            print(f"[dropped the {dropped} oldest turn(s) to fit the context of {ctx} tokens]", flush=True)
        ids = fit_prompt(ids, ctx, max_new)
        dec, answer = tok.stream(), []
        try:
            for t in generate_fn(ids, min(max_new, ctx - len(ids))):
                answer.append(t)
                if t == tok.eot:
                    break
                print(printable(dec.text(t)), end="", flush=True)
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        print(printable(dec.end()), flush=True)
        if template and (not answer or answer[-1] != tok.eot):
            answer.append(tok.eot)                   # each turn closes as SFT taught it
        turns.append((user, answer))


# ----------------------------------------------------------------------------------------------------
# training: one loop for pretraining and SFT; progress lines, a JSONL log, atomic checkpoints
#
# The Trainer protocol, which each engine implements:
#   step(x, y, lr)  queue one AdamW step on the batch (x, y) (B, T) int32
#   results()       -> [(objective, per-head CE, grad norm)] of the steps since the last call
#   host_state()    -> (parameters, Adam m, Adam v) as host Params, for checkpoints and samples
#   sync_every_step False when steps may run ahead of the host until the next results()

class StopFlag:
    """Ctrl-C sets a flag that the loop reads between steps, so a checkpoint never holds half a step.
    restore() puts the previous handler back (a later Ctrl-C then interrupts as usual)."""

    def __init__(self, when="this step"):
        import signal
        self.stop, self.when = False, when
        self.previous = signal.signal(signal.SIGINT, self.handler)

    def handler(self, signum, frame):
        if self.stop:                                    # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.stop = True
        print(f"\n[Ctrl-C: finishing {self.when}, then saving a checkpoint]", flush=True)

    def restore(self):
        import signal
        signal.signal(signal.SIGINT, self.previous)


def validation_loss(batch_loss, tokens, B, T, n_batches, bytes_per_token):
    """Head-0 validation loss over fixed batches of the validation split, and bits per byte.
    batch_loss(x, y) -> head-0 CE of one batch, on whichever engine."""
    val = Batches(tokens, B, T, seed=1234, split="val")
    loss = float(np.mean([batch_loss(*val.next()) for _ in range(n_batches)]))
    return loss, loss / math.log(2) / bytes_per_token



LOG, EVALS = "train_log.jsonl", "evals.jsonl"        # a run folder's step log, and eval's scores of its checkpoint


def start_log(out_dir, step):
    """Readies a run's log for the steps after `step`: keeps its records of steps up to `step` (a resume's
    checkpoint; 0, a new run: none) and drops the rest, the steps of a
    run that died after its last checkpoint or of an earlier run that left none, so the log holds each step
    once and one run only; rewritten whole or not at all. A new run drops the old checkpoint's evals too."""
    path = os.path.join(out_dir, LOG)
    if step == 0 and os.path.exists(os.path.join(out_dir, EVALS)):
        os.remove(os.path.join(out_dir, EVALS))
    if not os.path.exists(path):
        return
    keep, dropped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
                ok = 0 < step and rec["step"] <= step
            except (ValueError, KeyError, TypeError):
                ok = False                           # a line cut short by a kill
            if ok:
                keep.append(line.rstrip("\n") + "\n")
            dropped += not ok and bool(line.strip())
    if not dropped:
        return
    atomic_write(path, "".join(keep))
    print(f"note: {path} held {dropped} lines of an earlier run; this run starts the log afresh"
          if step == 0 else f"note: {path}: dropped {dropped} lines logged after the checkpoint's step {step}; "
          "this run logs those steps again", flush=True)


def read_log(out_dir):
    """A run folder's log -> its records in order, each step once: where a step comes again (a log written
    before start_log, resumed after a kill), the later records replace the earlier from that step on."""
    recs = []
    for _, rec in read_jsonl(os.path.join(out_dir, LOG), "run log"):
        if isinstance(rec, dict) and isinstance(rec.get("step"), (int, float)):
            while recs and recs[-1]["step"] >= rec["step"]:
                recs.pop()
            recs.append(rec)
    return recs


def train_loop(trainer, tok, batches, args, out_dir, val_fn=None, extra=None, start=0, sample_fn=None, first=()):
    """Steps start .. args['steps']-1 of any engine's trainer on batches.next(): one JSONL line per step,
    a progress line every log_every steps, validation, samples, checkpoints, Ctrl-C and NaN handling.
    args: steps, schedule_steps, lr, warmup, eval_every, sample_every, ckpt_every, log_every, stop_after.
    val_fn() -> (val loss, bits per byte[, a dict for the log]); sample_fn(step) prints a sample; first: log
    records of step 0. A new run over an old run's checkpoint (--force) logs beside the old log until its
    first checkpoint, which then takes the old log's place and drops the old evals. Returns the
    last validation loss; raises KeyboardInterrupt after saving when Ctrl-C stopped the run. On several GPUs
    every rank runs it with its trainer (trainer.rank, trainer.world): the checkpoint is a collective that only
    rank 0 writes, only rank 0 writes the log, and a Ctrl-C on any rank stops them all at the next progress
    line."""
    ckpt_path, log_path = os.path.join(out_dir, "ckpt.npz"), os.path.join(out_dir, LOG)
    rank, world = getattr(trainer, "rank", 0), getattr(trainer, "world", 1)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)          # made here: a run that fails before its first step leaves none
        for stale in glob.glob(os.path.join(glob.escape(out_dir), "ckpt.npz.*.tmp")):
            os.remove(stale)                         # a write killed (SIGKILL, power) before its rename: GBs at big
        if start == 0 and os.path.exists(ckpt_path):     # --force: the old run's log and evals stay with its
            log_path += ".new"                           # checkpoint until this run's first replaces it
            print(f"note: this run logs to {log_path} until its first checkpoint replaces {ckpt_path}", flush=True)
        else:
            start_log(out_dir, start)
    flag = StopFlag("this step" if world == 1 else "the steps up to the next progress line")
    try:
        with open(log_path if rank == 0 else os.devnull, "w" if log_path.endswith(".new") else "a") as log:
            for rec in first:                        # records before step 1 (DPO's held-out metrics at step 0)
                log.write(json.dumps(rec) + "\n")
            step, val_loss, stopped = _train_steps(trainer, tok, batches, args, ckpt_path, log, flag, val_fn, extra,
                                                   start, sample_fn, rank, world)
    finally:
        flag.restore()
    if stopped:
        raise KeyboardInterrupt
    return val_loss


def _train_steps(trainer, tok, batches, args, ckpt_path, log, flag, val_fn, extra, start, sample_fn, rank, world):
    steps, val_loss, t_start, agreed = args["steps"], None, time.time(), False
    schedule = args.get("schedule_steps") or steps
    minutes = args.get("ckpt_minutes") or 0
    saved, t_saved = start or None, time.time()     # the step in ckpt_path of this run (None: none yet), and when
    fresh_log = log.name if log.name.endswith(".new") else None     # train_loop's log beside an old run's

    def kept():
        return f"the checkpoint of step {saved} is kept ({ckpt_path})" if saved else "no checkpoint was written yet"

    def checkpoint(step):
        nonlocal saved, t_saved, fresh_log
        state = trainer.host_state()                 # on several GPUs a collective: every rank takes part
        if rank == 0:
            P, m, v = state
            # the weights can go NaN a step or two before the loss that would show it: never save them
            if not all(np.isfinite(t.flat).all() for t in state):
                raise UserError(f"the weights hold NaN or infinite values after step {step}; stopped, {kept()}; "
                                "try a lower --lr")
            save_checkpoint(ckpt_path, P, tok, {"step": step, "adam_m": m, "adam_v": v, "data": batches.state(),
                                                "train": args}, extra)
            if fresh_log:                            # this run's first checkpoint: its log is the folder's now
                os.replace(fresh_log, fresh_log[:-len(".new")])
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(os.path.dirname(ckpt_path), EVALS))
                fresh_log = None
        saved, t_saved = step, time.time()

    step, pending, t_last = start, [], time.time()
    t_print, tokens_since_print = t_last, 0                        # the progress line's rate: since the last one
    while step < steps:
        lr = lr_at(step, schedule, args["lr"], args["warmup"])
        x, y = batches.next()
        trainer.step(x, y, lr)
        step += 1
        pending.append((step, lr, x.size * world))                  # the tokens of every rank
        due = minutes > 0 and time.time() - t_saved >= 60 * minutes     # by time too: a crash loses at most that
        if world > 1:      # the ranks stop, or save by time, at one step: they agree at each progress line (collectives)
            line = step % args["log_every"] == 0 or step == steps
            agreed = line and trainer.any_rank(flag.stop)
            due = line and trainer.any_rank(due)
        stopping = ((flag.stop if world == 1 else agreed)
                    or (args.get("stop_after") and step - start >= args["stop_after"]))
        evaluating = val_fn is not None and (step % args["eval_every"] == 0 or step == steps)
        saving = step % args["ckpt_every"] == 0 or step == steps or stopping or due
        printing = step % args["log_every"] == 0 or step == steps or evaluating
        if not (trainer.sync_every_step or printing or saving or stopping):
            continue
        # read back the steps since the last sync: the device may have run ahead of the host until here
        results, now = trainer.results(), time.time()
        dt = (now - t_last) / len(pending)
        tokens_since_print += sum(n for _, _, n in pending)
        for (s, s_lr, n_tokens), (objective, ces, norm) in zip(pending, results):
            if not math.isfinite(objective):
                raise UserError(f"loss is {objective} at step {s}; stopped, {kept()}; try a lower --lr")
            rec = {"step": s, "loss": round(ces[0], 5), "objective": round(objective, 5), "lr": s_lr,
                   "grad_norm": round(norm, 4), "ms": round(dt * 1e3, 2), "tok_s": round(n_tokens / dt),
                   "tokens": n_tokens}                  # this step's: batch x grad-accum x seq x GPUs
            if s == step and evaluating:
                val_loss, bpb, *more = val_fn()          # more: a dict of other metrics for the log (DPO)
                rec.update(val_loss=round(val_loss, 5), **({"val_bpb": round(bpb, 5)} if bpb else {}), **(more[0] if more else {}))
            log.write(json.dumps(rec) + "\n")
        log.flush()
        if printing:
            eta = (steps - step) * (time.time() - t_start) / (step - start)
            rate = tokens_since_print / (now - t_print)
            t_print, tokens_since_print = time.time(), 0
            msg = (f"step {step:5d}/{steps} | loss {ces[0]:.4f} | lr {lr:.2e} | {rate:,.0f} tok/s | "
                   + (f"MFU {trainer.mfu(rate):.1%} | " if hasattr(trainer, "mfu") else "") + f"ETA {eta / 60:.1f} min")
            if evaluating:
                msg += f" | val loss {rec['val_loss']:.4f}" + (f" | val bpb {rec['val_bpb']:.3f}" if "val_bpb" in rec else "")
            print(msg, flush=True)
        if sample_fn and args.get("sample_every") and step % args["sample_every"] == 0 and step < steps:
            sample_fn(step)
        if saving and stopping and fresh_log and (extra or {}).get("kind") == "chat":
            # Ctrl-C in sft/dpo --force, before its first checkpoint: no resume could finish this run, so its
            # part would only replace the finished model in the folder
            print(f"stopped at step {step}/{steps}; {ckpt_path} stays the earlier run's (sft and dpo do not "
                  "resume)", flush=True)
            return step, val_loss, True
        if saving:
            checkpoint(step)
        pending, t_last = [], time.time()
        if stopping:
            break
    print(f"checkpoint: {ckpt_path} (step {step}/{steps}, {(time.time() - t_start) / 60:.1f} min)")
    return step, val_loss, flag.stop if world == 1 else agreed


def print_sample(tok, generate_fn, prompt, n, seed=0):
    """A sample in a frame, for progress output: generate_fn(ids, n, rng) yields ids. -> the sample's text,
    printable."""
    ids = tok.encode(prompt)
    text = printable(tok.decode(ids + list(generate_fn(ids, n, np.random.default_rng(seed)))))
    print("--- sample ---\n" + text + "\n--------------", flush=True)
    return text


# The small model's defaults: on the embedded corpus (~215K tokens) validation loss is lowest near 1000
# steps (~5 epochs) and climbs after; longer runs pay on larger corpora (--steps).
TRAIN_DEFAULTS = dict(config="small", steps=1000, batch=8, seq=256, lr=3e-3, warmup=100, eval_every=100,
                      sample_every=500, ckpt_every=500, log_every=50, seed=0, stop_after=0, data=None, grad_accum=1,
                      ckpt_minutes=10.0, optim="adamw", muon_lr=0.02)

# Fine-tuning defaults. SFT: the steps both engines share, and per engine the batch, longest example and
# rate (the GPU's larger batches and longer examples take a lower rate). DPO: the same on both engines.
SFT_DEFAULTS = {"steps": 300, "cpu": dict(batch=8, seq=256, lr=1e-3), "gpu": dict(batch=16, seq=512, lr=1e-4)}
DPO_DEFAULTS = dict(steps=75, batch=8, lr=1e-5, beta=0.1)

# The default run folder of each stage, on both engines: sft reads train's checkpoint, dpo reads sft's.
RUN_DIRS = {"train": "out", "sft": "out_chat", "dpo": "out_dpo"}


def run_ckpt(stage):
    """The default checkpoint of a stage's run: run_ckpt("train") is out/ckpt.npz."""
    return f"{RUN_DIRS[stage]}/ckpt.npz"


def check_positive(a, *names):
    for name in names:
        v = a[name] if isinstance(a, dict) else getattr(a, name)
        if v is None or v < 1:
            raise UserError(f"--{name.replace('_', '-')} {v}: give a whole number of at least 1")


def start_run(a, defaults, resume):
    """The start of a training run, shared by both engines. Fresh: the config named by the flags or
    defaults['config'], the contract's init. Resumed: the checkpoint in a.out with its optimiser state and
    its own arguments (flags given now override them; --stop-after applies to this run only; the
    learning-rate schedule keeps the run's first length). -> (P, tok, tokens, args, state, extra)."""
    writable_run(a.out)
    ckpt_path = os.path.join(a.out, "ckpt.npz")
    given = {k: v for k, v in vars(a).items() if k in defaults and v is not None}
    if resume:
        P, tok, state, extra = load_checkpoint(ckpt_path, want_state=True)
        if state is None:
            raise UserError(f"{ckpt_path} holds no training state to resume (an SFT checkpoint?)")
        if extra.get("kind") == "chat":              # sft/dpo stopped by Ctrl-C: resume would go on pretraining it
            raise UserError(f"{ckpt_path} is an sft or dpo run's; resume goes on with pretraining runs only: run sft "
                            "or dpo again")
        run = state["train"]
        name = run.get("config", config_name(P.cfg))
        if given.get("config", name) != name:
            raise UserError(f"{ckpt_path} is a run of config {name}, not {given['config']}; resume without a config "
                            "or start a new run in another --out")
        args = {**defaults, **run, **given, "stop_after": given.get("stop_after", 0), "config": name}
        optim = run.get("optim", "adamw")              # a run from before --optim trained with AdamW
        if args["optim"] != optim:
            raise UserError(f"--optim {args['optim']}: the run in {a.out} trains with {optim}, whose state its "
                            f"checkpoint holds; resume with --optim {optim}, or start a new run in another --out")
        shape = ("batch", "seq", "grad_accum")      # what each step sees: a resume continues the run exactly
        changed = [f"--{k.replace('_', '-')} {args[k]}" for k in shape if args[k] != run.get(k, defaults[k])]
        if changed:
            raise UserError(f"{', '.join(changed)}: the run in {a.out} has " + ", ".join(
                f"--{k.replace('_', '-')} {run.get(k, defaults[k])}" for k in shape) + ", and a resume continues it "
                "exactly; drop the flag, or start a new run in another --out")
        args["schedule_steps"] = run.get("schedule_steps", run["steps"])
        if args["steps"] <= state["step"]:
            raise UserError(f"the run in {a.out} is at step {state['step']} of {args['steps']}; raise --steps to "
                            "go on (the rate stays at its 10% floor past the first schedule)")
        print(f"resuming {ckpt_path} at step {state['step']}/{args['steps']}"
              + (f" (schedule of {args['schedule_steps']} steps, then lr {0.1 * args['lr']:.2e})"
                 if args["steps"] > args["schedule_steps"] else ""))
    else:
        if os.path.exists(ckpt_path) and not a.force:
            raise UserError(f"{ckpt_path} exists: resume it, start over with --force, or pick another --out")
        args, state, extra = {**defaults, **given}, None, {"kind": "base"}
        args["schedule_steps"] = args["steps"]
    check_positive(args, "steps", "batch", "seq", "eval_every", "ckpt_every", "log_every", "grad_accum",
                   *(["stop_after"] if "stop_after" in given else []))
    for name in ("lr", "muon_lr"):
        if not 0 < args[name] < math.inf:
            raise UserError(f"--{name.replace('_', '-')} {args[name]}: give a positive, finite learning rate")
    if args["warmup"] < 0:
        raise UserError(f"--warmup {args['warmup']}: give --warmup at least 0 (steps)")
    if not 0 <= args["ckpt_minutes"] < math.inf:
        raise UserError(f"--ckpt-minutes {args['ckpt_minutes']}: give minutes between checkpoints (0: by steps only)")
    cfg = P.cfg if resume else get_config(args["config"])
    if "seq" not in given and not resume:            # the default, where the config's context is shorter
        args["seq"] = min(args["seq"], cfg.ctx)
    if args["seq"] > cfg.ctx:
        raise UserError(f"--seq {args['seq']} is longer than the context of {cfg.ctx} of config {args['config']}")
    if args["data"] and os.path.isdir(args["data"]):
        raise UserError(f"--data {args['data']} is a folder; give a text file or a .bin token file")
    tokens, tok_data = prepare_data(args["data"], cfg, args["config"])
    if resume and tok_data.to_string() != tok.to_string():
        raise UserError("the data's tokenizer differs from the checkpoint's; resume with the same --data")
    if not resume:
        tok, P = tok_data, Params.init(cfg, args["seed"])
    print(f"model: {args['config']} {cfg}, {num_params(cfg):,} parameters", flush=True)
    return P, tok, tokens, args, state, extra


# ----------------------------------------------------------------------------------------------------
# command line: the flags both engines share, each with its help and default

class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (raised as UserError) and a near-miss suggestion for a wrong flag."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kw)

    def error(self, message):
        if message.startswith("unrecognized arguments:"):
            parsers = [self] + [sp for a in self._actions if isinstance(a, argparse._SubParsersAction)
                                for sp in a.choices.values()]
            flags = [s for p in parsers for a in p._actions for s in a.option_strings]
            for word in message.split(":", 1)[1].split():
                near = difflib.get_close_matches(word, flags, 1)
                if near:
                    message += f" (did you mean {near[0]}?)"
                    break
        raise UserError(f"{message} (see {self.prog} --help)")


def run_main(prog, doc, modes, letters, argv, error_of=None):
    """The one mode dispatch of both engines: `prog MODE [flags]`. modes: {name: (one-line help, fn(argv))} in
    the order listed; letters: {letter: name} (the letter "" names the mode run when none is given). -h, --help
    or no mode prints the modes; a misspelt mode gets the nearest name. A UserError, or an exception that
    error_of(e) turns into a message (not None), is one `error:` line and status 1; Ctrl-C is 130. A mode's int
    is its status (a failed check, a failed rank); anything else it returns is success, 0."""
    argv = [str(x) for x in argv]
    if argv[:1] in (["-h"], ["--help"], ["help"]) or (not argv and "" not in letters):
        names = {name: [k for k, v in letters.items() if v == name and k] for name in modes}
        rows = [(name + "".join(f" | {k}" for k in names[name]), text) for name, (text, _) in modes.items()]
        width = max(len(r) for r, _ in rows)
        print(f"usage: {prog} MODE [flags]\n\n{doc.strip()}\n\nmodes (a word or its letter; {prog} MODE --help "
              "lists its flags):\n" + "\n".join(f"  {r:{width}}  {text}" for r, text in rows))
        return 0 if argv else 1
    mode, rest = (argv[0], argv[1:]) if argv and not argv[0].startswith("-") else ("", argv)
    mode = letters.get(mode, mode)
    try:
        if not mode:
            raise UserError(f"give a mode before {rest[0]}; the modes are {', '.join(modes)} (see {prog} --help)")
        if mode not in modes:
            near = difflib.get_close_matches(mode, list(modes) + [k for k in letters if k], 1)
            hint = f" (did you mean {letters.get(near[0], near[0])}?)" if near else ""
            raise UserError(f"invalid choice: mode {mode!r}{hint}; the modes are {', '.join(modes)} (see {prog} --help)")
        status = modes[mode][1](rest)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        message = error_of(e) if error_of is not None else None
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 1
    return status if isinstance(status, int) and not isinstance(status, bool) else 0


def add_config_arg(p, default):
    """The config, by name, as a word or --config (every mode of both engines)."""
    names = ", ".join(CONFIGS)
    p.add_argument("config", nargs="?", metavar="CONFIG", help=f"model: {names} (default {default}; CONTRACT.md)")
    p.add_argument("--config", dest="config_flag", metavar="NAME", help="the same, as a flag")


def config_arg(a):
    """The config named by the word or the flag (None when neither), checked."""
    if a.config and a.config_flag and a.config != a.config_flag:
        raise UserError(f"two configs given: {a.config} and --config {a.config_flag}")
    name = a.config or a.config_flag
    if name is not None:
        get_config(name)
    return name


def add_prompt_arg(p):
    """sample's prompt, as a word or --prompt (both engines)."""
    p.add_argument("prompt", nargs="?", help="text to continue (default a newline; also --prompt)")
    p.add_argument("--prompt", dest="prompt_flag", metavar="TEXT", help="the same, as a flag")


def prompt_arg(a):
    """The prompt given by the word or the flag; a newline when neither."""
    if a.prompt is not None and a.prompt_flag is not None and a.prompt != a.prompt_flag:
        raise UserError(f"two prompts given: {a.prompt!r} and --prompt {a.prompt_flag!r}")
    return next((t for t in (a.prompt, a.prompt_flag) if t is not None), "\n")


def seed_arg(v):
    """--seed: a whole number numpy's generators take."""
    try:
        n = int(v)
    except ValueError:
        n = -1
    if not 0 <= n < 2 ** 63:
        raise argparse.ArgumentTypeError(f"{v!r}: give a whole number from 0 to 2**63 - 1")
    return n


def batch_or_auto(v):
    """--batch's value where the engine sizes the batch itself: a whole number or 'auto'."""
    return v if v == "auto" else int(v)


def add_train_flags(p, out, defaults, lr_note="", auto_batch=None):
    """The flags of a training run (both engines); those not given come from defaults or, when resuming,
    from the checkpoint's run. lr_note: what follows the default rate in --lr's help, where it depends on the
    config (" for small, 0.001 for the other configs"). auto_batch: what --batch auto does, where the engine
    has it (the GPU's)."""
    d = defaults
    add_config_arg(p, d["config"])
    p.add_argument("--data", help="a UTF-8 text file, or a uint16 .bin token file with its .bpe beside it "
                                  f"(default: {d['data'] or 'the embedded corpus, no download'})")
    helps = {"steps": "training steps; on --resume it may be raised: the cosine keeps the run's first length, "
                      "then the rate stays at its 10%% floor",
             "batch": "sequences per step (per GPU)", "seq": "tokens per sequence (at most the context)",
             "grad_accum": "micro-batches of --batch sequences per step, their gradients averaged: one step "
                           "sees batch x grad-accum (x GPUs) sequences",
             "lr": "peak learning rate", "warmup": "steps of linear warm-up", "seed": "init and data order",
             "eval_every": "validate every N steps", "sample_every": "print a sample every N steps (0: never)",
             "ckpt_every": "checkpoint every N steps",
             "ckpt_minutes": "checkpoint too when N minutes of training have passed since the last one, so a crash "
                             "loses at most that (0: by steps only)",
             "log_every": "progress line every N steps"}
    if auto_batch:
        helps["batch"] += f"; {auto_batch}"
    for name, text in helps.items():
        auto = auto_batch and name == "batch"
        kind = batch_or_auto if auto else seed_arg if name == "seed" else type(d[name])
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind,
                       metavar="X" if name == "lr" else "N|auto" if auto else "N",
                       help=f"{text} (default {d[name]}{lr_note if name == 'lr' else ''})")
    p.add_argument("--optim", choices=OPTIMS, help="adamw: AdamW on every tensor; muon: Muon on the blocks' matrices "
                   "at --muon-lr, AdamW at --lr on the embedding, norms and heads (CONTRACT.md; a resume keeps the "
                   f"run's) (default {d['optim']})")
    p.add_argument("--muon-lr", dest="muon_lr", type=float, metavar="X",
                   help=f"Muon's peak learning rate, on the schedule of --lr (default {d['muon_lr']})")
    p.add_argument("--stop-after", dest="stop_after", type=int, metavar="N",
                   help="stop (and checkpoint) after N steps of this run")
    p.add_argument("--out", default=out, help=f"folder for ckpt.npz and train_log.jsonl (default {out})")
    p.add_argument("--force", action="store_true", help="start over even if --out holds a checkpoint")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")


def sampling_of(a):
    """The Sampling the flags ask for."""
    return Sampling(a.temperature, a.top_k, a.top_p, a.repetition_penalty)


def speculative_for(flag, sampling, n_mtp, pays=True):
    """--speculative as given, or by default (None) on for greedy decoding alone, where the drafts are kept
    most often, and where it pays on this engine and model (pays); off without MTP heads to draft (n_mtp 1),
    which the speed line then says."""
    return n_mtp > 1 and (flag if flag is not None else sampling.temperature <= 0 and pays)


def add_sample_flags(p, ckpt, temperature, tokens_help=None, seed_help=None, speculative_help=None, speculative=True):
    """The flags of sample, chat and serve: the checkpoint, the sampling rule and speculative decoding (by
    default speculative_for's rule, said by speculative_help if given; speculative=False: no such flag).
    tokens_help and seed_help: what --tokens and --seed mean where they mean something else (serve)."""
    p.add_argument("--ckpt", default=ckpt, help=f"checkpoint file or run folder (default {ckpt})")
    p.add_argument("--tokens", type=int, default=200, help=tokens_help or "most tokens to generate (default 200; "
                   "generation stops when the context is full; a longer prompt keeps its last tokens, with a notice)")
    p.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 is greedy (default {temperature})")
    p.add_argument("--top-k", dest="top_k", type=int, default=40, help="sample from the k likeliest (0: all; default 40)")
    p.add_argument("--seed", type=seed_arg, default=0,
                   help=seed_help or "random seed: the same seed gives the same text (default 0)")
    p.add_argument("--top-p", dest="top_p", type=float, default=1.0,
                   help="then from the smallest set of ids whose probability reaches p (default 1: no cut)")
    p.add_argument("--repetition-penalty", dest="repetition_penalty", type=float, default=1.0,
                   help="divide the logits of ids already in the text by this (CTRL's rule; default 1: off)")
    if not speculative:
        return
    default = speculative_help or ("on when greedy, where a trained model's drafts make it faster; off when sampling, "
                                   "where fewer drafts are kept and it costs more than it saves")
    p.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=None,
                   help="let the MTP heads draft tokens that head 0 verifies in one forward: the same text, distributed "
                        f"exactly as without (default {default})")


def add_finetune_flags(p, ckpt_help, ckpt, out, steps, batch, lr, seed_help, data):
    """The flags sft and dpo share: batch is (default, what one is)."""
    p.add_argument("--ckpt", default=ckpt, help=ckpt_help)
    p.add_argument("--data", help=data)
    p.add_argument("--steps", type=int, default=steps, help=f"training steps (default {steps})")
    p.add_argument("--batch", type=int, default=batch[0], help=f"{batch[1]} (default {batch[0]})")
    p.add_argument("--lr", type=float, default=lr, help=f"peak learning rate (default {lr})")
    p.add_argument("--seed", type=seed_arg, default=0, help=f"{seed_help} (default 0)")
    p.add_argument("--out", default=out, help=f"folder of the chat checkpoint (default {out})")
    p.add_argument("--force", action="store_true", help="overwrite the checkpoint in --out")


def add_sft_flags(p, ckpt, out, batch, seq, lr):
    """batch, seq, lr: the engine's entry of SFT_DEFAULTS."""
    add_finetune_flags(p, f"the base checkpoint or its run folder (default {ckpt})", ckpt, out, SFT_DEFAULTS["steps"],
                       (batch, "examples per step"), lr, "data order",
                       data="Alpaca JSON (default: the built-in instruction set, no download)")
    p.add_argument("--seq", type=int, default=seq, help=f"longest example in tokens (default {seq})")

"""
bench/torch_reference.py -- OPTIONAL yardstick, not part of NanoEuler: the same model as CONTRACT.md (big by
default) in PyTorch with bf16 autocast, torch.compile, fused AdamW and SDPA with grouped-query attention,
timed like nanoeuler_cuda.py's bench (steps back to back after warm-up, CUDA events) with its peak memory.
The product never imports it and the tests exclude it; it needs PyTorch with CUDA.

    python3 bench/torch_reference.py [CONFIG] [--batches 16,64] [--seq 512] [--steps 10] [--json FILE]
                                     [--wait-for FILE] [--mode default,reduce-overhead,max-autotune-no-cudagraphs]

--mode: torch.compile's modes to time, each on a model of its own (default: default). reduce-overhead replays
CUDA graphs (the step starts with cudagraph_mark_step_begin); max-autotune-no-cudagraphs autotunes the
matrix products and Triton kernels without graphs (its compile takes minutes).

--wait-for: compile and warm up every batch size first, print "compiled", then wait until FILE exists
before the timed runs (so another program can use the GPU while torch.compile works on the CPU, and the
timed runs of both do not overlap).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pipeline as pl  # noqa: E402  (configs and the FLOP count only)

PEAK_TFLOPS = 989.0        # dense bf16 peak of an H100/H200 SXM, as nanoeuler_cuda.py bench


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):                                  # statistics in fp32, as the contract says
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def rope(u, cos, sin):                                     # half-split pairs, u (B, H, T, hd)
    h = u.shape[-1] // 2
    a, b = u[..., :h], u[..., h:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).type_as(u)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.attn_norm, self.ffn_norm = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        c = self.cfg
        B, T, _ = x.shape
        hd, Hq, Hkv = c.head_dim, c.n_heads, c.n_kv_heads
        q, k, v = self.wqkv(self.attn_norm(x)).split([Hq * hd, Hkv * hd, Hkv * hd], -1)
        q = rope(q.view(B, T, Hq, hd).transpose(1, 2), cos, sin)
        k = rope(k.view(B, T, Hkv, hd).transpose(1, 2), cos, sin)
        v = v.view(B, T, Hkv, hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, Hq * hd))
        g, u = self.w13(self.ffn_norm(x)).chunk(2, -1)
        return x + self.w2(F.silu(g) * u)


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.heads = nn.Linear(cfg.dim, cfg.n_mtp * cfg.vocab, bias=False)
        hd = cfg.head_dim
        f = 10000.0 ** (-torch.arange(0, hd // 2, dtype=torch.float64) * 2.0 / hd)
        ang = torch.arange(cfg.ctx, dtype=torch.float64)[:, None] * f[None, :]
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)
        for name, p in self.named_parameters():             # the contract's init
            if p.ndim == 2:
                std = 0.02 / (2 * cfg.n_layers) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, x, y):
        """The contract's objective: CE_0 + mtp_weight * mean(CE_1..CE_{K-1}); head k predicts y[t + k]."""
        c = self.cfg
        B, T = x.shape
        cos, sin = self.cos[:T], self.sin[:T]
        h = self.tok_emb(x)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.heads(self.norm(h)).view(B, T, c.n_mtp, c.vocab)
        ces = [F.cross_entropy(logits[:, :T - k, k].float().reshape(-1, c.vocab), y[:, k:].reshape(-1),
                               ignore_index=-1) for k in range(c.n_mtp)]
        return ces[0] + c.mtp_weight * torch.stack(ces[1:]).mean() if c.n_mtp > 1 else ces[0]


MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


def trainer(cfg, dev, mode, data):
    """A fresh model, its fused AdamW and torch.compile(mode) -> step(B): one training step on data[B]."""
    model = GPT(cfg).to(dev)
    decay = [q for q in model.parameters() if q.ndim == 2]
    no_decay = [q for q in model.parameters() if q.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    cmodel = torch.compile(model, mode=mode, dynamic=False)

    def step(B):
        x, y = data[B]
        if mode == "reduce-overhead":                       # a new iteration: the last replay's outputs are done
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cmodel(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[1])
    p.add_argument("config", nargs="?", default="big")
    p.add_argument("--batches", default="16,64")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json")
    p.add_argument("--wait-for")
    p.add_argument("--mode", default="default", help="torch.compile modes, comma-separated: " + ", ".join(MODES))
    a = p.parse_args()
    modes = a.mode.split(",")
    if not set(modes) <= set(MODES):
        p.error(f"--mode {a.mode}: give some of {', '.join(MODES)}")
    cfg = pl.get_config(a.config)
    T, batches = a.seq, [int(b) for b in a.batches.split(",")]
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    for knob in ("cache_size_limit", "recompile_limit"):   # one compiled graph per (model, batch size)
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(8, 2 * len(modes) * len(batches)))
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    data = {B: (torch.randint(0, cfg.vocab, (B, T), device=dev, generator=gen),
                torch.randint(0, cfg.vocab, (B, T), device=dev, generator=gen)) for B in batches}
    steps = {mode: trainer(cfg, dev, mode, data) for mode in modes}

    t0 = time.time()
    for mode in modes:                                      # compile (one graph per shape) and warm up
        for B in batches:
            for _ in range(3):
                steps[mode](B)
    torch.cuda.synchronize()
    print(f"compiled: {time.time() - t0:.0f} s (torch {torch.__version__})", flush=True)
    if a.wait_for:
        while not os.path.exists(a.wait_for):
            time.sleep(0.5)
    fpt = pl.model_flops_per_token(cfg, T)
    rows = []
    for mode in modes:
        for B in batches:
            step = steps[mode]
            for _ in range(2):
                step(B)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(a.steps):
                loss = step(B)
            e.record()
            e.synchronize()
            ms = s.elapsed_time(e) / a.steps
            rows.append(dict(mode=mode, B=B, T=T, ms=ms, tok_s=B * T / ms * 1e3,
                             mfu=fpt * B * T / (ms / 1e3) / 1e12 / PEAK_TFLOPS,
                             peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30, loss=float(loss)))
    print(f"PyTorch {torch.__version__}: {a.config}, bf16 autocast + torch.compile + fused AdamW + SDPA (GQA), "
          f"T={T}, {a.steps} steps after warm-up; MFU vs {PEAK_TFLOPS:.0f} TFLOP/s; peak = max_memory_allocated "
          "(every mode's model is resident: later modes' peaks include the earlier models' weights and moments)")
    print(f"{'run':<46}{'ms/step':>9}{'tokens/s':>11}{'MFU':>7}{'peak GiB':>10}")
    for r in rows:
        print(f"{'torch bf16 ' + r['mode'] + ' B=' + str(r['B']):<46}{r['ms']:9.2f}{r['tok_s']:11,.0f}"
              f"{100 * r['mfu']:6.1f}%{r['peak_gib']:10.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(torch=torch.__version__, config=a.config, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

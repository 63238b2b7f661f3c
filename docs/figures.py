"""The README's two pictures, written as SVG text (standard library only).

    python3 docs/figures.py        # -> docs/pipeline.svg, docs/euler_block.svg

pipeline.svg:    data -> tokenizer -> pretrain -> SFT -> DPO, and what a checkpoint is for (chat, serve,
                 export, eval).
euler_block.svg: one transformer block as two forward-Euler steps of the residual stream,
                 x <- x + attn(norm(x)), then x <- x + swiglu(norm(x)).

Each picture is a list of shapes in pixel coordinates; the helpers below turn each into one SVG element.
"""
import os

HERE = os.path.dirname(os.path.abspath(__file__))
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
INK = "#222"
# fills by role: what goes in, a training stage, a use of a checkpoint, the residual stream
FILL = {"in": "#eef1f5", "train": "#dbe8fb", "use": "#def3e4", "stream": "#f6e3c7"}
EDGE = {"in": "#7a8899", "train": "#3d6fb6", "use": "#3f8f58", "stream": "#b07a2a"}

# ---------------------------------------------------------------------------------------------- shapes

def esc(s):
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def text(x, y, s, size=14, weight="normal", anchor="middle", color=INK, style="normal"):
    return (f'<text x="{x}" y="{y}" font-family="{FONT}" font-size="{size}" font-weight="{weight}" '
            f'font-style="{style}" text-anchor="{anchor}" fill="{color}">{esc(s)}</text>')


def box(x, y, w, h, role, lines):
    """A rounded box; lines = [(text, size, weight), ...] centred, the first one bold."""
    out = [f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="8" fill="{FILL[role]}" '
           f'stroke="{EDGE[role]}" stroke-width="1.5"/>']
    step = 19
    top = y + h / 2 - step * (len(lines) - 1) / 2 + 5
    for i, (s, size, weight) in enumerate(lines):
        out.append(text(x + w / 2, top + i * step, s, size, weight, color=INK if i == 0 else "#444"))
    return "\n".join(out)


def line(points, color=INK, width=1.6, arrow=True, dash=None):
    d = " ".join(f"{x},{y}" for x, y in points)
    extra = ' marker-end="url(#arrow)"' if arrow else ""
    extra += f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="{width}" '
            f'stroke-linejoin="round"{extra}/>')


def svg(width, height, body):
    return f"""<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}">
<defs>
  <marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">
    <path d="M0,0 L10,5 L0,10 z" fill="{INK}"/>
  </marker>
</defs>
<rect width="{width}" height="{height}" fill="white"/>
{body}
</svg>
"""

# ---------------------------------------------------------------------------------------------- pipeline

def pipeline():
    W, H = 1000, 372
    bw, bh, gap, y0 = 160, 92, 36, 62
    stages = [  # (role, title, the command, what it writes)
        ("in", "data", "make data", "or the embedded corpus"),
        ("in", "tokenizer", "bpe.py train", "byte-level BPE"),
        ("train", "pretrain", "train", "out/  (base model)"),
        ("train", "SFT", "sft", "out_chat/  (chat model)"),
        ("train", "DPO", "dpo", "out_dpo/  (chat model)"),
    ]
    parts = [text(24, 34, "From text to a chat model", 17, "bold", anchor="start"),
             text(290, 34, "(pretrain, SFT and DPO are modes of both engines; data and tokenizer feed them)",
                  13, anchor="start", color="#555")]
    xs = [24 + i * (bw + gap) for i in range(len(stages))]
    for x, (role, title, cmd, what) in zip(xs, stages):
        parts.append(box(x, y0, bw, bh, role, [(title, 17, "bold"), (cmd, 14, "normal"), (what, 12, "normal")]))
    for a, b in zip(xs, xs[1:]):
        parts.append(line([(a + bw + 2, y0 + bh / 2), (b - 3, y0 + bh / 2)]))

    # every checkpoint (base, SFT or DPO) serves every use: three drops onto one bus, four arrows off it
    bus = y0 + bh + 58
    for x in xs[2:]:
        parts.append(line([(x + bw / 2, y0 + bh), (x + bw / 2, bus)], arrow=False))
    uses = [
        ("chat, sample", "chat / sample", "a REPL; text in the terminal"),
        ("serve", "serve", "OpenAI API + chat page"),
        ("export", "export", "transformers, llama.cpp"),
        ("evaluate", "eval / plot", "HellaSwag, bits per byte"),
    ]
    uw, ugap = 196, 32
    ux = [W - 24 - len(uses) * uw - (len(uses) - 1) * ugap + i * (uw + ugap) for i in range(len(uses))]
    left, right = min(ux[0] + uw / 2, xs[2] + bw / 2), max(ux[-1] + uw / 2, xs[-1] + bw / 2)
    parts.append(line([(left, bus), (right, bus)], arrow=False))
    parts.append(text(xs[2] + bw + gap / 2, bus - 10, "any ckpt.npz, either engine", 12, color="#555",
                      style="italic"))
    uy = bus + 48
    for x, (title, cmd, what) in zip(ux, uses):
        parts.append(line([(x + uw / 2, bus), (x + uw / 2, uy - 3)]))
        parts.append(box(x, uy, uw, 84, "use", [(title, 16, "bold"), (cmd, 14, "normal"), (what, 12, "normal")]))
    return svg(W, H, "\n".join(parts))

# ---------------------------------------------------------------------------------------------- Euler block

def euler_block():
    W, H = 1040, 440
    ys = 300                                   # the residual stream, left to right
    x_in, x_add1, x_add2, x_out = 80, 480, 890, 950
    parts = [text(24, 34, "One block = two forward-Euler steps of the residual stream "
                          "(step h = 1): x ← x + f(x)", 16, "bold", anchor="start")]
    # the stream itself: a broad band under a plain arrow
    parts.append(f'<rect x="{x_in - 10}" y="{ys - 13}" width="{x_out - x_in + 12}" height="26" rx="13" '
                 f'fill="{FILL["stream"]}" stroke="{EDGE["stream"]}" stroke-width="1.2"/>')
    parts.append(line([(x_in + 8, ys), (x_add1 - 17, ys)], width=2.2))
    parts.append(line([(x_add1 + 17, ys), (x_add2 - 17, ys)], width=2.2))
    parts.append(line([(x_add2 + 17, ys), (x_out + 14, ys)], width=2.2))
    parts.append(text(x_in - 18, ys + 6, "xₗ", 20, "bold", anchor="end"))
    parts.append(text(x_out + 20, ys + 6, "xₗ₊₁", 20, "bold", anchor="start"))

    def branch(x_tap, x_add, f_lines):
        """tap the stream, normalise, compute f, add the result back at x_add."""
        top = 100
        norm_x, f_x = x_tap + 30, x_tap + 180
        out = [line([(x_tap, ys - 13), (x_tap, top + 30), (norm_x - 3, top + 30)])]
        out.append(box(norm_x, top, 120, 60, "in", [("RMSNorm", 15, "bold"), ("eps 1e-5", 12, "normal")]))
        out.append(line([(norm_x + 120, top + 30), (f_x - 3, top + 30)]))
        out.append(box(f_x, top - 12, 170, 84, "train", f_lines))
        out.append(line([(f_x + 170, top + 30), (x_add, top + 30), (x_add, ys - 19)]))
        out.append(f'<circle cx="{x_add}" cy="{ys}" r="16" fill="white" stroke="{INK}" stroke-width="1.8"/>')
        out.append(text(x_add, ys + 8, "+", 24, "bold"))
        return out

    parts += branch(x_in + 40, x_add1, [("Attention", 16, "bold"), ("causal, grouped-query", 12, "normal"),
                                        ("RoPE on q and k", 12, "normal")])
    parts += branch(x_add1 + 40, x_add2, [("SwiGLU", 16, "bold"), ("silu(h W1ᵀ) ⊙ (h W3ᵀ)", 12, "normal"),
                                          ("then · W2ᵀ", 12, "normal")])
    parts.append(text(x_add1 + 26, ys + 40, "x′", 18, "bold", anchor="start"))
    # the two updates as formulas, and where the block sits in the model
    parts.append(text(x_add1 - 160, 374, "x′ = xₗ + Attention(RMSNorm(xₗ))", 17))
    parts.append(text(x_add2 - 160, 374, "xₗ₊₁ = x′ + SwiGLU(RMSNorm(x′))", 17))
    parts.append(text(W / 2, 408, "the model: token embedding → L such blocks (a layer is a time step of "
                                  "dx/dt = f(x, t)) → RMSNorm → n_mtp heads", 13, color="#555"))
    return svg(W, H, "\n".join(parts))


if __name__ == "__main__":
    for name, make in (("pipeline.svg", pipeline), ("euler_block.svg", euler_block)):
        path = os.path.join(HERE, name)
        with open(path, "w") as f:
            f.write(make())
        print("wrote", os.path.relpath(path))

"""
export.py -- NanoEuler checkpoints to and from the files other tools read: a Hugging Face Llama folder
(transformers, and every tool built on it) and a GGUF file (llama.cpp, Ollama).

    python3 nanoeuler.py export --ckpt CKPT --format hf --out DIR
    python3 nanoeuler.py export --ckpt CKPT --format gguf [--dtype f32|f16|q8_0] --out FILE.gguf
    python3 nanoeuler.py import --hf DIR --out CKPT [--mtp keep|none|init]

The model of CONTRACT.md is a Llama decoder (RMSNorm eps 1e-5, RoPE theta 1e4 in the half-split layout,
no bias, GQA, SwiGLU) whose head 0 is the language-model head: it maps onto LlamaForCausalLM with an untied
lm_head, names as in CONTRACT.md. The MTP heads 1.. have no place in Llama: the HF folder keeps them in
mtp_heads.safetensors (import reads them back), the GGUF file leaves them out. The tokenizer becomes
tokenizer.json (HF tokenizers: a BPE model with GPT-2's ByteLevel pre-tokenizer and decoder, the same ids
and merges) and GGUF's gpt2 tokenizer; the SFT template of CONTRACT.md becomes a Jinja chat template.

Dependencies of these modes alone, imported when used: safetensors (HF weights) and gguf (llama.cpp's own
writer and quantiser). Library code raises pipeline.UserError.

Sections: names | tokenizer | chat template | Hugging Face export | GGUF export | import | modes
"""
import dataclasses
import importlib
import json
import math
import os

import numpy as np

import bpe
import pipeline as pl
from pipeline import Config, Params, UserError

# ----------------------------------------------------------------------------------------------------
# names: (NanoEuler, Hugging Face, GGUF) for every tensor of head 0's model (CONTRACT.md)

_LAYER = (("attn_norm", "input_layernorm", "attn_norm"), ("wq", "self_attn.q_proj", "attn_q"),
          ("wk", "self_attn.k_proj", "attn_k"), ("wv", "self_attn.v_proj", "attn_v"),
          ("wo", "self_attn.o_proj", "attn_output"), ("ffn_norm", "post_attention_layernorm", "ffn_norm"),
          ("w1", "mlp.gate_proj", "ffn_gate"), ("w3", "mlp.up_proj", "ffn_up"), ("w2", "mlp.down_proj", "ffn_down"))


def names(cfg):
    out = [("tok_emb", "model.embed_tokens.weight", "token_embd.weight")]
    for i in range(cfg.n_layers):
        out += [(f"layers.{i}.{a}", f"model.layers.{i}.{b}.weight", f"blk.{i}.{c}.weight") for a, b, c in _LAYER]
    return out + [("norm", "model.norm.weight", "output_norm.weight"), ("heads.0", "lm_head.weight", "output.weight")]


MTP_FILE = "mtp_heads.safetensors"      # heads.1 .. heads.{n_mtp-1}, (V, D) each, rows in the folder's token ids


def _need(module):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{module} is not installed (pip install -r requirements.txt)") from None


# ----------------------------------------------------------------------------------------------------
# tokenizer: bpe.py's ids <-> HF tokenizers' byte-level BPE. GPT-2 spells each byte as one printable
# character (printable Latin-1 as itself, the rest as U+0100..), so a token's bytes become a vocab string.

def _gpt2_byte_chars():
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


BYTE_CHARS = _gpt2_byte_chars()                                   # byte -> its character
# bpe.py cuts a piece longer than MAX_PIECE_BYTES into chunks; after ByteLevel one byte is one character
CHUNKER = {"type": "Split", "pattern": {"Regex": f".{{1,{bpe.MAX_PIECE_BYTES}}}"}, "behavior": "Isolated",
           "invert": False}
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def token_strings(tok):
    """The vocab string of every non-special id (byte-level characters)."""
    return ["".join(BYTE_CHARS[b] for b in tok.token_bytes[i]) for i in range(256 + len(tok.merges))]


def tokenizer_json(tok):
    """tokenizer.json for HF tokenizers: the same ids, merges in rank order, GPT-2's pre-tokenisation
    (ByteLevel's regex is bpe.GPT2_PATTERN) and the 256-byte chunks, specials as added tokens."""
    strings = token_strings(tok)
    vocab = {s: i for i, s in enumerate(strings)}
    if len(vocab) != len(strings):
        raise UserError("the tokenizer has two ids for the same bytes; a byte-level BPE vocab cannot hold both")
    vocab.update(tok.special_ids)               # as GPT-2's: tokenizers gives an added token its vocab id
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for s, i in tok.special_ids.items()]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [BYTE_LEVEL, CHUNKER]},
            "post_processor": None, "decoder": dict(BYTE_LEVEL),
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": [f"{strings[a]} {strings[b]}" for a, b in tok.merges]}}


def _is_gpt2_byte_level(tj):
    """bpe.py encodes like this tokenizer.json only with GPT-2's ByteLevel split (and maybe our chunker)."""
    pre, model = tj.get("pre_tokenizer") or {}, tj.get("model") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    first = steps[0] if steps else {}
    return (model.get("type") == "BPE" and not model.get("ignore_merges") and not model.get("byte_fallback")
            and tj.get("normalizer") is None and (tj.get("decoder") or {}).get("type") == "ByteLevel"
            and first.get("type") == "ByteLevel" and first.get("use_regex", True) and not first.get("add_prefix_space")
            and all(s == CHUNKER for s in steps[1:]))


def tokenizer_from_json(tj, n_ids):
    """-> (bpe.Tokenizer, order): order[new id] = the folder's id of the same token. Ours are bytes first,
    then merges by rank, then the added tokens; n_ids is the model's vocabulary (rows of the embedding)."""
    if not _is_gpt2_byte_level(tj):
        raise UserError("the tokenizer is not GPT-2's byte-level BPE (a BPE model with a ByteLevel pre-tokenizer "
                        "and decoder, no normalizer), the only kind bpe.py encodes like")
    model = tj["model"]
    vocab, ours = model["vocab"], {c: b for b, c in enumerate(BYTE_CHARS)}      # string -> our id
    if not all(c in vocab for c in BYTE_CHARS):
        raise UserError("the tokenizer's vocab lacks some of the 256 byte tokens: not a byte-level BPE")
    order, merges = [vocab[c] for c in BYTE_CHARS], []
    for m in model["merges"]:
        a, b = m.split(" ") if isinstance(m, str) else m
        if a not in ours or b not in ours or a + b in ours or a + b not in vocab:
            raise UserError(f"tokenizer merge {a!r} {b!r} does not make a new token from earlier ones")
        merges.append((ours[a], ours[b]))
        ours[a + b] = 255 + len(merges)
        order.append(vocab[a + b])
    added = sorted(tj.get("added_tokens") or [], key=lambda t: t["id"])
    order += [t["id"] for t in added]
    try:
        tok = bpe.Tokenizer(merges, [t["content"] for t in added])
    except ValueError as e:
        raise UserError(f"tokenizer: {e}") from None
    if tok.eot is None:
        raise UserError(f"the tokenizer has no {pl.EOT} token, which closes every document and chat turn here")
    if len(set(order)) != len(order) or not all(type(i) is int and 0 <= i < n_ids for i in order):
        raise UserError(f"the tokenizer's ids do not fit the model's vocabulary of {n_ids} "
                        "(an id used twice, or one that is not a row of the embedding)")
    return tok, order


# ----------------------------------------------------------------------------------------------------
# chat template: CONTRACT.md's SFT format, one block per turn. A user turn may carry an "input" (the
# template's optional Input section); add_generation_prompt ends with "### Response:\n" as in format_prompt.

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}"
    "Below is an instruction that describes a task{% if m['input'] %}, paired with an input that provides "
    "further context{% endif %}.\nWrite a response that appropriately completes the request.\n\n"
    "### Instruction:\n{{ m['content'] }}\n\n{% if m['input'] %}### Input:\n{{ m['input'] }}\n\n{% endif %}"
    "{%- elif m['role'] == 'assistant' -%}"
    "### Response:\n{{ m['content'] }}" + pl.EOT +
    "{%- else -%}{{ raise_exception('the SFT template has user and assistant turns only') }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt %}### Response:\n{% endif %}")


# ----------------------------------------------------------------------------------------------------
# Hugging Face export: a LlamaForCausalLM folder that from_pretrained loads with no custom code

def _write_json(path, obj):
    pl.atomic_write(path, json.dumps(obj, indent=1, ensure_ascii=False) + "\n")   # an --force export cut short


def _save_safetensors(tensors, path):
    _need("safetensors.numpy").save_file(tensors, path, metadata={"format": "pt"})   # transformers asks for "pt"
    mask = os.umask(0)              # it writes through a temp file of mode 0600: give the mode open() would
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def export_hf(P, tok, extra, out):
    _need("safetensors.numpy")
    cfg, eot = P.cfg, tok.eot
    os.makedirs(out, exist_ok=True)
    _save_safetensors({hf: P[ours] for ours, hf, _ in names(cfg)}, os.path.join(out, "model.safetensors"))
    heads = {f"heads.{k}": P[f"heads.{k}"] for k in range(1, cfg.n_mtp)}
    if heads:
        _save_safetensors(heads, os.path.join(out, MTP_FILE))
    elif os.path.exists(os.path.join(out, MTP_FILE)):          # --force over another model's folder
        os.remove(os.path.join(out, MTP_FILE))
    _write_json(os.path.join(out, "config.json"), {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "max_position_embeddings": cfg.ctx,
        "vocab_size": cfg.vocab, "rms_norm_eps": pl.RMS_EPS, "rope_theta": pl.ROPE_THETA, "rope_scaling": None,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": eot, "eos_token_id": eot, "torch_dtype": "float32",
        "nanoeuler": {"kind": extra.get("kind", "base"), "n_mtp": cfg.n_mtp, "mtp_weight": cfg.mtp_weight,
                      "mtp_heads": f"{MTP_FILE} holds heads.1..heads.{cfg.n_mtp - 1} (V, D): head k predicts the "
                                   "token k+1 places after the next (CONTRACT.md); lm_head is head 0"
                      if heads else "none"}})
    _write_json(os.path.join(out, "generation_config.json"), {"bos_token_id": eot, "eos_token_id": eot})
    _write_json(os.path.join(out, "tokenizer.json"), tokenizer_json(tok))
    _write_json(os.path.join(out, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": pl.EOT, "add_bos_token": False,
        "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": cfg.ctx,
        "chat_template": CHAT_TEMPLATE})
    return ["config.json", "model.safetensors"] + [MTP_FILE] * bool(heads) + \
        ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


# ----------------------------------------------------------------------------------------------------
# GGUF export: llama.cpp's llama architecture, written by the gguf package

def interleave_rope_rows(w, n_heads):
    """Rows of wq or wk, per head from the half-split RoPE layout (i paired with i + hd/2) to GGUF llama's
    interleaved pairs (2i, 2i+1): the permutation llama.cpp's convert_hf_to_gguf.py applies. (heads*hd, D)."""
    return w.reshape(n_heads, 2, -1, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def export_gguf(P, tok, out, dtype):
    gguf = _need("gguf")
    cfg, eot = P.cfg, tok.eot
    if dtype == "q8_0" and (cfg.dim % 32 or cfg.ffn % 32):
        raise UserError(f"q8_0 quantises rows in blocks of 32; this model's widths are {cfg.dim} and {cfg.ffn}")
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[dtype]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
    tmp = f"{out}.{os.getpid()}.tmp"
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name("NanoEuler")
    w.add_context_length(cfg.ctx)
    w.add_embedding_length(cfg.dim)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.ffn)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(pl.ROPE_THETA)
    w.add_layer_norm_rms_eps(pl.RMS_EPS)
    w.add_vocab_size(cfg.vocab)
    w.add_file_type(ftype)
    # the tokenizer as GPT-2's: byte-level strings, merges by rank, the gpt-2 pre-tokenizer; ids past the
    # tokenizer's (the model's spare rows) are padding, as convert_hf_to_gguf.py writes them
    strings = token_strings(tok)
    n_tok, n_base = tok.vocab_size, len(strings)
    T = gguf.TokenType
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(strings + list(tok.specials) + [f"[PAD{i}]" for i in range(n_tok, cfg.vocab)])
    w.add_token_types([T.NORMAL] * n_base + [T.CONTROL] * (n_tok - n_base) + [T.UNUSED] * (cfg.vocab - n_tok))
    w.add_token_merges([f"{strings[a]} {strings[b]}" for a, b in tok.merges])
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for ours, _, name in names(cfg):
        a = P[ours]
        if ours.endswith((".wq", ".wk")):
            a = interleave_rope_rows(a, cfg.n_heads if ours.endswith(".wq") else cfg.n_kv_heads)
        t = qtype if a.ndim == 2 else gguf.GGMLQuantizationType.F32          # norm weights stay f32
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a), t), raw_dtype=t)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ----------------------------------------------------------------------------------------------------
# import: a Llama-architecture HF folder with a GPT-2 byte-level BPE tokenizer -> a NanoEuler checkpoint

ST_DTYPES = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", "F64": "<f8"}     # bf16: read as its bits


def read_safetensors(path):
    """{name: float32 array} of a .safetensors file (8-byte header size, JSON header, raw data), read here
    because the safetensors package's numpy side has no bfloat16, the dtype most HF models ship in. A cut or
    foreign file raises UserError: every size and offset is checked against the file before it is used."""
    def damaged(why):
        return UserError(f"{path} is damaged or not a safetensors file ({why}); copy or export it again")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            text = f.read(n) if 8 + n <= size else None
    except OSError as e:
        raise UserError(f"{path} cannot be read ({e.strerror})") from None
    if text is None:
        raise damaged(f"its header claims {n} bytes, the file has {size}")
    try:
        header = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise damaged(f"header: {e}") from None
    if not isinstance(header, dict):
        raise damaged("its header is not a JSON object")
    data = np.memmap(path, np.uint8, "r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            kind, shape, (lo, hi) = t["dtype"], tuple(t["shape"]), t["data_offsets"]
            ok = isinstance(kind, str) and all(type(v) is int and v >= 0 for v in (*shape, lo, hi)) and lo <= hi
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise damaged(f"tensor {name} has no valid dtype, shape and data_offsets")
        if kind not in ST_DTYPES:
            raise UserError(f"{path}: tensor {name} is {kind}; give float32, float16 or bfloat16 weights")
        if hi > len(data):
            raise damaged(f"tensor {name} ends at byte {hi} of {len(data)}: the file is cut short")
        if hi - lo != math.prod(shape) * np.dtype(ST_DTYPES[kind]).itemsize:
            raise damaged(f"tensor {name} has {hi - lo} bytes for shape {list(shape)} in {kind}")
        a = data[lo:hi].view(ST_DTYPES[kind])
        a = (a.astype(np.uint32) << 16).view(np.float32) if kind == "BF16" else a.astype(np.float32)
        out[name] = a.reshape(shape)
    return out


def _read_json(folder, name):
    """A JSON object (config.json and tokenizer.json both are one); anything else raises UserError."""
    path = os.path.join(folder, name)
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{folder} has no {name}; give a Hugging Face model folder") from None
    except OSError as e:                                      # a folder of that name, no permission
        raise UserError(f"{path} cannot be read ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a JSON {type(obj).__name__}, not an object; give the model's own {name}")
    return obj


def _whole(c, key, where, default=None):
    """c[key] as a positive whole number: every size of the model is one (a bool is not, though Python's
    bool is an int), and a size of 0 or less would only fail later, in sample or train."""
    v = default if c.get(key) is None else c[key]
    if v is None:
        raise UserError(f"{where}/config.json lacks {key}")
    if type(v) is not int or v < 1:
        raise UserError(f"{where}/config.json: {key} is {json.dumps(v)}; give a positive whole number")
    return v


def _config_from_hf(c, where):
    """The NanoEuler Config of a HF config.json; anything the contract's model cannot compute raises."""
    arch = c.get("architectures") or [c.get("model_type")]
    arch = arch if isinstance(arch, list) else [arch]
    if c.get("model_type") != "llama" or "LlamaForCausalLM" not in arch:
        raise UserError(f"{where} is a {arch[0]} model; import reads LlamaForCausalLM folders only")
    if c.get("tie_word_embeddings", False):
        raise UserError(f"{where} ties lm_head to the embedding; NanoEuler's head 0 is a matrix of its own "
                        "(untie it: set lm_head to a copy of embed_tokens, then tie_word_embeddings false)")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}          # transformers 5 | 4
    rope = rope if isinstance(rope, dict) else {"rope_type": rope}
    theta, scaling = c.get("rope_theta", rope.get("rope_theta", pl.ROPE_THETA)), rope.get("rope_type", rope.get("type"))
    # every size checked before any arithmetic on it; null means "the default", as transformers reads it
    D, Hq, L, ctx, V, F = (_whole(c, k, where) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                                         "max_position_embeddings", "vocab_size", "intermediate_size"))
    Hkv, hd = _whole(c, "num_key_value_heads", where, Hq), _whole(c, "head_dim", where, max(D // Hq, 1))
    eps = c.get("rms_norm_eps", 1e-6)
    eps_bad = type(eps) not in (int, float) or not math.isclose(eps, pl.RMS_EPS)
    wrong = [what for what, bad in (
        (f"hidden_act {c.get('hidden_act')} (silu)", c.get("hidden_act", "silu") != "silu"),
        (f"rms_norm_eps {json.dumps(eps)} ({pl.RMS_EPS:g})", eps_bad),
        (f"rope_theta {theta} ({pl.ROPE_THETA:g})", theta != pl.ROPE_THETA),
        (f"rope scaling {scaling} (none)", scaling not in (None, "default")),
        (f"head_dim {hd} (hidden_size {D} / {Hq} heads, whole)", hd * Hq != D),
        (f"head_dim {hd} (even: RoPE turns pairs of its halves)", hd % 2),
        ("attention or MLP bias", c.get("attention_bias") or c.get("mlp_bias")),
        (f"{Hq} query heads over {Hkv} key/value heads (num_key_value_heads dividing num_attention_heads)", Hq % Hkv))
        if bad]
    if wrong:
        raise UserError(f"{where}: {'; '.join(wrong)} -- CONTRACT.md's model computes only the values in brackets")
    if V > 1 << 16:
        raise UserError(f"{where}: vocab of {V} ids; token files are uint16, so at most 65536")
    extra = c.get("nanoeuler") or {}                              # export's own block, absent elsewhere
    if not isinstance(extra, dict):
        raise UserError(f"{where}/config.json: nanoeuler is not an object; drop it or give the block export writes")
    w, kind = extra.get("mtp_weight", 0.3), extra.get("kind", "base")
    if type(w) not in (int, float) or not 0 <= w < math.inf:
        raise UserError(f"{where}/config.json: nanoeuler.mtp_weight is {json.dumps(w)}; give a number of at least 0")
    if kind not in ("base", "chat"):
        raise UserError(f"{where}/config.json: nanoeuler.kind is {json.dumps(kind)}; give base or chat")
    return Config(dim=D, n_heads=Hq, n_kv_heads=Hkv, n_layers=L, ctx=ctx, vocab=V, ffn=F, n_mtp=1, mtp_weight=w), kind


def import_hf(folder, mtp="keep", seed=0):
    """-> (Params, tokenizer, kind). mtp: keep (heads 1.. from mtp_heads.safetensors when the folder has it),
    none (head 0 alone), init (head 0 and two fresh heads, the CPU configs' three)."""
    if not os.path.isdir(folder):
        raise UserError(f"Hugging Face folder not found: {folder}")
    cfg, kind = _config_from_hf(_read_json(folder, "config.json"), folder)
    try:                                     # tokenizer_from_json trusts the format's layout; a damaged one fails in it
        tok, order = tokenizer_from_json(_read_json(folder, "tokenizer.json"), cfg.vocab)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{folder}/tokenizer.json is damaged or not HF tokenizers' format "
                        f"({type(e).__name__}: {e})") from None
    order += sorted(set(range(cfg.vocab)) - set(order))             # the model's spare rows keep their order
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors") and n != MTP_FILE)
    if not files:
        raise UserError(f"{folder} has no .safetensors weights (pytorch_model.bin: re-save with safe_serialization)")
    W = {k: v for n in files for k, v in read_safetensors(os.path.join(folder, n)).items()}
    heads = {}
    if mtp == "keep" and os.path.isfile(os.path.join(folder, MTP_FILE)):
        heads = read_safetensors(os.path.join(folder, MTP_FILE))        # "heads.1", ...: no HF name clashes
        W.update(heads)
    cfg = dataclasses.replace(cfg, n_mtp={"keep": 1 + len(heads), "none": 1, "init": 3}[mtp])
    pairs = names(cfg) + [(f"heads.{k}", f"heads.{k}", None) for k in range(1, 1 + len(heads))]
    shapes = dict(pl.param_shapes(cfg))
    for ours, hf, _ in pairs:            # before Params.init: the config's sizes are trusted once the weights agree
        if hf not in W:
            raise UserError(f"{folder} lacks tensor {hf}")
        if W[hf].shape != shapes[ours]:
            raise UserError(f"{folder}: {hf} has shape {W[hf].shape}, its config says {shapes[ours]}")
    P = Params.init(cfg, seed)                                       # fresh MTP heads for init; the rest is set below
    for ours, hf, _ in pairs:
        P[ours][:] = W[hf][order] if ours == "tok_emb" or ours.startswith("heads.") else W[hf]   # rows in bpe.py's ids
    if not np.isfinite(P.flat).all():
        raise UserError(f"{folder} holds NaN or infinite weights")
    return P, tok, kind


# ----------------------------------------------------------------------------------------------------
# modes (nanoeuler.py export / import)

def _free(path, force, folder=False):
    """--out checked before the slow work: writable (pl.writable), and not already there unless --force."""
    pl.writable(path, "--out", folder=folder, force=True)
    if os.path.exists(path) and not force:
        raise UserError(f"{path} exists: use another --out or --force")
    return path


def cmd_export(argv, prog):
    """`prog export` of either engine (numpy alone: the GPU engine's is this one)."""
    p = pl.Parser(prog=f"{prog} export", description="write a checkpoint as a Hugging Face LlamaForCausalLM folder "
                  "(hf) or a GGUF file for llama.cpp (gguf); export.py says how")
    p.add_argument("--ckpt", default=pl.run_ckpt("train"),
                   help=f"checkpoint file or run folder (default {pl.run_ckpt('train')})")
    p.add_argument("--format", choices=("hf", "gguf"), default="hf", help="hf: a folder; gguf: one file (default hf)")
    p.add_argument("--dtype", choices=("f32", "f16", "q8_0"), default="f32", help="gguf matrices (default f32)")
    p.add_argument("--out", required=True, help="folder (hf) or .gguf file to write (required, no default)")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    a = p.parse_args(argv)
    if a.format == "hf" and a.dtype != "f32":          # --dtype picks GGUF's matrix types; hf has no such choice
        raise UserError(f"--dtype {a.dtype} is for --format gguf; the hf folder holds float32 weights "
                        "(transformers converts them as it loads: from_pretrained(DIR, dtype=torch.float16))")
    _free(a.out, a.force, folder=a.format == "hf")
    P, tok, _, extra = pl.load_checkpoint(a.ckpt)
    if a.format == "hf":
        written = export_hf(P, tok, extra, a.out)
        print(f"wrote {a.out}: {', '.join(written)} (LlamaForCausalLM, {pl.num_params(P.cfg):,} parameters; "
              f"AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load it)")
    else:
        export_gguf(P, tok, a.out, a.dtype)
        left = f" (head 0 only: llama.cpp has no place for the {P.cfg.n_mtp - 1} MTP heads)" if P.cfg.n_mtp > 1 else ""
        print(f"wrote {a.out}: GGUF llama, {a.dtype}, {os.path.getsize(a.out) / 1e6:.1f} MB{left}")


def cmd_import(argv, prog):
    """`prog import` of either engine."""
    p = pl.Parser(prog=f"{prog} import", description="read a Hugging Face LlamaForCausalLM folder with a byte-level "
                  "BPE tokenizer into a NanoEuler checkpoint")
    p.add_argument("--hf", required=True, help="the Hugging Face folder (required, no default)")
    p.add_argument("--out", required=True, help="checkpoint file (.npz) or run folder to write (required, no default)")
    p.add_argument("--mtp", choices=("keep", "none", "init"), default="keep",
                   help="MTP heads: keep those of the folder's mtp_heads.safetensors, none (head 0 alone) or init "
                        "(two fresh ones) (default keep)")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    a = p.parse_args(argv)
    npz = a.out.endswith(".npz")
    pl.writable(os.path.dirname(a.out) or "." if npz else a.out, "--out", folder=True)   # made if new
    out = a.out if npz else os.path.join(a.out, "ckpt.npz")
    if os.path.exists(out):
        _free(out, a.force)
    P, tok, kind = import_hf(a.hf, a.mtp)
    pl.save_checkpoint(out, P, tok, extra={"kind": kind})
    print(f"wrote {out}: {kind} model {P.cfg}, {pl.num_params(P.cfg):,} parameters, tokenizer of "
          f"{tok.vocab_size} ids, {P.cfg.n_mtp} head(s)")


if __name__ == "__main__":                          # a library of the engines, not a command of its own
    raise SystemExit("error: export.py is the export and import modes: "
                     "python3 nanoeuler.py export --help (or import --help)")

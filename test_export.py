"""
test_export.py -- export.py checked by the libraries that read its files: transformers loads the Hugging Face
folder (logits, tokenizer ids, chat template, greedy generation), gguf's GGUFReader reads the GGUF file back
(every tensor, the tokenizer), import reads back a folder that transformers itself wrote. transformers and CPU
torch are test-only (make setup-test).

Sections: fixtures | Hugging Face export | GGUF export | import | bad input
"""
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import gguf
import torch
from gguf import GGUFReader, quants
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import bpe
import export
import nanoeuler as ne
import pipeline as pl


# ----------------------------------------------------------------------------------------------------
# fixtures: a tokenizer learnt on the head of the embedded corpus, a `small` model trained a few steps on
# it, its export; held-out text from the corpus's tail with the special token and the hard cases added

TEXT = pl.default_corpus()[0]
HELD_OUT = (TEXT[-2500:] + f"{pl.EOT}Tabs\tand  double  spaces \n\n\n  trailing   \nDigits 3.14159 2026, "
            "contractions don't we'll I'M, Unicode: naïve café Straße 日本語 Ελληνικά 🙂👍🏽, "
            + "the" * 240 + f" a piece longer than 256 bytes{pl.EOT}{pl.EOT} and an end")


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def tok():
    return bpe.Tokenizer.train(TEXT[:60_000], 512)


@pytest.fixture(scope="module")
def small(tok, tmp_path_factory):
    """(Params, checkpoint path): config small, 40 AdamW steps, so the logits are far from uniform."""
    P = pl.Params.init(pl.CONFIGS["small"], 0)
    batches = pl.Batches(np.array(tok.encode(TEXT[:60_000]), np.int32), 8, 64)
    trainer = ne.Trainer(P)
    for _ in range(40):
        trainer.step(*batches.next(), 3e-3)
    assert trainer.results()[-1][1][0] < 5.5                   # head 0 has learnt something (ln 512 = 6.24)
    path = tmp_path_factory.mktemp("small") / "ckpt.npz"
    pl.save_checkpoint(str(path), P, tok, extra={"kind": "base"})
    return P, path


@pytest.fixture(scope="module")
def hf_dir(small, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "model"
    assert ne.main(["export", "--ckpt", str(small[1]), "--format", "hf", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def hf_logits(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits
    return logits.reshape(-1, model.config.vocab_size).numpy()


# ----------------------------------------------------------------------------------------------------
# Hugging Face export

def test_hf_logits_equal_nanoeulers_trained_small(small, tok, hf_model):
    P, _ = small
    assert type(hf_model).__name__ == "LlamaForCausalLM" and not hf_model.config.tie_word_embeddings
    ids = np.array(tok.encode(HELD_OUT, allowed_special="all")[:256], np.int32).reshape(2, 128)
    err = rel_err(hf_logits(hf_model, ids), ne.forward(P, ids))
    assert err <= 1e-4, err


def test_hf_logits_equal_nanoeulers_big(tok, tmp_path):
    """The GPU pipeline's config (116M parameters, random weights), the contract's init scaled up so that
    the logits are not all near zero."""
    P = pl.Params.init(pl.CONFIGS["big"], 1)
    P.flat[:] *= 3
    export.export_hf(P, tok, {}, str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = np.array(tok.encode(HELD_OUT)[:64], np.int32)[None]
    err = rel_err(hf_logits(model, ids), ne.forward(P, ids))
    assert err <= 1e-4, err


def test_hf_tokenizer_ids_equal_bpe_on_held_out_text(tok, hf_dir):
    ht = AutoTokenizer.from_pretrained(hf_dir)
    ours = tok.encode(HELD_OUT, allowed_special="all")
    assert ht(HELD_OUT)["input_ids"] == ours and len(ours) > 1000 and ours.count(tok.eot) == HELD_OUT.count(pl.EOT)
    assert ht.decode(ours) == HELD_OUT and ht.eos_token_id == tok.eot
    assert ht("the" * 240)["input_ids"] == tok.encode("the" * 240)        # bpe.py's 256-byte chunks


def test_chat_template_is_the_sft_format(tok, hf_dir):
    ht = AutoTokenizer.from_pretrained(hf_dir)
    turns = [({"role": "user", "content": "Name a colour."}, "Blue."),
             ({"role": "user", "content": "Translate it.", "input": "French"}, " Bleu.")]
    messages = [m for user, answer in turns for m in (user, {"role": "assistant", "content": answer})]
    blocks = [pl.format_prompt(u["content"], u.get("input", "")) + a + pl.EOT for u, a in turns]
    assert ht.apply_chat_template(messages, tokenize=False) == "".join(blocks)
    prompt = ht.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == pl.format_prompt("Name a colour.")
    example = {"instruction": "Translate it.", "input": "French", "output": " Bleu."}      # what sft trains on
    ids, targets = pl.sft_example(tok, example, 512)
    assert ht.encode(ht.apply_chat_template(messages[2:], tokenize=False)) == list(ids) + [int(targets[-1])]


def test_hf_greedy_generation_equals_nanoeulers(small, tok, hf_dir, hf_model):
    P, _ = small
    assert GenerationConfig.from_pretrained(hf_dir).eos_token_id == tok.eot
    prompt = tok.encode("The for statement")
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    ours = list(ne.generate(P, prompt, 24, temperature=0))
    assert out == ours[:len(out)] and (len(out) == 24 or out[-1] == tok.eot)


def test_hf_files_get_the_mode_of_a_normal_write(hf_dir):
    """safetensors writes through a temp file of mode 0600; the folder's files all follow the umask."""
    mask = os.umask(0)
    os.umask(mask)
    assert {f.name: f.stat().st_mode & 0o777 for f in hf_dir.iterdir()} == \
        {f.name: 0o666 & ~mask for f in hf_dir.iterdir()}


# ----------------------------------------------------------------------------------------------------
# GGUF export

def _gguf(ckpt, tmp_path, dtype):
    out = tmp_path / f"m-{dtype}.gguf"
    assert ne.main(["export", "--ckpt", str(ckpt), "--format", "gguf", "--dtype", dtype, "--out", str(out)]) == 0
    return GGUFReader(out)


def _half_split(w, n_heads):
    """The inverse of llama.cpp's permutation, written from its meaning: GGUF row 2i+s of a head is the
    half-split row s*hd/2 + i."""
    return w.reshape(n_heads, -1, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_gguf_reads_back_every_tensor(small, tok, hf_dir, tmp_path, dtype):
    """Tokens as transformers spells them (convert_hf_to_gguf.py's source), tensors equal to the checkpoint's."""
    P, ckpt = small
    cfg = P.cfg
    r = _gguf(ckpt, tmp_path, dtype)
    field = lambda k: r.fields[k].contents()
    assert field("general.architecture") == "llama" and field("llama.block_count") == cfg.n_layers
    assert field("llama.attention.head_count_kv") == cfg.n_kv_heads and field("llama.rope.freq_base") == 10000
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "gpt-2"
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == cfg.vocab and tokens[tok.eot] == pl.EOT and field("tokenizer.ggml.eos_token_id") == tok.eot
    assert tokens[:tok.vocab_size] == AutoTokenizer.from_pretrained(hf_dir).convert_ids_to_tokens(range(tok.vocab_size))
    assert field("tokenizer.ggml.merges")[:3] == [f"{tokens[a]} {tokens[b]}" for a, b in tok.merges[:3]]
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == len(export.names(cfg))                    # head 0's model, no MTP head
    for ours, _, name in export.names(cfg):
        t, x = tensors[name], P[ours]
        got = quants.dequantize(t.data, t.tensor_type).reshape(x.shape)
        if ours.endswith((".wq", ".wk")):
            got = _half_split(got, cfg.n_heads if ours.endswith(".wq") else cfg.n_kv_heads)
        if dtype == "f32" or x.ndim == 1:
            assert np.array_equal(got, x), name
        elif dtype == "f16":
            assert t.tensor_type.name == "F16" and np.abs(got - x).max() <= np.abs(x).max() * 2 ** -11, name
        else:   # q8_0: blocks of 32 with scale d = max|x|/127 in f16: |error| <= d/2 + 127 d 2^-11
            d = np.abs(x.reshape(-1, 32)).max(1, keepdims=True) / 127
            assert t.tensor_type.name == "Q8_0"
            assert np.all(np.abs(got.reshape(-1, 32) - x.reshape(-1, 32)) <= d * (0.5 + 127 / 2048) + 1e-12), name


def contract_config(name):
    """CONTRACT.md's "Configurations" row of name, read from the page itself: D, Hq, Hkv, L, ctx, V, F."""
    text = (Path(__file__).parent / "CONTRACT.md").read_text()
    row = re.search(rf"^\| {name} \| (\d+) \| (\d+)/(\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|", text, re.M)
    D, Hq, Hkv, L, ctx, V, F = map(int, row.groups())
    assert "sqrt(mean(x^2) + 1e-5)" in text and "**RoPE**: base 10000" in text    # the constants below
    return dict(D=D, Hq=Hq, Hkv=Hkv, L=L, ctx=ctx, V=V, F=F)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """config tiny (random weights) with a tokenizer of 280 ids: the model's last 20 rows are padding."""
    tok = bpe.Tokenizer.train(TEXT[:20_000], 280)
    P = pl.Params.init(pl.CONFIGS["tiny"], 0)
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    export.export_gguf(P, tok, str(out), "f32")
    return tok, out


def test_gguf_metadata_is_the_contracts_model(tiny_gguf):
    """Authority: llama.cpp's own reader of the file (gguf's GGUFReader, the package llama.cpp ships) and
    its key names (gguf.Keys: what llama.cpp's llama architecture loads), each value compared with
    CONTRACT.md's page (the tiny row of its table; RMSNorm eps 1e-5; RoPE base 10000); the tokenizer as
    GPT-2's in llama.cpp's terms: byte-level tokens NORMAL, the special tokens CONTROL, <|endoftext|> both
    bos and eos, no BOS added to a prompt (the SFT template and the base model's documents start bare)."""
    tok, path = tiny_gguf
    c, r, K = contract_config("tiny"), GGUFReader(path), gguf.Keys
    field = lambda k: r.fields[k.format(arch="llama")].contents()
    written = {k for k in r.fields if not k.startswith("GGUF.")}
    assert written == {"general.architecture", "general.name", "general.file_type", "tokenizer.chat_template",
                       *(k.format(arch="llama") for k in (
                           K.LLM.CONTEXT_LENGTH, K.LLM.EMBEDDING_LENGTH, K.LLM.BLOCK_COUNT, K.LLM.FEED_FORWARD_LENGTH,
                           K.Attention.HEAD_COUNT, K.Attention.HEAD_COUNT_KV, K.Rope.DIMENSION_COUNT,
                           K.Rope.FREQ_BASE, K.Attention.LAYERNORM_RMS_EPS, K.LLM.VOCAB_SIZE)),
                       K.Tokenizer.MODEL, K.Tokenizer.PRE, K.Tokenizer.LIST, K.Tokenizer.TOKEN_TYPE, K.Tokenizer.MERGES,
                       K.Tokenizer.BOS_ID, K.Tokenizer.EOS_ID, K.Tokenizer.ADD_BOS}
    assert field(K.General.ARCHITECTURE) == "llama"
    assert field(K.LLM.CONTEXT_LENGTH) == c["ctx"] and field(K.LLM.EMBEDDING_LENGTH) == c["D"]
    assert field(K.LLM.BLOCK_COUNT) == c["L"] and field(K.LLM.FEED_FORWARD_LENGTH) == c["F"]
    assert field(K.Attention.HEAD_COUNT) == c["Hq"] and field(K.Attention.HEAD_COUNT_KV) == c["Hkv"]
    assert field(K.Rope.DIMENSION_COUNT) == c["D"] // c["Hq"]              # RoPE turns the whole head
    assert field(K.Rope.FREQ_BASE) == 10000 == pl.ROPE_THETA
    assert field(K.Attention.LAYERNORM_RMS_EPS) == np.float32(1e-5) and pl.RMS_EPS == 1e-5
    assert field(K.LLM.VOCAB_SIZE) == c["V"] == len(field(K.Tokenizer.LIST)) == len(field(K.Tokenizer.TOKEN_TYPE))
    assert field(K.General.FILE_TYPE) == gguf.LlamaFileType.ALL_F32
    types, tokens = field(K.Tokenizer.TOKEN_TYPE), field(K.Tokenizer.LIST)
    n_base = 256 + len(tok.merges)
    assert set(types[:n_base]) == {gguf.TokenType.NORMAL}
    assert types[n_base:tok.vocab_size] == [gguf.TokenType.CONTROL] * len(tok.specials)
    assert tokens[n_base:tok.vocab_size] == list(tok.specials) and tokens[tok.eot] == pl.EOT
    assert field(K.Tokenizer.BOS_ID) == field(K.Tokenizer.EOS_ID) == tok.eot
    assert field(K.Tokenizer.ADD_BOS) is False
    assert field(K.Tokenizer.MODEL) == "gpt2" and len(field(K.Tokenizer.MERGES)) == len(tok.merges)


def test_gguf_padding_rows_are_unused(tiny_gguf):
    """Authority: llama.cpp's converter, convert_hf_to_gguf.py: an id past the tokenizer's vocabulary is
    written as "[PAD{i}]" of type UNUSED."""
    tok, path = tiny_gguf
    r = GGUFReader(path)
    tokens, types = r.fields["tokenizer.ggml.tokens"].contents(), r.fields["tokenizer.ggml.token_type"].contents()
    assert tokens[tok.vocab_size:] == [f"[PAD{i}]" for i in range(tok.vocab_size, 300)]
    assert types[tok.vocab_size:] == [gguf.TokenType.UNUSED] * (300 - tok.vocab_size)


def _rope_interleaved(u, pos):
    """llama.cpp's rotation for the llama architecture: pairs (2i, 2i+1), frequency 10000^(-2i/hd)."""
    hd = u.shape[-1]
    a = pos[:, None, None] * 10000.0 ** (-np.arange(0, hd, 2) / hd)
    x, y = u[..., 0::2], u[..., 1::2]
    out = np.empty_like(u)
    out[..., 0::2], out[..., 1::2] = x * np.cos(a) - y * np.sin(a), y * np.cos(a) + x * np.sin(a)
    return out


def test_gguf_attention_scores_equal_nanoeulers(small, tmp_path):
    """GGUF's permuted wq, wk under llama.cpp's interleaved rotation give the scores of NanoEuler's RoPE."""
    P, ckpt = small
    cfg, hd = P.cfg, P.cfg.head_dim
    tensors = {t.name: t.data for t in _gguf(ckpt, tmp_path, "f32").tensors}
    h = np.random.default_rng(0).standard_normal((16, cfg.dim)).astype(np.float32)
    pos = np.arange(16, dtype=np.int32)
    cos, sin = pl.rope_tables(cfg.ctx, hd, np.float32)
    q = ne.rope_forward((h @ P["layers.1.wq"].T).reshape(16, cfg.n_heads, hd), pos, cos, sin)
    k = ne.rope_forward((h @ P["layers.1.wk"].T).reshape(16, cfg.n_kv_heads, hd), pos, cos, sin)
    qg = _rope_interleaved((h @ tensors["blk.1.attn_q.weight"].T).reshape(16, cfg.n_heads, hd), pos)
    kg = _rope_interleaved((h @ tensors["blk.1.attn_k.weight"].T).reshape(16, cfg.n_kv_heads, hd), pos)
    G = cfg.n_heads // cfg.n_kv_heads
    scores = lambda q, k: np.einsum("thd,shd->hts", q, np.repeat(k, G, axis=1))
    assert np.allclose(scores(qg, kg), scores(q, k), rtol=1e-4, atol=1e-5)
    assert not np.allclose(tensors["blk.1.attn_q.weight"], P["layers.1.wq"])   # the rows did move


def test_llama_cpp_greedy_equals_nanoeulers(small, tok, tmp_path):
    """Authority: llama.cpp itself (llama-cpp-python): what its loader reads from the header (the trained
    context, width, layers, vocabulary, norm eps, RoPE base) is CONTRACT.md's small model, and its greedy
    ids are the engine's."""
    llama_cpp = pytest.importorskip("llama_cpp")                   # only where a llama.cpp build is installed
    P, ckpt = small
    _gguf(ckpt, tmp_path, "f32")
    llm = llama_cpp.Llama(str(tmp_path / "m-f32.gguf"), n_ctx=P.cfg.ctx, verbose=False)
    c, meta = contract_config("small"), llm.metadata
    assert (llm._model.n_ctx_train(), llm.n_embd(), llm.n_vocab()) == (c["ctx"], c["D"], c["V"])
    assert int(meta["llama.block_count"]) == c["L"] and int(meta["llama.attention.head_count_kv"]) == c["Hkv"]
    assert float(meta["llama.attention.layer_norm_rms_epsilon"]) == pytest.approx(1e-5, rel=1e-4)
    assert float(meta["llama.rope.freq_base"]) == 10000 and int(meta["tokenizer.ggml.eos_token_id"]) == tok.eot
    prompt = tok.encode("The for statement")
    assert llm.tokenize("The for statement".encode(), add_bos=False) == prompt
    out = []
    for t in llm.generate(prompt, temp=0.0, top_k=1):
        if t == tok.eot or len(out) == 24:
            break
        out.append(t)
    assert out == list(ne.generate(P, prompt, 24, temperature=0))[:len(out)]


# ----------------------------------------------------------------------------------------------------
# import

def test_import_round_trip_gives_back_the_checkpoint(small, hf_dir, tmp_path):
    P, ckpt = small
    assert ne.main(["import", "--hf", str(hf_dir), "--out", str(tmp_path / "run")]) == 0
    Q, tok2, _, extra = pl.load_checkpoint(str(tmp_path / "run"))
    assert Q.cfg == P.cfg and np.array_equal(Q.flat, P.flat)              # MTP heads back from mtp_heads.safetensors
    assert tok2.to_string() == pl.load_checkpoint(str(ckpt))[1].to_string() and extra["kind"] == "base"
    for mtp, n in (("none", 1), ("init", 3)):
        assert ne.main(["import", "--hf", str(hf_dir), "--out", str(tmp_path / f"{mtp}.npz"), "--mtp", mtp]) == 0
        R = pl.load_checkpoint(str(tmp_path / f"{mtp}.npz"))[0]
        assert R.cfg.n_mtp == n and np.array_equal(R["heads.0"], P["heads.0"])
    assert abs(R["heads.2"].std() - 0.02) < 2e-3 and not np.allclose(R["heads.2"], P["heads.2"])


def test_import_reads_a_folder_transformers_wrote_in_bfloat16(small, hf_dir, tmp_path):
    """transformers' own config.json, its tokenizers' tokenizer.json and bf16 safetensors."""
    P, ckpt = small
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(tmp_path / "bf16")
    Q, tok2, kind = export.import_hf(str(tmp_path / "bf16"))
    assert tok2.to_string() == pl.load_checkpoint(str(ckpt))[1].to_string() and Q.cfg.n_mtp == 1
    for ours, hf, _ in export.names(P.cfg):
        assert np.array_equal(Q[ours], model.state_dict()[hf].float().numpy()), ours


def test_import_puts_a_vocab_of_another_order_back_in_bpe_order(small, tok, hf_dir, tmp_path):
    """GPT-2's own vocab, for one, does not keep the bytes at ids 0-255: import renumbers and moves the rows."""
    from safetensors.numpy import load_file, save_file
    P, _ = small
    perm = np.random.default_rng(0).permutation(P.cfg.vocab)             # new id of old id i: perm[i]
    d = tmp_path / "shuffled"
    shutil.copytree(hf_dir, d)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["model"]["vocab"] = {s: int(perm[i]) for s, i in tj["model"]["vocab"].items()}
    for t in tj["added_tokens"]:
        t["id"] = int(perm[t["id"]])
    (d / "tokenizer.json").write_text(json.dumps(tj))
    for name in ("model.safetensors", export.MTP_FILE):
        W = load_file(d / name)
        for k in W:
            if W[k].shape[0] == P.cfg.vocab:
                W[k][perm] = W[k].copy()
        save_file(W, d / name, metadata={"format": "pt"})
    assert AutoTokenizer.from_pretrained(d)(HELD_OUT)["input_ids"] == \
        [int(perm[i]) for i in tok.encode(HELD_OUT, allowed_special="all")]
    Q, _, _ = export.import_hf(str(d))
    assert np.array_equal(Q.flat, P.flat)


def test_imported_checkpoint_fine_tunes_with_sft(hf_dir, tmp_path, capsys):
    assert ne.main(["import", "--hf", str(hf_dir), "--out", str(tmp_path / "base"), "--mtp", "none"]) == 0
    assert ne.main(["sft", "--ckpt", str(tmp_path / "base"), "--steps", "4", "--batch", "2", "--seq", "96",
                    "--out", str(tmp_path / "chat")]) == 0
    assert "SFT validation loss: before" in capsys.readouterr().out
    assert pl.load_checkpoint(str(tmp_path / "chat"))[3]["kind"] == "chat"


# ----------------------------------------------------------------------------------------------------
# bad input: one `error:` line each

def _broken(hf_dir, tmp_path, name, config=None, tokenizer=None):
    d = tmp_path / name
    d.mkdir()
    for f, change in (("config.json", config), ("tokenizer.json", tokenizer)):
        obj = json.loads((hf_dir / f).read_text())
        if change:
            change(obj)
        (d / f).write_text(json.dumps(obj))
    return d


def _one_error(capsys, argv, *words):
    assert ne.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and all(w in err[0] for w in words), err


def test_bad_input_gets_one_line(small, hf_dir, tmp_path, capsys):
    cases = [
        ("gpt2", dict(config=lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")),
         ("GPT2LMHeadModel", "LlamaForCausalLM")),
        ("tied", dict(config=lambda c: c.update(tie_word_embeddings=True)), ("ties lm_head",)),
        ("theta", dict(config=lambda c: c.update(rope_theta=500000.0)), ("rope_theta 500000",)),
        ("whitespace", dict(tokenizer=lambda t: t.update(pre_tokenizer={"type": "Whitespace"})),
         ("not GPT-2's byte-level",)),
        ("huge", dict(config=lambda c: c.update(vocab_size=70000)), ("70000", "uint16")),
        ("short", dict(config=lambda c: c.update(vocab_size=400)), ("vocabulary of 400",)),
    ]
    for name, change, words in cases:
        _one_error(capsys, ["import", "--hf", str(_broken(hf_dir, tmp_path, name, **change)), "--out",
                            str(tmp_path / "x.npz")], *words)
    _one_error(capsys, ["import", "--hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.npz")], "not found")
    _one_error(capsys, ["import", "--hf", str(hf_dir), "--out", str(small[1])], "exists", "--force")
    _one_error(capsys, ["export", "--ckpt", str(small[1]), "--out", str(hf_dir)], "exists", "--force")
    for dtype in ("f16", "q8_0"):                         # GGUF's matrix types: the hf folder is float32
        _one_error(capsys, ["export", "--ckpt", str(small[1]), "--format", "hf", "--dtype", dtype, "--out",
                            str(tmp_path / "hf16")], f"--dtype {dtype}", "gguf", "float32")
    assert not (tmp_path / "hf16").exists()


def _edit(name, change):
    def damage(d):
        obj = json.loads((d / name).read_text())
        change(obj)
        (d / name).write_text(json.dumps(obj))
    return damage


def _folder_in_place(d):
    (d / "config.json").unlink()
    (d / "config.json").mkdir()


DAMAGED = {   # what is done to a copy of the exported folder -> words of the one error line
    "cut in the header": (lambda d: os.truncate(d / "model.safetensors", 1000), ("model.safetensors", "header claims")),
    "cut in the data": (lambda d: os.truncate(d / "model.safetensors", 150_000), ("model.safetensors", "cut short")),
    "cut mtp file": (lambda d: os.truncate(d / export.MTP_FILE, 1000), (export.MTP_FILE, "cut short")),
    "not safetensors": (lambda d: (d / "model.safetensors").write_bytes(b"\x04" + bytes(7) + b"PK\x03\x04" * 9),
                        ("model.safetensors", "damaged", "header")),
    "no heads": (_edit("config.json", lambda c: c.update(num_attention_heads=0)), ("num_attention_heads is 0",)),
    "vocab as text": (_edit("config.json", lambda c: c.update(vocab_size="512")), ('vocab_size is "512"',)),
    "context -1": (_edit("config.json", lambda c: c.update(max_position_embeddings=-1)),
                   ("max_position_embeddings is -1",)),
    "layers true": (_edit("config.json", lambda c: c.update(num_hidden_layers=True)), ("num_hidden_layers is true",)),
    "no width": (_edit("config.json", lambda c: c.pop("hidden_size")), ("lacks hidden_size",)),
    "kv heads": (_edit("config.json", lambda c: c.update(num_key_value_heads=3)), ("num_key_value_heads",)),
    "head_dim": (_edit("config.json", lambda c: c.update(head_dim=16)), ("head_dim 16",)),
    "odd head": (_edit("config.json", lambda c: c.update(hidden_size=120, num_attention_heads=8, head_dim=15)),
                 ("head_dim 15", "even")),
    "eps as text": (_edit("config.json", lambda c: c.update(rms_norm_eps="1e-5")), ('rms_norm_eps "1e-5"',)),
    "mtp_weight": (_edit("config.json", lambda c: c["nanoeuler"].update(mtp_weight="x")), ("nanoeuler.mtp_weight",)),
    "config list": (lambda d: (d / "config.json").write_text("[1, 2]"), ("config.json", "list")),
    "config folder": (_folder_in_place, ("config.json", "cannot be read")),
    "no merges": (_edit("tokenizer.json", lambda t: t["model"].pop("merges")), ("tokenizer.json", "damaged")),
    "negative id": (_edit("tokenizer.json", lambda t: t["model"]["vocab"].update({export.BYTE_CHARS[0]: -1})),
                    ("do not fit",)),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_folder_gets_one_line(hf_dir, tmp_path, capsys, case):
    damage, words = DAMAGED[case]
    d = tmp_path / "model"
    shutil.copytree(hf_dir, d)
    damage(d)
    _one_error(capsys, ["import", "--hf", str(d), "--out", str(tmp_path / "x.npz")], *words)
    assert not (tmp_path / "x.npz").exists()

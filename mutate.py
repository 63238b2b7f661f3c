"""
mutate.py -- plants one bug at a time in the engine and reports whether the tests catch it (issue 11).

Each mutant is an exact source replacement (or a few) in one file, each a bug outside the gradients
(gradcheck.py catches those): optimiser details, the schedule's shape, the MTP objective, batches and splits,
SFT padding and masks, the chat template, sampling, the model's constants, checkpoints; and (issue 36) where
the code meets the outside world: HellaSwag's scores, the report, batched streams, chat history, the
server's wire format, the GGUF header, tokenizer edges. For each mutant the repository's .py files (and what
the tests read beside them) are copied to a temporary folder with the Numba cache of an unmutated run (so
that only a mutated nanoeuler.py recompiles), the replacement is applied (it must match exactly as often as
stated), and `pytest -x` runs the mutant's tests there (DEFAULT_TESTS unless it names its own): caught if
they fail, survived if they pass.

    python3 mutate.py                 every mutant, 2 at a time; a table and the catch rate (`make mutation`)
    python3 mutate.py -k adam         the mutants whose name holds 'adam'
    python3 mutate.py --list          the mutants, without running them
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.abspath(__file__))

# the tests that must catch a mutant unless it names its own: the reference and the usage mistakes (36 tests)
DEFAULT_TESTS = ("test_reference.py", "test_cli.py::test_every_cli_mistake_gets_one_line", "-k", "not torch")
_RENAME = "        os.replace(tmp, path)\n    finally:"            # save_checkpoint's (start_log renames too)
# the tests of issue 36's contracts, which its mutants name
_HELLASWAG = ("test_evaluate.py::test_hellaswag_acc_and_acc_norm_of_a_hand_computed_item",)
_STREAMS = ("test_cpu_engine.py::test_batched_streams_sample_their_own_logits_and_history",)
_CHAT = ("test_cpu_engine.py::test_chat_history_drops_the_oldest_turns_when_the_context_is_full",)
_SFT = ("test_cpu_engine.py::test_sft_example_without_a_counted_response_token_is_skipped",)
_LAST_VAL = ("test_cpu_engine.py::test_last_step_is_validated",)
_REPORT = ("test_evaluate.py::test_report_tokens_sum_each_steps_own_and_count_a_repeated_step_once",
           "test_evaluate.py::test_report_tokens_sum_steps_of_unequal_size")
_CKPT = ("test_cpu_engine.py::test_checkpoint_survives_a_crash_between_write_and_rename",
         "test_cpu_engine.py::test_checkpoint_replaces_the_file_a_reader_holds_by_rename")
_T36A_SERVE = ("test_serve.py::test_chat_wire_format_finish_reason_and_usage", "test_serve.py::test_completions_wire_format",
               "test_serve.py::test_up_to_four_stop_strings")
_T36A_EXPORT = ("test_export.py::test_gguf_metadata_is_the_contracts_model",)
_MUON = ("test_reference.py", "-k", "muon")
_SPEEDRUN = ("test_speedrun.py::test_speedrun_card_resume_and_rerun",)
_T36A_BPE = ("test_tokenizer.py::test_encodings_equal_hugging_face_tokenizers",
             "test_tokenizer.py::test_merge_table_that_refers_to_its_own_id_is_refused")

# (name, file, [(old, new, times)][, pytest arguments]): old must occur exactly `times` times in the file; the
# tests are DEFAULT_TESTS unless the mutant names its own (or --tests overrides them all)
MUTANTS = [
    # optimiser
    ("adamw beta2 0.999", "nanoeuler.py", [("beta2=0.95,", "beta2=0.999,", 1)]),
    ("adamw eps inside the sqrt", "nanoeuler.py",
     [("(np.sqrt(v[i]) * inv_sqrt_bc2 + eps_)", "np.sqrt(v[i] * inv_sqrt_bc2 * inv_sqrt_bc2 + eps_)", 1)]),
    ("adamw no first-moment bias correction", "nanoeuler.py", [("lr / (1.0 - beta1 ** step),", "lr,", 1)]),
    ("adamw second-moment correction not rooted", "nanoeuler.py",
     [("1.0 / math.sqrt(1.0 - beta2 ** step)", "1.0 / (1.0 - beta2 ** step)", 1)]),
    ("adamw weight decay 0.01", "nanoeuler.py", [("weight_decay=0.1,", "weight_decay=0.01,", 1)]),
    ("decay on norm weights", "pipeline.py", [("view[:] = 0.0 if view.ndim == 1 else 1.0", "view[:] = 1.0", 1)]),
    # --optim muon (issue 34): its reference step and the test of which tensors it orthogonalises
    ("muon skips Newton-Schulz", "nanoeuler.py",
     [("* newton_schulz((1 - mu) * g + mu * m)", "* ((1 - mu) * g + mu * m)", 1)], _MUON),
    ("muon ns coefficient c 2.0315 -> 2.315", "pipeline.py", [("(3.4445, -4.7750, 2.0315)", "(3.4445, -4.7750, 2.315)", 1)],
     _MUON),
    ("muon on the embedding too", "pipeline.py",
     [('return [f"layers.{i}.{w}" for i', 'return ["tok_emb"] + [f"layers.{i}.{w}" for i', 1)], _MUON),
    ("muon q|k|v and w1|w3 as fused matrices", "nanoeuler.py",
     [("list(_thread_pool().map(matrix, self.matrices))", "fused(self, P, G, scale, mu, lr_muon)", 1),
      ("class Muon(AdamW):", "def fused(opt, P, G, scale, mu, lr_muon):\n"
       "    for i in range(P.cfg.n_layers):\n"
       "        for first, last in (('wq', 'wv'), ('w1', 'w3')):\n"
       "            f, l = f'layers.{i}.{first}', f'layers.{i}.{last}'\n"
       "            g, m, p = G.rows(f, l) * scale, opt.m.rows(f, l), P.rows(f, l)\n"
       "            m *= mu\n"
       "            m += (1 - mu) * g\n"
       "            p -= (lr_muon * pl.muon_scale(p.shape)) * newton_schulz((1 - mu) * g + mu * m)\n"
       "        for w in ('wo', 'w2'):\n"
       "            n = f'layers.{i}.{w}'\n"
       "            g, m, p = G[n] * scale, opt.m[n], P[n]\n"
       "            m *= mu\n"
       "            m += (1 - mu) * g\n"
       "            p -= (lr_muon * pl.muon_scale(p.shape)) * newton_schulz((1 - mu) * g + mu * m)\n\n\n"
       "class Muon(AdamW):", 1)], _MUON),
    ("muon without nesterov", "nanoeuler.py", [("newton_schulz((1 - mu) * g + mu * m)", "newton_schulz(m)", 1)], _MUON),
    ("muon scale min(1, rows/cols)", "pipeline.py", [("max(1.0, shape[0] / shape[1])", "min(1.0, shape[0] / shape[1])", 1)],
     _MUON),
    ("clip also scales small gradients up", "nanoeuler.py",
     [("scale = min(1.0, self.clip / (norm + 1e-6))", "scale = self.clip / (norm + 1e-6)", 1)]),
    ("clip at 2.0", "nanoeuler.py", [("clip=1.0):", "clip=2.0):", 1)]),
    ("resumed trainer restarts the step count", "nanoeuler.py",
     [('self.opt.step_count = state["step"]', "self.opt.step_count = 0", 1)]),
    # schedule
    ("schedule linear, not cosine", "pipeline.py",
     [("0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))", "0.9 * (1.0 - progress)", 1)]),
    ("schedule decays to 0, not 10%", "pipeline.py", [("(0.1 + 0.9 * 0.5 *", "(0.0 + 1.0 * 0.5 *", 1)]),
    ("warm-up one step late", "pipeline.py", [("peak_lr * (step + 1) / warmup", "peak_lr * step / warmup", 1)]),
    ("cosine over the warm-up too", "pipeline.py",
     [("(step - warmup) / max(1, schedule_steps - warmup)", "step / max(1, schedule_steps)", 1)]),
    ("train loop uses the next step's rate", "pipeline.py",
     [('lr = lr_at(step, schedule, args["lr"]', 'lr = lr_at(step + 1, schedule, args["lr"]', 1)]),
    # MTP objective
    ("mtp targets shifted the wrong way", "pipeline.py",
     [("out[k, :, :T - k] = targets[:, k:]", "out[k, :, k:] = targets[:, :T - k]", 1)]),
    ("mtp mean counts masked targets", "pipeline.py", [("(targets[:, k:] >= 0).sum()", "(targets[:, k:] >= -1).sum()", 1)]),
    ("mtp mean over all T positions", "pipeline.py", [("(targets[:, k:] >= 0).sum()", "(targets >= 0).sum()", 1)]),
    ("mtp heads summed, not averaged", "pipeline.py",
     [("mtp_weight * float(np.mean(ces[1:]))", "mtp_weight * float(np.sum(ces[1:]))", 1)]),
    ("mtp weight 0.5", "pipeline.py", [("mtp_weight: float = 0.3", "mtp_weight: float = 0.5", 1)]),
    # data and SFT
    ("batch targets are the previous token", "pipeline.py",
     [("return w[:, :-1], w[:, 1:]", "return w[:, 1:], w[:, :-1]", 1)]),
    ("validation split overlaps training", "pipeline.py",
     [('else tokens[len(tokens) - n_val:]', "else tokens[:n_val]", 1)]),
    ("validation reads the training split", "pipeline.py",
     [('val = Batches(tokens, B, T, seed=1234, split="val")', 'val = Batches(tokens, B, T, seed=1234, split="train")', 1)]),
    ("data position not restored", "pipeline.py",
     [("    def set_state(self, state):\n        self.rng.bit_generator.state = state\n\n\ndef bytes_per_token",
       "    def set_state(self, state):\n        pass\n\n\ndef bytes_per_token", 1)]),
    ("sft padding targets are eot", "pipeline.py",
     [("y = np.full((B, T), -1, np.int32)", "y = np.full((B, T), self.eot, np.int32)", 1)]),
    ("sft padding with id 0", "pipeline.py", [("x = np.full((B, T), self.eot, np.int32)", "x = np.full((B, T), 0, np.int32)", 1)]),
    ("sft last prompt position trained", "pipeline.py",
     [("targets[:len(prompt) - 1] = -1                                  # positions",
       "targets[:len(prompt) - 2] = -1                                  # positions", 1)]),
    ("chat template loses a newline", "pipeline.py",
     [("{instruction}\\n\\n### Response:\\n\")", "{instruction}\\n### Response:\\n\")", 1)]),
    ("chat does not stop at <|endoftext|>", "pipeline.py",
     [("if t == tok.eot:\n                    break", "if t == tok.eot:\n                    pass", 1)]),
    ("token id == vocab accepted", "pipeline.py", [("if top >= vocab:", "if top > vocab:", 1)]),
    ("bits per byte over characters", "pipeline.py",
     [("len(tok.decode_bytes(sample.tolist())) / len(sample)", "len(tok.decode(sample.tolist())) / len(sample)", 1)]),
    ("bits per byte in nats", "pipeline.py",
     [("loss, loss / math.log(2) / bytes_per_token", "loss, loss / bytes_per_token", 1)]),
    ("sft keeps one token too few", "pipeline.py", [("seq = seq[:T + 1]", "seq = seq[:T]", 1)]),
    ("chat turn cut short not closed", "pipeline.py",
     [("answer.append(tok.eot)                   # each turn", "pass                   # each turn", 1)]),
    ("a NaN step still updates", "nanoeuler.py",
     [("if math.isfinite(objective):                     # a NaN step changes nothing",
       "if True:                     # a NaN step changes nothing", 1)]),
    # sampling and generation
    ("temperature multiplies the logits", "pipeline.py", [("z /= self.temperature", "z *= self.temperature", 1)]),
    ("top-k keeps k+1", "pipeline.py",
     [("np.partition(z, -self.top_k)[-self.top_k]", "np.partition(z, -self.top_k)[-self.top_k - 1]", 1)]),
    ("temperature 0 not greedy", "pipeline.py", [("if self.temperature <= 0:", "if self.temperature < 0:", 2)]),
    ("the last id is never drawn", "pipeline.py", [("rng.random() * cdf[-1]", "rng.random() * cdf[-2]", 1)]),
    ("the decoder's draw drops ids tied at the top-k cut", "nanoeuler.py",
     [("np.exp(z[v] - top) if z[v] >= cut else 0.0", "np.exp(z[v] - top) if z[v] > cut else 0.0", 1)],
     ("test_serve.py::test_decoder_samples_rows_together_as_sampling_does_one_by_one",)),
    ("generation ignores top-k", "nanoeuler.py",
     [("sampling = sampling or pl.Sampling(temperature, top_k)", "sampling = sampling or pl.Sampling(temperature, 0)", 1)]),
    ("generation ignores the caller's rng", "nanoeuler.py",
     [("rng = rng if rng is not None else np.random.default_rng(0)", "rng = np.random.default_rng(0)", 1)]),
    ("generation ignores the temperature", "nanoeuler.py",
     [("sampling = sampling or pl.Sampling(temperature, top_k)", "sampling = sampling or pl.Sampling(1.0, top_k)", 1)]),
    ("streamed samples decoded strictly", "bpe.py",
     [('codecs.getincrementaldecoder("utf-8")(errors="replace")', 'codecs.getincrementaldecoder("utf-8")()', 1)]),
    ("generation runs past the context", "nanoeuler.py", [("if len(ids) >= P.cfg.ctx:", "if len(ids) > P.cfg.ctx:", 1)]),
    ("sampling forward reads head 1", "nanoeuler.py", [('_mm(P["heads.0"], h, N, logits[0])',
                                                         '_mm(P["heads.1"], h, N, logits[0])', 1)]),
    ("sampling cache hides the token itself", "nanoeuler.py",
     [("if u == t or off[u] < off[t]:", "if off[u] < off[t]:", 1)]),
    ("guesses at one position see each other", "nanoeuler.py",
     [("if u == t or off[u] < off[t]:", "if u == t or off[u] <= off[t]:", 1)]),
    # model constants (forward and backward changed alike, so gradcheck passes)
    ("rmsnorm eps 1e-6", "nanoeuler.py", [("np.sqrt(ss / D + RMS_EPS)", "np.sqrt(ss / D + 1e-6)", 1)]),
    ("rope theta 500000", "pipeline.py", [("freqs = ROPE_THETA ** (", "freqs = 500000.0 ** (", 1)]),
    ("rope frequencies i/hd", "pipeline.py", [("-np.arange(0, hd // 2) * 2.0 / hd", "-np.arange(0, hd // 2) * 1.0 / hd", 1)]),
    ("rope turns the other way", "nanoeuler.py", [("u[n, h, i] = a * c - b * s", "u[n, h, i] = a * c + b * s", 1),
                                                  ("u[n, h, i + half] = b * c + a * s", "u[n, h, i + half] = b * c - a * s", 1)]),
    ("attention scale 1/hd", "nanoeuler.py", [("qg.dtype.type(1.0 / math.sqrt(hd))", "qg.dtype.type(1.0 / hd)", 2),
                                              ("K.dtype.type(1.0 / math.sqrt(hd))", "K.dtype.type(1.0 / hd)", 2)]),
    ("init wo and w2 at 0.02/sqrt(L)", "pipeline.py",
     [("0.02 / math.sqrt(2 * cfg.n_layers)", "0.02 / math.sqrt(cfg.n_layers)", 1)]),
    ("init matrices at 0.01", "pipeline.py",
     [('name.endswith((".wo", ".w2")) else 0.02', 'name.endswith((".wo", ".w2")) else 0.01', 1)]),
    # checkpoints
    ("checkpoint written in place", "pipeline.py", [('with open(tmp, "wb") as f:', 'with open(path, "wb") as f:', 1),
                                                    (_RENAME, "        pass\n    finally:", 1)]),
    ("failed write leaves its temporary file", "pipeline.py",
     [("if os.path.exists(tmp):                      # a failed", "if False:                      # a failed", 1)]),
    ("checkpoint not flushed to disk", "pipeline.py", [("os.fsync(f.fileno())", "pass", 1)]),
    ("checkpoint saves adam_m as adam_v", "pipeline.py",
     [('arrays[f"adam_v.{name}"] = np.asarray(state["adam_v"][name]',
       'arrays[f"adam_v.{name}"] = np.asarray(state["adam_m"][name]', 1)]),
    ("checkpoint step one short", "pipeline.py",
     [('arrays["step"] = np.array(state["step"], np.int64)',
       'arrays["step"] = np.array(state["step"] - 1, np.int64)', 1)]),
    ("NaN weights accepted", "pipeline.py", [("if not np.isfinite(P.flat).all():", "if False:", 1)]),
    # tokenizer
    ("decode passes bad bytes as surrogates", "bpe.py",
     [('.decode("utf-8", "replace")', '.decode("utf-8", "surrogateescape")', 1)]),
    # issue 36: evaluation
    ("acc_norm over tokens, not characters", "evaluate.py",
     [('norm = [s / len(e) for s, e in zip(sums, item["endings"])]', "norm = [s / n for s, n in zip(sums, ns)]", 1)],
     _HELLASWAG),
    ("acc_norm over bytes, not characters", "evaluate.py",
     [("norm = [s / len(e) for s, e", "norm = [s / len(e.encode()) for s, e", 1)], _HELLASWAG),
    ("acc_norm counts the leading space", "evaluate.py",
     [("norm = [s / len(e) for s, e", 'norm = [s / len(" " + e) for s, e', 1)],
     ("test_evaluate.py::test_hellaswag_acc_norm_excludes_the_leading_space",)),
    ("hellaswag sums the context too", "evaluate.py",
     [("sums = [float(np.sum(lp[len(lp) - n:]))", "sums = [float(np.sum(lp))", 1)], _HELLASWAG),
    ("hellaswag scores one context token too many", "evaluate.py",
     [("sums = [float(np.sum(lp[len(lp) - n:]))", "sums = [float(np.sum(lp[len(lp) - n - 1:]))", 1)], _HELLASWAG),
    ("acc picks the normalised argmax", "evaluate.py",
     [("preds.append((int(np.argmax(sums)),", "preds.append((int(np.argmax(norm)),", 1)], _HELLASWAG),
    # issue 36: batched generation
    ("batch streams sample stream 0's logits", "nanoeuler.py",
     [("outs[r].append(sampling.sample(logits[r], ids[r], rng))", "outs[r].append(sampling.sample(logits[0], ids[r], rng))", 1)],
     _STREAMS),
    ("batch penalty from stream 0's history", "nanoeuler.py",
     [("outs[r].append(sampling.sample(logits[r], ids[r], rng))", "outs[r].append(sampling.sample(logits[r], ids[0], rng))", 1)],
     _STREAMS),
    ("batch feeds stream 0's token to every stream", "nanoeuler.py",
     [("forward_cached(P, [[o[-1]] for o in outs], cache)", "forward_cached(P, [[outs[0][-1]] for o in outs], cache)", 1)],
     _STREAMS),
    # issue 36: chat history, SFT examples, the last step, checkpoints
    ("chat history drops the newest turns", "pipeline.py",
     [("for u, a in turns[dropped:] for t in u + a] + user", "for u, a in turns[:len(turns) - dropped] for t in u + a] + user",
       1)], _CHAT),
    ("chat history trimmed at the budget exactly", "pipeline.py",
     [("while dropped < len(turns) and total > budget:", "while dropped < len(turns) and total >= budget:", 1)], _CHAT),
    ("chat history without the half-context floor", "pipeline.py",
     [("budget = max(ctx - max_new, ctx // 2)", "budget = ctx - max_new", 1)], _CHAT),
    ("sft example with no response token accepted", "pipeline.py",
     [("if len(seq) <= len(prompt):", "if len(seq) < len(prompt):", 1)], _SFT),
    ("sft batches keep the examples that do not fit", "pipeline.py",
     [("self.examples = [e for e in encoded if e is not None]", "self.examples = [e for e in encoded]", 1)], _SFT),
    ("last step not validated", "pipeline.py",
     [('(step % args["eval_every"] == 0 or step == steps)', '(step % args["eval_every"] == 0)', 1)], _LAST_VAL),
    ("checkpoint copied over the old one", "pipeline.py",
     [(_RENAME, '        with open(tmp, "rb") as src, open(path, "wb") as dst:\n            dst.write(src.read())\n'
       "    finally:", 1)], _CKPT),
    ("checkpoint's temporary file is the checkpoint", "pipeline.py",
     [('    tmp = f"{path}.{os.getpid()}.tmp"\n    try:', "    tmp = path\n    try:", 1)], _CKPT),
    ("report tokens are steps x the last step's", "evaluate.py",
     [('tokens = np.cumsum([r["tokens"] for r in recs], dtype=float)',
       'tokens = step * np.array([r["tokens"] for r in recs], float)', 1)], _REPORT),
    ("run log keeps a step a resume repeated", "pipeline.py",
     [('while recs and recs[-1]["step"] >= rec["step"]:', 'while recs and recs[-1]["step"] > rec["step"]:', 1)], _REPORT),
    # issue 31's, from H-train31 (1d06231)
    ("resume keeps the dead steps in the log", "pipeline.py", [('ok = 0 < step and rec["step"] <= step', "ok = True", 1)],
     ("test_cpu_engine.py::test_a_run_logs_each_step_once_and_one_run_only",)),
    # the careless-user audit of 2026-12-03
    ("NaN weights replace the last checkpoint", "pipeline.py",
     [("if not all(np.isfinite(t.flat).all() for t in state):", "if False:", 1)],
     ("test_cpu_engine.py::test_weights_gone_nan_never_replace_the_last_checkpoint",)),
    ("a forced run drops the old run's log at its start", "pipeline.py",
     [("if start == 0 and os.path.exists(ckpt_path):", "if False:", 1)],
     ("test_cpu_engine.py::test_a_forced_run_keeps_the_old_runs_log_until_its_first_checkpoint",)),
    ("the token cache keyed by length", "pipeline.py",
     [("hashlib.sha256(text.encode()).hexdigest()[:16]", "len(text)", 1)],
     ("test_cpu_engine.py::test_two_corpora_of_one_name_size_and_time_are_cached_apart",)),
    ("resume accepts another batch", "pipeline.py",
     [("for k in shape if args[k] != run.get(k, defaults[k])]", "for k in shape if False]", 1)],
     ("test_cpu_engine.py::test_resume_refuses_another_batch_seq_or_grad_accum",)),
    ("ESC reaches the terminal", "pipeline.py",
     [("(*range(0x20), 0x7f, *range(0x80, 0xa0))", "(*range(0x1b), 0x7f, *range(0x80, 0xa0))", 1)],
     ("test_cpu_engine.py::test_model_text_shown_to_a_person_escapes_control_bytes",)),
    ("no checkpoint by time", "pipeline.py", [("or stopping or due", "or stopping", 1)],
     ("test_cpu_engine.py::test_nan_loss_names_only_a_checkpoint_that_exists",)),
    # issue 36, H-tests36a's (/work/brief/mutants_36a.py): serve.py's wire format against OpenAI's API reference,
    # export.py's GGUF header as llama.cpp reads it, bpe.py's edges against Hugging Face tokenizers
    ('stream never sends [DONE]', 'serve.py',
     [('b"data: [DONE]\\n\\n" if done == job.n', 'b"" if done == job.n', 1)], _T36A_SERVE),
    ('finish_reason length at <|endoftext|>', 'serve.py',
     [('if t == self.tok.eot and not job.ignore_eos:\n            reason = "stop"',
       'if t == self.tok.eot and not job.ignore_eos:\n            reason = "length"', 1)], _T36A_SERVE),
    ('usage leaves out the end token', 'serve.py',
     [('                    n = len(drawn)\n', '                    n = len(drawn) - (end == "stop")\n', 1)], _T36A_SERVE),
    ('stop strings resolved in list order', 'serve.py',
     [('end = min(hits) if hits', 'end = hits[0] if hits', 1)], _T36A_SERVE),
    ('four stop strings refused', 'serve.py',
     [('len(stop) <= MAX_STOPS', 'len(stop) < MAX_STOPS', 1)], _T36A_SERVE),
    ('events end with one newline', 'serve.py',
     [('b"data: " + json.dumps(obj).encode() + b"\\n\\n" for obj in out', 'b"data: " + json.dumps(obj).encode() + b"\\n" for obj in out', 1)],
     _T36A_SERVE),
    ('chunks named chat.completion', 'serve.py',
     [('head["object"] = "chat.completion.chunk" if chat', 'head["object"] = "chat.completion" if chat', 1)], _T36A_SERVE),
    ('stream sent as text/plain', 'serve.py',
     [('"text/event-stream"', '"text/plain"', 1)], _T36A_SERVE),
    ('created in milliseconds', 'serve.py',
     [('"created": int(time.time())', '"created": int(time.time() * 1000)', 1)], _T36A_SERVE),
    # issue 33 (h33s): serve's continuous batching
    ("a departed client keeps its row", "serve.py", [("elif ch is None and job.live:", "elif False:", 1)],
     ("test_serve.py::test_a_client_that_leaves_frees_its_place",)),
    ("a stop string keeps its row", "serve.py", [("scheduler.retire(job, ch)", "pass", 1)],
     ("test_serve.py::test_a_stop_string_frees_its_row_at_once",)),
    ("a full queue takes one more", "serve.py", [("if len(self.waiting) >= self.max_queue:", "if False:", 1)],
     ("test_serve.py::test_a_full_queue_answers_429_with_retry_after",)),
    ("the api key is not checked", "serve.py", [('if not key or not path.startswith("/v1"):', "if True:", 1)],
     ("test_serve.py::test_api_key_locks_the_api_not_the_page",)),
    ("a long prompt keeps its head", "serve.py",
     [("else ids[len(ids) - pl.prompt_keep(self.ctx, max_new):]", "else ids[:pl.prompt_keep(self.ctx, max_new)]", 1)],
     ("test_serve.py::test_a_prompt_longer_than_the_context_keeps_its_tail",)),
    ("n choices share one seed", "serve.py", [("(job.seed + i) % (1 << 64)", "job.seed % (1 << 64)", 1)],
     ("test_serve.py::test_n_choices_are_rows_with_seeds_seed_plus_i",)),
    ("the engine process's queue takes one more", "serve.py", [("if self.queued.value >= self.max_queue:", "if False:", 1)],
     ("test_serve.py::test_the_engine_process_queues_refuses_and_frees_rows",)),
    ("a worker's reports go to worker 0", "serve.py", [("news[key[0]][0].append((key[1], job.t0", "news[0][0].append((key[1], job.t0", 1)],
     ("test_serve.py::test_each_worker_gets_its_own_requests_reports",)),
    ("the relay drops a report's ids", "serve.py", [("ch.ids.extend(ids)", "pass", 1)], _T36A_SERVE),
    ("a NaN row answers an id", "nanoeuler.py", [("finite = np.isfinite(logits[:len(rows)]).all(axis=1)",
                                               "finite = np.ones(len(rows), bool)", 1)],
     ("test_serve.py::test_a_row_whose_logits_go_nan_fails_alone",)),
    ("a decode row reads its neighbour's cache", "nanoeuler.py",
     [("Kh, Vh, qh = K[s, h // G], V[s, h // G], q[r, h]", "Kh, Vh, qh = K[slots[0], h // G], V[s, h // G], q[r, h]", 1)],
     ("test_serve.py::test_decoder_rows_are_the_same_alone_or_interleaved",)),
    ("a prefill's last layer reads a padding column", "nanoeuler.py",
     [("x[-1:], a[:, N - 1:N], h[:, N - 1:N]", "x[-1:], a[:, -1:], h[:, N - 1:N]", 1)],
     ("test_cpu_engine.py::test_a_prefill_may_run_the_head_on_its_last_row_alone",)),
    ("a decode step's parts skip their first row", "nanoeuler.py",
     [("p = slice(4 * fours.start, min(4 * fours.stop, n))", "p = slice(4 * fours.start + 1, min(4 * fours.stop, n))", 1)],
     ("test_serve.py::test_decoder_rows_are_the_same_alone_or_interleaved",)),
    ("a decode row's values skip every fourth position", "nanoeuler.py",
     [("o[i] += p0 * V0[i] + p1 * V1[i] + p2 * V2[i] + p3 * V3[i]", "o[i] += p0 * V0[i] + p1 * V1[i] + p2 * V2[i]", 1)],
     ("test_serve.py::test_decoder_rows_are_the_same_alone_or_interleaved",)),
    ("a decode row's scores skip the last position of a tail", "nanoeuler.py",
     [("for j in range(e - e % 4, e):\n                acc = zero", "for j in range(e - e % 4, e - 1):\n                acc = zero", 1)],
     ("test_serve.py::test_decoder_rows_are_the_same_alone_or_interleaved",)),
    ('gguf norm eps 1e-6', 'export.py',
     [('w.add_layer_norm_rms_eps(pl.RMS_EPS)', 'w.add_layer_norm_rms_eps(1e-6)', 1)], _T36A_EXPORT),
    ('gguf special tokens typed NORMAL', 'export.py',
     [('[T.CONTROL] * (n_tok - n_base)', '[T.NORMAL] * (n_tok - n_base)', 1)], _T36A_EXPORT),
    ('gguf rope dimension counts pairs', 'export.py',
     [('w.add_rope_dimension_count(cfg.head_dim)', 'w.add_rope_dimension_count(cfg.head_dim // 2)', 1)], _T36A_EXPORT),
    ('gguf feed-forward length 4 D', 'export.py',
     [('w.add_feed_forward_length(cfg.ffn)', 'w.add_feed_forward_length(4 * cfg.dim)', 1)], _T36A_EXPORT),
    ('gguf vocab size of the tokenizer', 'export.py',
     [('w.add_vocab_size(cfg.vocab)', 'w.add_vocab_size(tok.vocab_size)', 1)], _T36A_EXPORT),
    ('gguf adds a BOS to prompts', 'export.py',
     [('w.add_add_bos_token(False)', 'w.add_add_bos_token(True)', 1)], _T36A_EXPORT),
    ('gguf bos id 0', 'export.py',
     [('w.add_bos_token_id(eot)', 'w.add_bos_token_id(0)', 1)], _T36A_EXPORT),
    ('digits cut from their leading space', 'bpe.py',
     [('| ?\\p{N}+|', '|\\p{N}+|', 1)], _T36A_BPE),
    ('contractions of any case', 'bpe.py',
     [('r"""\'s|\'t|\'re|\'ve|\'m|\'ll|\'d|', 'r"""(?i:\'s|\'t|\'re|\'ve|\'m|\'ll|\'d)|', 1)], _T36A_BPE),
    ('a run of spaces keeps its last space', 'bpe.py',
     [('|\\s+(?!\\S)|\\s+""")', '|\\s+""")', 1)], _T36A_BPE),
    ('encoder merges the leftmost pair first', 'bpe.py',
     [('if rank is not None and (best_rank is None or rank < best_rank):', 'if rank is not None and best_rank is None:', 1)], _T36A_BPE),
    ('a regex match lets the GIL go', 'bpe.py',
     [('GPT2_PATTERN.findall(text, concurrent=False)', 'GPT2_PATTERN.findall(text)', 1)],
     ("test_tokenizer.py::test_encoding_keeps_the_gil",)),
    ('merge that uses its own id accepted', 'bpe.py',
     [('if max(pair) >= 256 + len(merges):', 'if max(pair) > 256 + len(merges):', 1)], _T36A_BPE),
    # issue 35: the speedrun's resumption and card
    ("speedrun redoes finished stages", "speedrun.py", [("    if os.path.isfile(marker):\n", "    if False:\n", 1)],
     _SPEEDRUN),
    ("speedrun retrains instead of resuming", "speedrun.py", [("    elif done:\n", "    elif False:\n", 1)], _SPEEDRUN),
    ("speedrun's pretraining gets 90% of the budget", "speedrun.py", [('"pretrain": 0.80,', '"pretrain": 0.90,', 1)],
     _SPEEDRUN),
    ("speedrun's card takes the first validation", "speedrun.py",
     [('    v = last(recs, "val_loss")', '    v = next(r for r in recs if "val_loss" in r)', 1)], _SPEEDRUN),
    ("finished speedrun rewrites its card", "speedrun.py",
     [("    if os.path.isfile(card) and all(", "    if False and all(", 1)], _SPEEDRUN),
    ("speedrun pretrains past MAX_EPOCHS", "speedrun.py",
     [('    steps = pretrain_steps(plan, tokens)', '    steps = plan["steps"]', 1)],
     ("test_speedrun.py::test_pretraining_takes_at_most_max_epochs_of_a_small_text",)),
    ("speedrun downloads make data's 100 MB at most", "speedrun.py",
     [("        mb = max(WEB_MB, math.ceil(", "        mb = min(WEB_MB, math.ceil(", 1)],
     ("test_speedrun.py::test_the_download_holds_the_budget_in_max_epochs_passes",)),
]


def copy_tree(src, dst):
    """The .py files, what tests read beside them (chat.html, CONTRACT.md, pytest.ini, data/ without its
    cache) and the Numba cache, with their times (the cache is keyed by them)."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name.endswith((".py", ".html", ".md")) or name == "pytest.ini":
            shutil.copy2(os.path.join(src, name), dst)
    if os.path.isdir(os.path.join(src, "data")):
        shutil.copytree(os.path.join(src, "data"), os.path.join(dst, "data"), ignore=shutil.ignore_patterns("cache"))
    if os.path.isdir(os.path.join(src, "__pycache__")):
        shutil.copytree(os.path.join(src, "__pycache__"), os.path.join(dst, "__pycache__"), copy_function=shutil.copy2)


def mutated(folder, file, replacements):
    """The text of folder/file with the replacements made; exits if one does not match as often as stated
    (the engine changed under the mutant: update it)."""
    with open(os.path.join(folder, file)) as f:
        src = f.read()
    for old, new, times in replacements:
        found = src.count(old)
        if found != times:
            raise SystemExit(f"error: mutant does not apply: {old!r} occurs {found} times in {file}, not {times}")
        src = src.replace(old, new)
    return src


def run_tests(folder, tests, threads, timeout):
    """-> (passed, first failing test or reason, seconds)."""
    env = dict(os.environ, NANOEULER_THREADS=str(threads))
    env.pop("NANOEULER_CACHE", None)
    t0 = time.time()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests], cwd=folder,
                           capture_output=True, text=True, errors="replace", timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return False, f"timeout after {timeout} s", time.time() - t0
    failed = re.findall(r"^(?:FAILED|ERROR) \S+?::(\S+)", r.stdout, re.M)
    return r.returncode == 0, (failed[0] if failed else f"pytest exit {r.returncode}"), time.time() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("-k", default="", help="only the mutants whose name holds this (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    p.add_argument("--tests", nargs="+", help="pytest arguments for every mutant (default: each mutant's own, else "
                                              "test_reference.py and test_cli.py's mistakes, -k 'not torch')")
    p.add_argument("--timeout", type=int, default=300, help="seconds one mutant's tests may take (default 300)")
    a = p.parse_args()
    mutants = [(*m[:3], tuple(a.tests or (m[3] if len(m) > 3 else DEFAULT_TESTS))) for m in MUTANTS if a.k in m[0]]
    if not mutants:
        p.error(f"no mutant's name holds {a.k!r} (see --list)")
    for name, file, repl, _ in mutants:               # a stale mutant stops the run before any test
        mutated(ROOT, file, repl)
    if a.list:
        for name, file, _, _ in mutants:
            print(f"{file:13} {name}")
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        base = os.path.join(tmp, "base")              # unmutated runs: the tests must pass, the cache warms
        copy_tree(ROOT, base)
        secs = 0.0
        for tests in dict.fromkeys(m[3] for m in mutants):      # each set of tests once, in the mutants' order
            ok, why, took = run_tests(base, tests, cores, a.timeout)
            if not ok:
                print(f"error: the tests fail without any mutant ({' '.join(tests)}: {why}); fix that first",
                      file=sys.stderr)
                return 1
            secs += took
        print(f"unmutated: the tests pass ({secs:.0f} s); {len(mutants)} mutants, {a.jobs} at a time", flush=True)

        def run(i):
            name, file, repl, tests = mutants[i]
            folder = os.path.join(tmp, f"m{i}")
            copy_tree(base, folder)
            src = mutated(folder, file, repl)
            with open(os.path.join(folder, file), "w") as f:
                f.write(src)
            passed, why, secs = run_tests(folder, tests, max(1, cores // a.jobs), a.timeout)
            shutil.rmtree(folder, ignore_errors=True)
            print(f"  {'SURVIVED' if passed else 'caught  '} {name} ({secs:.0f} s)", flush=True)
            return name, file, passed, why, secs
        with ThreadPoolExecutor(a.jobs) as pool:
            results = list(pool.map(run, range(len(mutants))))
    caught = sum(not passed for _, _, passed, _, _ in results)
    width = max(len(r[0]) for r in results)
    print(f"\n| {'mutant':{width}} | file         | result   | caught by |")
    print(f"|{'-' * (width + 2)}|--------------|----------|-----------|")
    for name, file, passed, why, secs in results:
        print(f"| {name:{width}} | {file:12} | {'SURVIVED' if passed else 'caught':8} | {'' if passed else why} |")
    print(f"\ncaught {caught} of {len(results)} ({100 * caught / len(results):.0f}%)")
    for name, _, passed, _, _ in results:
        if passed:
            print(f"survived: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

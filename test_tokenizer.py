"""
test_tokenizer.py -- the byte-level BPE tokenizer (bpe.py): training, encode and decode, its file, parallel
file encoding and its command line.

Authorities: CONTRACT.md's "Tokenizer" section; merges worked out by hand; a brute-force trainer written
here (full recount every merge); any Unicode text round-trips (hypothesis); Hugging Face tokenizers'
byte-level BPE given the same merges and ids (a test-only dependency, installed with transformers).
"""
import codecs
import json
import random
import re
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import bpe
from conftest import run_engine, run_here


def _corpus():
    """A small mixed corpus: English, accents, CJK, emoji, digits, code-like whitespace."""
    rng = random.Random(0)
    words = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "naïve", "café",
             "東京", "😀", "don't", "it's", "2024", "3.14", "==", "->", "Ünïcödé", "ok")
    seps = (" ", " ", " ", "  ", "\n", "\n\n", "\t", ", ", ". ")
    syllables = ("ka", "ri", "to", "mo", "an", "el", "qu", "is", "ßa", "ён", "ng", "th")
    words += tuple("".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(300))
    return "".join(rng.choice(words) + rng.choice(seps) for _ in range(3000))


CORPUS = _corpus()


TOK = bpe.Tokenizer.train(CORPUS, 400)


def _bin_ids(path):
    return np.fromfile(path, dtype="<u2").tolist()


# ----------------------------------------------------------------------------------------------------
# training

def test_known_merges_and_ids():
    # "aaab" x1 and " aaab" x2: (a,a) counts 6, then (a,b) and (aa,a) tie at 3 -> smaller pair
    # (97,98) wins, then (aa,ab) 3, then (" ", aaab) 2.
    tok = bpe.Tokenizer.train("aaab aaab aaab", 261)
    assert tok.merges == [(97, 97), (97, 98), (256, 257), (32, 258)]
    assert tok.vocab_size == 261 and tok.eot == 260 and tok.special_id("<|endoftext|>") == 260
    assert tok.encode("aaab aaab") == [258, 259]
    assert tok.encode("aaa") == [256, 97]              # left-to-right, non-overlapping
    assert tok.encode("aaaab") == [256, 256, 98]
    assert tok.encode("aaab<|endoftext|>", "all") == [258, 260]


def test_training_stops_when_pairs_run_out():
    tok = bpe.Tokenizer.train("ab", 1000)
    assert tok.merges == [(97, 98)] and tok.vocab_size == 258 and tok.eot == 257


def test_special_strings_are_not_learnt():
    tok = bpe.Tokenizer.train("<|endoftext|>" * 50 + "xy", 300)
    assert tok.merges == [(120, 121)]


def _reference_merges(text, n_merges):
    """Brute force: full recount every merge, highest count then smallest pair."""
    words = [[list(p.encode()), c] for p, c in Counter(bpe.GPT2_PATTERN.findall(text)).items()]
    merges = []
    for new_id in range(256, 256 + n_merges):
        counts = Counter()
        for w, c in words:
            for pair in zip(w, w[1:]):
                counts[pair] += c
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        for entry in words:
            w, out, i = entry[0], [], 0
            while i < len(w):
                if tuple(w[i:i + 2]) == best:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            entry[0] = out
    return merges


@pytest.mark.parametrize("seed", range(4))
def test_incremental_training_matches_brute_force(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(["ab", "ba", "aab", "é", "a", "b", " ", "  ", "\n", "!!"])
                   for _ in range(400))
    assert bpe.Tokenizer.train(text, 256 + 60 + 1).merges == _reference_merges(text, 60)


def test_training_is_deterministic():
    assert bpe.Tokenizer.train(CORPUS, 400).to_string() == TOK.to_string()


def test_compresses_and_ids_in_range():
    assert TOK.vocab_size == 400 and len(TOK.merges) == 400 - 256 - 1
    ids = TOK.encode(CORPUS)
    assert len(CORPUS.encode()) / len(ids) > 2.5
    assert all(0 <= i < TOK.vocab_size - len(TOK.specials) for i in ids)


# ----------------------------------------------------------------------------------------------------
# encode / decode

@settings(max_examples=150, deadline=None)
@given(st.text())
def test_round_trip_unicode(s):
    assert TOK.decode(TOK.encode(s)) == s
    assert TOK.decode(TOK.encode(s, "all")) == s


@settings(max_examples=80, deadline=None)
@given(st.text(st.one_of(st.characters(), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF))))
@example("\ud800x\udfff \ud83d\ude00")
def test_round_trip_lone_surrogates(s):
    """A lone surrogate is not text (it has no UTF-8 form): it comes back as U+FFFD, the rest exactly."""
    assert TOK.decode(TOK.encode(s)) == re.sub("[\ud800-\udfff]", "\ufffd", s)


def test_round_trip_long_piece_without_spaces():
    s = "ab" * 1000 + "é" * 300          # pieces longer than MAX_PIECE_BYTES are cut into chunks
    assert TOK.decode(TOK.encode(s)) == s


def test_empty_input():
    assert TOK.encode("") == [] and TOK.encode("", "all") == []
    assert TOK.decode([]) == "" and TOK.decode_bytes([]) == b""


def test_special_tokens_allowed_or_plain():
    s = "hello<|endoftext|>world"
    plain = TOK.encode(s)
    assert TOK.eot == TOK.vocab_size - 1 and TOK.eot not in plain
    allowed = TOK.encode(s, "all")
    assert allowed == TOK.encode("hello") + [TOK.eot] + TOK.encode("world")
    assert TOK.encode(s, {"<|endoftext|>"}) == allowed
    assert TOK.decode(plain) == TOK.decode(allowed) == s
    with pytest.raises(ValueError, match="unknown special"):
        TOK.encode(s, {"<|nope|>"})


def test_several_specials_take_the_last_ids():
    tok = bpe.Tokenizer.train(CORPUS, 400, specials=("<|endoftext|>", "<|pad|>"))
    assert (tok.special_id("<|endoftext|>"), tok.special_id("<|pad|>")) == (398, 399)
    ids = tok.encode("a<|pad|>b<|endoftext|>", {"<|pad|>"})
    assert 399 in ids and 398 not in ids
    overlapping = bpe.Tokenizer([], specials=("<|x|>", "<|x|>y"))
    assert overlapping.encode("<|x|>y<|x|>", "all") == [257, 256]     # longest special wins
    with pytest.raises(ValueError):
        bpe.Tokenizer([], specials=("<|a b|>",))


def test_decode_never_raises():
    assert TOK.decode([0xFF, 0xC3]) == "\ufffd\ufffd"            # invalid and truncated UTF-8
    assert TOK.decode([-1, 10**9, TOK.vocab_size]) == "\ufffd" * 3  # unknown ids
    assert TOK.decode(np.array([104, 105], dtype=np.uint16)) == "hi"


def test_streaming_decode_of_partial_utf8():
    byte_tok = bpe.Tokenizer([])                  # every byte its own token
    s = "naïve 東京 😀"
    ids = byte_tok.encode(s)
    assert any("\ufffd" in byte_tok.decode([i]) for i in ids)   # single tokens cut characters
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    assert "".join(dec.decode(byte_tok.decode_bytes([i])) for i in ids) == s


def test_encoding_keeps_the_gil():
    """serve's connection threads encode prompts at once: a regex match that lets the GIL go makes each
    queue to take it back (32 threads: a 0.07 ms match took 3.5 ms). With no forced switches (an interval
    of 60 s), a thread that waits for the GIL runs only where encode() lets it go: never."""
    count, stop = [0], threading.Event()

    def spin():                                          # waits for the GIL after each sleep(0)
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)
    old = sys.getswitchinterval()
    t = threading.Thread(target=spin, daemon=True)
    try:
        t.start()
        while count[0] < 10:                            # it runs (this thread waits in sleep meanwhile)
            time.sleep(0.001)
        sys.setswitchinterval(60)
        time.sleep(0.001)                                # (its wait started under the old interval ends)
        seen = count[0]
        for _ in range(1000):                          # (many matches: a loaded machine may not run it at each)
            TOK.encode("Once upon a time, naïve café <|endoftext|> 東京 2024 " * 5, allowed_special="all")
        ran = count[0] - seen
    finally:
        sys.setswitchinterval(old)
        stop.set()
        t.join()
    assert ran == 0, ran


# ----------------------------------------------------------------------------------------------------
# serialisation

def test_save_load_identity(tmp_path):
    s = TOK.to_string()
    assert s.splitlines()[0] == "nanoeuler-bpe v1"
    tok2 = bpe.Tokenizer.from_string(s)
    assert tok2.to_string() == s and tok2.merges == TOK.merges and tok2.eot == TOK.eot
    TOK.save(tmp_path / "t.tok")
    tok3 = bpe.Tokenizer.load(tmp_path / "t.tok")
    sample = CORPUS[:2000] + "<|endoftext|>"
    assert tok3.encode(sample, "all") == tok2.encode(sample, "all") == TOK.encode(sample, "all")


_GOOD = bpe.Tokenizer.train("aaab aaab aaab", 261).to_string()


@pytest.mark.parametrize("text, message", [
    ("", "not a tokenizer"),
    ("hello\nworld\n", "not a tokenizer"),
    ("nanoeuler-bpe v1\n{not json\n", "line 2"),
    ("nanoeuler-bpe v1\n{\"vocab_size\": 257}\n", "line 2"),
    (_GOOD.replace("97 98", "97 x"), "line 4"),
    (_GOOD.replace("97 98", "-1 98"), "line 4"),
    (_GOOD.replace("256 257", "256 300"), "not defined"),
    (_GOOD.rsplit("\n", 2)[0] + "\n", "truncated"),
])
def test_corrupt_tokenizer_raises_value_error(text, message):
    with pytest.raises(ValueError, match=message):
        bpe.Tokenizer.from_string(text)


def test_load_corrupt_file_names_it(tmp_path):
    (tmp_path / "bad.tok").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ValueError, match="bad.tok"):
        bpe.Tokenizer.load(tmp_path / "bad.tok")


# ----------------------------------------------------------------------------------------------------
# against Hugging Face tokenizers: the same merges and ids in its byte-level BPE give the same encodings

def _gpt2_bytes_to_unicode():
    """GPT-2's table of byte -> printable character (bytes_to_unicode of openai/gpt-2's encoder.py, written
    here from its definition): printable Latin-1 stands for itself, every other byte for U+0100 onwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def hf_tokenizer(tok):
    """tokenizers' BPE model holding tok's ids and merges (in rank order), GPT-2's ByteLevel pre-tokenizer
    (its own regex) and decoder, and tok's special tokens as added tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    char = _gpt2_bytes_to_unicode()
    spell = lambda i: "".join(char[b] for b in tok.token_bytes[i])
    vocab = {spell(i): i for i in range(256 + len(tok.merges))}
    assert len(vocab) == 256 + len(tok.merges)                      # no two ids of the same bytes
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [(spell(a), spell(b)) for a, b in tok.merges]))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = tokenizers.decoders.ByteLevel()
    hf.add_special_tokens(list(tok.specials))
    assert [hf.token_to_id(s) for s in tok.specials] == [tok.special_id(s) for s in tok.specials]
    return hf


def merges_of(words):
    """Merges that build each word's bytes left to right (a new id per new prefix), in the order given:
    a merge table written by hand, whatever the trainer would learn."""
    merges, made = [], {bytes([b]): b for b in range(256)}
    for w in words:
        data = w.encode()
        for k in range(2, len(data) + 1):
            if data[:k] not in made:
                merges.append((made[data[:k - 1]], made[data[k - 1:k]]))
                made[data[:k]] = 255 + len(merges)
    return merges


# pieces GPT-2's pattern keeps whole or cuts, each with a merge that shows which: a digit run with its
# leading space, contractions (lower case only), whitespace runs before a word, newlines; and "bc" ranked
# before "ab", so that "abc" is a, bc (the lowest rank first, not the leftmost pair)
HAND = bpe.Tokenizer(merges_of([" 1", " 12", " 123", " 4", " 42", "12", "42", "  ", "   ", "    ", "\n\n", "\n\n\n",
                                "'s", "'t", "'ll", "'M", "'re", "I'", "n'", "don", " don", " ca", " caf", " café",
                                "é", "日本", "🙂", "bc", "ab", "abc", " x", "x ", "\t\t", " \n", "e ", "1b", " 1b"]))

EDGES = [" 123", "a 1b", "x  42", "x   42", "123", "a1b 12 123 1234", "3.14159 2026", "x\t 42",
         "don't", "we'll", "I'M", "I'm", "they're", "it's  here", "don 't",
         "naïve café", "Ünïcödé 日本語 Ελληνικά", "🙂👍🏽 🙂", "\u00a042 \u3000x",
         "line\nnext\n\n\nend", "a\n\n", "\n\n\n", " \n x", "x\r\ny", "tabs\t\tand   spaces   ", "  leading",
         "trailing  ", "x    ", "abc", "abcabc bc ab", ""]


@pytest.mark.parametrize("tok", [HAND, TOK], ids=["hand", "trained"])
def test_encodings_equal_hugging_face_tokenizers(tok):
    """Authority: Hugging Face tokenizers' byte-level BPE (GPT-2's ByteLevel pre-tokenizer with its own
    regex, merges applied lowest rank first) given the same merges and ids: equal ids on edge cases of
    digits after a space, contractions, Unicode, newlines and runs of spaces; equal decoded text."""
    hf = hf_tokenizer(tok)
    for s in EDGES + [CORPUS[:3000]]:
        ids = tok.encode(s)
        assert hf.encode(s).ids == ids, s
        assert hf.decode(ids) == s
    s = "one<|endoftext|> two\n<|endoftext|>"
    assert hf.encode(s).ids == tok.encode(s, "all") and tok.eot in tok.encode(s, "all")


def test_hand_merges_are_used_where_the_pattern_allows():
    """The edge cases above test something: the hand merges join the pieces GPT-2's pattern keeps whole."""
    ids = lambda s: [HAND.decode([i]) for i in HAND.encode(s)]
    assert ids(" 123") == [" 123"] and ids("x  42") == ["x", " ", " 42"] and ids("a 1b") == ["a", " 1", "b"]
    assert ids("I'M") == ["I", "'", "M"] and ids("don't") == ["don", "'t"] and ids("abc") == ["a", "bc"]


@pytest.mark.parametrize("lines, bad_line, token", [
    (["97 98", "257 97"], 4, 257),               # the merge that makes 257 uses 257
    (["97 98", "256 258", "98 99"], 4, 258),     # 258 is used before the line that defines it
    (["256 97"], 3, 256),
])
def test_merge_table_that_refers_to_its_own_id_is_refused(tmp_path, lines, bad_line, token):
    """Authority: CONTRACT.md's tokenizer file: "a b makes the next id from ids a and b, both already
    defined": a merge that uses its own id, or one defined later, is refused with the line and the id."""
    text = "\n".join(["nanoeuler-bpe v1", json.dumps({"vocab_size": 257 + len(lines), "specials": ["<|endoftext|>"]}),
                      *lines]) + "\n"
    with pytest.raises(ValueError, match=rf"line {bad_line}: merge uses token {token}, which is not defined yet"):
        bpe.Tokenizer.from_string(text)
    (tmp_path / "t.tok").write_text(text)
    with pytest.raises(ValueError, match=r"t\.tok: tokenizer line"):
        bpe.Tokenizer.load(tmp_path / "t.tok")


# ----------------------------------------------------------------------------------------------------
# files and command line

def _tricky_text(n=6000):
    rng = random.Random(1)
    parts = ("word", " ", "  ", "\n", "\n\n", "\t", " \n", "'s", "123", "!!", "\r\n", "é", "東京",
             "<|endoftext|>", "x")
    return "".join(rng.choice(parts) for _ in range(n))


@pytest.mark.parametrize("allow_special", [True, False])
def test_parallel_file_encoding_equals_whole_text(tmp_path, allow_special):
    text = _tricky_text()
    tok = bpe.Tokenizer.train(text, 300)         # learns whitespace-run merges that a bad cut breaks
    path = tmp_path / "in.txt"
    path.write_text(text, encoding="utf-8", newline="")
    size = path.stat().st_size
    assert len(bpe._chunk_bounds(path, size, 500)) > 20          # really cut into many chunks
    n_tokens, n_bytes, _ = bpe.encode_file_parallel(tok, path, tmp_path / "out.bin", workers=2,
                                                    allow_special=allow_special, chunk_bytes=500)
    expected = tok.encode(text, "all" if allow_special else None)
    assert _bin_ids(tmp_path / "out.bin") == expected
    assert n_tokens == len(expected) and n_bytes == size


def test_cli_train_encode_stats(tmp_path):
    (tmp_path / "c.txt").write_text(CORPUS, encoding="utf-8")
    r = run_engine("bpe.py", "train", tmp_path / "c.txt", "--vocab", 400, "-o", tmp_path / "c.tok")
    assert r.returncode == 0, r.stderr
    assert bpe.Tokenizer.load(tmp_path / "c.tok").to_string() == TOK.to_string()
    doc = "one doc<|endoftext|>two doc"
    (tmp_path / "d.txt").write_text(doc, encoding="utf-8")
    r = run_engine("bpe.py", "encode", tmp_path / "c.tok", tmp_path / "d.txt", "-o", tmp_path / "d.bin")
    assert r.returncode == 0, r.stderr
    assert _bin_ids(tmp_path / "d.bin") == TOK.encode(doc, "all")
    r = run_engine("bpe.py", "stats", tmp_path / "c.tok", tmp_path / "c.txt")
    assert r.returncode == 0 and "bytes/token" in r.stdout
    for cmd in ("train", "encode", "stats"):
        assert run_here("bpe.py", cmd, "--help").returncode == 0


def test_cli_errors_are_one_line(tmp_path):
    TOK.save(tmp_path / "t.tok")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "binary.txt").write_bytes(b"abc \xff\xfe\x00\x01" * 10)
    (tmp_path / "bad.tok").write_text("junk\n")
    cases = [("encode", tmp_path / "t.tok", tmp_path / "missing.txt", "-o", tmp_path / "o.bin"),
             ("encode", tmp_path / "t.tok", tmp_path / "binary.txt", "-o", tmp_path / "o.bin"),
             ("encode", tmp_path / "bad.tok", tmp_path / "empty.txt", "-o", tmp_path / "o.bin"),
             ("stats", tmp_path / "missing.tok", tmp_path / "empty.txt"),
             ("stats", tmp_path / "t.tok", tmp_path / "empty.txt"),
             ("train", tmp_path / "binary.txt", "--vocab", 300, "-o", tmp_path / "o.tok")]
    for args in cases:                               # in this process (conftest.run_here); the commands above,
        r = run_here("bpe.py", *args)                # and test_cli.py's bpe.py mistakes, run in real processes
        assert r.returncode == 1, args
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, r.stderr)
    assert not (tmp_path / "o.bin").exists() and not (tmp_path / "o.bin.tmp").exists()


def test_encoding_workers_leave_ctrl_c_to_the_parent():
    """A Ctrl-C from a terminal reaches every process of the group: each pool worker printed its own
    KeyboardInterrupt traceback. Workers ignore SIGINT; the parent stops the pool and exits with 130."""
    import signal
    old = signal.getsignal(signal.SIGINT)
    try:
        bpe._init_worker(bpe.Tokenizer([]).to_string())
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)

"""bpe.py - byte-level BPE tokenizer for NanoEuler, written from scratch.

Ids 0..255 are the raw bytes, then one id per merge in rank order, then the special tokens
(default "<|endoftext|>"), as CONTRACT.md requires. Pre-tokenisation is GPT-2's: a word
keeps its leading space, and merges never cross piece boundaries.

    python bpe.py train FILE --vocab N -o TOKFILE        learn merges from a UTF-8 text file
    python bpe.py encode TOKFILE FILE -o OUT.bin          uint16 little-endian token file, all cores
    python bpe.py stats TOKFILE FILE                      bytes/token and encoding speed

Dependencies: numpy, and `regex` (allowed: Python's `re` has no \\p{L} / \\p{N} classes that the
GPT-2 pattern needs).
"""
import argparse
import codecs
import heapq
import json
import multiprocessing
import os
import signal
import sys
import time
from collections import Counter, defaultdict
from itertools import chain

import numpy as np
import regex

FORMAT_HEADER = "nanoeuler-bpe v1"
DEFAULT_SPECIALS = ("<|endoftext|>",)
GPT2_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
# A piece longer than this is cut into chunks of this many bytes (same rule in training and
# encoding), so a megabyte without spaces cannot make the quadratic merge loop explode.
MAX_PIECE_BYTES = 256
CACHE_MAX_PIECES = 1 << 20     # the encode cache is cleared when it grows past this


# ----------------------------------------------------------------------------------------------
# Bytes <-> text. Decoding replaces every invalid UTF-8 sequence with U+FFFD (errors="replace"), so
# decoded text is always valid Unicode that prints and encodes as UTF-8, and decoding never raises.
# A Python str may hold lone surrogates, which are not text and have no UTF-8 form: encoding turns
# each into U+FFFD. So decode(encode(s)) == s for every valid string, and a lone surrogate comes
# back as U+FFFD. (Passing surrogates through made decode return unprintable strings.)

def _surrogate_to_replacement(err):
    if isinstance(err, UnicodeEncodeError):
        return "\ufffd".encode() * (err.end - err.start), err.end    # bytes: the UTF-8 codec takes only ASCII str
    raise err


codecs.register_error("nanoeuler-bpe", _surrogate_to_replacement)


def _piece_chunks(piece):
    """The UTF-8 bytes of one pre-token piece, cut into chunks of at most MAX_PIECE_BYTES."""
    data = piece.encode("utf-8", "nanoeuler-bpe")
    return [data[i:i + MAX_PIECE_BYTES] for i in range(0, len(data), MAX_PIECE_BYTES)]


def _merge(ids, pair, new_id):
    """Replace every non-overlapping occurrence of pair, left to right, by new_id."""
    a, b = pair
    out, i, n = [], 0, len(ids)
    while i < n:
        if ids[i] == a and i + 1 < n and ids[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


# ----------------------------------------------------------------------------------------------
# The tokenizer

class Tokenizer:
    def __init__(self, merges, specials=DEFAULT_SPECIALS):
        specials = tuple(specials)
        for s in specials:
            # Specials must contain no whitespace: the parallel file encoder cuts files only just
            # before a whitespace byte, which then can never fall inside a special token.
            if not isinstance(s, str) or not s or any(c.isspace() for c in s):
                raise ValueError(f"special token {s!r} must be a non-empty string without spaces")
        if len(set(specials)) != len(specials):
            raise ValueError(f"duplicate special tokens in {specials!r}")
        self.merges = [tuple(m) for m in merges]
        self.ranks = {pair: rank for rank, pair in enumerate(self.merges)}
        if len(self.ranks) != len(self.merges):
            raise ValueError("duplicate merge in tokenizer")
        self.specials = specials
        n_base = 256 + len(self.merges)
        self.special_ids = {s: n_base + k for k, s in enumerate(specials)}
        self.vocab_size = n_base + len(specials)
        self.eot = self.special_ids.get("<|endoftext|>")
        # id -> bytes as a dict, so that negative or unknown ids fall back instead of indexing
        self.token_bytes = {i: bytes([i]) for i in range(256)}
        for rank, (a, b) in enumerate(self.merges):
            self.token_bytes[256 + rank] = self.token_bytes[a] + self.token_bytes[b]
        for s, i in self.special_ids.items():
            self.token_bytes[i] = s.encode("utf-8")
        self._cache = {}           # pre-token piece (str) -> tuple of ids

    def special_id(self, s):
        if s not in self.special_ids:
            raise ValueError(f"unknown special token {s!r}; this tokenizer has {self.specials!r}")
        return self.special_ids[s]

    # -- training --------------------------------------------------------------------------------

    @classmethod
    def train(cls, text, vocab_size, specials=DEFAULT_SPECIALS, verbose=False):
        """Learn vocab_size - 256 - len(specials) merges from text (fewer if the text runs out of
        pairs). Ties between equally frequent pairs go to the smallest (id, id) pair."""
        specials = tuple(specials)
        n_merges = vocab_size - 256 - len(specials)
        if n_merges < 0:
            raise ValueError(f"vocab size {vocab_size} is below 256 bytes + {len(specials)} specials")
        t0 = time.perf_counter()
        # Count each distinct piece once, with its multiplicity; special strings are not learnt.
        piece_counts = Counter()
        for segment in cls._split_specials(text, specials)[::2]:
            piece_counts.update(GPT2_PATTERN.findall(segment))
        words, freqs = [], []
        for piece, count in piece_counts.items():
            for chunk in _piece_chunks(piece):
                words.append(list(chunk))
                freqs.append(count)
        if verbose:
            print(f"bpe: {sum(piece_counts.values()):,} pieces, {len(words):,} distinct, "
                  f"learning {n_merges:,} merges", file=sys.stderr)

        # pair -> weighted count, pair -> indices of words that (may) contain it, and a max-heap
        # of (-count, pair) whose stale entries are skipped when popped (lazy invalidation).
        pair_count, where = defaultdict(int), defaultdict(set)
        for i, (word, freq) in enumerate(zip(words, freqs)):
            for pair in zip(word, word[1:]):
                pair_count[pair] += freq
                where[pair].add(i)
        heap = [(-count, pair) for pair, count in pair_count.items()]
        heapq.heapify(heap)

        merges, last_report = [], time.perf_counter()
        while len(merges) < n_merges and heap:
            neg_count, pair = heapq.heappop(heap)
            if pair_count.get(pair) != -neg_count:
                continue
            new_id = 256 + len(merges)
            merges.append(pair)
            # Re-count only the words that held the pair: subtract their old pairs, add new ones.
            delta = defaultdict(int)
            for i in where.pop(pair):
                word, freq = words[i], freqs[i]
                merged = _merge(word, pair, new_id)
                if len(merged) == len(word):
                    continue            # index left over from an earlier merge of this word
                for p in zip(word, word[1:]):
                    delta[p] -= freq
                for p in zip(merged, merged[1:]):
                    delta[p] += freq
                    if new_id in p:
                        where[p].add(i)
                words[i] = merged
            for p, d in delta.items():
                if d:
                    pair_count[p] += d
                    if pair_count[p] > 0:
                        heapq.heappush(heap, (-pair_count[p], p))
                    else:
                        del pair_count[p]
            if verbose and time.perf_counter() - last_report > 1.0:
                last_report = time.perf_counter()
                print(f"bpe: {len(merges):,}/{n_merges:,} merges, "
                      f"{len(merges) / (last_report - t0):,.0f} merges/s, "
                      f"last pair count {-neg_count:,}", file=sys.stderr)
        if verbose:
            print(f"bpe: {len(merges):,} merges in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
        return cls(merges, specials)

    # -- encoding --------------------------------------------------------------------------------

    @staticmethod
    def _split_specials(text, specials):
        """[text, special, text, special, ..., text]; longest special first where they overlap."""
        if not specials:
            return [text]
        alternatives = "|".join(map(regex.escape, sorted(specials, key=len, reverse=True)))
        return regex.split(f"({alternatives})", text, concurrent=False)

    def _bpe(self, piece):
        """Ids of one pre-token piece: apply merges by rank (lowest first) until none applies."""
        ranks, ids = self.ranks, []
        for chunk in _piece_chunks(piece):
            word = list(chunk)
            while len(word) > 1:
                best_rank = None
                for p in zip(word, word[1:]):
                    rank = ranks.get(p)
                    if rank is not None and (best_rank is None or rank < best_rank):
                        best_rank, best_pair = rank, p
                if best_rank is None:
                    break
                word = _merge(word, best_pair, 256 + best_rank)
            ids.extend(word)
        return tuple(ids)

    def _encode_ordinary(self, text):
        # concurrent=False: regex would release the GIL for each match; with serve's 32 connection threads
        # encoding at once, a 0.07 ms findall then took 3.5 ms (the threads queue to take the GIL back)
        pieces = GPT2_PATTERN.findall(text, concurrent=False)
        cache = self._cache
        if len(cache) > CACHE_MAX_PIECES:   # a new dict, not clear(): another thread may be reading the old one
            self._cache = cache = {}
        for piece in set(pieces):
            if piece not in cache:
                cache[piece] = self._bpe(piece)
        return list(chain.from_iterable(map(cache.__getitem__, pieces)))

    def encode(self, text, allowed_special=None):
        """Token ids of text. Special-token strings become their ids only when allowed
        (allowed_special="all" or a set of them); otherwise they are encoded as plain text."""
        if allowed_special is None:
            return self._encode_ordinary(text)
        allowed = self.specials if allowed_special == "all" else tuple(allowed_special)
        for s in allowed:
            self.special_id(s)              # raises on a special this tokenizer does not have
        ids = []
        for k, part in enumerate(self._split_specials(text, allowed)):
            if k % 2:
                ids.append(self.special_ids[part])
            elif part:
                ids.extend(self._encode_ordinary(part))
        return ids

    # -- decoding --------------------------------------------------------------------------------

    def decode_bytes(self, ids):
        """Raw bytes of ids; unknown ids become U+FFFD."""
        return b"".join([self.token_bytes.get(i, b"\xef\xbf\xbd") for i in ids])

    def decode(self, ids):
        return self.decode_bytes(ids).decode("utf-8", "replace")

    def stream(self):
        """A decoder of ids one at a time, for printing text as it is generated: see TextStream."""
        return TextStream(self)

    # -- serialisation ---------------------------------------------------------------------------
    # Line 1: the format header; line 2: JSON {"vocab_size", "specials"}; then one merge per line,
    # "a b" (the ids merged), in rank order. The same string goes inside checkpoints.

    def to_string(self):
        meta = json.dumps({"vocab_size": self.vocab_size, "specials": list(self.specials)})
        return "\n".join([FORMAT_HEADER, meta] + [f"{a} {b}" for a, b in self.merges]) + "\n"

    @classmethod
    def from_string(cls, s):
        lines = s.split("\n")
        if lines[-1] == "":
            lines.pop()
        if not lines or lines[0] != FORMAT_HEADER:
            first = lines[0][:40] if lines else ""
            raise ValueError(f"not a tokenizer: first line is {first!r}, expected {FORMAT_HEADER!r}")
        try:
            meta = json.loads(lines[1])
            vocab_size, specials = int(meta["vocab_size"]), list(meta["specials"])
        except (IndexError, ValueError, KeyError, TypeError):
            raise ValueError("tokenizer line 2 must be JSON with 'vocab_size' and 'specials'") from None
        merges = []
        for line_no, line in enumerate(lines[2:], start=3):
            m = regex.fullmatch(r"([0-9]+) ([0-9]+)", line)
            if not m:
                raise ValueError(f"tokenizer line {line_no}: expected 'id id', got {line[:40]!r}")
            pair = (int(m[1]), int(m[2]))
            if max(pair) >= 256 + len(merges):
                raise ValueError(f"tokenizer line {line_no}: merge uses token {max(pair)}, "
                                 f"which is not defined yet")
            merges.append(pair)
        tok = cls(merges, specials)
        if tok.vocab_size != vocab_size:
            raise ValueError(f"tokenizer declares vocab size {vocab_size} but its merges and "
                             f"specials give {tok.vocab_size} (truncated file?)")
        return tok

    def save(self, path):
        """Whole or not at all: -o over a good tokenizer, cut short, keeps it."""
        import pipeline as pl                        # which imports this module: loaded when first needed
        pl.atomic_write(path, self.to_string())

    @classmethod
    def load(cls, path):
        with open(path, "rb") as f:
            data = f.read()
        try:
            return cls.from_string(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None


class TextStream:
    """text(id) -> the characters that id completes (a character cut between tokens waits for its last
    byte); end() -> what is left, an unfinished character as U+FFFD."""

    def __init__(self, tok):
        self.tok, self.decoder = tok, codecs.getincrementaldecoder("utf-8")(errors="replace")

    def text(self, t):
        return self.decoder.decode(self.tok.decode_bytes([t]))

    def end(self):
        return self.decoder.decode(b"", final=True)


# ----------------------------------------------------------------------------------------------
# Encoding large files on every core. The file is cut into chunks just before an ASCII whitespace
# byte that follows a printable non-space ASCII byte. Such a cut is a piece boundary that the GPT-2
# pattern finds the same way whether or not the text goes on (no piece ends with whitespace after
# a non-space character, and the pattern has no look-behind), so the concatenated chunk encodings
# equal the encoding of the whole file. Chunks are encoded by a pool, results kept in order.

_CUT = regex.compile(rb"[\x21-\x7e][ \t\n\r]")
_worker_tok = None


def _chunk_bounds(path, size, chunk_bytes):
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + chunk_bytes < size:
            pos = bounds[-1] + chunk_bytes
            while True:                 # scan forward window by window for a safe cut
                f.seek(pos)
                window = f.read(1 << 16)
                m = _CUT.search(window)
                if m or len(window) < 2:
                    break
                pos += len(window) - 1
            if not m:
                break                   # no safe cut before the end: the rest is one chunk
            bounds.append(pos + m.start() + 1)
    return bounds + [size]


def _encode_range(tok, path, start, end, allow_special):
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (invalid byte at offset {start + e.start})") from None
    ids = tok.encode(text, "all" if allow_special else None)
    return np.array(ids, dtype="<u2"), len(data)


def _init_worker(tok_string):
    global _worker_tok
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a Ctrl-C is the parent's to handle: no traceback per worker
    _worker_tok = Tokenizer.from_string(tok_string)


def _encode_in_worker(job):
    return _encode_range(_worker_tok, *job)


def _cpu_count():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def iter_encoded_chunks(tok, path, workers=None, allow_special=True, chunk_bytes=1 << 20):
    """Iterator of (uint16 ids, n_bytes) for consecutive chunks of a UTF-8 file, in file order.
    Checks the file before returning, so a missing or empty file raises here."""
    if tok.vocab_size > 1 << 16:
        raise ValueError(f"vocab size {tok.vocab_size} does not fit uint16 token files")
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{path}: empty file")
    bounds = _chunk_bounds(path, size, chunk_bytes)
    jobs = [(path, a, b, allow_special) for a, b in zip(bounds, bounds[1:])]
    workers = min(workers or _cpu_count(), len(jobs))
    if workers == 1:
        return (_encode_range(tok, *job) for job in jobs)
    return _pool_imap(tok, jobs, workers)


def _pool_imap(tok, jobs, workers):
    with multiprocessing.Pool(workers, _init_worker, (tok.to_string(),)) as pool:
        yield from pool.imap(_encode_in_worker, jobs)


def encode_file_parallel(tok, path, out_path, workers=None, allow_special=True,
                         chunk_bytes=1 << 20, verbose=False):
    """Encode a UTF-8 file into a raw little-endian uint16 token file (written atomically).
    Returns (n_tokens, n_bytes, seconds)."""
    t0 = last_report = time.perf_counter()
    size, n_tokens, n_bytes = os.path.getsize(path), 0, 0
    chunks = iter_encoded_chunks(tok, path, workers, allow_special, chunk_bytes)
    tmp_path = f"{out_path}.tmp"
    try:
        with open(tmp_path, "wb") as out:
            for ids, chunk_len in chunks:
                out.write(ids.tobytes())
                n_tokens, n_bytes = n_tokens + len(ids), n_bytes + chunk_len
                if verbose and time.perf_counter() - last_report > 1.0:
                    last_report = time.perf_counter()
                    print(f"encode: {n_bytes / 1e6:,.1f}/{size / 1e6:,.1f} MB, "
                          f"{n_bytes / 1e6 / (last_report - t0):.1f} MB/s", file=sys.stderr)
        os.replace(tmp_path, out_path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise
    return n_tokens, n_bytes, time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------
# Command line

def _read_text(path):
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise ValueError(f"{path}: empty file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):                        # one line, not usage + message
        raise ValueError(f"{message} (see {self.prog} --help)")


def main(argv=None):
    ap = _Parser(prog="bpe.py", description="Byte-level BPE tokenizer for NanoEuler (file format: CONTRACT.md).")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("train", help="learn a tokenizer from a UTF-8 text file")
    p.add_argument("file", help="training text (UTF-8)")
    p.add_argument("--vocab", type=int, required=True, help="vocabulary size, specials included")
    p.add_argument("-o", "--out", required=True, help="tokenizer file to write")
    for name, help_text in (("encode", "encode a UTF-8 file into a uint16 token file"),
                            ("stats", "bytes per token and encoding speed on a UTF-8 file")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("tokfile", help="tokenizer file (from 'train')")
        p.add_argument("file", help="text to encode (UTF-8)")
        if name == "encode":
            p.add_argument("-o", "--out", required=True, help="token file to write (.bin)")
        p.add_argument("--allow-special", action=argparse.BooleanOptionalAction, default=True,
                       help="literal '<|endoftext|>' in the file is the special token (default on)")
        p.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    import pipeline as pl                            # which imports this module: loaded by the command line alone
    try:
        args = ap.parse_args(argv)
        if args.command != "stats":                  # an unusable -o is found before the slow work
            pl.writable(args.out, "-o", force=True)  # (a file there is replaced, as make data wants)
            for name in (args.file, getattr(args, "tokfile", None)):    # but never an input
                if name and os.path.exists(name) and os.path.exists(args.out) and os.path.samefile(name, args.out):
                    raise ValueError(f"-o {args.out} is the input {name}; give another file name")
        if args.command == "train":
            t0 = time.perf_counter()
            tok = Tokenizer.train(_read_text(args.file), args.vocab, verbose=True)
            tok.save(args.out)
            print(f"wrote {args.out}: vocab {tok.vocab_size} ({len(tok.merges)} merges) "
                  f"in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
            return
        tok = Tokenizer.load(args.tokfile)
        if args.command == "encode":
            n_tokens, n_bytes, secs = encode_file_parallel(
                tok, args.file, args.out, args.workers, args.allow_special, verbose=True)
            print(f"wrote {args.out}: {n_tokens:,} tokens, {n_bytes / n_tokens:.3f} bytes/token, "
                  f"{n_bytes / 1e6 / secs:.2f} MB/s", file=sys.stderr)
        else:
            t0, n_tokens, n_bytes = time.perf_counter(), 0, 0
            for ids, chunk_len in iter_encoded_chunks(tok, args.file, args.workers, args.allow_special):
                n_tokens, n_bytes = n_tokens + len(ids), n_bytes + chunk_len
            secs = time.perf_counter() - t0
            print(f"bytes {n_bytes:,}  tokens {n_tokens:,}  bytes/token {n_bytes / max(n_tokens, 1):.3f}  "
                  f"time {secs:.2f} s  {n_bytes / 1e6 / secs:.2f} MB/s")
    except OSError as e:
        sys.exit(f"error: {e.filename}: {e.strerror}" if e.filename else f"error: {e}")
    except (ValueError, pl.UserError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()

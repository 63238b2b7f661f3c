#!/usr/bin/env bash
# Download a slice of Anthropic's HH-RLHF preference set (helpful-base, ~44k pairs) and convert it to the
# JSONL that `nanoeuler.py dpo --data` reads, one {"prompt", "chosen", "rejected"} a line. An HH-RLHF
# record holds two whole dialogues, "\n\nHuman: ...\n\nAssistant: ..."; they share all but the last
# assistant turn, which is the answer. The prompt is the question alone for a one-turn dialogue, else the
# transcript before the answer. Pairs whose answers are empty or equal, or whose dialogues differ before
# the answer, are skipped and counted.
#
# Usage: data/get_prefs.sh [MAX_PAIRS]      (default: every pair of the source)
# Environment:
#   PREFS_SOURCE  URL or local file, HH-RLHF JSONL, gzipped or not (default: helpful-base/train.jsonl.gz)
#   OUT           output file (default: prefs.jsonl next to this script)
#   FORCE=1       rebuild even if OUT already exists
#   PYTHON        interpreter used for the conversion (default python3)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MAX=${1:-0}
SRC=${PREFS_SOURCE:-https://huggingface.co/datasets/Anthropic/hh-rlhf/resolve/main/helpful-base/train.jsonl.gz}
OUT=${OUT:-$here/prefs.jsonl}
PYTHON=${PYTHON:-python3}

. "$here/fetch.sh"          # die, begin_output, fetch

[[ $MAX =~ ^[0-9]+$ ]] || die "MAX_PAIRS must be a whole number (0: all), got '$MAX'"
begin_output raw             # $tmp, and $raw for the download

fetch PREFS_SOURCE "$raw"

"$PYTHON" - "$raw" "$tmp" "$SRC" "$MAX" <<'EOF'
import gzip, json, sys
raw, out, src, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
A = "\n\nAssistant:"

def fail(why):
    print(f"error: {src} is not HH-RLHF preference data: {why}", file=sys.stderr)
    sys.exit(1)

data = open(raw, "rb").read()
try:
    text = (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).decode("utf-8")
except (OSError, EOFError) as e:
    fail(f"a damaged gzip file ({e})")
except UnicodeDecodeError as e:
    fail(f"not UTF-8 ({e.reason} at byte {e.start})")
pairs, skipped = [], 0
for n, line in enumerate(text.splitlines(), 1):
    if not line.strip():
        continue
    try:
        d = json.loads(line)
    except ValueError as e:
        fail(f"line {n} is not JSON ({e})")
    if not isinstance(d, dict) or not all(isinstance(d.get(k), str) for k in ("chosen", "rejected")):
        fail(f"line {n} has no chosen and rejected dialogues")
    c, r = d["chosen"], d["rejected"]
    i, j = c.rfind(A), r.rfind(A)
    prompt, chosen, rejected = c[:i].strip(), c[i + len(A):].strip(), r[j + len(A):].strip()
    if i < 0 or j < 0 or c[:i] != r[:j] or not (prompt and chosen and rejected) or chosen == rejected:
        skipped += 1
        continue
    if prompt.startswith("Human:") and A.strip() not in prompt:
        prompt = prompt[len("Human:"):].strip()          # one turn: the question alone
    pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    if len(pairs) == limit:
        break
if not pairs:
    fail(f"no usable pair ({skipped} skipped)")
with open(out, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs)
print(f"{len(pairs)} pairs ({skipped} skipped: an empty or equal answer, or dialogues that differ before it)")
EOF

mv "$tmp" "$OUT"
echo "wrote $OUT ($(wc -c <"$OUT") bytes)"

#!/usr/bin/env bash
# Download the HellaSwag validation set (10,042 items, JSONL) to data/hellaswag_val.jsonl and check that
# every line is an object with a string ctx, a list of 4 string endings and a label 0..3. The file is
# kept byte for byte. Scored by `nanoeuler.py eval --task hellaswag`.
#
# Environment:
#   HELLASWAG_SOURCE  URL or local file (default: rowanz/hellaswag's data/hellaswag_val.jsonl;
#                     offline fixture: data/fixtures/hellaswag_val.jsonl)
#   OUT               output file (default: hellaswag_val.jsonl next to this script)
#   FORCE=1           download again even if OUT already exists
#   PYTHON            interpreter used for the check (default python3)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC=${HELLASWAG_SOURCE:-https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl}
OUT=${OUT:-$here/hellaswag_val.jsonl}
PYTHON=${PYTHON:-python3}

. "$here/fetch.sh"          # die, begin_output, fetch

begin_output

fetch HELLASWAG_SOURCE "$tmp"

# validate; prints the number of items
n=$("$PYTHON" - "$tmp" "$SRC" <<'EOF'
import json, sys
path, src = sys.argv[1], sys.argv[2]
def fail(why):
    print(f"error: {src} is not a HellaSwag data set: {why}", file=sys.stderr)
    sys.exit(1)
n = 0
try:
    with open(path, encoding="utf-8") as f:
        for k, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ex = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"line {k} is not JSON ({e.msg})")
            ok = (isinstance(ex, dict) and isinstance(ex.get("ctx"), str) and isinstance(ex.get("endings"), list)
                  and len(ex["endings"]) == 4 and all(isinstance(e, str) for e in ex["endings"])
                  and ex.get("label") in (0, 1, 2, 3, "0", "1", "2", "3"))
            if not ok:
                fail(f"line {k} lacks ctx, 4 endings or a label 0..3")
            n += 1
except UnicodeDecodeError as e:
    fail(f"not UTF-8 ({e.reason} at byte {e.start})")
if not n:
    fail("no items")
print(n)
EOF
)

mv "$tmp" "$OUT"
echo "wrote $OUT: $n items, $(wc -c <"$OUT") bytes"

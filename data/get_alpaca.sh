#!/usr/bin/env bash
# Download the Stanford Alpaca instruction set (52k examples) to data/alpaca.json and check that
# it is a non-empty JSON list of objects whose instruction, input and output are strings (empty
# strings are allowed: 28 of the original outputs are empty). The file is kept byte for byte.
#
# Environment:
#   ALPACA_SOURCE  URL or local file (default: the tatsu-lab/stanford_alpaca alpaca_data.json)
#   OUT            output file (default: alpaca.json next to this script)
#   FORCE=1        download again even if OUT already exists
#   PYTHON         interpreter used for the check (default python3)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC=${ALPACA_SOURCE:-https://raw.githubusercontent.com/tatsu-lab/stanford_alpaca/main/alpaca_data.json}
OUT=${OUT:-$here/alpaca.json}
PYTHON=${PYTHON:-python3}

. "$here/fetch.sh"          # die, begin_output, fetch

begin_output

fetch ALPACA_SOURCE "$tmp"

# validate; prints the number of examples
n=$("$PYTHON" - "$tmp" "$SRC" <<'EOF'
import json, sys
path, src = sys.argv[1], sys.argv[2]
def fail(why):
    print(f"error: {src} is not an Alpaca data set: {why}", file=sys.stderr)
    sys.exit(1)
try:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
except UnicodeDecodeError as e:
    fail(f"not UTF-8 ({e.reason} at byte {e.start})")
except json.JSONDecodeError as e:
    fail(f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno})")
if not isinstance(data, list) or not data:
    fail("expected a non-empty JSON list")
for i, ex in enumerate(data):
    if not isinstance(ex, dict):
        fail(f"entry {i} is not an object")
    for key in ("instruction", "input", "output"):
        if not isinstance(ex.get(key), str):
            fail(f"entry {i} has no string '{key}'")
print(len(data))
EOF
)

mv "$tmp" "$OUT"
echo "wrote $OUT: $n examples, $(wc -c <"$OUT") bytes"

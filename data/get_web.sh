#!/usr/bin/env bash
# Take the first MAX_MB megabytes (10^6 bytes, default 100) of FineWeb-Edu text: stream the `text`
# column of a parquet shard with DuckDB (over HTTPS it reads only the row groups it needs) and
# write the documents in file order to data/web.txt, each followed by "\n<|endoftext|>\n".
# Rows are taken until the size reaches MAX_MB, so the file ends at most one document past it.
#
# Usage: data/get_web.sh [MAX_MB]
# Environment:
#   WEB_SOURCE  parquet URL (https://, hf://), or local parquet path or glob (default: shard 0 of
#               the FineWeb-Edu 10BT sample)
#   OUT         output file (default: web.txt next to this script)
#   FORCE=1     rebuild even if OUT already exists
#   PYTHON      interpreter with the duckdb package (default python3)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MAX_MB=${1:-100}
SRC=${WEB_SOURCE:-https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu/resolve/main/sample/10BT/000_00000.parquet}
OUT=${OUT:-$here/web.txt}
PYTHON=${PYTHON:-python3}

. "$here/fetch.sh"          # die, begin_output

if ! [[ $MAX_MB =~ ^[0-9]*\.?[0-9]+$ ]] || ! awk -v m="$MAX_MB" 'BEGIN { exit !(m > 0) }'; then
  die "MAX_MB must be a positive number of megabytes, got '$MAX_MB'"
fi
begin_output
"$PYTHON" -c 'import duckdb' 2>/dev/null || die "the duckdb Python package is missing: pip install duckdb"

# fail fast, with retries and timeouts, when a URL cannot be reached
if [[ $SRC =~ ^https?:// ]]; then
  rc=0
  curl -fsL --retry 3 --retry-delay 2 --connect-timeout 20 --max-time 120 -r 0-0 -o /dev/null "$SRC" || rc=$?
  case $rc in
    0) ;;
    22) die "cannot download $SRC (HTTP error: wrong URL or mirror?)" ;;
    *) die "cannot download $SRC (curl exit $rc; offline?)" ;;
  esac
elif [[ ! $SRC =~ ^[a-zA-Z][a-zA-Z0-9+.-]*:// ]]; then
  compgen -G "$SRC" >/dev/null || die "WEB_SOURCE=$SRC: no such file"
fi

"$PYTHON" - "$SRC" "$tmp" "$MAX_MB" <<'EOF'
import sys
import duckdb

src, out, limit = sys.argv[1], sys.argv[2], int(float(sys.argv[3]) * 1e6)
SEP = b"\n<|endoftext|>\n"

def fail(msg, e=None):
    if e is not None:  # the first line of a DuckDB message is the useful one
        msg += ": " + next((l for l in str(e).splitlines() if l.strip()), type(e).__name__)
    print("error: " + msg, file=sys.stderr)
    sys.exit(1)

con = duckdb.connect()
con.execute("SET enable_progress_bar = false")  # our own progress lines only
if "://" in src:
    try:
        con.execute("INSTALL httpfs")
        con.execute("LOAD httpfs")
    except duckdb.Error as e:
        fail("DuckDB cannot get its httpfs extension (download the parquet file and set "
             "WEB_SOURCE to its path)", e)
try:
    res = con.execute("SELECT text FROM read_parquet(?)", [src])  # streamed, in file order
except duckdb.Error as e:
    fail(f"cannot read {src}", e)

size = docs = 0
step = max(10**6, limit // 10)  # progress every 10% (at least every MB)
mark = step
with open(out, "wb") as f:
    while size < limit:
        try:
            rows = res.fetchmany(1024)
        except duckdb.Error as e:
            fail(f"reading {src} failed after {docs} documents", e)
        if not rows:
            break
        for (text,) in rows:
            text = (text or "").replace("<|endoftext|>", "").strip()
            if not text:
                continue
            b = text.encode("utf-8") + SEP
            f.write(b)
            size += len(b)
            docs += 1
            if size >= mark:
                print(f"web: {size / 1e6:.1f} MB, {docs} documents", flush=True)
                mark = (size // step + 1) * step
            if size >= limit:
                break
print(f"web: {docs} documents, {size} bytes from {src}")
EOF

[[ -s $tmp ]] || die "no text read from $SRC, $OUT not written"
mv "$tmp" "$OUT"
echo "wrote $OUT ($(wc -c <"$OUT") bytes)"

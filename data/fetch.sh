# data/fetch.sh -- sourced by every get_*.sh here: the steps they share.

die() { echo "error: $*" >&2; exit 1; }

# begin_output [NAME...]: check $OUT, then stop here when it is there already (FORCE=1 makes it
# again); else make its folder and set $tmp, the file to write, and $NAME for each NAME, a scratch
# file beside it. On exit the scratch files go (unless the script moved one to $OUT), and on failure
# so do the folders made here, so that a failed run leaves nothing behind.
begin_output() {
  local d name
  # OUT must name a file we can write: a folder would get the scratch file put inside it and a
  # bogus "wrote" line, a fifo or device (as root, /dev/null) would be replaced by mv, and a file as
  # a parent or a folder we cannot write in would fail later with a bare mkdir/cp/Python message.
  if [[ -d $OUT || $OUT == */ ]]; then die "OUT=$OUT names a folder; set OUT to a file path"; fi
  if [[ -e $OUT && ! -f $OUT ]]; then die "OUT=$OUT is not a regular file; set OUT to a file path"; fi
  made=()                                   # the folders mkdir -p will make, deepest first
  d=$(dirname "$OUT")
  while [[ ! -e $d && ! -L $d ]]; do made+=("$d"); d=$(dirname "$d"); done
  [[ -d $d ]] || die "OUT=$OUT: $d is not a folder; choose another OUT"
  if [[ -s $OUT && ${FORCE:-0} != 1 ]]; then
    echo "$OUT already exists ($(wc -c <"$OUT") bytes); FORCE=1 to download again"
    exit 0
  fi
  # checked only now: an OUT already there needs no writing, so a read-only data folder is fine
  [[ -w $d && -x $d ]] || die "OUT=$OUT: cannot write in $d (read-only?); choose another OUT"
  mkdir -p "$(dirname "$OUT")"
  tmp="$OUT.$$.tmp" scratch=("$OUT.$$.tmp")
  for name; do printf -v "$name" %s "$OUT.$$.$name.tmp"; scratch+=("${!name}"); done
  trap end_output EXIT
}

# end_output: the EXIT trap that begin_output sets; the script's exit status is kept.
end_output() {
  local rc=$?
  rm -f -- "${scratch[@]}"
  if ((rc && ${#made[@]})); then rmdir -- "${made[@]}" 2>/dev/null || true; fi   # only while still empty
}

# fetch VAR DEST: download $SRC (a URL) or copy it (a local file) to DEST; VAR names the environment
# variable that sets SRC, for the message when it names nothing.
fetch() {
  local var=$1 dest=$2 rc=0
  if [[ $SRC =~ ^[a-zA-Z][a-zA-Z0-9+.-]*:// ]]; then
    echo "downloading $SRC"
    curl -fsL --retry 3 --retry-delay 2 --connect-timeout 20 --max-time 600 -o "$dest" "$SRC" || rc=$?
    case $rc in
      0) ;;
      22) die "cannot download $SRC (HTTP error: wrong URL or mirror?)" ;;
      *) die "cannot download $SRC (curl exit $rc; offline?)" ;;
    esac
  elif [[ -f $SRC ]]; then
    cp "$SRC" "$dest"
  else
    die "$var=$SRC: no such file"
  fi
  [[ -s $dest ]] || die "$SRC is empty"
}

# data/fetch.sh -- sourced by get_alpaca.sh, get_prefs.sh and get_hellaswag.sh: the steps they share.

die() { echo "error: $*" >&2; exit 1; }

# begin_output: stop here when $OUT is there already (FORCE=1 makes it again); else $tmp is the file to
# write, removed on exit unless the script moves it to $OUT.
begin_output() {
  if [[ -s $OUT && ${FORCE:-0} != 1 ]]; then
    echo "$OUT already exists ($(wc -c <"$OUT") bytes); FORCE=1 to download again"
    exit 0
  fi
  mkdir -p "$(dirname "$OUT")"
  tmp="$OUT.$$.tmp"
  trap 'rm -f "$tmp"' EXIT
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

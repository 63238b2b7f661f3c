#!/usr/bin/env bash
# Download a fixed list of public-domain classics from Project Gutenberg, cut each book's
# licence header/footer at the "*** START OF" / "*** END OF" marker lines, and write the books
# one after another to data/gutenberg.txt, each followed by "\n<|endoftext|>\n" (so files made
# this way can simply be concatenated with cat).
#
# Environment:
#   GUTENBERG_SOURCE  base URL laid out as BASE/ID/pgID.txt (default: the Gutenberg cache),
#                     or a local directory holding pgID.txt, ID.txt or ID/pgID.txt files
#   GUTENBERG_IDS     space-separated book ids to use instead of the built-in list
#   OUT               output file (default: gutenberg.txt next to this script)
#   FORCE=1           rebuild even if OUT already exists
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC=${GUTENBERG_SOURCE:-https://www.gutenberg.org/cache/epub}
SRC=${SRC%/}
OUT=${OUT:-$here/gutenberg.txt}

. "$here/fetch.sh"          # die, begin_output
mb() { awk -v b="$1" 'BEGIN { printf "%.2f MB", b / 1e6 }'; }

# id and title (all public domain in the US)
BOOKS="
1342 Pride and Prejudice
11 Alice's Adventures in Wonderland
84 Frankenstein
98 A Tale of Two Cities
1661 The Adventures of Sherlock Holmes
2701 Moby Dick
345 Dracula
174 The Picture of Dorian Gray
76 Adventures of Huckleberry Finn
74 The Adventures of Tom Sawyer
1260 Jane Eyre
768 Wuthering Heights
2600 War and Peace
1400 Great Expectations
36 The War of the Worlds
35 The Time Machine
120 Treasure Island
161 Sense and Sensibility
158 Emma
1232 The Prince
64317 The Great Gatsby
16328 Beowulf
2554 Crime and Punishment
4300 Ulysses
1184 The Count of Monte Cristo
43 The Strange Case of Dr. Jekyll and Mr. Hyde
5200 Metamorphosis
219 Heart of Darkness
844 The Importance of Being Earnest
25344 The Scarlet Letter
205 Walden
1497 The Republic
2814 Dubliners
215 The Call of the Wild
103 Around the World in Eighty Days
164 Twenty Thousand Leagues under the Sea
829 Gulliver's Travels
521 Robinson Crusoe
46 A Christmas Carol
730 Oliver Twist
105 Persuasion
1727 The Odyssey
6130 The Iliad
996 Don Quixote
55 The Wonderful Wizard of Oz
1399 Anna Karenina
28054 The Brothers Karamazov
145 Middlemarch
"
ids=${GUTENBERG_IDS:-$(awk 'NF { print $1 }' <<<"$BOOKS")}
title() { awk -v id="$1" '$1 == id { $1 = ""; printf "%s", $0 }' <<<"$BOOKS"; }

begin_output raw txt        # $tmp, and $raw and $txt for each book
if [[ -d $SRC ]]; then local_src=1
elif [[ $SRC =~ ^[a-zA-Z][a-zA-Z0-9+.-]*:// ]]; then local_src=0
else die "GUTENBERG_SOURCE=$SRC is neither a directory nor a URL"
fi
for id in $ids; do
  [[ $id =~ ^[0-9]+$ ]] || die "bad book id '$id' (GUTENBERG_IDS takes numbers)"
done

: >"$tmp"

# book ID -> $raw: a local copy, or a download with retries and timeouts
fetch_book() {
  local id=$1 f url rc=0
  if ((local_src)); then
    for f in "$SRC/pg$id.txt" "$SRC/$id.txt" "$SRC/$id/pg$id.txt"; do
      if [[ -f $f ]]; then cp "$f" "$raw"; return; fi
    done
    die "book $id not found in $SRC (looked for pg$id.txt, $id.txt, $id/pg$id.txt)"
  fi
  url="$SRC/$id/pg$id.txt"
  curl -fsL --retry 3 --retry-delay 2 --connect-timeout 20 --max-time 600 -o "$raw" "$url" || rc=$?
  case $rc in
    0) ;;
    22) die "cannot download $url (HTTP error: wrong id or mirror?)" ;;
    *) die "cannot download $url (curl exit $rc; offline?)" ;;
  esac
}

# the book's text: BOM and CRLF removed, only the lines strictly between the START and END
# markers, without a leading "Produced by ..." paragraph, the "End of (the) Project Gutenberg"
# line, blank lines at both ends, trailing spaces, any literal <|endoftext|>, or a final newline.
# Empty when there is no START marker.
body() {
  sed '1s/^\xEF\xBB\xBF//; s/\r$//' "$1" | awk '
    { u = toupper($0) }
    !on && u ~ /^\*\*\* ?START OF/ { on = 1; next }
    !on { next }
    u ~ /^\*\*\* ?END OF/ { exit }
    u ~ /^END OF (THE )?PROJECT GUTENBERG/ { next }
    !started && u ~ /^(PRODUCED|TRANSCRIBED|E-TEXT PREPARED) BY/ { credit = 1 }
    credit { if ($0 ~ /^[ \t]*$/) credit = 0; next }
    {
      gsub(/<\|endoftext\|>/, ""); sub(/[ \t]+$/, "")
      if ($0 ~ /^[ \t]*$/) { if (started) blanks++; next }
      for (; blanks > 0; blanks--) printf "\n"
      printf "%s%s", (started ? "\n" : ""), $0; started = 1
    }'
}

n=$(wc -w <<<"$ids") i=0 books=0
for id in $ids; do
  i=$((i + 1))
  fetch_book "$id"
  body "$raw" >"$txt"
  if [[ ! -s $txt ]]; then
    echo "warning: book $id has no text between START/END markers, skipped" >&2
    continue
  fi
  { cat "$txt"; printf '\n<|endoftext|>\n'; } >>"$tmp"
  books=$((books + 1))
  echo "[$i/$n] $id$(title "$id"): $(mb "$(wc -c <"$txt")") (total $(mb "$(wc -c <"$tmp")"))"
done

[[ -s $tmp ]] || die "no book text extracted, $OUT not written"
mv "$tmp" "$OUT"
echo "wrote $OUT: $books books, $(wc -c <"$OUT") bytes"

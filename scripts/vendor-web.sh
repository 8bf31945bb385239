#!/usr/bin/env bash
# Refresh the web UI's vendored JavaScript (src/tokenmill/server/static/vendor/) from npm, at the
# pinned versions below. Run by hand when upgrading them; installing tokenmill never runs it (the
# files are committed and shipped in the package, so the UI needs no Node and no network).
#   uPlot      charts (time series)                      MIT
#   marked     markdown -> HTML (model replies)          MIT
#   DOMPurify  HTML sanitizer (marked's output)          MPL-2.0 OR Apache-2.0
set -euo pipefail
cd "$(dirname "$0")/.."
UPLOT=1.6.32 MARKED=18.2.1 DOMPURIFY=3.5.0
out=src/tokenmill/server/static/vendor
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "uplot@$UPLOT" "marked@$MARKED" "dompurify@$DOMPURIFY" >/dev/null)
for pkg in "uplot-$UPLOT" "marked-$MARKED" "dompurify-$DOMPURIFY"; do
    mkdir -p "$work/$pkg" && tar xzf "$work/$pkg.tgz" -C "$work/$pkg"
done
rm -rf "$out" && mkdir -p "$out"
cp "$work/uplot-$UPLOT/package/dist/uPlot.iife.min.js" "$work/uplot-$UPLOT/package/dist/uPlot.min.css" "$out/"
cp "$work/uplot-$UPLOT/package/LICENSE" "$out/uPlot.LICENSE"
cp "$work/marked-$MARKED/package/lib/marked.umd.js" "$out/"
cp "$work/marked-$MARKED/package/LICENSE" "$out/marked.LICENSE"
cp "$work/dompurify-$DOMPURIFY/package/dist/purify.min.js" "$out/"
cp "$work/dompurify-$DOMPURIFY/package/LICENSE" "$out/purify.LICENSE"
printf 'uplot %s\nmarked %s\ndompurify %s\n' "$UPLOT" "$MARKED" "$DOMPURIFY" > "$out/VERSIONS"
echo "vendored into $out:" && ls "$out"

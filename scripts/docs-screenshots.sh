#!/usr/bin/env bash
# Build the documentation site and take a full-width screenshot of every page with a
# headless Chromium, to look at what a reader sees (code blocks cut off, broken tables,
# images that do not load). Needs chromium (apt-get install chromium); not part of CI.
#   scripts/docs-screenshots.sh [OUT_DIR]     (default: site-shots/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-site-shots}"
browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
if [ -z "$browser" ]; then
    echo "docs-screenshots: no chromium found (apt-get install chromium)" >&2
    exit 1
fi
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site"
mkdir -p "$out"
for page in "$site"/*/index.html "$site"/index.html; do
    name="$(basename "$(dirname "$page")")"
    [ "$page" = "$site/index.html" ] && name="index"
    "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,4000 \
        --screenshot="$out/$name.png" "file://$page" >/dev/null 2>&1
    echo "$out/$name.png"
done

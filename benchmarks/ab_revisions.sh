#!/usr/bin/env bash
# Before/after A/B of two git revisions on the same machine, interleaved: each benchmark runs with
# OLD's source, then NEW's, ROUNDS times, so a change in machine load hits both. Each run prints
# its own lmstack/peer ratios (the peer runs in the same process); compare those across revisions.
#
#   bash benchmarks/ab_revisions.sh OLD_REV [NEW_REV=HEAD] [ROUNDS=2] > ab.txt
#
# The revisions are checked out as detached worktrees under a temporary folder (removed at the
# end); both run with this checkout's .venv and PYTHONPATH pointing at their own src/.
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${1:?usage: ab_revisions.sh OLD_REV [NEW_REV] [ROUNDS]}
NEW=${2:-HEAD}
ROUNDS=${3:-2}
PY=${PY:-$PWD/.venv/bin/python}
TMP=$(mktemp -d)
trap 'git worktree remove --force "$TMP/old" >/dev/null 2>&1; git worktree remove --force "$TMP/new" >/dev/null 2>&1; rm -rf "$TMP"' EXIT
git worktree add --detach "$TMP/old" "$OLD" >/dev/null
git worktree add --detach "$TMP/new" "$NEW" >/dev/null

BENCHES=(
  "inference_decode.py --threads 1 --new-tokens 32 --repeats 3 --lmstack fp32,int4 --hf fp32 --llama-threads="
  "inference_serving.py --threads 1 --requests 24 --batch 8 --skip-static-lmstack"
  "inference_speculative.py --threads 1 --new-tokens 64"
  "train_step.py --precision bf16"
)
echo "# $(date -u +%FT%TZ)  old=$(git rev-parse --short "$OLD")  new=$(git rev-parse --short "$NEW")  rounds=$ROUNDS  $(nproc) CPUs"
for bench in "${BENCHES[@]}"; do
  read -r script args <<<"$bench"
  for round in $(seq "$ROUNDS"); do
    for side in old new; do
      echo "## $side round $round: $script $args"
      (cd "$TMP/$side" && PYTHONPATH="$TMP/$side/src" "$PY" "benchmarks/$script" $args 2>&1) || echo "(exit $?)"
    done
  done
done

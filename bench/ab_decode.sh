#!/usr/bin/env bash
# CPU wall time of the decode step at two revisions, measured back to back in one run:
#   bench/ab_decode.sh OLD_REV [NEW_REV=working tree] [bench_decode.py args...]
# Each revision is checked out into a temporary worktree and bench/bench_decode.py runs there
# with this checkout's venv, alternating OLD, NEW, OLD, NEW; prints each run and the NEW/OLD ratio
# of every case (mean of the two runs each).
set -euo pipefail
cd "$(dirname "$0")/.."
old="$1"; shift
new="${1:-}"; [[ $# -gt 0 ]] && shift
args=("$@"); [[ ${#args[@]} -gt 0 ]] || args=(--model tiny --prompt-len 8192 --steps 32)
PY="$(pwd)/.venv/bin/python"
tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/old" >/dev/null 2>&1 || true; [[ -n "$new" ]] && git worktree remove --force "$tmp/new" >/dev/null 2>&1; rm -rf "$tmp"' EXIT
git worktree add -q --detach "$tmp/old" "$old"
if [[ -n "$new" ]]; then git worktree add -q --detach "$tmp/new" "$new"; newdir="$tmp/new"; else newdir="$(pwd)"; fi
for i in 1 2; do
  for side in old new; do
    dir=$tmp/old; [[ $side == new ]] && dir=$newdir
    (cd "$dir" && JAX_PLATFORMS=cpu PYTHONPATH="$dir" "$PY" bench/bench_decode.py "${args[@]}" \
      --json "$tmp/$side$i.json" | sed "s/^/[$side $i] /")
  done
done
"$PY" - "$tmp" <<'PYEOF'
import json, sys
d = sys.argv[1]
runs = {s: [json.load(open(f"{d}/{s}{i}.json"))["results"] for i in (1, 2)] for s in ("old", "new")}
print(f"{'case':<30} {'old ms/step':>12} {'new ms/step':>12} {'new/old':>8}")
for case in runs["old"][0]:
    o = sum(r[case]["step_ms"] for r in runs["old"]) / 2
    n = sum(r[case]["step_ms"] for r in runs["new"]) / 2
    print(f"{case:<30} {o:12.3f} {n:12.3f} {n / o:8.2f}")
PYEOF

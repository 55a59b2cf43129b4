#!/usr/bin/env bash
# CPU wall time of the decode step at two revisions, measured back to back in one run:
#   bench/ab_decode.sh OLD_REV [NEW_REV=working tree] [bench_step.py args...]
# Each revision is checked out into a temporary worktree, and this checkout's bench/bench_step.py
# runs against it with this checkout's venv, alternating OLD, NEW three times; prints each run
# and the NEW/OLD ratio of every case (the fastest of the three runs each: CPU timings here are
# noisy).
set -euo pipefail
cd "$(dirname "$0")/.."
old="$1"; shift
new="${1:-}"; [[ $# -gt 0 ]] && shift
args=("$@")
bench="$(pwd)/bench/bench_step.py"
PY="$(pwd)/.venv/bin/python"
tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/old" >/dev/null 2>&1 || true; [[ -n "$new" ]] && git worktree remove --force "$tmp/new" >/dev/null 2>&1; rm -rf "$tmp"' EXIT
git worktree add -q --detach "$tmp/old" "$old"
if [[ -n "$new" ]]; then git worktree add -q --detach "$tmp/new" "$new"; newdir="$tmp/new"; else newdir="$(pwd)"; fi
for i in 1 2 3; do
  for side in old new; do
    dir=$tmp/old; [[ $side == new ]] && dir=$newdir
    (cd "$dir" && JAX_PLATFORMS=cpu PYTHONPATH="$dir" "$PY" "$bench" "${args[@]}" \
      --json "$tmp/$side$i.json" | sed "s/^/[$side $i] /")
  done
done
"$PY" - "$tmp" <<'PYEOF'
import json, sys
d = sys.argv[1]
runs = {s: [json.load(open(f"{d}/{s}{i}.json"))["results"] for i in (1, 2, 3)] for s in ("old", "new")}
print(f"{'case':<30} {'old ms/step':>12} {'new ms/step':>12} {'new/old':>8}")
for case in runs["old"][0]:
    o = min(r[case]["step_ms"] for r in runs["old"])
    n = min(r[case]["step_ms"] for r in runs["new"])
    print(f"{case:<30} {o:12.3f} {n:12.3f} {n / o:8.2f}")
PYEOF

#!/usr/bin/env bash
# The one prepared GPU script: gpu_check, the generation backends, then the whole loop
# end to end on one GPU.
#
#   bash bench/gpu_run.sh OUT_DIR [BUDGET_S] [PARTS]   # BUDGET_S: seconds in all, default 300
#                                                      # PARTS: default check,generation,e2e
#
# 1. check: python3 bench/gpu_check.py (every mode that fits one GPU; half the budget),
#    its output in OUT_DIR;
# 2. generation: python3 bench/gpu_generation.py (the paged backend against today's, item
#    by item; at most 300 s and half of what is left), gpu_generation.json in OUT_DIR;
# 3. e2e: the GPU bundle installed offline (bench/gpu_install.sh), then bench/gpu_e2e.py
#    on a Qwen2.5-0.5B-shaped model (and 1.5B when time is left): server, engine, 64
#    workers;
# 4. every figure printed and written as files under OUT_DIR.
# Exit status: non-zero when any part failed; each part's output says why.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/gpu_run.sh OUT_DIR [BUDGET_S]}
budget=${2:-300}
parts=${3:-check,generation,e2e}
mkdir -p "$out"
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
status=0

wants() { case ",$parts," in *",$1,"*) return 0;; *) return 1;; esac; }

if wants check; then
  echo "== gpu_check"
  timeout $(( $(left) / 2 )) python3 bench/gpu_check.py 2>&1 | tee "$out/gpu_check.txt"
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "gpu_check: exit $rc"; status=1; }
fi

if wants generation; then
  share=$(( $(left) / 2 )); [ "$share" -gt 300 ] && share=300
  echo "== gpu_generation ($share s)"
  timeout $(( share + 30 )) python3 bench/gpu_generation.py --out "$out" --budget-s "$share" \
    2>"$out/gpu_generation.stderr"
  rc=$?; [ "$rc" = 0 ] || { echo "gpu_generation: exit $rc (tail of its log:)"; tail -20 "$out/gpu_generation.stderr"; status=1; }
fi

wants e2e || { echo "== done in $(( $(date +%s) - start )) s, status $status"; exit $status; }

echo "== install the bundle ($(left) s left)"
if ! bash bench/gpu_install.sh bench/gpu_bundle /tmp/ajet-gpu-venv 2>&1 | tee "$out/install.txt"; then
  echo "install failed: no end-to-end run"; exit 1
fi
py=/tmp/ajet-gpu-venv/bin/python

for shape in qwen2.5-0.5b qwen2.5-1.5b; do
  remaining=$(left)
  if [ "$shape" != qwen2.5-0.5b ] && [ "$remaining" -lt 120 ]; then
    echo "== $shape skipped: $remaining s left"; continue
  fi
  echo "== gpu_e2e $shape ($remaining s left)"
  timeout $(( remaining - 10 )) "$py" bench/gpu_e2e.py --shape "$shape" --out "$out" \
    --deadline-s $(( remaining * 2 / 3 )) 2>"$out/gpu_e2e-$shape.stderr"
  rc=$?; [ "$rc" = 0 ] || { echo "gpu_e2e $shape: exit $rc (tail of its log:)"; tail -20 "$out/gpu_e2e-$shape.stderr"; status=1; }
done
rm -rf "$out"/work-*/model   # the random weights are not worth carrying back
echo "== done in $(( $(date +%s) - start )) s, status $status"
exit $status

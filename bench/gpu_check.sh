#!/usr/bin/env bash
# The GPU checks, in one script of at most ~10 minutes on one GPU with SmolLM2 (CPU machines cannot
# run them: CI never has a GPU):
#   1. mtp-train trainer=gpu (bf16-mixed) for STEPS steps
#   2. mtp-train trainer=deepspeed_stage_2 (Lightning's DeepSpeed strategy, ZeRO-2, bf16) for STEPS steps
#   3. mtp-export-heads on the DeepSpeed run (gathers the ZeRO shards into heads.safetensors)
#   4. mtp-eval of the exported heads on the GPU (verify and tree against HF generate)
# Prints one line per check (PASS/FAIL, seconds, the figure that matters); logs go to OUT/<check>.log.
#
#   bash bench/gpu_check.sh                   # needs the prepared demo data (make demo's mtp-prep) or makes it
#   STEPS=100 OUT=runs/gpu_check bash bench/gpu_check.sh
#   bash bench/gpu_check.sh --compose-only    # CPU: compose every command's config (hydra --cfg job), run nothing
set -uo pipefail

BIN=${BIN:-$( [ -x .venv/bin/mtp-train ] && echo .venv/bin || dirname "$(command -v mtp-train)" )}
OUT=${OUT:-runs/gpu_check}
STEPS=${STEPS:-300}
EXP=${EXP:-experiment=smollm2_demo}
# the demo's recipe times float32 against bf16 on a CPU (trainer.precision=auto); on the GPU both
# trainers run the bf16-mixed their group files set
GPU_PRECISION=trainer.precision=bf16-mixed
mkdir -p "$OUT"

commands=(
  "prep|$BIN/mtp-prep $EXP stage=all"
  "cache|$BIN/mtp-prep $EXP stage=cache"
  "train_gpu|$BIN/mtp-train $EXP trainer=gpu $GPU_PRECISION trainer.max_steps=$STEPS trainer.val_check_interval=$STEPS hydra.run.dir=$OUT/gpu"
  "train_deepspeed2|$BIN/mtp-train $EXP trainer=deepspeed_stage_2 $GPU_PRECISION trainer.devices=1 trainer.max_steps=$STEPS trainer.val_check_interval=$STEPS hydra.run.dir=$OUT/ds2"
  "export|$BIN/mtp-export-heads $OUT/ds2"
  "eval|$BIN/mtp-eval $EXP eval.train_run=$OUT/ds2 eval.modes=[verify,tree] eval.n_prompts=20 eval.rounds=1 hydra.run.dir=$OUT/eval"
)

if [ "${1:-}" = "--compose-only" ]; then
  status=0
  for entry in "${commands[@]}"; do
    name=${entry%%|*}; cmd=${entry#*|}
    case $name in export) continue ;; esac  # not a Hydra command
    if $cmd --cfg job > "$OUT/$name.compose.yaml" 2> "$OUT/$name.compose.log"; then
      echo "COMPOSED $name"
    else
      echo "FAIL $name: config does not compose (see $OUT/$name.compose.log)"; status=1
    fi
  done
  exit $status
fi

python_bin="$BIN/python"; [ -x "$python_bin" ] || python_bin=python3
$python_bin - <<'EOF' || { echo "FAIL no CUDA GPU visible to torch"; exit 1; }
import torch
assert torch.cuda.is_available()
print(f"GPU {torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16 {torch.cuda.is_bf16_supported()}")
EOF

failed=0
for entry in "${commands[@]}"; do
  name=${entry%%|*}; cmd=${entry#*|}
  start=$(date +%s)
  if $cmd > "$OUT/$name.log" 2>&1; then
    secs=$(( $(date +%s) - start ))
    figure=$(grep -Eo "(val/sim_tau[^,]*|sim_tau [0-9.]+|speedup[^|]*)" "$OUT/$name.log" | tail -1)
    echo "PASS $name (${secs} s) ${figure}"
  else
    rc=$?; failed=1
    echo "FAIL $name (exit $rc after $(( $(date +%s) - start )) s; $OUT/$name.log):"
    tail -n 5 "$OUT/$name.log" | sed 's/^/    /'
  fi
done
[ -f "$OUT/eval/eval_report.json" ] && $python_bin - "$OUT/eval/eval_report.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
for name, m in r["modes"].items():
    print(f"  {name:12s} {m['speedup_vs_hf']:.2f}x HF generate  tau {m['tau']:.2f}  identical {m['identical_to_greedy']}")
EOF
exit $failed

#!/bin/bash
# 2.79 vs 2.97 (docs/fidelity.md round two, repeatability): the regime check's command under the study's settings
cd /work/main && . .venv/bin/activate
while pgrep -f regime.sh >/dev/null; do sleep 20; done
set -x
C="--dataset fonts:train=1 --method ce --model lenet --init scratch --epochs 20 --milestones 10 15 --batch-size 64 --lr 0.05 --momentum 0.9 --weight-decay 0.0001 --seed 0 --eval-splits 10"
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 dpsm-ray train $C --out /work/runs/r2/fonts-t1-threads1
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 dpsm-ray train $C --diagnostic-examples 0 --out /work/runs/r2/fonts-t1-threads1-diag0

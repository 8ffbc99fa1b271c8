#!/bin/bash
# the criterion's second pilot step on fonts: ConfTr T 0.01, lambda 0.5, seed 0 at lr 0.001
cd /work/main && . .venv/bin/activate
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
set -x
F="--method conftr --sigmoid-temperature 0.01 --conformal-weight 0.5 --momentum 0.9 --weight-decay 0.0001 --batch-size 128 --lr 0.001 --seed 0 --eval-splits 10 --val-splits 5 --diagnostic-examples 0 --data-workers 0"
dpsm-ray train --dataset fonts:train=1 --model lenet --init weights:/work/runs/r2/fonts-t1-threads1-diag0/model.pt --epochs 10 --milestones 6 $F \
    --out /work/runs/r2/pilot-fonts-lr0.001
echo "pilot fonts lr 0.001 rc=$?"

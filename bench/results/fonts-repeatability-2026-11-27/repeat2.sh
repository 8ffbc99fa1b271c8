#!/bin/bash
cd /work/main && . .venv/bin/activate
set -x
C="--dataset fonts:train=1 --method ce --model lenet --init scratch --epochs 20 --milestones 10 15 --batch-size 64 --lr 0.05 --momentum 0.9 --weight-decay 0.0001 --seed 0 --eval-splits 10"
OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 dpsm-ray train $C --out /work/runs/r2/fonts-t1-threads2

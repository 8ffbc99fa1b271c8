#!/bin/bash
# round two's ConfTr pilot (docs/fidelity.md): ConfTr T 0.01, lambda 0.5, seed 0, lr 0.01, from each regime's seed-0 base model
cd /work/main && . .venv/bin/activate
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
while pgrep -f regime.sh >/dev/null; do sleep 20; done
set -x
F="--method conftr --sigmoid-temperature 0.01 --conformal-weight 0.5 --momentum 0.9 --weight-decay 0.0001 --batch-size 128 --lr 0.01 --seed 0 --eval-splits 10 --val-splits 5 --diagnostic-examples 0 --data-workers 0"
dpsm-ray train --dataset fonts_transfer --pretrained-path /work/runs/r2/fonts-backbone/model.pt --model lenet \
    --init weights:/work/runs/r2/fonts-transfer-ce-s0/model.pt --epochs 40 --milestones 25 $F --out /work/runs/r2/pilot-fonts_transfer-lr0.01
echo "pilot fonts_transfer rc=$?"
while pgrep -f repeat.sh >/dev/null; do sleep 20; done
dpsm-ray train --dataset fonts:train=1 --model lenet --init weights:/work/runs/r2/fonts-t1-threads1-diag0/model.pt --epochs 10 --milestones 6 $F \
    --out /work/runs/r2/pilot-fonts-lr0.01
echo "pilot fonts rc=$?"

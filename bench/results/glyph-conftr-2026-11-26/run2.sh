#!/bin/bash
cd /work/main
COMMON="--dataset glyphs --alpha 0.1 --init base --base-epochs 60 --base-milestones 30 45 --epochs 40 --batch-size 128 --lr 0.1 --milestones 25 --lr-decay 0.1 --momentum 0.9 --weight-decay 0.0001 --val-splits 5 --eval-splits 10 --diagnostic-examples 0 --seed 0 --data-workers 0"
run() { name=$1; shift; nice -n 10 .venv/bin/dpsm-ray train $COMMON "$@" --out /tmp/glyph/$name > /tmp/glyph/$name.log  # the .txt files here 2>&1; }
run conftr_l0005 --method conftr --conformal-weight 0.005
run conftr_lr001 --method conftr --lr 0.01
run conftr_seed1 --method conftr --seed 1
run ce_seed1 --method ce --seed 1

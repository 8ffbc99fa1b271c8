#!/bin/bash
# The glyph ConfTr collapse, one factor at a time (seed 0, the fidelity study's glyphs settings)
cd /work/main
COMMON="--dataset glyphs --alpha 0.1 --init base --base-epochs 60 --base-milestones 30 45 --epochs 40 --batch-size 128 --lr 0.1 --milestones 25 --lr-decay 0.1 --momentum 0.9 --weight-decay 0.0001 --val-splits 5 --eval-splits 10 --diagnostic-examples 0 --seed 0 --data-workers 0"
run() { name=$1; shift; /usr/bin/time -f "%e s" nice -n 10 .venv/bin/dpsm-ray train $COMMON "$@" --out /tmp/glyph/$name > /tmp/glyph/$name.log  # the .txt files here 2>&1; }
run ce --method ce
run conftr --method conftr
run conftr_l0 --method conftr --conformal-weight 0
run conftr_exact --method conftr --sort-temperature 0
run conftr_t01 --method conftr --sigmoid-temperature 0.1
run conftr_halves --method conftr --conftr-split halves
run dpsm_official --method dpsm --preset official

set -u
python3 - <<'PY'
import sys; sys.path.insert(0, "tests")
from fake_datasets import write_cifar100
from pathlib import Path; write_cifar100(Path("/tmp/c100"), train=50000, test=10000)
PY
for P in 4 1; do
  python3 sweeps/cifar100.py --results-dir /tmp/fast$P --data-root /tmp/c100 --model resnet110 --methods dpsm --init scratch --epochs 2 --batch-size 128 --trials $P --concurrency $P --final-seeds 1 --trials-per-gpu $P --device cuda --step graph --precision bf16 --channels-last 2>&1 | grep -E "done in|finished|rror"
  python3 - $P <<'PY'
import sys, pandas as pd
P = sys.argv[1]
e = pd.read_parquet(f"/tmp/fast{P}/epochs.parquet"); t = pd.read_parquet(f"/tmp/fast{P}/trials.parquet")
r = e[e.stage == "search"].groupby("trial_id").epoch_seconds.mean().rdiv(45000)
print(f"P={P} fast: per trial {r.mean():.0f} img/s, aggregate {r.sum():.0f} img/s, epoch_seconds {e[e.stage=='search'].epoch_seconds.round(2).tolist()}, ok {(t.status=='ok').sum()}/{len(t)}")
PY
done

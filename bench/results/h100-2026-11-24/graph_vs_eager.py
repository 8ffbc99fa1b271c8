import sys, torch
sys.path.insert(0, "tests/train"); sys.path.insert(0, ".")
import test_step as t

def maxdiff(a, b):
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a[0].state_dict().values(), b[0].state_dict().values()) if x.is_floating_point())

def trace_diff(a, b):
    return [round(abs(ra["ce"] - rb["ce"]), 7) for ra, rb in zip(a[3], b[3])]

for det in (False, True):
    torch.backends.cudnn.deterministic = det
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = not det
    torch.backends.cuda.matmul.allow_tf32 = not det
    for method in ("ce", "dpsm", "conftr"):
        for n in (1, 2, 8):
            data = t.batches(n, half=32, shape=(3, 32, 32), device="cuda")
            e1 = t.run_resnet("eager", method, data)
            e2 = t.run_resnet("eager", method, data)
            g = t.run_resnet("graph", method, data)
            print(f"det={det} {method} steps={n}: eager-eager {maxdiff(e1, e2):.2e}  eager-graph {maxdiff(e1, g):.2e}  ce diffs {trace_diff(e1, g)}", flush=True)

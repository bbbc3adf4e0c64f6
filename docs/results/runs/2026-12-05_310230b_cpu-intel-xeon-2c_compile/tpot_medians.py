import json, glob, sys, numpy as np
sys.path.insert(0, '/work/main')
from harness.core.metrics import median_ci
def tpot(r):
    return (r['time_s'] - r['ttft_s']) / (r['new_tokens'] - r['first_tokens']) * 1e3
for label in sys.argv[1:]:
    f = glob.glob(f'/tmp/timing/{label}/*/prompts.jsonl')[0]
    rs = [json.loads(l) for l in open(f)]
    s = json.load(open(glob.glob(f'/tmp/timing/{label}/*/summary.json')[0]))
    base = [tpot(r['base']) for r in rs]; spec = [tpot(r['spec']) for r in rs]
    lo, hi = median_ci(base)
    print(f"{label:32s} n={len(rs)} speedup {s['speedup']:.3f} [{s['speedup_ci'][0]:.3f}, {s['speedup_ci'][1]:.3f}] base TPOT med {np.median(base):.2f} [{lo:.2f}, {hi:.2f}] spec TPOT med {np.median(spec):.2f} eff {s.get('efficiency'):.3f} eff_iso {s.get('efficiency_isolated', float('nan')):.3f} recomp {s.get('recompiles_after_warm_up')}")

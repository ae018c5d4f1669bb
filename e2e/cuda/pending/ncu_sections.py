"""ncu `--csv --page details` output, per kernel and grid size: the mean of each numeric metric
over the launches, a line a metric (section / name / unit / mean / launches).

  ncu_sections.py ncu_sec.csv.gz
"""
import csv, gzip, sys
from collections import defaultdict

def main(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = [r for r in csv.reader(f)]
    head = next((i for i, r in enumerate(rows) if "Metric Name" in r), None)
    if head is None:
        sys.exit(f"{path}: no ncu details rows")
    cols = rows[head]
    at = {c: cols.index(c) for c in ("ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value")}
    launches = defaultdict(dict)  # launch id -> (section, name, unit) -> value
    names, grids = {}, {}
    grid_col = cols.index("Grid Size") if "Grid Size" in cols else None
    for r in rows[head + 1:]:
        if len(r) != len(cols):
            continue
        lid = r[at["ID"]]
        names[lid] = r[at["Kernel Name"]].split("(")[0]
        if grid_col is not None:
            grids[lid] = r[grid_col]
        try:
            v = float(r[at["Metric Value"]].replace(",", ""))
        except ValueError:
            continue
        launches[lid][(r[at["Section Name"]], r[at["Metric Name"]], r[at["Metric Unit"]])] = v
    groups = defaultdict(list)
    for lid, m in launches.items():
        grid = grids.get(lid) or str(int(next((v for (s, n, u), v in m.items() if n == "Grid Size"), 0)))
        groups[(names[lid], grid)].append(m)
    for (name, grid), ms in sorted(groups.items()):
        print(f"== {name} grid {grid}: {len(ms)} launches")
        keys = sorted({k for m in ms for k in m})
        for k in keys:
            vals = [m[k] for m in ms if k in m]
            print(f"   {k[0][:18]:18} {k[1][:44]:44} {sum(vals) / len(vals):14.3f} {k[2]}")

if __name__ == "__main__":
    main(sys.argv[1])

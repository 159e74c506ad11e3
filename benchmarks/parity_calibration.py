#!/usr/bin/env python
"""How often a parity check against a committed band fails on unchanged code: held-out seeds, in groups.

    python benchmarks/parity_calibration.py --band tests/data/parity_band_mlp.json \
        --heldout runs/parity-ci-heldout/parity.json --group 2

--heldout is the parity.json of `python recipes/parity.py ... --band BAND --seeds 9-20` (seeds the band was not
calibrated on, the band's settings). Its seeds are cut into consecutive groups of --group (as many as a CI check
runs), and each group's mean curve is checked against the band as recipes/parity.py checks it
(mixprec.parity.verdict): the table counts, per precision, the groups that leave it, and how close the closest
came (the largest |mean - fp32| / half-width over the points: 1 is the band's edge). Writes --out (a .md; the
.json beside it) when given.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from mixprec import parity


def check_groups(band: parity.Band, curves: dict[str, dict[int, float]], group: int) -> list[dict]:
    seeds = sorted(int(s) for s in curves)
    rows = []
    for i in range(0, len(seeds) - group + 1, group):
        chosen = seeds[i:i + group]
        v = parity.verdict("", {s: {int(t): x for t, x in curves[str(s)].items()} for s in chosen}, band)
        ratio = max(abs(d) / h if math.isfinite(d) else math.inf for d, h in zip(v.diff, v.half_width))
        rows.append({"seeds": chosen, "inside": v.inside, "outside": v.outside, "worst_ratio": ratio})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--band", type=Path, required=True)
    parser.add_argument("--heldout", type=Path, required=True)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    band_file, heldout = json.loads(args.band.read_text()), json.loads(args.heldout.read_text())
    if heldout["settings"] != band_file["settings"]:
        parser.error("--heldout was run with other settings than --band's")
    band = parity.Band.from_dict(band_file["band"])
    results, lines = {}, ["| precision | groups of seeds | outside the band | closest to the edge (1 = the edge) |",
                          "|---|---|---|---|"]
    for name, precision in heldout["precisions"].items():
        overlap = set(precision["seeds"]) & set(band.seeds)
        rows = check_groups(band, precision["curves"], args.group)
        results[name] = {"seeds_reused_from_the_band": sorted(overlap), "groups": rows}
        outside = sum(not r["inside"] for r in rows)
        lines.append(f"| {name} | {len(rows)} of {args.group} (seeds {rows[0]['seeds'][0]}-{rows[-1]['seeds'][-1]}) | "
                     f"{outside} | {max(r['worst_ratio'] for r in rows):.2f} |")
    head = [f"{heldout['machine']} ({heldout['cpu_kind']}); the band: {args.band.name} ({band.n} fp32 seeds "
            f"{band.seeds[0]}-{band.seeds[-1]}, alpha {band.alpha:g}, t = {band.q:.2f}); held out: "
            f"`{heldout['command']}`; `python benchmarks/parity_calibration.py --group {args.group}`", ""]
    text = "\n".join(head + lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"band": str(args.band), "group": args.group,
                                                             "precisions": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Two versions of the code on the connector's path, alternated in one call.

A run of `bench/connector_path.py` moves between runs by more than most changes to the
path gain or lose (this VM's CPU, a GPU host's state), so a change is judged against the
code before it in the same call, round after round: this tree and a checkout of the base
(`git worktree add DIR SHA`, or `git archive SHA | tar -x -C DIR` where the tree travels
without its history), each round running the same benchmark once in each, the order
turned around every round (base, new; new, base; ...).

    python bench/alternate.py --base /tmp/base --rounds 3 -- --transport tcp --tokens 16,512 --prefill-ms 20

Each run's JSON goes to `--out` (`ARM-ROUND.json`); the table gives, for every row of the
benchmark, each round's median of the chosen columns in both trees, each tree named by
the sha1 of its sources (`sources_sha1`, not its path), and `--json` writes the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("connector_ms", "after_prefill_ms", "forward_stretch_ms", "after_forward_end_ms")
SOURCES = ("broker", "connector", "protocols", "workers", "bench")


def sources_sha1(tree: Path) -> str:
    """What names a tree's code where it travels without its history (a `git archive`,
    a copy whose HEAD may be stale): the sha1 of its Python sources, the first 12 hex
    digits, as `bench/run_gpu.sh` prints it (`find ... -name '*.py' | sort | xargs cat`)."""
    paths = sorted(p.relative_to(tree).as_posix() for d in SOURCES for p in (tree / d).rglob("*.py"))
    digest = hashlib.sha1()
    for path in paths:
        digest.update((tree / path).read_bytes())
    return digest.hexdigest()[:12]


def run(tree: Path, args: list[str], out: Path, timeout_s: float) -> list[dict]:
    """One run of the benchmark in `tree` (its own modules first on the path); its rows."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, str(tree / "bench" / "connector_path.py"), *args, "--json", str(out)]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0 or not out.exists():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise SystemExit(f"the benchmark failed in {tree} (rc {done.returncode}):\n{tail}")
    return json.loads(out.read_text())["rows"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, type=Path, help="a checkout of the code to compare with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("alternate-out"), help="where each run's JSON goes")
    ap.add_argument("--columns", default=",".join(COLUMNS), help="the rows' fields to tabulate")
    ap.add_argument("--timeout-s", type=float, default=600, help="one run's limit")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv[:split])
    bench_args = argv[split + 1:]
    base = args.base.resolve()
    if not (base / "bench" / "connector_path.py").exists():
        ap.error(f"{base} holds no bench/connector_path.py: check out the base commit there")
    args.out.mkdir(parents=True, exist_ok=True)
    columns = args.columns.split(",")
    trees = {"base": base, "new": ROOT}
    runs: dict[str, list[list[dict]]] = {"base": [], "new": []}
    for k in range(args.rounds):
        for arm in ("base", "new") if k % 2 == 0 else ("new", "base"):
            rows = run(trees[arm], bench_args, args.out / f"{arm}-{k + 1}.json", args.timeout_s)
            runs[arm].append(rows)
            print(f"round {k + 1} {arm}: " + "; ".join(
                f"{r['tokens']}x{r['inflight']} {r['connector_ms']:.3f} ms" for r in rows), flush=True)
    table = []
    for i, row in enumerate(runs["new"][0]):
        for col in columns:
            if row.get(col) is None:  # a column this benchmark's run does not fill
                continue
            table.append({"tokens": row["tokens"], "inflight": row["inflight"], "column": col,
                          **{arm: [rows[i][col] for rows in runs[arm]] for arm in ("base", "new")}})
    named = {arm: sources_sha1(tree) for arm, tree in trees.items()}
    print(f"\nmedians of each run, ms; base: sources sha1 {named['base']}, new: {named['new']}; "
          "rounds alternate, base first")
    print(f"{'tokens':>7}{'inflight':>9}  {'column':<22}{'base':>28}  {'new':>28}")
    for t in table:
        cells = [" / ".join("-" if v is None else f"{v:.2f}" for v in t[arm]) for arm in ("base", "new")]
        print(f"{t['tokens']:>7}{t['inflight']:>9}  {t['column']:<22}{cells[0]:>28}  {cells[1]:>28}")
    if args.json:
        Path(args.json).write_text(json.dumps({"base": named["base"], "new": named["new"], "bench_args": bench_args,
                                               "rows": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Plot runs of ``bench/demo_learning.py`` from its ``--log`` file: right-tool rates by loop-clock minute.

    python -m bench.plot_demo_learning runs.jsonl --tags wr-incl-s0 wr-incl-s1 --out curves.png

One panel per run: the right-tool rate at T = 1 and greedy on held-out requests, and each tool's own rate
(a tool that drops out shows as a line that falls to zero and stays there).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--tags", nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {run["tag"]: run for run in map(json.loads, args.log.read_text().splitlines()) if run["tag"] in args.tags}
    missing = [t for t in args.tags if t not in runs]
    if missing:
        raise SystemExit(f"no run tagged {', '.join(missing)} in {args.log}")
    fig, axes = plt.subplots(1, len(args.tags), figsize=(5 * len(args.tags), 3.6), sharey=True, squeeze=False)
    for ax, tag in zip(axes[0], args.tags, strict=True):
        curve = runs[tag]["curve"]
        minutes = [p["clock_s"] / 60 for p in curve]
        ax.plot(minutes, [p["right_tool"] for p in curve], "k-", lw=2, label="right tool, T = 1")
        ax.plot(minutes, [p["right_tool_greedy"] for p in curve], "k--", lw=1, label="right tool, greedy")
        for tool in curve[0]["by_tool"]:
            ax.plot(minutes, [p["by_tool"][tool] for p in curve], lw=1, alpha=0.8, label=tool)
        ax.set_title(tag)
        ax.set_xlabel("loop clock (minutes)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("rate on held-out requests")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

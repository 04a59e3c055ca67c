"""Loss curves of training runs as a PNG: one line per run, or per group of runs their mean with
the band from the lowest to the highest.

    python -m bench.loss_curves outputs/debug                        # -> outputs/debug/loss.png
    python -m bench.loss_curves outputs/a outputs/b --out loss.png    # two runs, one line each
    python -m bench.loss_curves --group bf16=outputs/s0,outputs/s1 --group fp8=outputs/f0,outputs/f1 --out loss.png

A run is a dump folder of our trainer (it reads ``metrics.jsonl``, which rank 0 writes at every
logged step), such a ``metrics.jsonl`` itself, or a text log of either trainer (ours or upstream
TorchTitan: the printed ``step: ... loss: ...`` lines). Curves are drawn raw (thin) and as a moving
average over ``--smooth`` logged steps (thick); a group's band spans its runs' smoothed curves over
the steps all of them logged. Needs matplotlib (``pip install -e ".[plot]"``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.compare import parse_step_lines

METRICS_FILE = "metrics.jsonl"  # components.metrics.METRICS_FILE, without importing torch here


class CurveError(RuntimeError):
    pass


def read_metrics_file(path: Path) -> dict[int, float]:
    """Loss per step from a ``metrics.jsonl``. A ``start`` record (written when a run begins or
    resumes at that step) drops the steps from there on that an earlier run left in the file."""
    losses: dict[int, float] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CurveError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
        if "start" in record:
            losses = {s: v for s, v in losses.items() if s < record["start"]}
        elif "step" in record and "loss" in record:
            losses[int(record["step"])] = float(record["loss"])
    return losses


def read_losses(run: str | Path) -> dict[int, float]:
    """Loss per logged step of one run: a dump folder, a ``metrics.jsonl`` or a trainer's log."""
    path = Path(run)
    if path.is_dir():
        if not (path / METRICS_FILE).is_file():
            raise CurveError(f"{path} holds no {METRICS_FILE}: pass a dump folder of a run of train.py, its "
                             f"{METRICS_FILE}, or a log of the run")
        path = path / METRICS_FILE
    elif not path.is_file():
        raise CurveError(f"{path} does not exist")
    if path.suffix == ".jsonl":
        losses = read_metrics_file(path)
    else:
        losses = {s: v["loss"] for s, v in parse_step_lines(path.read_text(encoding="utf-8", errors="replace")).items()
                  if "loss" in v}
    if not losses:
        raise CurveError(f"{path} has no logged steps with a loss")
    return losses


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def band(curves: list[dict[int, float]], window: int) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps all ``curves`` logged, and there the mean, lowest and highest of their smoothed values."""
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    smoothed = [smooth([c[s] for s in steps], window) for c in curves]
    columns = list(zip(*smoothed))
    return steps, [sum(col) / len(col) for col in columns], [min(col) for col in columns], [max(col) for col in columns]


def plot(groups: dict[str, list[dict[int, float]]], path: Path, title: str = "", window: int = 20) -> Path:
    """One line (and, for several runs, a band) per group; written to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CurveError('the picture needs matplotlib: pip install -e ".[plot]" (or pip install matplotlib)') from None
    fig, ax = plt.subplots(figsize=(9, 5))
    frame: list[float] = []  # smoothed values after the first tenth of the steps: the y range shown
    for label, curves in groups.items():
        steps, mean, lo, hi = band(curves, window)
        if not steps:
            raise CurveError(f"{label}: its runs share no logged step")
        skip = len(steps) // 10
        frame += lo[skip:] + hi[skip:]
        raw = [sum(c[s] for c in curves) / len(curves) for s in steps]
        (line,) = ax.plot(steps, raw, linewidth=0.5, alpha=0.35)
        name = f"{label} ({len(curves)} runs: mean, min-max)" if len(curves) > 1 else label
        ax.plot(steps, mean, color=line.get_color(), linewidth=1.8, label=name)
        if len(curves) > 1:
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.25, linewidth=0)
    # The first steps' loss (~12 from a random init) would flatten everything after them.
    y_lo, y_hi = min(frame), max(frame)
    ax.set_ylim(y_lo - 0.05 * (y_hi - y_lo) - 0.01, y_hi + 0.3 * (y_hi - y_lo) + 0.01)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({window}-step moving average)")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.loss_curves", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="runs, one line each: dump folders, metrics.jsonl files or logs")
    p.add_argument("--group", action="append", default=[], metavar="LABEL=RUN,RUN,...",
                   help="several runs (e.g. seeds) drawn as their mean and min-max band")
    p.add_argument("--out", type=Path, help="the PNG (default: loss.png in the first run's folder)")
    p.add_argument("--title", default="")
    p.add_argument("--smooth", type=int, default=20, help="moving-average window, in logged steps")
    args = p.parse_args(argv)
    if not args.runs and not args.group:
        p.error("give at least one run or --group")
    if args.smooth < 1:
        p.error("--smooth must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    groups: dict[str, list[dict[int, float]]] = {}
    first: Path | None = None
    try:
        for run in args.runs:
            groups[str(run)] = [read_losses(run)]
            first = first or Path(run)
        for spec in args.group:
            label, sep, runs = spec.partition("=")
            if not sep or not label or not runs:
                raise CurveError(f"--group {spec!r}: expected LABEL=RUN,RUN,...")
            groups[label] = [read_losses(r) for r in runs.split(",") if r]
            first = first or Path(runs.split(",")[0])
        out = args.out or ((first if first.is_dir() else first.parent) / "loss.png")
        plot(groups, out, args.title, args.smooth)
    except CurveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""FP8 training parity: the same model, data and seed trained in bf16 and in FP8, loss curves compared.

    python -m bench.fp8_parity                          # 4 layers of Qwen3-30B-A3B, 300 steps, seq 8192 (H200)
    python -m bench.fp8_parity --runs bf16,mega_fp8 --steps 200 --out outputs/fp8_parity

Runs our trainer (``train.py`` with the head-to-head's settings, ``bench.compare.plan``) once per
precision setting, one after another, each in its own process:

* ``bf16``: ``mega`` backend, bf16 (the reference curve);
* ``mega_fp8``: ``mega`` with ``[precision] moe = "fp8_blockwise"`` (our block-scaled FP8 kernels);
* ``gmm_fp8``: ``grouped_mm`` with ``[precision] moe = "fp8_rowwise"`` (TorchTitan's FP8 method);
* ``mega_fp8_all``: ``mega_fp8`` plus ``[precision] linear = "fp8_rowwise"`` (attention projections);
* ``titan_bf16``: upstream TorchTitan 0.2.2's own trainer, bf16, from the TOML ``bench.compare`` writes
  (the same data, schedule and seed; needs torchtitan installed, else the run is listed as skipped).

The data loader is seeded, so every run sees the same batches in the same order; initial weights come
from the same seed. Each FP8 curve is compared with the bf16 one by the mean loss over the last 10%
of steps: the two must agree within 1% at the end. Writes ``parity.json``, ``parity.md``
and ``parity.png`` (the loss curves; matplotlib, else no chart) into ``--out``, logs in
``<out>/logs``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from bench.compare import (
    MODELS,
    ROOT,
    TOKENIZER_DIR,
    Run,
    Setting,
    display,
    parse_step_lines,
    plan,
    run_one,
    torchtitan_toml,
    write_jsonl_data,
    write_tokenizer,
)

# Our run name -> (the head-to-head's run it starts from, extra trainer arguments).
RUNS = {
    "bf16": ("ours_mega", []),
    "mega_fp8": ("ours_mega_fp8", []),
    "gmm_fp8": ("ours_grouped_mm_fp8", []),
    "mega_fp8_all": ("ours_mega_fp8", ["--precision.linear", "fp8_rowwise"]),
    "titan_bf16": ("titan_bf16", []),
}
TOLERANCE = 0.01  # the loss within 1% of bf16 at the end


def end_loss(losses: dict[int, float], fraction: float = 0.1) -> float:
    """Mean loss over the last ``fraction`` of the logged steps (at least one step)."""
    steps = sorted(losses)
    tail = steps[-max(1, round(len(steps) * fraction)):]
    return sum(losses[s] for s in tail) / len(tail)


def compare_curves(curves: dict[str, dict[int, float]], reference: str = "bf16") -> dict[str, dict[str, Any]]:
    """Per run: its end loss and, for runs other than ``reference``, the relative difference and
    whether it is within ``TOLERANCE``. A run that stopped early (a time limit) is compared with the
    reference over the steps both logged, and its row says so."""
    ref_curve = curves.get(reference) or {}
    out: dict[str, dict[str, Any]] = {}
    for name, losses in curves.items():
        if not losses:
            out[name] = {"end_loss": None, "status": "no steps logged"}
            continue
        row: dict[str, Any] = {"end_loss": end_loss(losses), "steps": max(losses)}
        if name != reference and ref_curve:
            last = min(max(losses), max(ref_curve))
            if last < max(ref_curve):
                row["status"] = f"stopped at step {max(losses)}: compared over steps 1-{last}"
            mine = end_loss({s: v for s, v in losses.items() if s <= last})
            ref = end_loss({s: v for s, v in ref_curve.items() if s <= last})
            row["end_loss"] = mine
            rel = (mine - ref) / ref
            row.update(rel_diff=rel, within=abs(rel) <= TOLERANCE)
        out[name] = row
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [f"`{report['command']}` ({report['date']}): {report['setting']}", "",
             "| run | steps | mean loss, last 10% | vs bf16 | within 1% |", "| --- | --- | --- | --- | --- |"]
    for name, row in report["comparison"].items():
        if row.get("end_loss") is None:
            lines.append(f"| {name} | | | | {row.get('status', '')} |")
            continue
        rel = f"{row['rel_diff']:+.2%}" if "rel_diff" in row else "reference"
        within = {True: "yes", False: "**no**"}.get(row.get("within"), "")
        if row.get("status"):
            within += f" ({row['status']})"
        lines.append(f"| {name} | {row['steps']} | {row['end_loss']:.4f} | {rel} | {within} |")
    return "\n".join(lines) + "\n"


def loss_chart(curves: dict[str, dict[int, float]], path: Path, title: str) -> str:
    """Loss against step, one line per run (raw, thin) with a 20-step moving average (thick)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart"
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, losses in curves.items():
        if not losses:
            continue
        steps = sorted(losses)
        values = [losses[s] for s in steps]
        (line,) = ax.plot(steps, values, linewidth=0.5, alpha=0.4)
        window = 20
        smooth = [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
                  for i in range(len(values))]
        ax.plot(steps, smooth, color=line.get_color(), linewidth=1.8, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return "matplotlib"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fp8_parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=tuple(MODELS), default="qwen3_30b_a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--runs", default="bf16,mega_fp8,gmm_fp8", help=f"comma-separated, of {', '.join(RUNS)}; "
                   "bf16 is the reference and must be among them")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "fp8_parity")
    p.add_argument("--ours-args", default="", help="extra arguments for every run of our trainer, one string "
                   "(last wins)")
    p.add_argument("--reuse", action="store_true", help="keep a run whose log in --out already holds all its "
                   "steps from the same command (to spread the runs over several calls)")
    args = p.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    if unknown := set(names) - set(RUNS):
        p.error(f"unknown runs {', '.join(sorted(unknown))}; known: {', '.join(RUNS)}")
    if "bf16" not in names:
        p.error("--runs must include bf16, the reference curve")
    args.run_names = names
    return args


def write_report(args: argparse.Namespace, argv: list[str], out: Path, curves: dict[str, dict[int, float]],
                 commands: dict[str, str]) -> dict[str, Any]:
    """parity.json, parity.md and parity.png from the curves so far; returns the report."""
    report = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m bench.fp8_parity " + shlex.join(argv),
        "setting": f"{args.model}, {args.layers} layers, seq len {args.seq_len}, {args.steps} steps, seed 0",
        "commands": commands, "curves": {k: {str(s): v for s, v in c.items()} for k, c in curves.items()},
        "comparison": compare_curves(curves),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "parity.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (out / "parity.md").write_text(markdown(report), encoding="utf-8")
    report["chart"] = loss_chart(curves, out / "parity.png", f"training loss: {report['setting']}")
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out = args.out.resolve()
    setting = Setting(args.model, args.layers, args.seq_len, args.steps, out)
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        write_tokenizer()
    data_dir = write_jsonl_data(out / "data")
    # The caller's overrides are appended below, after each run's own arguments (last wins).
    toml_path = out / "torchtitan.toml"
    if "titan_bf16" in args.run_names:
        toml_path.parent.mkdir(parents=True, exist_ok=True)
        toml_path.write_text(torchtitan_toml(setting, data_dir=data_dir), encoding="utf-8")
    by_name = {r.name: r for r in plan(setting, toml_path=toml_path, data_dir=data_dir)}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    curves: dict[str, dict[int, float]] = {}
    commands: dict[str, str] = {}
    report: dict[str, Any] = {}
    for name in args.run_names:
        base, extra = RUNS[name]
        planned = by_name[base]
        cmd = planned.cmd + extra + (shlex.split(args.ours_args) if planned.trainer == "ours" else [])
        commands[name] = display(cmd)
        log_path = out / "logs" / f"{name}.log"
        if planned.skip:
            print(f"[{name}] skipped: {planned.skip}", flush=True)
            curves[name] = {}
            report = write_report(args, argv, out, curves, commands)
            continue
        text = log_path.read_text(encoding="utf-8", errors="replace") if log_path.is_file() else ""
        losses = {s: v["loss"] for s, v in parse_step_lines(text).items() if "loss" in v}
        if args.reuse and text.startswith("$ " + shlex.join(cmd)) and max(losses, default=0) >= args.steps:
            curves[name] = losses
            print(f"[{name}] reused {log_path}: {len(losses)} steps", flush=True)
        else:
            info = run_one(Run(name, name, planned.trainer, planned.precision, cmd), log_path, args.timeout, env)
            text = log_path.read_text(encoding="utf-8", errors="replace")
            curves[name] = {s: v["loss"] for s, v in parse_step_lines(text).items() if "loss" in v}
            print(f"[{name}] rc {info['returncode']}{' (timed out)' if info['timed_out'] else ''}, "
                  f"{len(curves[name])} steps logged, {info['wall_s']} s", flush=True)
        # The report after every run: a call cut short by its time limit still leaves one.
        report = write_report(args, argv, out, curves, commands)
    print(markdown(report) + f"chart: {report['chart']}", flush=True)
    failed = [n for n, row in report["comparison"].items() if row.get("within") is False or row.get("end_loss") is None]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

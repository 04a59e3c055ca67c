"""Training quality at a real horizon: bf16 and FP8, ours and upstream, several seeds, loss compared.

    python scripts/make_code_corpus.py                               # the corpus (once, ~160 MB)
    python -m bench.fp8_parity --runs bf16,mega_fp8 --seeds 0,1,2    # 30B shape, 4 layers, seq 16384, 500 steps
    python -m bench.fp8_parity --runs mega_fp8_all,titan_bf16 --seeds 0 --out outputs/quality_b
    python -m bench.fp8_parity --report outputs/quality_a outputs/quality_b --out outputs/quality
    python -m bench.fp8_parity --data stories --steps 300 --seq-len 8192   # the small shipped corpus

Runs our trainer (``train.py`` with the head-to-head's settings, ``bench.compare.plan``) once per
(setting, seed), one after another, each in its own process:

* ``bf16``: ``mega`` backend, bf16 (the reference);
* ``mega_fp8``: ``mega`` with ``[precision] moe = "fp8_blockwise"`` (our block-scaled FP8 kernels);
* ``gmm_fp8``: ``grouped_mm`` with ``[precision] moe = "fp8_rowwise"`` (TorchTitan's FP8 method);
* ``mega_fp8_all``: ``mega_fp8`` plus ``[precision] linear = "fp8_rowwise"`` (attention projections);
* ``titan_bf16``: upstream TorchTitan 0.2.2's own trainer, bf16, from the TOML ``bench.compare`` writes
  (same data, schedule and seed number; needs torchtitan installed, else the run is listed as skipped);
* ``bf16_in_order``: ``bf16`` reading the samples in stream order (``[training] shuffle = false``),
  as upstream's loader does, so that the two see the same tokens at every step: upstream's pair.

The seed (``--training.seed``, upstream's ``--debug.seed``) sets the initial weights and our loader's
sample order, so the runs of one seed differ only in precision. Upstream initialises its own way
and reads the data in stream order; its weights cannot start from ours without a conversion this
tool does not make, so it is compared with ``bf16_in_order`` (same tokens at every step, other
initial weights) when that ran, else with ``bf16`` (other data at the end, which moves the loss
by more than 1%: upstream's curve follows the documents it reads, e.g. a dip over a run of easy
files).

The default data is the code corpus of ``scripts/make_code_corpus.py`` (``data/code/jsonl``, ~108 M
tokens: 500 steps of 16,384 tokens read under 8% of it, so nothing is seen twice); our runs read it
pre-tokenized once into ``<out>/tokens`` (``scripts/pretokenize.py``, the same ids), upstream reads
the JSON lines.

Each run's end loss is its mean loss over the last ``--tail`` steps (50). Per setting: the mean
over its seeds and the spread (highest minus lowest). Checks, each over the seeds both sides ran (the
seed also picks the data order, which moves the end loss more than precision does): each FP8
setting within 1% of bf16 and, with two or more bf16 seeds, no further from it than the bf16 seeds'
spread; ours bf16 (in stream order when that ran) within 1% of upstream. Writes ``parity.json``,
``parity.md`` and ``parity.png`` (mean curves with their min-max bands, ``bench.loss_curves``) into
``--out``, the logs into ``<out>/logs``. The report is rewritten after every run; ``--report DIR ...`` rebuilds it from the logs of earlier
calls (e.g. runs spread over several GPU sessions) without running anything.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import statistics
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
    run_env,
    run_one,
    torchtitan_toml,
    write_jsonl_data,
    write_tokenizer,
)

# Our setting name -> (the head-to-head's run it starts from, extra trainer arguments).
RUNS = {
    "bf16": ("ours_mega", []),
    "mega_fp8": ("ours_mega_fp8", []),
    "gmm_fp8": ("ours_grouped_mm_fp8", []),
    "mega_fp8_all": ("ours_mega_fp8", ["--precision.linear", "fp8_rowwise"]),
    "titan_bf16": ("titan_bf16", []),
    # bf16 reading the samples in stream order, as upstream's loader does: upstream's pair.
    "bf16_in_order": ("ours_mega", ["--training.shuffle", "false"]),
}
REFERENCE = "bf16"
UPSTREAM = "titan_bf16"
IN_ORDER = "bf16_in_order"
TOLERANCE = 0.01  # relative difference of the mean end losses
CODE_CORPUS = ROOT / "data" / "code" / "jsonl"
LOG_NAME = re.compile(r"^(?P<name>[a-z0-9_]+)\.s(?P<seed>\d+)\.log$")


def end_loss(losses: dict[int, float], tail: int = 50) -> float:
    """Mean loss over the last ``tail`` logged steps (all of them if fewer)."""
    steps = sorted(losses)[-tail:]
    return sum(losses[s] for s in steps) / len(steps)


def summarize(curves: dict[tuple[str, int], dict[int, float]], steps: int, tail: int) -> dict[str, Any]:
    """Per run its end loss; per setting the mean and spread over seeds; the checks."""
    runs: dict[str, dict[str, Any]] = {}
    by_setting: dict[str, dict[int, float]] = {}
    for (name, seed), losses in sorted(curves.items()):
        row: dict[str, Any] = {"setting": name, "seed": seed, "steps": max(losses, default=0)}
        if not losses:
            row["status"] = "no steps logged"
        else:
            row["end_loss"] = end_loss(losses, tail)
            if row["steps"] < steps:
                row["status"] = f"stopped at step {row['steps']} of {steps}: not counted"
            else:
                by_setting.setdefault(name, {})[seed] = row["end_loss"]
        runs[f"{name}.s{seed}"] = row
    settings = {}
    for name, ends in by_setting.items():
        values = list(ends.values())
        settings[name] = {"seeds": sorted(ends), "end_losses": [ends[s] for s in sorted(ends)],
                          "mean": statistics.fmean(values), "spread": max(values) - min(values),
                          "stdev": statistics.stdev(values) if len(values) > 1 else None}
    return {"runs": runs, "settings": settings, "checks": checks(settings)}


def _paired_means(s: dict[str, Any], ref: dict[str, Any]) -> tuple[float, float, list[int]]:
    """Means of two settings over the seeds both ran (all of each when they share none)."""
    common = [seed for seed in s["seeds"] if seed in ref["seeds"]]
    if not common:
        return s["mean"], ref["mean"], []
    pick = lambda x: statistics.fmean(x["end_losses"][x["seeds"].index(seed)] for seed in common)  # noqa: E731
    return pick(s), pick(ref), common


def checks(settings: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The quality criteria that the settings present allow; each over the seeds both sides ran,
    since the seed also picks the data order, which moves the end loss more than precision does."""
    out = []
    ref = settings.get(REFERENCE)
    if ref is None:
        return out
    for name, s in settings.items():
        if name in (REFERENCE, UPSTREAM, IN_ORDER):
            continue
        mine, theirs, seeds = _paired_means(s, ref)
        rel = (mine - theirs) / theirs
        out.append({"check": f"{name} within 1% of bf16", "value": rel, "bound": TOLERANCE, "relative": True,
                    "seeds": seeds, "passed": abs(rel) <= TOLERANCE})
        if len(ref["seeds"]) > 1:
            out.append({"check": f"{name} within the bf16 seed spread", "value": abs(mine - theirs),
                        "bound": ref["spread"], "relative": False, "seeds": seeds,
                        "passed": abs(mine - theirs) <= ref["spread"]})
        if seeds:
            s["paired_diff_vs_bf16"] = [s["end_losses"][s["seeds"].index(x)] - ref["end_losses"][ref["seeds"].index(x)]
                                        for x in seeds]
    if UPSTREAM in settings:
        # Upstream reads the data in stream order: a shuffled run of ours sees other data at the end.
        ours = IN_ORDER if IN_ORDER in settings else REFERENCE
        theirs, mine, seeds = _paired_means(settings[UPSTREAM], settings[ours])
        rel = (mine - theirs) / theirs
        label = ("bf16 within 1% of upstream, same data order" if ours == IN_ORDER else
                 "bf16 within 1% of upstream (ours shuffled: other data at the end)")
        out.append({"check": label, "value": rel, "bound": TOLERANCE, "relative": True, "seeds": seeds,
                    "passed": abs(rel) <= TOLERANCE})
    return out


def markdown(report: dict[str, Any]) -> str:
    tail = report["tail"]
    lines = [f"`{report['command']}` ({report['date']}): {report['setting']}", "",
             f"| setting | seeds | end loss per seed (mean of the last {tail} steps) | mean | spread | vs bf16, same seeds |",
             "| --- | --- | --- | --- | --- | --- |"]
    settings = report["settings"]
    ref = settings.get(REFERENCE)
    for name, s in settings.items():
        rel = ""
        if name == REFERENCE:
            rel = "reference"
        elif ref:
            mine, theirs, seeds = _paired_means(s, ref)
            rel = f"{(mine - theirs) / theirs:+.2%}" + (f" (s{', s'.join(map(str, seeds))})" if seeds else "")
        per_seed = ", ".join(f"s{seed} {v:.4f}" for seed, v in zip(s["seeds"], s["end_losses"]))
        lines.append(f"| {name} | {len(s['seeds'])} | {per_seed} | {s['mean']:.4f} | {s['spread']:.4f} | {rel} |")
    others = [f"{k}: {r['status']}" for k, r in report["runs"].items() if r.get("status")]
    if others:
        lines += ["", "Not counted: " + "; ".join(others) + "."]
    if report["checks"]:
        lines += ["", "| check | seeds compared | value | bound | passed |", "| --- | --- | --- | --- | --- |"]
        for c in report["checks"]:
            value = f"{c['value']:+.2%}" if c["relative"] else f"{c['value']:.4f}"
            bound = f"{c['bound']:.0%}" if c["relative"] else f"{c['bound']:.4f}"
            seeds = ", ".join(map(str, c["seeds"])) or "all (none shared)"
            lines.append(f"| {c['check']} | {seeds} | {value} | {bound} | {'yes' if c['passed'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, curves: dict[tuple[str, int], dict[int, float]], meta: dict[str, Any]) -> dict[str, Any]:
    """parity.json, parity.md and parity.png from the curves so far; returns the report."""
    report = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **meta,
              **summarize(curves, meta["steps"], meta["tail"]),
              "curves": {f"{n}.s{s}": {str(k): v for k, v in c.items()} for (n, s), c in sorted(curves.items())}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "parity.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (out / "parity.md").write_text(markdown(report), encoding="utf-8")
    groups: dict[str, list[dict[int, float]]] = {}
    for (name, _), losses in sorted(curves.items()):
        if losses:
            groups.setdefault(name, []).append(losses)
    try:
        from bench.loss_curves import CurveError, plot

        plot(groups, out / "parity.png", f"training loss: {meta['setting']}")
        report["chart"] = str(out / "parity.png")
    except (ImportError, CurveError) as e:
        report["chart"] = f"no chart: {e}"
    return report


def read_logs(dirs: list[Path]) -> tuple[dict[tuple[str, int], dict[int, float]], dict[str, str]]:
    """The curves and commands in ``<dir>/logs/<setting>.s<seed>.log`` of each dir (later dirs win)."""
    curves, commands = {}, {}
    for d in dirs:
        for log in sorted((d / "logs").glob("*.log")):
            m = LOG_NAME.match(log.name)
            if not m or m["name"] not in RUNS:
                continue
            text = log.read_text(encoding="utf-8", errors="replace")
            key = (m["name"], int(m["seed"]))
            curves[key] = {s: v["loss"] for s, v in parse_step_lines(text).items() if "loss" in v}
            if text.startswith("$ "):
                commands[f"{key[0]}.s{key[1]}"] = text.splitlines()[0][2:]
    return curves, commands


def data_label(data: str) -> str:
    """``stories``, ``code`` (the folder made by make_code_corpus.py) or the data folder's name."""
    path = Path(data)
    return path.parent.name if path.name == "jsonl" else path.name


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fp8_parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=tuple(MODELS), default="qwen3_30b_a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--tail", type=int, default=50, help="end loss: mean over this many last logged steps")
    p.add_argument("--runs", default="bf16,mega_fp8", help=f"comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; every run is made once per seed")
    p.add_argument("--data", default=str(CODE_CORPUS), help="a JSON-lines folder (field 'text'), or 'stories' "
                   "for the shipped corpus; default: the corpus of scripts/make_code_corpus.py")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "fp8_parity")
    p.add_argument("--ours-args", default="", help="extra arguments for every run of our trainer, one string "
                   "(last wins)")
    p.add_argument("--report", nargs="+", type=Path, metavar="DIR",
                   help="run nothing: rebuild the report in --out from the logs under these folders")
    args = p.parse_args(argv)
    args.run_names = [n for n in args.runs.split(",") if n]
    if unknown := set(args.run_names) - set(RUNS):
        p.error(f"unknown runs {', '.join(sorted(unknown))}; known: {', '.join(RUNS)}")
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds {args.seeds!r}: expected comma-separated integers")
    if not args.seed_list or min(args.seed_list) < 0:
        p.error("--seeds needs at least one seed >= 0")
    if args.tail < 1:
        p.error("--tail must be >= 1")
    return args


def prepare_data(args: argparse.Namespace, out: Path, env: dict[str, str]) -> tuple[Path, Path]:
    """(JSON-lines folder for upstream, the folder our trainer reads): the text pre-tokenized once."""
    if args.data == "stories":
        text_dir = write_jsonl_data(out / "data")
    else:
        text_dir = Path(args.data).resolve()
        if not text_dir.is_dir() or not any(text_dir.glob("*.jsonl")):
            hint = (" (make it with python scripts/make_code_corpus.py, or pass --data stories)"
                    if text_dir == CODE_CORPUS else "")
            raise SystemExit(f"error: --data {text_dir} is not a folder of .jsonl files{hint}")
    if all(n == UPSTREAM for n in args.run_names):
        return text_dir, text_dir
    tokens = out / "tokens"
    stamp = json.dumps(sorted((f.name, f.stat().st_size) for f in text_dir.glob("*.jsonl")))
    if (tokens / "SOURCE").is_file() and (tokens / "SOURCE").read_text() == stamp:
        return text_dir, tokens
    cmd = [sys.executable, str(ROOT / "scripts" / "pretokenize.py"), "--tokenizer", str(TOKENIZER_DIR / "tokenizer.model"),
           "--dataset", str(text_dir), "--out", str(tokens), "--overwrite"]
    info = run_one(Run("pretokenize", "pretokenize", "ours", "bf16", cmd), out / "logs" / "pretokenize.txt",
                   args.timeout, env)
    if info["returncode"] != 0:
        raise SystemExit(f"error: pre-tokenizing {text_dir} failed: see {out / 'logs' / 'pretokenize.txt'}")
    (tokens / "SOURCE").write_text(stamp)
    return text_dir, tokens


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out = args.out.resolve()
    meta = {"command": "python -m bench.fp8_parity " + shlex.join(argv), "steps": args.steps, "tail": args.tail,
            "setting": f"{args.model}, {args.layers} layers, seq len {args.seq_len}, {args.steps} steps, "
                       f"data {data_label(args.data)}"}
    if args.report:
        curves, commands = read_logs([d.resolve() for d in args.report])
        report = write_report(out, curves, {**meta, "commands": commands, "from": [str(d) for d in args.report]})
        print(markdown(report) + f"chart: {report['chart']}", flush=True)
        return 1 if any(not c["passed"] for c in report["checks"]) else 0
    env = run_env()
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        write_tokenizer()
    text_dir, ours_dir = prepare_data(args, out, env)
    setting = Setting(args.model, args.layers, args.seq_len, args.steps, out)
    toml_path = out / "torchtitan.toml"
    if UPSTREAM in args.run_names:
        toml_path.parent.mkdir(parents=True, exist_ok=True)
        toml_path.write_text(torchtitan_toml(setting, data_dir=text_dir), encoding="utf-8")
    by_name = {r.name: r for r in plan(setting, toml_path=toml_path, data_dir=ours_dir)}
    curves: dict[tuple[str, int], dict[int, float]] = {}
    commands: dict[str, str] = {}
    report: dict[str, Any] = {}
    for seed in args.seed_list:
        for name in args.run_names:
            base, extra = RUNS[name]
            planned = by_name[base]
            if planned.trainer == "ours":
                cmd = planned.cmd + extra + ["--training.seed", str(seed)] + shlex.split(args.ours_args)
            else:
                cmd = planned.cmd + extra + ["--debug.seed", str(seed)]
            key = f"{name}.s{seed}"
            commands[key] = display(cmd)
            if planned.skip:
                print(f"[{key}] skipped: {planned.skip}", flush=True)
                curves[name, seed] = {}
            else:
                log_path = out / "logs" / f"{key}.log"
                info = run_one(Run(key, key, planned.trainer, planned.precision, cmd), log_path, args.timeout, env)
                text = log_path.read_text(encoding="utf-8", errors="replace")
                curves[name, seed] = {s: v["loss"] for s, v in parse_step_lines(text).items() if "loss" in v}
                print(f"[{key}] rc {info['returncode']}{' (timed out)' if info['timed_out'] else ''}, "
                      f"{len(curves[name, seed])} steps logged, {info['wall_s']} s", flush=True)
            # The report after every run: a call cut short by its time limit still leaves one.
            report = write_report(out, curves, {**meta, "commands": commands})
    print(markdown(report) + f"chart: {report['chart']}", flush=True)
    incomplete = [k for k, r in report["runs"].items() if r.get("status")]
    return 1 if incomplete or any(not c["passed"] for c in report["checks"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Same-call A/B of kernel switches read from the environment, timed by the kernel benchmark.

    python kernels/tools/ab_env.py --name NAME --variant "kept=" --variant "before=OSCAR_X=1" [--turns 3]
                          [--context 100000] [--batches 1,8] [--note TEXT] [--out kernels/measurements]

A switch compiled into a kernel cannot change inside one process (Triton checks the globals a kernel
read), so each variant runs as its own process of ``python -m eval.bench_gpu`` (``oscar_triton`` only, CUDA-graph
replay of the whole decode call), the variants in turn, ``--turns`` times: the machine's drift then
falls on every variant alike. A variant is ``LABEL=`` followed by space-separated ``KEY=VALUE``
settings (none for the code as it stands). Writes ``NAME.json`` and ``NAME.md`` (command, machine,
date; every run, and each variant's median per batch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from oscar_hf.provenance import machine_info, machine_line, utc_date

REPO = Path(__file__).resolve().parents[2]


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``"label=K1=V1 K2=V2"`` as ``(label, {K1: V1, K2: V2})``."""
    label, _, settings = text.partition("=")
    if not label:
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected LABEL=[KEY=VALUE ...]")
    return label, dict(item.split("=", 1) for item in settings.split())


def time_variant(settings: dict[str, str], context: int, batches: list[int], work: Path) -> dict[int, float]:
    """Graph-replayed µs of the whole decode call per batch, in a process of its own under ``settings``."""
    config = REPO / "eval/configs/bench_kernel.json"
    sets = [f"contexts=[{context}]", f"batches={json.dumps(batches)}", 'methods=["oscar_triton"]']
    command = [
        sys.executable,
        "-m",
        "eval.bench_gpu",
        "--config",
        str(config),
        "--out",
        str(work),
        "--name",
        "ab",
    ] + [arg for text in sets for arg in ("--set", text)]
    subprocess.run(command, check=True, env={**os.environ, **settings}, stdout=subprocess.DEVNULL, cwd=REPO)
    cases = json.loads((work / "ab.json").read_text())["cases"]
    return {case["batch"]: case["graph_us"] for case in cases if case["method"] == "oscar_triton"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--variant", dest="variants", action="append", type=parse_variant, required=True)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--context", type=int, default=100_000)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--note", default="", help="what the variants are (the switches are removed afterwards)")
    parser.add_argument("--out", type=Path, default=REPO / "kernels" / "measurements")
    options = parser.parse_args()
    batches = [int(b) for b in options.batches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for turn in range(1, options.turns + 1):
            for label, settings in options.variants:
                for batch, us in time_variant(settings, options.context, batches, Path(work)).items():
                    rows.append({"turn": turn, "variant": label, "settings": settings, "batch": batch, "us": us})
                    print(f"turn {turn} {label} batch {batch}: {us:.2f} us", flush=True)
    medians = {}
    for label, _ in options.variants:
        for batch in batches:
            times = [r["us"] for r in rows if r["variant"] == label and r["batch"] == batch]
            medians[f"{label} @ {batch}"] = statistics.median(times)
    machine = machine_info()
    command = "python kernels/tools/ab_env.py " + " ".join(
        f"'{arg}'" if " " in arg or not arg else arg for arg in sys.argv[1:]
    )
    record = {
        "name": options.name,
        "command": command,
        "machine": machine,
        "date": utc_date(),
        "note": options.note,
        "context": options.context,
        "rows": rows,
        "medians": medians,
    }
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / f"{options.name}.json").write_text(json.dumps(record, indent=1))
    lines = [
        f"# {options.name}",
        "",
        f"{machine_line(machine)}, {record['date']}",
        "",
        f"`{command}`",
        "",
        options.note,
        "",
        f"Whole decode call at {options.context:,} tokens, CUDA-graph replay (µs, the "
        "benchmark's median); the variants in turn, each its own process.",
        "",
        "| turn | variant | settings | batch | µs |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['turn']} | {r['variant']} | {' '.join(f'{k}={v}' for k, v in r['settings'].items())} | "
        f"{r['batch']} | {r['us']:.2f} |"
        for r in rows
    ]
    lines += ["", "| variant @ batch | median µs |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in medians.items()]
    (options.out / f"{options.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

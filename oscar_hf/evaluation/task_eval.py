"""``oscar-hf eval tasks``: accuracy per (method, task, seed) through lm-eval, and the paper's Table 2.

Every run goes through lm-eval's ``simple_evaluate`` with the ``oscar`` model
(:class:`oscar_hf.evaluation.lm_eval_model.OscarLM`), one wrapper per method around one loaded model. Each run
writes ``runs/<method>__<task>__seed<k>.json``; a run whose file exists is skipped, so an
interrupted evaluation resumes where it stopped. The summary (``table.md``, ``summary.json``,
``accuracy.png``) is rebuilt from the run files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from oscar_hf.config import METHODS
from oscar_hf.core.memory import bits_per_element
from oscar_hf.log import get_logger
from oscar_hf.model_info import head_dim_of
from oscar_hf.provenance import machine_line
from oscar_hf.rotations.rotation_set import MethodRotations, rotations_for

logger = get_logger(__name__)

BASELINE = "none"
BPE_CONTEXT = 131072  # the paper's BPE figures are at 128K context
MAX_ANSWER_CHARS = 1000


@dataclass(frozen=True)
class RunKey:
    method: str
    task: str
    seed: int

    @property
    def filename(self) -> str:
        return f"{self.method}__{self.task}__seed{self.seed}.json"


def run_path(out_dir: str | Path, key: RunKey) -> Path:
    return Path(out_dir) / "runs" / key.filename


def generation_kwargs(max_gen_toks: int | None, temperature: float) -> dict:
    """Task-level overrides: greedy by default; with temperature > 0 the paper's sampling (top_p 0.95, top_k 40)."""
    kwargs: dict = {}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=float(temperature), top_p=0.95, top_k=40)
    else:
        kwargs.update(do_sample=False, temperature=0.0)
    if max_gen_toks:
        kwargs["max_gen_toks"] = int(max_gen_toks)
    return kwargs


def _sample_record(spec, sample: dict) -> dict:
    """What a result file keeps of one sample: its id, the extracted answer and its scores (never the prompt)."""
    from oscar_hf.evaluation.tasks.scoring import extracted_answer, gpqa_letter

    filtered = sample.get("filtered_resps")
    filtered = filtered[0] if isinstance(filtered, list) and filtered else filtered
    raw = sample.get("resps") or [[""]]
    raw = raw[0][0] if isinstance(raw[0], list) else raw[0]
    if spec.redact:
        answer = str(filtered).strip()
        if answer not in ("A", "B", "C", "D", "[invalid]"):
            answer = gpqa_letter(answer)  # a letter only, whatever the filter returned
    elif spec.code:
        answer = str(raw)[:MAX_ANSWER_CHARS]
    elif sample.get("filter", "none") != "none":
        answer = str(filtered)[:MAX_ANSWER_CHARS]
    else:
        answer = extracted_answer(spec.name, str(raw))
    metric = spec.metric.split(",")[0]
    # A digest of the whole generation: "same output as BF16" without keeping the text.
    digest = hashlib.sha1(str(raw).encode("utf-8")).hexdigest()[:16]
    record = {"doc_id": sample.get("doc_id"), "answer": answer, metric: sample.get(metric), "response_sha1": digest}
    if not spec.redact and not spec.code:
        record["target"] = str(sample.get("target"))[:200]
    return record


def run_one(lm, spec, lm_eval_task: str, task_manager, key: RunKey, limit: int | None, gen_kwargs: dict) -> dict:
    """One (method, task, seed) through ``simple_evaluate``; returns the run record (metrics, samples, timing)."""
    from lm_eval import simple_evaluate

    start = time.time()
    output = simple_evaluate(
        model=lm,
        tasks=[lm_eval_task],
        task_manager=task_manager,
        limit=limit,
        gen_kwargs=dict(gen_kwargs),
        log_samples=True,
        random_seed=key.seed,
        numpy_random_seed=key.seed,
        torch_random_seed=key.seed,
        fewshot_random_seed=1234,  # the same few-shot examples for every seed and method
        confirm_run_unsafe_code=spec.code,
        bootstrap_iters=0,
    )
    elapsed = time.time() - start
    metrics = {
        k: v
        for k, v in output["results"][lm_eval_task].items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    filter_name = spec.metric.split(",")[1] if "," in spec.metric else "none"
    samples = [
        _sample_record(spec, s)
        for s in output.get("samples", {}).get(lm_eval_task, [])
        if s.get("filter", "none") == filter_name
    ]
    score = metrics.get(spec.metric)
    if score is None:
        raise KeyError(f"task {key.task}: metric {spec.metric!r} not in lm-eval's results {sorted(metrics)}")
    return {
        "method": key.method,
        "task": key.task,
        "seed": key.seed,
        "lm_eval_task": lm_eval_task,
        "metric": spec.metric,
        "score": float(score),
        "metrics": metrics,
        "n_samples": output.get("n-samples", {}).get(lm_eval_task),
        "gen_kwargs": gen_kwargs,
        "seconds": round(elapsed, 1),
        "samples": samples,
    }


def run_tasks(
    model,
    tokenizer,
    *,
    methods: list[str],
    tasks: list[str],
    seeds: int,
    out_dir: str | Path,
    limit: int | None = None,
    data_dir: str | Path | None = None,
    max_gen_toks: int | None = None,
    temperature: float = 0.0,
    rotations: MethodRotations = None,
    sink: int = 64,
    recent: int = 256,
    batch_size: int = 1,
    think_end_token: str | None = None,
    task_dirs: list[str] = (),
    environment: dict | None = None,
    progress: bool = True,
) -> dict:
    """Run every (method, task, seed) not yet in ``out_dir``, then write the summary; returns it."""
    from lm_eval.tasks import TaskManager

    from oscar_hf.evaluation.lm_eval_model import OscarLM
    from oscar_hf.evaluation.tasks import available_tasks, write_task_configs

    specs = available_tasks(task_dirs)
    unknown = [t for t in tasks if t not in specs]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; available: {sorted(specs)}")
    if seeds > 1 and temperature <= 0:
        logger.warning("%d seeds with greedy decoding give identical runs; pass --temperature > 0 to sample", seeds)
    if data_dir is not None:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out_dir = Path(out_dir)
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    gen_kwargs = generation_kwargs(max_gen_toks, temperature)
    settings = {
        "limit": limit,
        "max_gen_toks": max_gen_toks,
        "temperature": temperature,
        "sink": sink,
        "recent": recent,
        "batch_size": batch_size,
        "think_end_token": think_end_token,
        "data_dir": str(data_dir) if data_dir else None,
    }
    keys = [RunKey(m, t, s) for m in methods for t in tasks for s in range(seeds)]
    todo = [k for k in keys if not run_path(out_dir, k).exists()]
    _check_resumable(out_dir, [k for k in keys if k not in todo], settings)
    if len(todo) < len(keys):
        logger.warning("resuming: %d of %d runs already in %s", len(keys) - len(todo), len(keys), out_dir / "runs")
    with tempfile.TemporaryDirectory(prefix="oscar_hf_tasks_") as folder:
        names = write_task_configs([specs[t] for t in tasks], Path(data_dir) if data_dir else None, folder)
        task_manager = TaskManager(include_path=folder) if todo else None
        wrappers: dict[str, OscarLM] = {}
        bar = tqdm(todo, desc="eval tasks", disable=not progress)
        for key in bar:
            bar.set_postfix_str(f"{key.method} {key.task} seed {key.seed}")
            if key.method not in wrappers:
                wrappers.clear()  # one wrapper at a time around the one model
                wrappers[key.method] = OscarLM(
                    pretrained=model,
                    tokenizer=tokenizer,
                    method=key.method,
                    rotations=rotations_for(rotations, key.method),
                    sink=sink,
                    recent=recent,
                    max_gen_toks=max_gen_toks,
                    batch_size=batch_size,
                    think_end_token=think_end_token,
                )
            record = run_one(
                wrappers[key.method], specs[key.task], names[key.task], task_manager, key, limit, gen_kwargs
            )
            record.update({"settings": settings, **(environment or {})})
            path = run_path(out_dir, key)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=2) + "\n")
            tmp.replace(path)  # a run file exists only once the run finished
            logger.info(
                "%s %s seed %d: %s = %.4f (%.0f s)",
                key.method,
                key.task,
                key.seed,
                record["metric"],
                record["score"],
                record["seconds"],
            )
    return write_summary(
        out_dir, methods, tasks, seeds, head_dim=_head_dim(model), environment=environment, settings=settings
    )


RESUME_SETTINGS = ("limit", "max_gen_toks", "temperature", "sink", "recent", "think_end_token")


def _check_resumable(out_dir: Path, done: list[RunKey], settings: dict) -> None:
    """Refuse to mix runs made with other settings into one table (a resumed run must match them)."""
    for key in done:
        old = json.loads(run_path(out_dir, key).read_text()).get("settings", {})
        differ = {
            name: (old.get(name), settings.get(name))
            for name in RESUME_SETTINGS
            if name in old and old.get(name) != settings.get(name)
        }
        if differ:
            raise ValueError(
                f"{run_path(out_dir, key)} was made with other settings (file, now): {differ}; "
                "use another --out, or delete the run files to redo them"
            )


def _head_dim(model) -> int:

    return head_dim_of(model)


def load_runs(
    out_dir: str | Path, methods: list[str], tasks: list[str], seeds: int
) -> dict[tuple[str, str], list[float]]:
    """(method, task) -> the scores of the finished seeds found in ``out_dir``."""
    scores: dict[tuple[str, str], list[float]] = {}
    for method in methods:
        for task in tasks:
            for seed in range(seeds):
                path = run_path(out_dir, RunKey(method, task, seed))
                if path.exists():
                    scores.setdefault((method, task), []).append(json.loads(path.read_text())["score"])
    return scores


def same_output_rates(out_dir: str | Path, methods: list[str], tasks: list[str], seeds: int) -> dict[str, float]:
    """Method -> the fraction of samples whose whole generation equals BF16's (``none``), same task, seed and doc."""

    def digests(method):
        found = {}
        for task in tasks:
            for seed in range(seeds):
                path = run_path(out_dir, RunKey(method, task, seed))
                if path.exists():
                    for sample in json.loads(path.read_text())["samples"]:
                        found[(task, seed, sample["doc_id"])] = sample.get("response_sha1")
        return found

    base = digests(BASELINE)
    rates = {}
    for method in methods:
        mine = digests(method)
        shared = [k for k in mine if k in base and mine[k] and base[k]]
        if shared:
            rates[method] = sum(mine[k] == base[k] for k in shared) / len(shared)
    return rates


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summary_rows(
    scores: dict, methods: list[str], tasks: list[str], head_dim: int, sink: int = 64, recent: int = 256
) -> list[dict]:
    """One row per method: per-task mean/std (in %), mean over tasks, drop vs ``none``, BPE at 128K."""
    rows = []
    for method in methods:
        cells = {}
        for task in tasks:
            values = scores.get((method, task))
            if values:
                mean, std = _mean_std([100.0 * v for v in values])
                cells[task] = {"mean": mean, "std": std, "seeds": len(values)}
        complete = len(cells) == len(tasks)
        average = statistics.fmean(c["mean"] for c in cells.values()) if complete else None
        rows.append(
            {
                "method": method,
                "tasks": cells,
                "average": average,
                "bpe": bits_per_element(
                    METHODS[method].with_overrides(sink=sink, recent=recent), BPE_CONTEXT, head_dim
                ),
            }
        )
    base = next((r["average"] for r in rows if r["method"] == BASELINE), None)
    for row in rows:
        row["drop_vs_bf16"] = (row["average"] - base) if row["average"] is not None and base is not None else None
    return rows


def table_markdown(rows: list[dict], tasks: list[str]) -> str:
    def cell(c):
        if c is None:
            return "-"
        return f"{c['mean']:.1f} ± {c['std']:.1f}" if c["seeds"] > 1 else f"{c['mean']:.1f}"

    def number(x, signed=False):
        return "-" if x is None else (f"{x:+.1f}" if signed else f"{x:.1f}")

    head = ["method", *tasks, "avg", "Δ vs BF16", "same output as BF16", "BPE@128K"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        values = [
            row["method"],
            *(cell(row["tasks"].get(t)) for t in tasks),
            number(row["average"]),
            number(row["drop_vs_bf16"], signed=True),
            "-" if row.get("same_output_as_bf16") is None else f"{100 * row['same_output_as_bf16']:.0f}%",
            f"{row['bpe']:.2f}",
        ]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def bar_chart(rows: list[dict], tasks: list[str], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [*tasks, "avg"]
    width = 0.8 / max(len(rows), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(columns)), 4))
    for i, row in enumerate(rows):
        means = [row["tasks"].get(t, {}).get("mean", math.nan) for t in tasks] + [row["average"] or math.nan]
        stds = [row["tasks"].get(t, {}).get("std", 0.0) for t in tasks] + [0.0]
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(columns))]
        ax.bar(xs, means, width, yerr=stds, label=f"{row['method']} ({row['bpe']:.2f} BPE)", capsize=2)
    ax.set_xticks(range(len(columns)), columns)
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_summary(
    out_dir: str | Path,
    methods: list[str],
    tasks: list[str],
    seeds: int,
    *,
    head_dim: int,
    environment: dict | None = None,
    settings: dict | None = None,
) -> dict:
    """Rebuild ``table.md``, ``summary.json`` and ``accuracy.png`` from the run files in ``out_dir``."""
    out_dir = Path(out_dir)
    scores = load_runs(out_dir, methods, tasks, seeds)
    windows = {k: (settings or {}).get(k) or default for k, default in (("sink", 64), ("recent", 256))}
    rows = summary_rows(scores, methods, tasks, head_dim, **windows)
    overall = same_output_rates(out_dir, methods, tasks, seeds)
    by_task = {task: same_output_rates(out_dir, methods, [task], seeds) for task in tasks}
    for row in rows:
        row["same_output_as_bf16"] = overall.get(row["method"])
        row["same_output_as_bf16_by_task"] = {task: rates.get(row["method"]) for task, rates in by_task.items()}
    table = table_markdown(rows, tasks)
    env = environment or {}
    header = [
        f"Command: `{env.get('command', '?')}`",
        f"Machine: {machine_line(env['machine']) if 'machine' in env else '?'}",
        f"Date: {env.get('date', '?')}",
        f"Settings: {json.dumps(settings or {})}",
        f'Scores in %, mean ± std over {seeds} seed(s); "same output as BF16": share of samples whose whole '
        f"generation equals the `none` run's (same task, seed, example); BPE = KV bits per element at 128K "
        f"context, head_dim {head_dim}.",
    ]
    (out_dir / "table.md").write_text("\n\n".join(header) + "\n\n" + table + "\n")
    summary = {**env, "settings": settings, "methods": methods, "tasks": tasks, "seeds": seeds, "rows": rows}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    title = (
        textwrap.fill(env.get("command", ""), 120)
        + f"\n{machine_line(env['machine']) if 'machine' in env else ''}, {env.get('date', '')}"
    )
    bar_chart(rows, tasks, out_dir / "accuracy.png", title)
    return {**summary, "table": table}

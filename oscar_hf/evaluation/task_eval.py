"""``oscar-hf eval tasks``: accuracy per (method, task, seed) through lm-eval, and the paper's Table 2.

Every run goes through lm-eval's ``simple_evaluate`` with the ``oscar`` model
(:class:`oscar_hf.evaluation.lm_eval_model.OscarLM`), one wrapper per method around one loaded model. Each run
writes ``runs/<method>__<task>__seed<k>.json``; a run whose file exists is skipped, so an
interrupted evaluation resumes where it stopped. The summary (``table.md``, ``summary.json``,
``accuracy.png``) is rebuilt from the run files (:mod:`oscar_hf.evaluation.task_summary`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from tqdm.auto import tqdm

from oscar_hf.evaluation.task_summary import RunKey, run_path, write_summary
from oscar_hf.log import get_logger
from oscar_hf.model_info import head_dim_of
from oscar_hf.provenance import portable_path
from oscar_hf.rotations.rotation_set import MethodRotations, rotations_for

logger = get_logger(__name__)

MAX_ANSWER_CHARS = 1000


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
        "data_dir": portable_path(data_dir) if data_dir else None,
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
        out_dir, methods, tasks, seeds, head_dim=head_dim_of(model), environment=environment, settings=settings
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

"""Evaluation tasks for ``oscar-hf eval tasks``: one YAML file per task in this folder.

Each YAML is an lm-eval task config plus an ``oscar:`` block that this module reads and removes:

- ``name``: the short name used on the command line (``--tasks gsm8k``).
- ``include_lm_eval``: an lm-eval built-in task YAML (path under ``lm_eval/tasks``) whose prompt,
  filters and metrics are reused (rendered as an absolute ``include:``).
- ``data_files``: split -> file under the data dir (``--data-dir`` / ``$OSCAR_HF_DATA_DIR``); the
  files are read in place (``dataset_path: json``), never copied.
- ``online_task``: the lm-eval task to run when there is no data dir (it downloads the public
  dataset), or ``online_dataset`` (``dataset_path``/``dataset_name`` for this YAML) instead.
- ``metric``: the ``"metric,filter"`` key shown in the table.
- ``redact``: keep only extracted answers in result files (GPQA); ``code``: the task executes
  model-written programs (lm-eval's ``confirm_run_unsafe_code``).

Adding a task (e.g. LiveCodeBench v6) is one more YAML here, or in a folder passed as
``--task-dir``; functions it needs go in a module importable as ``!function package.module.fn``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

TASKS_DIR = Path(__file__).parent


class _Function(str):
    """A ``!function`` reference, kept as text and written back unchanged."""


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


_Loader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))
_Dumper.add_representer(_Function, lambda dumper, value: dumper.represent_scalar("!function", str(value)))


@dataclass
class TaskSpec:
    """One task of ``eval tasks``: where its YAML lives and what the ``oscar:`` block says."""

    name: str
    path: Path
    config: dict
    data_files: dict[str, str] = field(default_factory=dict)
    metric: str = "exact_match,none"
    online_task: str | None = None
    online_dataset: dict | None = None
    include_lm_eval: str | None = None
    redact: bool = False
    code: bool = False

    @property
    def lm_eval_name(self) -> str:
        return self.config["task"]

    def render(self, data_dir: Path | None) -> dict:
        """The lm-eval task config: local files under ``data_dir``, or the public dataset when it is None."""
        import lm_eval.tasks

        config = dict(self.config)
        if self.include_lm_eval:
            config = {"include": str(Path(lm_eval.tasks.__file__).parent / self.include_lm_eval), **config}
        if data_dir is None:
            if not self.online_dataset:
                raise ValueError(f"task {self.name!r} has no online dataset; pass --data-dir")
            config.update({"dataset_name": None, "dataset_kwargs": None, **self.online_dataset})
            return config
        files = {split: str((Path(data_dir) / rel).resolve()) for split, rel in self.data_files.items()}
        missing = [f for f in files.values() if not os.path.exists(f)]
        if missing:
            raise FileNotFoundError(f"task {self.name!r}: missing data file(s) {missing} (under --data-dir {data_dir})")
        config.update({"dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": files}})
        return config


def load_spec(path: str | Path) -> TaskSpec:
    path = Path(path)
    config = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    oscar = config.pop("oscar", None) or {}
    name = oscar.get("name") or path.stem
    return TaskSpec(
        name=name,
        path=path,
        config=config,
        data_files=dict(oscar.get("data_files") or {}),
        metric=oscar.get("metric", "exact_match,none"),
        online_task=oscar.get("online_task"),
        online_dataset=oscar.get("online_dataset"),
        include_lm_eval=oscar.get("include_lm_eval"),
        redact=bool(oscar.get("redact", False)),
        code=bool(oscar.get("code", False)),
    )


def available_tasks(extra_dirs: list[str | Path] = ()) -> dict[str, TaskSpec]:
    """Short name -> spec for every YAML here and in ``extra_dirs`` (later folders win)."""
    specs: dict[str, TaskSpec] = {}
    for folder in [TASKS_DIR, *map(Path, extra_dirs)]:
        for path in sorted(folder.glob("*.yaml")):
            spec = load_spec(path)
            specs[spec.name] = spec
    return specs


def write_task_configs(specs: list[TaskSpec], data_dir: Path | None, folder: str | Path) -> dict[str, str]:
    """Write the rendered YAMLs into ``folder`` (for ``TaskManager(include_path=folder)``).

    Returns short name -> the lm-eval task name to run: ours (``oscar_<name>``) with local data,
    the built-in one (``online_task``) without.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = {}
    for spec in specs:
        if data_dir is None and spec.online_task:
            names[spec.name] = spec.online_task
            continue
        text = yaml.dump(spec.render(data_dir), Dumper=_Dumper, sort_keys=False, allow_unicode=True)
        (folder / f"{spec.lm_eval_name}.yaml").write_text(text, encoding="utf-8")
        names[spec.name] = spec.lm_eval_name
    return names

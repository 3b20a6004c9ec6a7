"""Benchmark configs: ``--set KEY=JSON`` overrides and merging a config over its defaults."""

from __future__ import annotations

import copy
import json
from typing import Iterable


def deep_merge(base: dict, override: dict) -> dict:
    """``base`` with ``override`` applied key by key (nested dicts merged, everything else replaced)."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def apply_sets(config: dict, assignments: Iterable[str]) -> dict:
    """Apply ``--set a.b=JSON`` overrides (a value that is not JSON is taken as a string)."""
    config = copy.deepcopy(config)
    for assignment in assignments:
        path, _, raw = assignment.partition("=")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        *parents, last = path.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return config


def union_configs(configs: list[dict]) -> dict:
    """The first config with every list holding the values of all configs' lists at that key, in order."""
    merged = copy.deepcopy(configs[0])
    for other in configs[1:]:
        for key, value in other.items():
            mine = merged.get(key)
            if isinstance(value, dict) and isinstance(mine, dict):
                merged[key] = union_configs([mine, value])
            elif isinstance(value, list) and isinstance(mine, list):
                merged[key] = mine + [item for item in value if item not in mine]
    return merged

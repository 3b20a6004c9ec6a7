"""eval/soak.py in short: its checks pass on the cache as it is, and each catches the invariant it
guards when that invariant is broken on purpose."""

from __future__ import annotations

import json

import pytest

import oscar_hf.core.quantize_jobs as quantize_jobs_module
import oscar_hf.core.storage as storage_module
from eval import soak
from oscar_hf.core.layer import OscarLayer
from oscar_hf.core.layer_window import StepPlan


def test_a_short_soak_passes_its_checks_and_writes_its_results(tmp_path):
    argv = ["--steps", "300", "--check-every", "100", "--methods", "oscar-int2", "none", "--out", str(tmp_path)]
    assert soak.main(argv) == 0
    result = json.loads((tmp_path / "soak.json").read_text())
    runs = {(run["method"], run["mode"]): run for run in result["runs"]}
    assert set(runs) == {(m, mode) for m in ("oscar-int2", "none") for mode in ("eager", "frozen")}
    for (method, _), run in runs.items():
        assert run["failures"] == [] and len(run["samples"]) == 3 and run["samples"][-1]["length"] == 324
        assert run["probes"] == (3 if method == "oscar-int2" else 0)  # one recall probe per check
    portable = [*argv[:-1], tmp_path.name]  # the output folder, outside the working directory, by its name
    assert result["command"].endswith(" ".join(portable)) and result["machine"]["torch"]
    assert (tmp_path / "soak.png").stat().st_size > 0 and "| oscar-int2 | frozen |" in (
        tmp_path / "soak.md"
    ).read_text()


def _never_demote(monkeypatch):
    plan = OscarLayer._plan
    monkeypatch.setattr(OscarLayer, "_plan", lambda self, new, ahead: StepPlan(plan(self, new, ahead).to_sink, 0, 0))


def _corrupt_history(monkeypatch):
    quantize = quantize_jobs_module.quantize_pack_into

    def corrupting(sources, destinations, *args, **kwargs):
        quantize(sources, destinations, *args, **kwargs)
        for target in destinations:
            target.codes.bitwise_xor_(1)

    monkeypatch.setattr(quantize_jobs_module, "quantize_pack_into", corrupting)


def _leak_each_steps_keys(monkeypatch):
    kept, stash = [], OscarLayer.stash
    monkeypatch.setattr(OscarLayer, "stash", lambda self, keys, values: (kept.append(keys), stash(self, keys, values)))


def _overgrow_storage(monkeypatch):
    monkeypatch.setattr(storage_module, "_GROWTH", 3.0)


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (_never_demote, "demoted 0 rows"),
        (_corrupt_history, "demoted rows read back"),
        (_overgrow_storage, "more than growth allows"),
        (_leak_each_steps_keys, "more Python objects"),
    ],
)
def test_a_broken_invariant_is_caught(monkeypatch, break_it, message):
    break_it(monkeypatch)
    model = soak.tiny_model()
    rotations = soak.random_rotations(soak.MODEL["head_dim"], [0, 1])
    run = soak.Soak(model, "oscar-int2", "eager", rotations, check_every=100).soak(200)
    assert any(message in failure for failure in run.failures), run.failures

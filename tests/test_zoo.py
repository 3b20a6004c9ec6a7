"""Rotation files: our format, the official RotationZoo layout, the hub (faked: no network) and OscarCache.from_zoo."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import load_file, save_file
from transformers import Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from oscar_hf import OscarCache
from oscar_hf.model_info import full_attention_layer_ids
from oscar_hf.rotations.files import CONFIG_FILE, TENSORS_FILE, load_rotation_config, save_rotations
from oscar_hf.rotations.hub import RotationsNotFoundError, load_rotations, push_rotations_to_hub
from oscar_hf.rotations.official import OFFICIAL_KEY_FILE, OFFICIAL_VALUE_FILE, convert_official, load_official
from oscar_hf.rotations.resolve import (
    DEFAULT_PAPER_ROTATIONS,
    DEFAULT_ROTATIONS,
    ROTATION_ZOO,
    bundled_rotations_dir,
    resolve_rotations,
)
from oscar_hf.rotations.rotation_set import RotationSet
from tests.conftest import TINY, forward, tiny_model

HEAD_DIM = TINY["head_dim"]
QWEN_FOLDER = "Qwen3-8B/seq20000_prompt83_group128"


# --- helpers -------------------------------------------------------------------------------------


def orthogonal(dim: int = HEAD_DIM, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))[0].float()


def rotation_set(layer_ids=(0, 1), head_dim: int = HEAD_DIM, clips: bool = True) -> RotationSet:
    n = len(layer_ids)
    return RotationSet(
        head_dim,
        key={i: orthogonal(head_dim, i) for i in layer_ids},
        value={i: orthogonal(head_dim, 100 + i) for i in layer_ids},
        description="test rotations",
        key_eigenvalues={i: torch.linspace(0, 1, head_dim) + i for i in layer_ids},
        value_eigenvalues={i: torch.linspace(1, 2, head_dim) + i for i in layer_ids},
        key_clip=dict(zip(layer_ids, [0.96, 0.9][:n])) if clips else {},
        value_clip=dict(zip(layer_ids, [0.92, 0.875][:n])) if clips else {},
    )


def assert_same(a: RotationSet, b: RotationSet, eigenvalues: bool = True) -> None:
    assert a.head_dim == b.head_dim
    tables = ["key", "value"] + (["key_eigenvalues", "value_eigenvalues"] if eigenvalues else [])
    for table in tables:
        left, right = getattr(a, table), getattr(b, table)
        assert sorted(left) == sorted(right), table
        assert all(torch.equal(left[i], right[i]) for i in left), table
    assert a.key_clip == b.key_clip and a.value_clip == b.value_clip
    assert a.key_bits == b.key_bits and a.value_bits == b.value_bits and a.base_bits == b.base_bits


def official_layers(layer_ids, head_dim=HEAD_DIM, seed=0, str_keys=False, eigenvalues=True) -> dict:
    layers = {}
    for i in layer_ids:
        entry = {"layer_id": i, "rotation": orthogonal(head_dim, seed + i)}
        if eigenvalues:
            entry["eigenvalues"] = torch.rand(head_dim, generator=torch.Generator().manual_seed(i)).sort().values
        layers[str(i) if str_keys else i] = entry
    return layers


def write_official(
    directory: Path, layer_ids=(0, 1), head_dim=HEAD_DIM, str_keys=False, eigenvalues=True, value_layer_ids=None
) -> Path:
    """A folder in the exact RotationZoo format."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, objective, ids, seed in (
        (OFFICIAL_KEY_FILE, "qqt_r_h_pbr", layer_ids, 0),
        (OFFICIAL_VALUE_FILE, "sst_r_h_pbr", value_layer_ids or layer_ids, 100),
    ):
        data = {
            "format_version": 1,
            "objective": objective,
            "source_grouping": "layer",
            "layers": official_layers(ids, head_dim, seed, str_keys, eigenvalues),
        }
        torch.save(data, directory / name)
    return directory


def tiny_llama(name_or_path: str = "") -> LlamaForCausalLM:
    model = tiny_model("llama")
    model.config._name_or_path = name_or_path
    return model


class FakeHub:
    """``snapshot_download`` over a local folder laid out like a hub repo: copies what allow_patterns select."""

    def __init__(self, repo_root: Path, cache: Path):
        self.repo_root, self.cache, self.calls = repo_root, cache, []

    def __call__(self, repo_id, **kwargs):
        self.calls.append({"repo_id": repo_id, **kwargs})
        files = [p.relative_to(self.repo_root).as_posix() for p in self.repo_root.rglob("*") if p.is_file()]
        snapshot = self.cache / f"snapshot{len(self.calls)}"
        snapshot.mkdir(parents=True)
        for name in filter_repo_objects(files, allow_patterns=kwargs.get("allow_patterns")):
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.repo_root / name, snapshot / name)
        return str(snapshot)


_REAL_SNAPSHOT_DOWNLOAD = huggingface_hub.snapshot_download


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any hub access a test did not fake fails at once (instead of waiting on an unreachable hub)."""

    def cache_only(repo_id, **kwargs):
        if not kwargs.get("local_files_only"):
            raise AssertionError(f"test tried to reach the hub for {repo_id}")
        return _REAL_SNAPSHOT_DOWNLOAD(repo_id, **kwargs)

    def no_api(*args, **kwargs):
        raise AssertionError("test tried to use huggingface_hub.HfApi")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cache_only)
    monkeypatch.setattr(huggingface_hub, "HfApi", no_api)


@pytest.fixture
def online(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def fake_zoo(tmp_path, monkeypatch, online) -> FakeHub:
    """The RotationZoo as a fake hub: Qwen3-8B at one calibration, Qwen3-4B at two."""
    root = tmp_path / "hub-repo"
    write_official(root / QWEN_FOLDER)
    write_official(root / "Qwen3-4B" / "seq20000_prompt83_group128")
    write_official(root / "Qwen3-4B" / "seq5000_prompt20_group64")
    (root / "README.md").write_text("RotationZoo")
    hub = FakeHub(root, tmp_path / "hub-cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    return hub


# --- our format ----------------------------------------------------------------------------------


def test_round_trip_with_clip_ratios(tmp_path) -> None:
    rotations = rotation_set()
    metadata = {"model_id": "tiny", "revision": "abc", "objective": "qqt_sst", "group_size": 16, "sink": 4}
    out = save_rotations(rotations, tmp_path / "rot", metadata)
    assert {p.name for p in out.iterdir()} == {TENSORS_FILE, CONFIG_FILE}
    tensors = load_file(str(out / TENSORS_FILE))
    assert tensors["layers.0.key_clip"].dtype == torch.float32 and tensors["layers.1.value_clip"].numel() == 1
    loaded = load_rotations(out)
    assert_same(loaded, rotations)
    assert loaded.key_clip == {0: 0.96, 1: 0.9} and loaded.value_clip == {0: 0.92, 1: 0.875}  # exact, not float32 noise
    config = load_rotation_config(out)
    assert config["layer_ids"] == [0, 1] and {k: config[k] for k in metadata} == metadata


def test_round_trip_without_clip_ratios_and_clip_only_layers(tmp_path) -> None:
    rotations = rotation_set(clips=False)
    assert_same(load_rotations(save_rotations(rotations, tmp_path / "a")), rotations)
    clip_only = RotationSet(HEAD_DIM, key_clip={3: 0.5})
    loaded = load_rotations(save_rotations(clip_only, tmp_path / "b"))
    assert loaded.key_clip == {3: 0.5} and loaded.key == {} and load_rotation_config(tmp_path / "b")["layer_ids"] == [3]


def test_clip_tensors_may_be_0d_but_not_longer(tmp_path) -> None:
    out = save_rotations(rotation_set(clips=False), tmp_path)
    tensors = load_file(str(out / TENSORS_FILE))
    save_file({**tensors, "layers.0.key_clip": torch.tensor(0.96)}, str(out / TENSORS_FILE))
    assert load_rotations(out).key_clip == {0: 0.96}
    save_file({**tensors, "layers.0.key_clip": torch.tensor([0.9, 0.8])}, str(out / TENSORS_FILE))
    with pytest.raises(ValueError, match="single clip ratio"):
        load_rotations(out)
    save_file({**tensors, "layers.0.key_clip": torch.tensor([1.5])}, str(out / TENSORS_FILE))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        load_rotations(out)


def test_bundled_artifact_without_clip_tensors_still_loads() -> None:
    rotations = load_rotations(bundled_rotations_dir(DEFAULT_PAPER_ROTATIONS))
    assert rotations.head_dim == 64 and len(rotations.key) == 30 and rotations.key_clip == {} == rotations.value_clip
    assert rotations.key_bits == {} == rotations.value_bits


def test_round_trip_with_per_layer_bit_widths(tmp_path) -> None:
    rotations = rotation_set()
    rotations.key_bits.update({0: 4})
    rotations.value_bits.update({0: 1, 1: 1})
    out = save_rotations(rotations, tmp_path)
    assert load_file(str(out / TENSORS_FILE))["layers.1.value_bits"].tolist() == [1.0]
    loaded = load_rotations(out)
    assert_same(loaded, rotations)
    assert loaded.key_bits == {0: 4} and loaded.value_bits == {0: 1, 1: 1}
    assert all(type(b) is int for b in loaded.value_bits.values())


def test_the_widths_base_method_is_recorded_and_read_back(tmp_path) -> None:
    rotations = rotation_set()
    rotations.key_bits.update({0: 4})
    rotations.value_bits.update({1: 1})
    rotations.base_bits = (3, 2)
    out = save_rotations(rotations, tmp_path / "k3v2")
    assert load_rotation_config(out)["base_bits"] == {"key": 3, "value": 2}
    assert load_rotations(out).base_bits == (3, 2)
    assert "base_bits" not in load_rotation_config(save_rotations(rotation_set(), tmp_path / "plain"))
    # sets saved without the record hold allocations for 2-bit K and V, as the bundled default does
    assert load_rotations(bundled_rotations_dir(DEFAULT_ROTATIONS)).base_bits == (2, 2)
    config = load_rotation_config(out)
    (out / CONFIG_FILE).write_text(json.dumps({**config, "base_bits": [3, 2]}))
    with pytest.raises(ValueError, match="base_bits must be"):
        load_rotations(out)


def test_bit_width_tensors_must_be_one_supported_whole_number(tmp_path) -> None:
    out = save_rotations(rotation_set(clips=False), tmp_path)
    tensors = load_file(str(out / TENSORS_FILE))
    for bad, message in (
        (torch.tensor([1.5]), "whole bit width"),
        (torch.tensor([4.0, 1.0]), "whole bit width"),
        (torch.tensor([8.0]), r"one of \(1, 2, 3, 4\)"),
    ):
        save_file({**tensors, "layers.0.key_bits": bad}, str(out / TENSORS_FILE))
        with pytest.raises(ValueError, match=message):
            load_rotations(out)


def test_from_pretrained_local_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rotations(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rotations(str(tmp_path / "missing"))  # an absolute path is never taken for a hub id
    with pytest.raises(FileNotFoundError, match="holds no rotations"):
        load_rotations(tmp_path)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(NotADirectoryError):
        load_rotations(tmp_path / "file.txt")


# --- the official RotationZoo layout -------------------------------------------------------------


@pytest.mark.parametrize("str_keys", [False, True])
@pytest.mark.parametrize("eigenvalues", [True, False])
def test_load_official_reads_the_files_as_they_are(tmp_path, str_keys, eigenvalues) -> None:
    folder = write_official(tmp_path / QWEN_FOLDER, (0, 2, 5), str_keys=str_keys, eigenvalues=eigenvalues)
    rotations = load_official(folder)
    assert rotations.head_dim == HEAD_DIM and sorted(rotations.key) == sorted(rotations.value) == [0, 2, 5]
    assert torch.equal(rotations.key[2], orthogonal(HEAD_DIM, 2))
    assert torch.equal(rotations.value[5], orthogonal(HEAD_DIM, 105))
    assert sorted(rotations.key_eigenvalues) == ([0, 2, 5] if eigenvalues else [])
    assert "Qwen3-8B/seq20000_prompt83_group128" in rotations.description
    assert_same(load_rotations(folder), rotations)  # load_rotations detects the official layout


@pytest.mark.parametrize("str_keys", [False, True])
def test_convert_official_round_trip(tmp_path, str_keys) -> None:
    src = write_official(tmp_path / "zoo" / QWEN_FOLDER, (3, 7), str_keys=str_keys)
    official = load_official(src)
    out = convert_official(src, tmp_path / "converted", metadata={"model_id": "Qwen/Qwen3-8B"})
    assert_same(load_rotations(out), official)
    config = load_rotation_config(out)
    assert config["objective"] == "qqt_sst" and config["composition"] == "r_h_pbr"
    assert config["key_objective"] == "qqt_r_h_pbr" and config["value_objective"] == "sst_r_h_pbr"
    assert config["calibration"] == "seq20000_prompt83_group128" and config["model_name"] == "Qwen3-8B"
    assert config["source_path"] == str(src.resolve()) and config["model_id"] == "Qwen/Qwen3-8B"
    assert config["layer_ids"] == [3, 7]


def test_other_objectives_and_identity_files(tmp_path) -> None:
    folder = tmp_path / "identity"
    folder.mkdir()
    eye = {
        "format_version": "identity-v1",
        "objective": "hadamard",
        "source_grouping": "layer",
        "layers": {0: {"layer_id": 0, "rotation": torch.eye(HEAD_DIM)}},
    }
    torch.save(eye, folder / "k_rotation_hadamard.pt")
    torch.save(eye, folder / "v_rotation_hadamard.pt")
    assert torch.equal(load_official(folder).key[0], torch.eye(HEAD_DIM))
    assert load_rotation_config(convert_official(folder, tmp_path / "out"))["objective"] == "hadamard"


def rewrite(path: Path, edit) -> None:
    data = torch.load(path, weights_only=True)
    edit(data)
    torch.save(data, path)


def test_official_errors(tmp_path) -> None:
    folder = write_official(tmp_path / "a")
    (folder / OFFICIAL_VALUE_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=OFFICIAL_VALUE_FILE):
        load_official(folder)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_official(tmp_path / "missing")

    cases = {
        "no 'layers' key": lambda d: d.pop("layers"),
        "shape": lambda d: d["layers"][0].update(rotation=torch.eye(HEAD_DIM)[:, :8]),
        "eigenvalues of layer 1": lambda d: d["layers"][1].update(eigenvalues=torch.zeros(3)),
        "orthogonal": lambda d: d["layers"][0].update(rotation=torch.ones(HEAD_DIM, HEAD_DIM)),
        "layer_id=5": lambda d: d["layers"][0].update(layer_id=5),
        "format_version": lambda d: d.update(format_version=2),
        "not a layer id": lambda d: d["layers"].update(bad={}),
        "no 'rotation'": lambda d: d["layers"][1].pop("rotation"),
    }
    for message, edit in cases.items():
        folder = write_official(tmp_path / message.replace(" ", "_").replace("'", ""))
        rewrite(folder / OFFICIAL_KEY_FILE, edit)
        with pytest.raises(ValueError, match=message):
            load_official(folder)

    mismatched = write_official(tmp_path / "mismatch", (0, 1), value_layer_ids=(0, 2))
    message = r"k_rotation_qqt_r_h_pbr.pt has layers \[0, 1\] but v_rotation_sst_r_h_pbr.pt has layers \[0, 2\]"
    with pytest.raises(ValueError, match=message):
        load_official(mismatched)
    sizes = write_official(tmp_path / "sizes")
    torch.save({"format_version": 1, "layers": official_layers((0, 1), head_dim=8)}, sizes / OFFICIAL_VALUE_FILE)
    with pytest.raises(ValueError, match="different shapes"):
        load_official(sizes)
    garbage = write_official(tmp_path / "garbage")
    (garbage / OFFICIAL_KEY_FILE).write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="not a torch-saved RotationZoo file"):
        load_official(garbage)


# --- the hub (faked) -----------------------------------------------------------------------------


def test_from_pretrained_official_zoo_on_the_hub(fake_zoo) -> None:
    rotations = load_rotations(ROTATION_ZOO, subfolder=QWEN_FOLDER, revision="v1")
    assert_same(rotations, load_official(fake_zoo.repo_root / QWEN_FOLDER))
    (call,) = fake_zoo.calls
    assert call["repo_id"] == ROTATION_ZOO and call["revision"] == "v1" and call["local_files_only"] is False
    assert all(pattern.startswith(QWEN_FOLDER + "/") for pattern in call["allow_patterns"])
    fetched = sorted(p.name for p in (fake_zoo.cache / "snapshot1").rglob("*") if p.is_file())
    assert fetched == [OFFICIAL_KEY_FILE, OFFICIAL_VALUE_FILE]  # only this folder's files, not the whole zoo


def test_from_pretrained_our_format_on_the_hub(tmp_path, monkeypatch, online) -> None:
    root = tmp_path / "repo"
    rotations = rotation_set()
    save_rotations(rotations, root)
    hub = FakeHub(root, tmp_path / "cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    assert_same(load_rotations("someone/my-rotations", cache_dir=tmp_path / "c"), rotations)
    assert hub.calls[0]["cache_dir"] == tmp_path / "c"
    assert TENSORS_FILE in hub.calls[0]["allow_patterns"] and CONFIG_FILE in hub.calls[0]["allow_patterns"]


def test_hub_folder_without_rotations(fake_zoo) -> None:
    with pytest.raises(RotationsNotFoundError, match="holds no rotation files matching"):
        load_rotations(ROTATION_ZOO, subfolder="Qwen3-8B/no-such-calibration")
    with pytest.raises(RotationsNotFoundError, match="pass subfolder='<Model>/<calibration>'"):
        load_rotations(ROTATION_ZOO)


def test_offline_error_is_actionable(monkeypatch) -> None:
    def offline(repo_id, **kwargs):
        assert kwargs["local_files_only"] is True  # HF_HUB_OFFLINE=1 is honoured
        raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(RotationsNotFoundError) as info:
        load_rotations(ROTATION_ZOO, subfolder=QWEN_FOLDER)
    message = str(info.value)
    assert "offline mode is on" in message and ROTATION_ZOO in message and OFFICIAL_KEY_FILE[:11] in message
    assert f"hf download {ROTATION_ZOO} --include '{QWEN_FOLDER}/*'" in message
    assert f"load_rotations('DIR/{QWEN_FOLDER}')" in message and "HF_HUB_OFFLINE" in message
    # Deriving the folder from the model needs the zoo too; a local copy of its root then works as is.
    with pytest.raises(RotationsNotFoundError, match=r"--include 'Qwen3-8B/\*'.*OscarCache.from_zoo\(model, 'DIR'\)"):
        OscarCache.from_zoo(tiny_llama("Qwen/Qwen3-8B"), ROTATION_ZOO)


def test_unreachable_hub_error(monkeypatch, online) -> None:
    def unreachable(repo_id, **kwargs):
        raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(RotationsNotFoundError, match="hub is unreachable.*pass the local directory instead"):
        load_rotations("someone/rotations")


def test_real_snapshot_download_offline_with_empty_cache(tmp_path, monkeypatch) -> None:
    # The real huggingface_hub, told to stay offline: it must fail from the (empty) cache, without network.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RotationsNotFoundError, match="offline mode is on"):
        load_rotations(ROTATION_ZOO, subfolder=QWEN_FOLDER, cache_dir=tmp_path)


def test_missing_hub_repo(monkeypatch, online) -> None:
    def missing(repo_id, **kwargs):
        response = SimpleNamespace(headers={}, status_code=404, request=None)
        raise RepositoryNotFoundError("404 Repository Not Found", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", missing)
    with pytest.raises(RotationsNotFoundError, match="no local directory 'nobody/nothing' either"):
        load_rotations("nobody/nothing")


class FakeHfApi:
    instances: list["FakeHfApi"] = []

    def __init__(self, token=None):
        self.token, self.calls = token, []
        FakeHfApi.instances.append(self)

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        # What upload_folder would send: the folder's files that allow_patterns select, read now.
        files = [p.name for p in Path(folder_path).iterdir()]
        uploaded = sorted(filter_repo_objects(files, allow_patterns=kwargs.get("allow_patterns")))
        self.calls.append(("upload_folder", repo_id, uploaded, kwargs))
        return f"https://huggingface.co/{repo_id}/commit/123"


@pytest.fixture
def fake_api(monkeypatch):
    FakeHfApi.instances = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    return FakeHfApi


def test_push_rotation_set(fake_api) -> None:
    commit = push_rotations_to_hub(rotation_set(), "me/rot", private=True, commit_message="add", token="hf_x")
    assert commit == "https://huggingface.co/me/rot/commit/123"
    (api,) = fake_api.instances
    assert api.token == "hf_x"
    (_, repo, create), (_, repo2, uploaded, upload) = api.calls
    assert repo == repo2 == "me/rot" and create == {"private": True, "exist_ok": True}
    assert uploaded == [CONFIG_FILE, TENSORS_FILE] and upload["commit_message"] == "add"


def test_push_directory_uploads_only_rotation_files(tmp_path, fake_api) -> None:
    out = save_rotations(rotation_set(), tmp_path / "rot")
    (out / "notes.txt").write_text("private notes")
    push_rotations_to_hub(out, "me/rot")
    assert fake_api.instances[0].calls[1][2] == [CONFIG_FILE, TENSORS_FILE]
    official = write_official(tmp_path / "official")
    push_rotations_to_hub(official, "me/zoo")
    assert fake_api.instances[1].calls[1][2] == [OFFICIAL_KEY_FILE, OFFICIAL_VALUE_FILE]


def test_push_refuses_a_broken_directory(tmp_path, fake_api) -> None:
    out = save_rotations(rotation_set(), tmp_path / "rot")
    (out / TENSORS_FILE).unlink()
    with pytest.raises(FileNotFoundError):
        push_rotations_to_hub(out, "me/rot")
    assert fake_api.instances == []


# --- resolve_rotations and OscarCache.from_zoo ---------------------------------------------------


def test_from_zoo_with_a_local_directory(tmp_path) -> None:
    model = tiny_llama()
    rotations = rotation_set()
    cache = OscarCache.from_zoo(model, save_rotations(rotations, tmp_path / "rot"), sink=2, recent=2)
    assert_same(cache.rotations, rotations)
    assert cache.oscar_config.sink == 2
    forward(model, torch.randint(3, 256, (1, 12)), cache)
    assert cache.layers[0].history_length > 0


def test_from_zoo_rejects_mismatched_rotations(tmp_path) -> None:
    model = tiny_llama("someone/tiny")
    with pytest.raises(ValueError, match="head_dim=32 but someone/tiny has head_dim=16"):
        OscarCache.from_zoo(model, save_rotations(rotation_set(head_dim=32), tmp_path / "a"))
    with pytest.raises(
        ValueError,
        match=r"cover layers \[0-2\] but the full-attention layers of someone/tiny "
        r"are \[0, 1\] \(extra \[2\]\)",
    ):
        OscarCache.from_zoo(model, save_rotations(rotation_set((0, 1, 2), clips=False), tmp_path / "b"))
    with pytest.raises(ValueError, match=r"missing \[1\]"):
        resolve_rotations(model, rotation_set((0,)))


def test_layer_types_select_the_full_attention_layers(tmp_path) -> None:
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    config = Gemma3TextConfig(**dict(TINY, num_hidden_layers=4, sliding_window=4, layer_types=layer_types))
    assert full_attention_layer_ids(config) == [1, 3]
    sparse = write_official(tmp_path / "gemma", (1, 3))
    assert sorted(resolve_rotations(config, sparse).key) == [1, 3]
    with pytest.raises(ValueError, match="full-attention layers"):
        resolve_rotations(config, write_official(tmp_path / "dense", (0, 1, 2, 3)))


def test_from_zoo_derives_the_rotation_zoo_folder(fake_zoo) -> None:
    cache = OscarCache.from_zoo(tiny_llama("Qwen/Qwen3-8B"), ROTATION_ZOO, revision="main")
    assert_same(cache.rotations, load_official(fake_zoo.repo_root / QWEN_FOLDER))
    first, second = fake_zoo.calls
    assert first["allow_patterns"] == ["Qwen3-8B/*/k_rotation_*.pt", "Qwen3-8B/*/v_rotation_*.pt"]
    assert all(p.startswith(QWEN_FOLDER + "/") for p in second["allow_patterns"])
    assert first["revision"] == second["revision"] == "main"


def test_from_zoo_with_several_calibrations(fake_zoo) -> None:
    model = tiny_llama("Qwen/Qwen3-4B")
    with pytest.raises(
        ValueError,
        match=r"several calibrations for Qwen3-4B: \['seq20000_prompt83_group128', "
        r"'seq5000_prompt20_group64'\]; pick one with calibration=",
    ):
        OscarCache.from_zoo(model, ROTATION_ZOO)
    cache = OscarCache.from_zoo(model, ROTATION_ZOO, calibration="seq5000_prompt20_group64")
    assert_same(cache.rotations, load_official(fake_zoo.repo_root / "Qwen3-4B" / "seq5000_prompt20_group64"))
    assert all(p.startswith("Qwen3-4B/seq5000_prompt20_group64/") for p in fake_zoo.calls[-1]["allow_patterns"])


def test_from_zoo_model_missing_from_the_zoo_lists_what_is_there(fake_zoo, monkeypatch) -> None:
    files = [p.relative_to(fake_zoo.repo_root).as_posix() for p in fake_zoo.repo_root.rglob("*") if p.is_file()]
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: SimpleNamespace(list_repo_files=lambda repo, revision: files))
    with pytest.raises(
        ValueError,
        match=r"no rotations for 'Llama-3-8B'.*Qwen3-4B/seq5000_prompt20_group64.*"
        r"Qwen3-8B/seq20000_prompt83_group128",
    ):
        resolve_rotations(tiny_llama("meta/Llama-3-8B"), ROTATION_ZOO)
    with pytest.raises(ValueError, match="no name_or_path"):
        resolve_rotations(tiny_llama(""), ROTATION_ZOO)


def test_from_zoo_with_a_local_copy_of_the_zoo(tmp_path) -> None:
    root = tmp_path / "zoo"
    write_official(root / QWEN_FOLDER)
    model = tiny_llama("/models/Qwen3-8B")
    assert_same(resolve_rotations(model, root), load_official(root / QWEN_FOLDER))
    assert_same(resolve_rotations(model, root, subfolder=QWEN_FOLDER), load_official(root / QWEN_FOLDER))
    with pytest.raises(ValueError, match="not a RotationZoo root"):
        resolve_rotations(model, root / QWEN_FOLDER, calibration="x")


def test_default_without_a_bundled_set_explains_what_to_do() -> None:
    with pytest.raises(
        ValueError,
        match=r"no rotations are bundled.*smollm2-135m-instruct \(for "
        r"HuggingFaceTB/SmolLM2-135M-Instruct\).*oscar-hf calibrate",
    ):
        OscarCache.from_zoo(tiny_llama("someone/tiny"))
    with pytest.raises(ValueError, match="not to 'default'"):
        resolve_rotations(tiny_llama(), "default", subfolder="x")


SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
)


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "models/SmolLM2-135M-Instruct.Q4_1-0123"])
def test_default_matches_the_bundled_set_by_name_or_signature(name) -> None:
    config = LlamaConfig(**SMOLLM2)  # a config only: no weights are built
    config._name_or_path = name
    rotations = resolve_rotations(config, "default")
    assert rotations.head_dim == 64 and sorted(rotations.key) == list(range(30))
    config.num_hidden_layers = 28  # same name, other shape: caught by the check, not silently used
    config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(ValueError, match="full-attention layers"):
        resolve_rotations(config, "default")


@pytest.mark.slow
def test_from_zoo_default_model_offline(monkeypatch) -> None:
    from oscar_hf.core.models import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_model("default")
    cache = OscarCache.from_zoo(model)
    assert cache.rotations.head_dim == 64 and len(cache.rotations.key) == 30
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    forward(model, ids, cache)


# --- per-KV-head rotations ------------------------------------------------------------------------

KV_HEADS = TINY["num_key_value_heads"]


def per_head_set(layer_ids=(0, 1), kv_heads: int = KV_HEADS) -> RotationSet:
    return RotationSet(
        HEAD_DIM,
        key={i: torch.stack([orthogonal(seed=10 * i + h) for h in range(kv_heads)]) for i in layer_ids},
        value={i: torch.stack([orthogonal(seed=200 + 10 * i + h) for h in range(kv_heads)]) for i in layer_ids},
        description="per head",
        key_eigenvalues={i: torch.rand(kv_heads, HEAD_DIM).sort().values for i in layer_ids},
        value_eigenvalues={i: torch.rand(kv_heads, HEAD_DIM).sort().values for i in layer_ids},
        key_clip={i: 0.9 for i in layer_ids},
    )


def write_official_per_head(directory: Path, layer_ids=(0, 1), kv_heads: int = KV_HEADS, which: str = "kv") -> Path:
    """The reference's format 2 files (per KV head), torch.save'd as it writes them."""
    directory.mkdir(parents=True, exist_ok=True)
    for kind, seed in (("k", 0), ("v", 500)):
        if kind not in which:
            continue
        layers = {
            i: {
                "layer_id": i,
                "rotation": torch.stack([orthogonal(seed=seed + 10 * i + h) for h in range(kv_heads)]),
                "eigenvalues": torch.rand(kv_heads, HEAD_DIM).sort().values,
            }
            for i in layer_ids
        }
        data = {
            "format_version": 2,
            "objective": f"{'qqt' if kind == 'k' else 'sst'}_perhead",
            "source_grouping": "per_kv_head",
            "layers": layers,
        }
        torch.save(data, directory / f"{kind}_rotation_perhead.pt")
    return directory


def test_our_format_round_trips_per_head_rotations(tmp_path):
    rotations = per_head_set()
    out = save_rotations(rotations, tmp_path / "heads", {"model_id": "tiny"})
    assert load_rotation_config(out)["kv_heads"] == KV_HEADS
    loaded = load_rotations(out)
    assert loaded.kv_heads == KV_HEADS
    assert_same(loaded, rotations)
    assert "kv_heads" not in load_rotation_config(save_rotations(rotation_set(), tmp_path / "shared"))
    assert load_rotations(out, per_head=True).per_head
    with pytest.raises(ValueError, match="holds one rotation per KV head only, but shared rotations were asked"):
        load_rotations(out, per_head=False)
    with pytest.raises(ValueError, match="holds rotations shared by all heads of a layer only, but per-head"):
        load_rotations(tmp_path / "shared", per_head=True)
    tensors = load_file(str(out / TENSORS_FILE))
    tensors["layers.0.key_rotation"] = tensors["layers.0.key_rotation"][None]
    save_file(tensors, str(out / TENSORS_FILE))
    with pytest.raises(ValueError, match="has shape \\(1, 2, 16, 16\\), expected \\(16, 16\\) or \\(kv_heads"):
        load_rotations(out)


def test_official_per_head_files_load_beside_the_shared_ones(tmp_path):
    folder = write_official_per_head(write_official(tmp_path / "Qwen3-30B-A3B" / "calib"))
    v2_key = torch.load(folder / "k_rotation_perhead.pt")["layers"]
    heads = load_official(folder)  # both kinds present: the per-head files win
    assert heads.kv_heads == KV_HEADS and "qqt_perhead" in heads.description
    assert torch.equal(heads.key[1], v2_key[1]["rotation"])
    assert torch.equal(heads.key_eigenvalues[1], v2_key[1]["eigenvalues"])
    shared = load_official(folder, per_head=False)  # the V1 files, on request
    assert not shared.per_head
    assert torch.equal(shared.key[0], torch.load(folder / OFFICIAL_KEY_FILE)["layers"][0]["rotation"])
    assert load_rotations(folder, per_head=True).kv_heads == KV_HEADS
    converted = load_rotations(convert_official(folder, tmp_path / "ours"))
    assert_same(converted, heads)
    assert load_rotation_config(tmp_path / "ours")["source_files"] == ["k_rotation_perhead.pt", "v_rotation_perhead.pt"]


def test_asking_for_missing_per_head_files_is_an_error_not_a_fallback(tmp_path):
    only_v1 = write_official(tmp_path / "v1")
    assert not load_official(only_v1).per_head  # V1 alone keeps loading
    with pytest.raises(FileNotFoundError, match="no k_rotation_perhead.pt: per-head rotations were asked for"):
        load_official(only_v1, per_head=True)
    only_v2 = write_official_per_head(tmp_path / "v2")
    assert load_official(only_v2).per_head
    with pytest.raises(FileNotFoundError, match="holds no k_rotation_qqt_r_h_pbr.pt"):
        load_official(only_v2, per_head=False)
    # a per-head R_K file beside shared files: the best the folder allows is per-head K with shared V
    mixed = write_official_per_head(write_official(tmp_path / "mixed"), which="k")
    rotations = load_official(mixed)
    assert rotations.key[0].shape == (KV_HEADS, HEAD_DIM, HEAD_DIM) and rotations.value[0].shape == (HEAD_DIM, HEAD_DIM)
    with pytest.raises(FileNotFoundError, match="no v_rotation_perhead.pt"):
        load_official(mixed, per_head=True)


def test_official_per_head_files_are_validated(tmp_path):
    folder = write_official_per_head(tmp_path / "bad")
    data = torch.load(folder / "k_rotation_perhead.pt")
    torch.save({**data, "source_grouping": "layer"}, folder / "k_rotation_perhead.pt")
    with pytest.raises(ValueError, match="format_version 2 files have 'per_kv_head'"):
        load_official(folder)
    data["layers"][0]["rotation"] = data["layers"][0]["rotation"][0]
    torch.save(data, folder / "k_rotation_perhead.pt")
    with pytest.raises(ValueError, match="expected \\[H_kv, D, D\\] \\(per_kv_head\\)"):
        load_official(folder)
    data = torch.load(folder / "v_rotation_perhead.pt")
    data["layers"][1]["rotation"][1] *= 2
    torch.save(data, folder / "v_rotation_perhead.pt")
    write_official_per_head(folder, which="k")
    with pytest.raises(ValueError, match="layer 1, KV head 1 is not orthogonal"):
        load_official(folder)


def test_resolve_rotations_checks_the_kv_heads_and_from_zoo_takes_per_head(tmp_path):
    model = tiny_llama()
    folder = write_official_per_head(write_official(tmp_path / "zoo"))
    assert OscarCache.from_zoo(model, folder).rotations.kv_heads == KV_HEADS
    assert not OscarCache.from_zoo(model, folder, per_head=False).rotations.per_head
    other = write_official_per_head(tmp_path / "four", kv_heads=4)
    with pytest.raises(ValueError, match="for 4 KV heads but this model has 2 KV heads"):
        resolve_rotations(model, other)


def smollm2_config() -> LlamaConfig:
    config = LlamaConfig(**SMOLLM2)  # a config only: no weights are built
    config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    return config


def test_the_default_recipe_takes_the_clip_searched_set_and_the_paper_recipe_its_own() -> None:
    best = OscarCache.from_zoo(smollm2_config(), "default", "oscar-int2")
    paper = OscarCache.from_zoo(smollm2_config(), "default", "oscar-int2-paper")
    searched = load_rotations(bundled_rotations_dir(DEFAULT_ROTATIONS))
    plain = load_rotations(bundled_rotations_dir(DEFAULT_PAPER_ROTATIONS))
    assert len(searched.key_clip) == 30 and plain.key_clip == {}
    # The bundled default also moves bits between layers: K at 3 bits in 12 (the bits of 4-bit K in 6), V at 1 bit in 12.
    assert sorted(searched.key_bits.values()) == [3] * 12 and sorted(searched.value_bits.values()) == [1] * 12
    assert best.layers[17].config.key.bits == 3 and best.layers[9].config.value.bits == 1
    assert (
        {layer.config.key.bits for layer in paper.layers} == {2} == {layer.config.value.bits for layer in paper.layers}
    )
    for i in (0, 1):
        assert torch.equal(best.layers[i].key_rotation, searched.key[i])
        assert best.layers[i].config.key.clip_ratio == searched.key_clip[i]
        assert best.layers[i].config.value.clip_ratio == searched.value_clip[i]
        assert torch.equal(paper.layers[i].key_rotation, plain.key[i])
        assert (paper.layers[i].config.key.clip_ratio, paper.layers[i].config.value.clip_ratio) == (0.96, 0.92)


def test_the_paper_recipe_ignores_searched_clips_and_refuses_per_head_rotations() -> None:
    searched = load_rotations(bundled_rotations_dir(DEFAULT_ROTATIONS))
    paper = OscarCache(smollm2_config(), "oscar-int2-paper", rotations=searched)
    assert {(layer.config.key.clip_ratio, layer.config.value.clip_ratio) for layer in paper.layers} == {(0.96, 0.92)}
    per_head = RotationSet(
        64,
        {i: searched.key[i].expand(3, 64, 64) for i in range(30)},
        {i: searched.value[i].expand(3, 64, 64) for i in range(30)},
    )
    with pytest.raises(ValueError, match="one rotation per layer.*per KV head"):
        OscarCache(smollm2_config(), "oscar-int2-paper", rotations=per_head)
    OscarCache(smollm2_config(), "oscar-int2", rotations=per_head)  # the best recipe takes either


def test_the_cli_takes_the_bundled_set_of_each_methods_recipe() -> None:
    from oscar_hf.cli.common import rotations_for

    plain = load_rotations(bundled_rotations_dir(DEFAULT_PAPER_ROTATIONS))
    searched = load_rotations(bundled_rotations_dir(DEFAULT_ROTATIONS))
    sets = rotations_for("default", None, methods=["none", "oscar-int2", "oscar-int2-paper"])
    assert set(sets) == {"oscar-int2", "oscar-int2-paper"}
    assert torch.equal(sets["oscar-int2-paper"].key[3], plain.key[3]) and sets["oscar-int2-paper"].key_clip == {}
    assert torch.equal(sets["oscar-int2"].key[3], searched.key[3]) and len(sets["oscar-int2"].key_clip) == 30
    own = rotations_for("default", None, methods=["oscar-k4v2"])["oscar-k4v2"]
    assert own.base_bits == (2, 2)  # no set allocated against K4 V2: the 2-bit one, whose widths it ignores


def test_oscar_k3v2_takes_its_own_bundled_set() -> None:
    """The default model's oscar-k3v2 set: rotations clip-searched under K3 V2 with centered keys (its config
    records the command that made them), widths allocated against K3 V2; a set apart from the 2-bit one."""
    k3v2 = OscarCache.from_zoo(smollm2_config(), "default", "oscar-k3v2")
    two_bit = load_rotations(bundled_rotations_dir(DEFAULT_ROTATIONS))
    assert k3v2.rotations.base_bits == (3, 2) and len(k3v2.rotations.key_mean) == len(two_bit.key_mean) == 30
    searched_apart = [i for i in range(30) if not torch.equal(k3v2.rotations.key[i], two_bit.key[i])]
    assert searched_apart or k3v2.rotations.key_clip != two_bit.key_clip
    config = load_rotation_config(bundled_rotations_dir(f"{DEFAULT_ROTATIONS}-k3v2"))
    made = config["recipe"]
    assert made["search_for"] == "oscar-k3v2" and made["center_keys"] and made["key_feedback"]
    assert len(k3v2.rotations.key_feedback) == len(two_bit.key_feedback) == 30
    assert "--search-for oscar-k3v2 --allocate-bits 6 --allocate-for oscar-k3v2" in config["command"]
    widths = [(layer.config.key.bits, layer.config.value.bits) for layer in k3v2.layers]
    assert widths.count((4, 2)) == 6 and widths.count((3, 1)) == 6 and widths.count((3, 2)) == 18


def test_a_method_takes_the_bundled_set_allocated_against_its_own_widths(tmp_path, monkeypatch) -> None:
    from dataclasses import replace

    import oscar_hf.rotations.resolve as resolve

    searched = load_rotations(bundled_rotations_dir(DEFAULT_ROTATIONS))
    metadata = {
        k: v
        for k, v in load_rotation_config(bundled_rotations_dir(DEFAULT_ROTATIONS)).items()
        if k in ("model_id", "model_signature", "clip")
    }
    # K3 -> K4 in one layer paid by V2 -> V1 in one: oscar-k3v2's history bits
    save_rotations(
        replace(searched, key_bits={17: 4}, value_bits={9: 1}, base_bits=(3, 2)), tmp_path / "k3v2", metadata
    )
    shutil.copytree(bundled_rotations_dir(DEFAULT_ROTATIONS), tmp_path / "two-bit")
    shutil.copytree(bundled_rotations_dir(DEFAULT_PAPER_ROTATIONS), tmp_path / "paper")
    monkeypatch.setattr(resolve, "_BUNDLED_ROOT", tmp_path)
    assert resolve.bundled_set_name("HuggingFaceTB/SmolLM2-135M-Instruct", "oscar-k3v2") == "k3v2"
    for method, name in (("oscar-int2", "two-bit"), ("oscar-k4v2", "two-bit"), ("oscar-int2-paper", "paper")):
        assert resolve.bundled_set_name("HuggingFaceTB/SmolLM2-135M-Instruct", method) == name
    k3v2 = OscarCache.from_zoo(smollm2_config(), "default", "oscar-k3v2")
    assert k3v2.rotations.base_bits == (3, 2) and k3v2.layers[17].config.key.bits == 4  # its widths apply
    assert k3v2.layers[9].config.value.bits == 1 and k3v2.layers[3].config.key.bits == 3
    shutil.copytree(tmp_path / "k3v2", tmp_path / "k3v2-again")
    with pytest.raises(ValueError, match=r"several bundled rotation sets fit .*oscar-k3v2"):
        OscarCache.from_zoo(smollm2_config(), "default", "oscar-k3v2")


def test_searched_clips_apply_to_2_bit_tensors_only() -> None:
    """The clip search measures at 2 bits; 3- and 4-bit keys keep their method's own ratio."""
    searched = load_rotations(bundled_rotations_dir(DEFAULT_ROTATIONS))
    k3v2 = OscarCache(smollm2_config(), "oscar-k3v2", rotations=searched)
    for i in (0, 17):  # nor do 2-bit allocations of bits reach a 3-bit method
        assert k3v2.layers[i].config.key.clip_ratio == 0.96 and k3v2.layers[i].config.key.bits == 3
        assert k3v2.layers[i].config.value.clip_ratio == searched.value_clip[i]


def test_a_cache_takes_the_windows_its_rotation_set_was_made_for(tmp_path):
    """A set that records (sink, recent) gives them to a cache made by method name, unless the caller
    passes a window or a whole OscarConfig; they survive saving, and the memory report says whence."""
    import dataclasses

    from oscar_hf import METHODS, OscarCache
    from oscar_hf.rotations.files import load_ours, save_rotations
    from oscar_hf.rotations.rotation_set import RotationSet
    from tests.conftest import tiny_model

    model = tiny_model("llama")
    rotations = dataclasses.replace(RotationSet.hadamard(16, [0, 1]), windows=(4, 8))

    def windows(cache: OscarCache) -> set[tuple[int, int]]:
        return {(layer.config.sink, layer.config.recent) for layer in cache.layers}

    cache = OscarCache(model, "oscar-int2", rotations=rotations)
    assert windows(cache) == {(4, 8)} and cache.windows == "the rotation set's sink 4, the rotation set's recent 8"
    assert windows(OscarCache(model, "oscar-int2", rotations=rotations, sink=2)) == {(2, 8)}
    assert windows(OscarCache(model, METHODS["oscar-int2"], rotations=rotations)) == {(64, 256)}
    assert windows(OscarCache(model, "naive-int2", rotations=rotations)) == {(64, 256)}  # rotations unused
    assert windows(OscarCache(model, "oscar-int2", rotations=dataclasses.replace(rotations, windows=None))) == {
        (64, 256)
    }

    loaded = load_ours(save_rotations(rotations, tmp_path / "set"))
    assert loaded.windows == (4, 8)
    cache = OscarCache(model, "oscar-int2", rotations=loaded)
    forward(model, torch.randint(3, 200, (1, 40)), cache)
    assert cache.layers[0].sink_keys.length == 4 and cache.layers[0].history_length > 0
    report = cache.memory_report()
    assert report.summary()["windows"] == cache.windows and "(the rotation set's sink 4" in str(report)
    for bad in ((-1, 8), (4, 0), (4.5, 8), (True, 8)):
        with pytest.raises(ValueError, match="windows"):
            dataclasses.replace(rotations, windows=bad)


def write_official_centered(directory: Path, per_head: bool, extra: dict | None = None) -> Path:
    """The reference's format 3 files: key centering (``k_mean`` per layer), ``k_rotation_oscar2_<variant>.pt``."""
    directory.mkdir(parents=True, exist_ok=True)
    for kind, seed in (("k", 0), ("v", 500)):
        layers = {}
        for i in (0, 1):
            heads = [orthogonal(seed=seed + 10 * i + h) for h in range(KV_HEADS)]
            entry = {"layer_id": i, "rotation": torch.stack(heads) if per_head else heads[0]}
            if kind == "k":
                entry["k_mean"] = torch.randn(KV_HEADS, HEAD_DIM) if per_head else torch.randn(HEAD_DIM)
                entry.update(extra or {})
            layers[i] = entry
        data = {"format_version": 3, "objective": "oscar2", "calibration": {"tokens": 30000}, "layers": layers}
        torch.save(data, directory / f"{kind}_rotation_oscar2_{'perhead' if per_head else 'shared'}_centered.pt")
    return directory


@pytest.mark.parametrize("per_head", [False, True])
def test_official_format_3_loads_its_key_means_and_refuses_non_orthogonal_transforms(tmp_path, per_head):
    folder = write_official_centered(tmp_path / "centered", per_head)
    rotations = load_official(folder)
    saved = torch.load(next(folder.glob("k_rotation_*.pt")), weights_only=True)["layers"]
    assert sorted(rotations.key_mean) == [0, 1] and rotations.per_head == per_head
    assert all(torch.equal(rotations.key_mean[i], saved[i]["k_mean"]) for i in (0, 1))
    model = tiny_llama()
    cache = OscarCache.from_zoo(model, folder)  # the cache centers keys with them
    assert all(torch.equal(layer.key_mean, rotations.key_mean[i]) for i, layer in enumerate(cache.layers))
    whitened = write_official_centered(tmp_path / "nova", per_head, {"q_rotation": torch.eye(HEAD_DIM)})
    with pytest.raises(ValueError, match="non-orthogonal key transform"):
        load_official(whitened)
    wrong = write_official_centered(tmp_path / "wrong", per_head, {"k_mean": torch.zeros(HEAD_DIM + 1)})
    with pytest.raises(ValueError, match="k_mean of layer 0"):
        load_official(wrong)

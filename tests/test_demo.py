"""``oscar-hf demo``: its answer comparison and its option checks (before any model loads)."""

from __future__ import annotations

import pytest

from oscar_hf.cli.main import main
from oscar_hf.evaluation.demo import first_difference


def test_first_difference_by_word():
    assert first_difference("a small grey dog named Biscuit.", "a small grey dog named Biscuit.") is None
    assert first_difference("a small grey dog named Biscuit.", "a small grey cat named Biscuit.") == (4, "dog", "cat")
    assert first_difference("a grey dog", "a grey dog named Biscuit") == (4, "(nothing)", "named")
    assert first_difference("a grey\ndog", "a  grey dog") is None  # spacing is not part of an answer


@pytest.mark.parametrize(
    "options, message",
    [
        (["--rotations", "{missing}"], "rotations: "),
        (["--methods", "none,oscar-int2"], "oscar-int2 needs rotations calibrated for {missing}: pass --rotations DIR"),
    ],
)
def test_bad_options_fail_in_one_line_before_the_model_loads(tmp_path, options, message):
    missing = str(tmp_path / "missing")  # as --model too: loading it would fail with another error
    options = [option.format(missing=missing) for option in options]
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--model", missing, *options])
    error = str(exit_info.value.code)
    assert error.startswith("oscar-hf demo: ") and message.format(missing=missing) in error and "\n" not in error

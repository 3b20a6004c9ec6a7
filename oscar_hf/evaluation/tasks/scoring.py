"""Scoring helpers that the task YAMLs reference (``!function oscar_hf.evaluation.tasks.scoring.<name>``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

HUMANEVAL_TIMEOUT_S = float(os.environ.get("OSCAR_HF_CODE_TIMEOUT", "10"))

# "The answer is (B)", "answer: B", "**Answer:** (C)": the last such statement wins.
_ANSWER_IS = re.compile(r"(?i:answer)\s*(?:is|:)?\s*[:*\s]*\(?\s*([A-D])\s*\)?(?![A-Za-z])")
_PAREN_LETTER = re.compile(r"\(([A-D])\)|(?<![A-Za-z])([A-D])\)")


def gpqa_letter(text: str) -> str:
    """The answer letter a response commits to: the last "answer is X", else the last "(X)"/"X)", else "[invalid]"."""
    found = _ANSWER_IS.findall(text)
    if found:
        return found[-1].upper()
    found = [a or b for a, b in _PAREN_LETTER.findall(text)]
    return found[-1].upper() if found else "[invalid]"


def gpqa_extract(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """lm-eval custom filter: each response becomes the letter it chose."""
    return [[gpqa_letter(r) for r in resp] for resp in resps]


def humaneval_program(doc: dict, completion: str) -> str:
    return f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def run_program(program: str, timeout_s: float = HUMANEVAL_TIMEOUT_S) -> bool:
    """Whether ``program`` exits with status 0 within ``timeout_s``, run by ``python -I`` in an empty temporary folder.

    This executes model-written code: run it only on a machine where that is acceptable.
    """
    with tempfile.TemporaryDirectory(prefix="oscar_hf_code_") as folder:
        path = os.path.join(folder, "program.py")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(program)
        try:
            done = subprocess.run(
                [sys.executable, "-I", path],
                cwd=folder,
                capture_output=True,
                timeout=timeout_s,
                stdin=subprocess.DEVNULL,
                env={"PATH": os.environ.get("PATH", "")},
            )
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0


def humaneval_process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """pass@1 of one greedy (or sampled) completion: the prompt + completion + tests run locally."""
    return {"pass_at_1": float(run_program(humaneval_program(doc, results[0])))}


def extracted_answer(task: str, response: str) -> str:
    """A short answer for result files: the boxed/final answer for math tasks, the letter for GPQA."""
    if task == "gpqa_diamond":
        return gpqa_letter(response)
    if task in ("aime25", "math500"):
        from lm_eval.tasks.minerva_math.utils import (
            get_unnormalized_answer,
            last_boxed_only_string,
            normalize_final_answer,
            remove_boxed,
        )

        boxed = last_boxed_only_string(response)
        if boxed is not None:
            try:
                return normalize_final_answer(remove_boxed(boxed))
            except (AssertionError, IndexError):
                pass
        answer = get_unnormalized_answer(response)
        return normalize_final_answer(answer)[:200]
    return response[:200]

"""The bundled arithmetic dataset: every task once, so that repeats are only the ones a run asks for."""

from __future__ import annotations

import json

from gym_ray.servers import bundled_dataset_path
from gym_ray.servers.datagen import NUM_ROWS, arithmetic_rows


def test_the_bundled_dataset_asks_each_question_once_and_is_what_the_generator_makes() -> None:
    lines = bundled_dataset_path().read_text(encoding="utf-8").splitlines()
    questions = [json.loads(line)["responses_create_params"]["input"][0]["content"] for line in lines]
    assert (len(lines), len(set(lines)), len(set(questions))) == (NUM_ROWS, NUM_ROWS, NUM_ROWS)
    assert [json.loads(line) for line in lines] == arithmetic_rows()


def test_a_longer_generation_extends_a_shorter_one() -> None:
    assert arithmetic_rows(300)[:NUM_ROWS] == arithmetic_rows()

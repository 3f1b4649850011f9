"""Loads the task's local JSONL (next to this file) without the Hugging Face Hub or a cache."""

import json
from pathlib import Path

import datasets


def load(**_):
    rows = [json.loads(line) for line in
            (Path(__file__).with_name("tinystories_cloze.jsonl")).read_text().splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})

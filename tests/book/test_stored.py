"""The stored data files' writer, shared by the scripts under experiments/."""

from __future__ import annotations

import json

from gradlab.book import stored


def test_write_json_is_one_compact_line_that_reads_back(tmp_path):
    data = {"runs": [{"loss": [2.5, None, 1e-3]}], "seed": 0, "label": "clip at 1"}
    path = tmp_path / "new" / "folder" / "data.json"
    size = stored.write_json(path, data)
    text = path.read_text()
    assert size == path.stat().st_size == len(text.encode())
    assert text.endswith("\n") and text.count("\n") == 1 and ", " not in text
    assert json.loads(text) == data

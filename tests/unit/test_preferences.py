"""Preference data (domains/preferences.py): four formats, bad rows named by file, row, line and field, the margin
column, the held-out split by prompt hash, and the one rendering a reward model scores."""
import json
from pathlib import Path

import pandas as pd
import pytest

from domains.dataset import DatasetError
from domains.preferences import (PreferencePair, held_out, load_preferences, reward_input_ids, split_pairs)

pytestmark = pytest.mark.unit


def rows(n: int) -> list[dict]:
    return [{"prompt": f"question {i}\nsecond line", "chosen": f"good {i}!", "rejected": f"bad {i}.",
             "margin": 0.5 * (i % 3)} for i in range(n)]


def write(path: Path, data: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data), encoding="utf-8")
    elif path.suffix == ".parquet":
        pd.DataFrame(data).to_parquet(path, index=False)
    elif path.suffix == ".csv":
        pd.DataFrame(data).to_csv(path, index=False)
    else:
        path.write_text(json.dumps(data), encoding="utf-8")
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_every_format_reads_the_same_pairs(tmp_path, suffix):
    pairs = load_preferences(str(write(tmp_path / f"p{suffix}", rows(6))), margin="margin")
    assert pairs[4] == PreferencePair("question 4\nsecond line", "good 4!", "bad 4.", 0.5, 4)
    assert [p.margin for p in pairs] == [0.0, 0.5, 1.0, 0.0, 0.5, 1.0]  # CSV's text "0.5" read as a number
    assert [p.index for p in pairs] == list(range(6))
    assert load_preferences(str(tmp_path / f"p{suffix}"))[2].margin == 0.0  # no margin column asked: 0


def test_bad_rows_are_named_by_file_row_line_and_field(tmp_path):
    data = rows(6)
    data[1]["chosen"] = ""
    del data[2]["rejected"]
    data[3]["prompt"] = 7
    data[4]["rejected"] = data[4]["chosen"]
    data[5]["margin"] = "lots"
    path = tmp_path / "p.jsonl"
    path.write_text("\n" + "".join(json.dumps(r) + "\n" for r in data))  # a blank first line: row i is on line i + 2
    with pytest.raises(DatasetError) as err:
        load_preferences(str(path), margin="margin")
    msg = str(err.value)
    assert f"preference data {path} has 5 bad row(s) of 6" in msg
    assert "row 1 (line 3): field 'chosen' (the chosen response) is empty" in msg
    assert "row 2 (line 4): field 'rejected' (the rejected response) is missing" in msg
    assert "row 3 (line 5): field 'prompt' (the prompt) is int 7, not a string" in msg
    assert "row 4 (line 6): the chosen and the rejected response are the same text" in msg
    assert "row 5 (line 7): field 'margin' (the margin) is str 'lots', not a finite number" in msg
    assert "row 0" not in msg


def test_absent_columns_empty_files_and_unreadable_paths(tmp_path):
    with pytest.raises(DatasetError, match=r"no column 'better' \(columns: prompt, chosen, rejected, margin\)"):
        load_preferences(str(write(tmp_path / "p.csv", rows(3))), chosen="better")
    with pytest.raises(DatasetError, match="no column 'score'"):
        load_preferences(str(tmp_path / "p.csv"), margin="score")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DatasetError, match=r"empty\.jsonl has no rows"):
        load_preferences(str(tmp_path / "empty.jsonl"))
    with pytest.raises(DatasetError, match=r"preference data .*missing\.jsonl not found") as err:
        load_preferences(str(tmp_path / "missing.jsonl"))
    assert err.value.field == "path"
    with pytest.raises(DatasetError, match="unknown file type"):
        load_preferences(str(tmp_path / "p.txt"))


def test_size_limits_name_the_setting(tmp_path):
    path = write(tmp_path / "p.jsonl", rows(4))
    with pytest.raises(DatasetError, match="max_file_mb") as err:
        load_preferences(str(path), max_file_mb=1e-5)
    assert err.value.field == "max_file_mb"
    big = rows(2)
    big[1]["chosen"] = "x" * 3000
    with pytest.raises(DatasetError, match=r"row 1 \(line 2\): the row is .* over the limit of 2.0 KiB \(max_row_kb"):
        load_preferences(str(write(tmp_path / "big.jsonl", big)), max_row_kb=2)


def test_split_is_by_prompt_hash_deterministic_and_keeps_a_prompt_on_one_side():
    pairs = [PreferencePair(f"p{i % 50}", f"c{i}", f"r{i}", index=i) for i in range(200)]  # 4 pairs per prompt
    train, val = split_pairs(pairs, 0.2)
    assert {p.prompt for p in train}.isdisjoint({p.prompt for p in val})
    assert len(train) + len(val) == 200 and 0 < len(val) < 100
    assert (train, val) == split_pairs(list(reversed(pairs))[::-1], 0.2)  # order in, order out
    assert all(held_out(p.prompt, 0.2) for p in val)
    assert {p.prompt for p in split_pairs(pairs, 0.3)[1]} >= {p.prompt for p in val}  # a larger fraction adds prompts
    with pytest.raises(ValueError, match=r"leaves 1 to train and 0 held out.*val_data"):
        split_pairs(pairs[:1], 1e-9)
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\)"):
        split_pairs(pairs, 1.0)


def test_reward_input_ids_are_what_the_policy_produced(tiny_model_dir, qwen2_bpe_dir):
    """The rendered prompt then the response and the turn's end: the ids SFT trains the policy on for that answer
    (training/sft.py encode_pair), with the char tokenizer and with a chat template."""
    from infra.tokenizer import load_tokenizer
    from training.sft import encode_pair

    for model_dir in (tiny_model_dir, qwen2_bpe_dir):
        tok = load_tokenizer(model_dir)
        ids = reward_input_ids(tok, "reverse: abc", "cba!", system="be brief")
        assert ids == encode_pair(tok, "reverse: abc", "cba!", "be brief")[0]
        assert reward_input_ids(tok, "reverse: abc", "cba!", system="be brief", max_length=5) == ids[-5:]
        assert reward_input_ids(tok, "reverse: abc", "cba!", system="be brief", max_length=999) == ids

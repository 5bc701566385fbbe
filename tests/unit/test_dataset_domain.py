"""Dataset domains (domains/dataset.py): files read with pandas in four formats, rows checked and deduplicated, split
by prompt hash, the configured verifier as the reward, and the config around them (DatasetConfig in
infra/config_shared.py, domains/registry.py). Real files in tmp dirs; the S3 read is in
tests/integration/test_dataset_s3.py."""
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from domains.base import SPLITS, prompt_split
from domains.dataset import DatasetDomain, DatasetError
from domains.registry import load_domains
from infra.config import ConfigError, config_from_dict
from tasks.prefixes import base_prefix

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
UNICODE = "Zoë has 3 €.\r\nJosé gives her 4 more 🙂\n\tHow many € now?  "  # CRLF, a tab, trailing spaces, an emoji
# split sizes small enough for a few hundred rows (train ~75%, val ~5%, eval ~20%)
SMALL = {"base": {"n_train_per_domain": 20}, "eval": {"n_eval": 5},
         "specialists": {"n_prompts": 20, "val_n": 2}, "distill": {"n_prompts_per_domain": 20, "eval_n": 5}}


def rows(n: int) -> list[dict]:
    return [{"q": f"line one of {i}\nwhat is {i} + 1?", "a": str(i + 1), "tag": f"t{i % 3}"} for i in range(n)]


def write(path: Path, data: list[dict]) -> Path:
    df = pd.DataFrame(data)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data), encoding="utf-8")
    elif path.suffix == ".json":
        path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    elif path.suffix == ".parquet":
        df.to_parquet(path, index=False)
    else:
        df.to_csv(path, index=False)
    return path


def config(path, **domain) -> dict:
    return {"domains": [{"name": "ds", "dataset": {"path": str(path), "prompt": "q", "answer": "a"}, **domain}],
            **SMALL}


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_every_format_reads_the_same_examples(tmp_path, suffix):
    data = rows(40)
    dom = DatasetDomain("ds", write(tmp_path / f"d{suffix}", data), prompt="q", answer="a", fields=["tag"])
    assert [(e.prompt, e.answer, e.meta) for e in dom.examples] == \
        [(r["q"], r["a"], {"row": {"tag": r["tag"]}, "index": i}) for i, r in enumerate(data)]
    assert all(e.domain == "ds" and e.difficulty == 1 for e in dom.examples)


def test_multiline_unicode_prompts_are_kept_byte_for_byte(tmp_path):
    data = [{"q": UNICODE, "a": "7"}, {"q": "ünïcödé\n\nsecond paragraph — «quoted»", "a": "x"}]
    for suffix in (".jsonl", ".parquet"):
        dom = DatasetDomain("ds", write(tmp_path / f"u{suffix}", data), prompt="q", answer="a")
        assert [e.prompt.encode("utf-8") for e in dom.examples] == [r["q"].encode("utf-8") for r in data]


def test_numbers_in_the_answer_column_become_strings(tmp_path):
    path = tmp_path / "n.jsonl"
    path.write_text('{"q": "a", "a": 42}\n{"q": "b", "a": 42.0}\n{"q": "c", "a": 3.5}\n{"q": "d", "a": " 007 "}\n'
                    '{"q": "e", "a": -1e3}\n')
    assert [e.answer for e in DatasetDomain("ds", path, prompt="q", answer="a").examples] == \
        ["42", "42", "3.5", "007", "-1000"]


def test_rows_are_deduplicated_by_prompt_first_kept(tmp_path):
    data = [{"q": "same", "a": "1"}, {"q": "other", "a": "2"}, {"q": "same", "a": "3"}]
    dom = DatasetDomain("ds", write(tmp_path / "d.jsonl", data), prompt="q", answer="a")
    assert [(e.prompt, e.answer, e.meta["index"]) for e in dom.examples] == [("same", "1", 0), ("other", "2", 1)]
    assert dom.n_rows == 3


def test_splits_partition_by_prompt_hash_and_are_seeded_and_prefix_stable(tmp_path):
    dom = DatasetDomain("ds", write(tmp_path / "d.parquet", rows(400)), prompt="q", answer="a")
    sizes = {s: len(dom.by_split[s]) for s in SPLITS}
    assert sum(sizes.values()) == 400 and sizes["train"] > sizes["eval"] > sizes["val"] > 0
    drawn = {s: dom.split(s, sizes[s], seed=0) for s in SPLITS}
    for s in SPLITS:
        assert {prompt_split(e.prompt) for e in drawn[s]} == {s}
        assert len({e.prompt for e in drawn[s]}) == sizes[s]
    assert set.union(*({e.prompt for e in drawn[s]} for s in SPLITS)) == {r["q"] for r in rows(400)}
    assert dom.split("train", 10, seed=0) == drawn["train"][:10]  # prefix-stable
    assert dom.split("train", 10, seed=0) == dom.split("train", 10, seed=0)
    assert dom.split("train", 10, seed=1) != dom.split("train", 10, seed=0)
    with pytest.raises(ValueError, match=rf"the val split of dataset .* has {sizes['val']} rows \(of 400 distinct "
                                         rf"prompts\), {sizes['val'] + 1} requested"):
        dom.split("val", sizes["val"] + 1, seed=0)


def test_bad_rows_are_named_by_row_and_line_all_in_one_error(tmp_path):
    lines = ['{"q": "fine", "a": "1"}', '{"a": "2"}', '', '{"q": "   \\n ", "a": "3"}', '{"q": 5, "a": "4"}',
             '{"q": "no answer", "a": null}', '{"q": "empty answer", "a": ""}', '{"q": "bool", "a": true}',
             '{"q": "also fine", "a": 8}']
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as err:
        DatasetDomain("ds", path, prompt="q", answer="a")
    msg = str(err.value)
    assert "6 bad row(s) of 8 (rows are 0-based data rows, lines 1-based)" in msg
    for expected in ["row 1 (line 2): field 'q' (the prompt) is missing",
                     "row 2 (line 4): field 'q' (the prompt) is empty",
                     "row 3 (line 5): field 'q' (the prompt) is int 5, not a string",
                     "row 4 (line 6): field 'a' (the answer) is missing",
                     "row 5 (line 7): field 'a' (the answer) is empty",
                     "row 6 (line 8): field 'a' (the answer) is bool True, not a string or a finite number"]:
        assert expected in msg
    assert "row 0" not in msg and "row 7" not in msg


def test_bad_rows_are_capped_and_counted(tmp_path):
    data = [{"q": "", "a": str(i)} for i in range(30)] + [{"q": "ok", "a": "1"}]
    with pytest.raises(DatasetError, match=r"30 bad row\(s\) of 31 \(rows are 0-based data rows\)") as err:
        DatasetDomain("ds", write(tmp_path / "b.csv", data), prompt="q", answer="a")
    assert "row 19: " in str(err.value) and "row 20: " not in str(err.value)
    assert "… and 10 more (the first 20 shown)" in str(err.value)


def test_answers_the_verifier_cannot_use_are_bad_rows(tmp_path):
    data = [{"q": "How many?", "a": "twelve", "choices": ["x", "y"]}, {"q": "Pick\nA) x\nB) y", "a": "C",
                                                                       "choices": ["x", "y"]}]
    path = write(tmp_path / "d.parquet", data)
    with pytest.raises(DatasetError, match=r"row 0: field 'a' \(the answer\): .*'twelve'.* \(verifier 'numeric'\)"):
        DatasetDomain("ds", path, prompt="q", answer="a", verifier="numeric")
    with pytest.raises(DatasetError, match=r"2 bad row\(s\) of 2 .*\n  row 0: .*\n  row 1: field 'a' \(the answer\): the "
                                           r"answer 'C' is neither .*\(verifier 'choice'\)"):
        DatasetDomain("ds", path, prompt="q", answer="a", fields=["choices"], verifier="choice")


def test_missing_columns_and_unknown_suffix(tmp_path):
    with pytest.raises(DatasetError, match=r"no column 'question' \(columns: q, a, tag\)"):
        DatasetDomain("ds", write(tmp_path / "d.jsonl", rows(3)), prompt="question", answer="a")
    txt = tmp_path / "d.txt"
    txt.write_text("hello")
    with pytest.raises(DatasetError, match=r"d.txt: unknown file type; the suffix must be one of .jsonl, .json, "
                                           r"\.parquet, \.csv") as err:
        DatasetDomain("ds", txt)
    assert err.value.field == "path"
    with pytest.raises(ConfigError, match=r"domains\.0\.dataset\.path: .*unknown file type"):
        load_domains(config_from_dict(config(txt)))


def test_the_verifier_is_the_reward_and_accuracy_is_full_reward(tmp_path):
    data = [{"q": "How many?", "a": "1,000"}, {"q": "And now?", "a": 7}]
    num = DatasetDomain("ds", write(tmp_path / "d.jsonl", data), prompt="q", answer="a", verifier="numeric")
    ex = num.examples[0]
    assert num.verify(ex, "So the answer is 1000.") == 1.0 and num.is_correct(ex, "1000")
    assert num.verify(ex, "999") == 0.0 and not num.is_correct(ex, "999")
    assert num.max_answer_chars == 5 and num.max_response_chars >= 8192


def test_token_budget_from_the_train_answers_or_the_setting(tmp_path):
    from infra.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    path = write(tmp_path / "d.jsonl", rows(200))
    dom = DatasetDomain("ds", path, prompt="q", answer="a")
    longest = max(len(e.answer) for e in dom.by_split["train"])  # the char tokenizer: one token per character
    assert dom.token_budget(tok) == 2 * longest + 8
    assert DatasetDomain("ds", path, prompt="q", answer="a", max_new_tokens=77).token_budget(tok) == 77


def test_the_file_is_read_once_per_version(tmp_path):
    path = write(tmp_path / "d.jsonl", rows(10))
    a, b = (DatasetDomain("ds", path, prompt="q", answer="a") for _ in range(2))
    assert a.examples is b.examples  # parsed once
    write(path, rows(12))  # another size: read again
    assert len(DatasetDomain("ds", path, prompt="q", answer="a").examples) == 12


# -------------------------------------------------------------------------------------------- config and registry


def test_config_errors_name_the_field(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError, match=rf"domains\.0\.dataset\.path: no such file: {missing}"):
        config_from_dict(config(missing))
    path = write(tmp_path / "d.jsonl", rows(300))
    for verifier in ("nonsense", "regex:("):
        cfg = config_from_dict(config(path, verifier=verifier))
        with pytest.raises(ConfigError, match=r"domains\.0\.verifier: .*"):
            load_domains(cfg)
    bad = [({"impl": "m:C"}, r"domains\.0: dataset and impl are exclusive"),
           ({"params": {"x": 1}}, r"domains\.0: params: a dataset domain takes none"),
           ({"system": "s", "dataset": {"path": str(path), "system": "t"}}, r"domains\.0\.system: dataset\.system is"),
           ({"unknown": 1}, r"domains\.0\.unknown: unknown key")]
    for extra, pattern in bad:
        with pytest.raises(ConfigError, match=pattern):
            config_from_dict(config(path, **extra))
    with pytest.raises(ConfigError, match=r"domains\.0\.verifier: applies to dataset domains only"):
        config_from_dict({"domains": [{"name": "addition", "verifier": "numeric"}]})
    assert config_from_dict(config("s3://bucket/not-checked-here.jsonl")).domains[0].dataset.path.startswith("s3://")


def test_alloy_config_exits_2_naming_a_missing_dataset(tmp_path, capsys):
    from alloy.cli import main

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(config(tmp_path / "absent.parquet")))
    assert main(["config", str(cfg_file)]) == 2
    err = capsys.readouterr().err
    assert "domains.0.dataset.path" in err and str(tmp_path / "absent.parquet") in err


def test_a_dataset_too_small_for_the_split_sizes_says_what_it_has_and_needs(tmp_path):
    path = write(tmp_path / "d.jsonl", rows(60))
    dom = DatasetDomain("ds", path, prompt="q", answer="a")
    train = len(dom.by_split["train"])
    cfg = config_from_dict({**config(path), "base": {"n_train_per_domain": 500}})
    with pytest.raises(ConfigError) as err:
        load_domains(cfg)
    msg = str(err.value)
    assert msg.startswith("domains.0.dataset.path: domain 'ds': dataset ")
    assert f"the train split has {train} rows, but base.n_train_per_domain = 500 asks for more" in msg
    assert "60 rows read, 60 distinct prompts" in msg
    cfg = config_from_dict({**config(path), "specialists": {"val_n": 50, "per_domain": {"ds": {"n_prompts": 900}}}})
    with pytest.raises(ConfigError, match=r"specialists\.per_domain\.ds\.n_prompts = 900 asks for more; the val split "
                                          r"has \d+ rows, but specialists\.val_n = 50"):
        load_domains(cfg)


def test_load_domains_builds_dataset_domains_and_sets_system(tmp_path):
    path = write(tmp_path / "d.csv", rows(300))
    data = config(path, verifier="exact")
    data["domains"][0]["dataset"]["system"] = "Answer with a number."
    data["domains"] += [{"name": "addition", "system": "Add."}, {"name": "reverse"}]
    doms = load_domains(config_from_dict(data))
    assert isinstance(doms["ds"], DatasetDomain) and doms["ds"].system == "Answer with a number."
    assert (doms["addition"].system, doms["reverse"].system) == ("Add.", "")
    data["domains"][0] = config(path, system="From the domain.")["domains"][0]
    assert load_domains(config_from_dict(data))["ds"].system == "From the domain."


def test_the_dataset_content_keys_the_checkpoints(tmp_path):
    path = write(tmp_path / "d.jsonl", rows(300))
    cfg = config_from_dict(config(path))
    before = base_prefix(cfg, "s3://b/p")
    assert base_prefix(config_from_dict(config(path)), "s3://b/p") == before
    data = rows(300)
    data[7]["a"] = "changed"
    write(path, data)
    assert base_prefix(config_from_dict(config(path)), "s3://b/p") != before
    # a generator domain's fingerprint data holds none of the dataset settings left at their defaults
    plain = config_from_dict({"domains": [{"name": "addition"}]})
    assert plain.model_dump(context={"fingerprint": True})["domains"] == \
        [{"name": "addition", "impl": None, "difficulty": 1, "params": {}}]


# -------------------------------------------------------------------------------------------- the example datasets


def test_make_datasets_is_deterministic_and_its_answers_verify(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_datasets", REPO / "scripts" / "make_datasets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(tmp_path / "a"), "--rows", "300"]) == 0
    mod.write_datasets(tmp_path / "b", rows=300)
    for name in ("wordmath.jsonl", "quiz.parquet", "corpus.txt"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    corpus = (tmp_path / "a" / "corpus.txt").read_text(encoding="utf-8")
    assert "Answer with a number." in corpus and "Zoë" in corpus
    wm = DatasetDomain("wordmath", tmp_path / "a" / "wordmath.jsonl", prompt="question", verifier="numeric")
    quiz = DatasetDomain("quiz", tmp_path / "a" / "quiz.parquet", prompt="question", fields=["choices"],
                         verifier="choice")
    for dom in (wm, quiz):
        assert len(dom.examples) == 300
        assert all("\n" in e.prompt for e in dom.examples)
        assert any(not e.prompt.isascii() for e in dom.examples)
        assert all(dom.verify(e, e.answer) == 1.0 for e in dom.examples)
    assert all(isinstance(e.meta["row"]["choices"], list) and 4 <= len(e.meta["row"]["choices"]) <= 5
               for e in quiz.examples)
    assert all(e.answer in "ABCDE" for e in quiz.examples)
    assert all(float(e.answer).is_integer() and not math.isnan(float(e.answer)) for e in wm.examples)
    ex = quiz.examples[0]
    wrong = next(letter for letter in "ABCD" if letter != ex.answer)
    assert quiz.verify(ex, wrong) == 0.0


def test_the_dataset_caches_are_bounded(tmp_path, monkeypatch):
    """Least recently used entries leave once the budget is passed; the newest stays even when it alone is over."""
    from infra import datasets

    cache = datasets.BoundedCache(10)
    cache.put("a", 1, 4), cache.put("b", 2, 4)
    assert cache.get("a") == 1  # a is now the most recently used
    cache.put("c", 3, 4)  # 12 > 10: b (least recently used) goes
    assert (cache.get("b"), cache.get("a"), cache.get("c"), cache.weight) == (None, 1, 3, 8)
    cache.put("huge", 4, 50)  # over the whole budget alone: everything else goes, it stays
    assert (len(cache), cache.get("huge"), cache.weight) == (1, 4, 50)
    cache.put("huge", 5, 2)  # a re-put replaces the weight
    assert cache.weight == 2

    monkeypatch.setattr(datasets, "_CACHE", datasets.BoundedCache(150))
    files = []
    for i in range(3):
        files.append(tmp_path / f"d{i}.jsonl")
        files[-1].write_text(json.dumps({"prompt": f"p{i}" * 20, "answer": "a"}) + "\n")  # ~70 bytes each
        datasets.read_dataset(str(files[-1]))
    assert len(datasets._CACHE) == 2 and datasets._CACHE.weight <= 150  # the first file left the cache

    monkeypatch.setenv(datasets.CACHE_ENV, "0.5")
    assert datasets.cache_budget_bytes() == 2 ** 19
    monkeypatch.setenv(datasets.CACHE_ENV, "lots")
    with pytest.raises(ValueError, match="ALLOY_DATASET_CACHE_MB must be a number of MiB, got 'lots'"):
        datasets.cache_budget_bytes()


# --------------------------------------------------------------------------------------------- limits (issue 34)


def test_a_file_over_max_file_mb_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from infra import datasets

    path = write(tmp_path / "d.jsonl", rows(300))
    read = []
    monkeypatch.setattr(datasets, "read_bytes", lambda url: read.append(url) or b"")
    cfg = config_from_dict(config(path, dataset={"path": str(path), "prompt": "q", "answer": "a",
                                                 "max_file_mb": 0.001}))
    with pytest.raises(ConfigError, match=rf"domains\.0\.dataset\.max_file_mb: domain 'ds': dataset {path} is "
                                          rf"{path.stat().st_size} bytes, over the limit of 1048 bytes "
                                          r"\(dataset\.max_file_mb\)"):
        load_domains(cfg)
    with pytest.raises(ConfigError, match=r"domains\.0\.dataset\.max_file_mb: dataset .* over the limit"):
        base_prefix(cfg, "s3://b/run")  # the fingerprint reads the file too
    assert read == []


def test_a_row_over_max_row_kb_is_named_by_row_and_line(tmp_path):
    data = rows(300)
    data[7]["q"] = "x" * (2 << 20)  # a 2 MiB prompt
    path = write(tmp_path / "d.jsonl", data)
    with pytest.raises(ConfigError) as err:
        load_domains(config_from_dict(config(path)))
    msg = str(err.value)
    assert msg.startswith("domains.0.dataset.max_row_kb: domain 'ds': dataset") and "1 bad row(s) of 300" in msg
    assert "row 7 (line 8): the row is 2048.0 KiB, over the limit of 1024.0 KiB (dataset.max_row_kb" in msg
    big = {"path": str(path), "prompt": "q", "answer": "a", "max_row_kb": 3000}
    assert len(load_domains(config_from_dict(config(path, dataset=big)))["ds"].examples) == 300
    csv = write(tmp_path / "d.csv", data)  # the same rule for every format (no line numbers)
    with pytest.raises(DatasetError, match=r"row 7: the row is 2048\.0 KiB"):
        DatasetDomain("ds", str(csv), prompt="q", answer="a")


def test_deeply_nested_json_is_a_dataset_error_naming_the_row(tmp_path):
    lines = [json.dumps(r) for r in rows(300)]
    deep = tmp_path / "deep.jsonl"  # past every parser's depth: pandas refuses, json.loads would recurse
    deep.write_text("\n".join(lines[:5] + ['{"q": "p", "a": "1", "x": ' + "[" * 10_000 + "]" * 10_000 + "}"]
                              + lines[5:]) + "\n")
    with pytest.raises(DatasetError, match=r"row 5 \(line 6\) nests its JSON too deeply"):
        DatasetDomain("ds", str(deep), prompt="q", answer="a")
    mid = tmp_path / "mid.jsonl"  # parsed, but deeper than a cell may nest: a bad row, its repr never taken
    nested = "[" * 500 + "]" * 500
    mid.write_text("\n".join(lines[:5] + ['{"q": ' + nested + ', "a": "1", "x": ' + nested + "}"] + lines[5:]) + "\n")
    with pytest.raises(DatasetError, match=r"row 5 \(line 6\): field 'q' nests more than 64 levels deep"):
        DatasetDomain("ds", str(mid), prompt="q", answer="a")

"""Malformed data rows from a domain plugin's generator: refused before any training, with a message that names the
domain, the bad example and what is wrong with it, and (the claim of issue 8) the row numbers of the bad rows.

Other bad input is covered elsewhere: config types/unknown keys (tests/unit/test_config.py, exit code 2 in
tests/integration/test_pipeline.py::test_cli_run_exit_codes), plugins that fail to import or raise
(tests/unit/test_domain_plugins.py), a verifier that raises or returns NaN (tests/unit/test_domains.py, and through a
real pipeline in test_pipeline_secrets.py), malformed HTTP (tests/integration/test_engine_fuzz.py).
"""
from __future__ import annotations

import re

import pytest

from domains.base import MAX_BAD_ROWS, Domain, Example, is_eval_prompt
from domains.registry import load_domain

pytestmark = pytest.mark.unit

# draw numbers (0-based) at which the generator below misbehaves, and how
BAD = {3: "newline", 7: "not_example", 12: "padded", 20: "too_long", 26: "empty_prompt", 31: "non_ascii"}
PROBLEM = {"newline": "prompt must be non-empty printable ASCII without newlines",
           "not_example": "generate() returned dict, not Example",
           "padded": "answer must be non-empty printable ASCII without newlines or surrounding spaces",
           "too_long": "answer is longer than max_answer_chars=4",
           "empty_prompt": "prompt must be non-empty printable ASCII without newlines",
           "non_ascii": "answer must be non-empty printable ASCII without newlines or surrounding spaces"}


class Rows(Domain):
    """A plugin whose generator emits one malformed row at each draw listed in BAD (all others are fine).
    `only` restricts the bad rows to a subset (to test each kind alone)."""

    name, tag, max_answer_chars = "rows", "row", 4
    defaults = {"only": None}

    def setup(self):
        self.draws = 0

    def generate(self, rng):
        i, self.draws = self.draws, self.draws + 1
        body = f"{i:05d}"
        kind = BAD.get(i) if self.params["only"] in (None, BAD.get(i)) else None
        if kind == "newline":
            return Example(self.name, f"row:{body}\n=", "ok", 1)
        if kind == "not_example":
            return {"prompt": f"row:{body}=", "answer": "ok"}
        if kind == "padded":
            return self.make(body, " ok")
        if kind == "too_long":
            return self.make(body, "okokok")
        if kind == "empty_prompt":
            return Example(self.name, "", "ok", 1)
        if kind == "non_ascii":
            return self.make(body, "ök")
        return self.make(body, "ok")

    def score(self, example, response):
        return float(response == example.answer)


def split_error(dom: Domain, n: int = 40) -> str:
    with pytest.raises(ValueError) as err:
        dom.split("train", n, seed=0)
    return str(err.value)


def test_split_of_good_rows_is_fine():
    assert len(Rows(only="nothing").split("train", 10, seed=0)) == 10


def test_every_bad_row_falls_in_the_train_split():
    """Fixture check: every bad row hashes into the train bucket, so the eval-split test below shows that a row is
    checked before its bucket is looked at (an eval split never keeps these prompts, yet must refuse them)."""
    dom = Rows()
    rows = [dom.generate(None) for _ in range(max(BAD) + 1)]
    prompts = [r["prompt"] if isinstance(r, dict) else r.prompt for r in rows]
    assert not any(is_eval_prompt(prompts[i]) for i in BAD)


def test_bad_rows_are_refused_whatever_their_split():
    """Every draw is checked before its eval bucket is looked at: an eval split refuses train-bucket bad rows too."""
    with pytest.raises(ValueError) as err:
        Rows(only="padded").split("eval", 10, seed=0)
    assert str(err.value).startswith("domain 'rows': bad example at row 12: "), err.value


@pytest.mark.parametrize("kind", sorted(PROBLEM))
def test_each_kind_of_bad_row_is_refused_naming_domain_example_and_problem(kind):
    """Each malformed row alone stops `split` (so the base stage, before any training) with a precise message that
    names its row; a row that is not even an Example is checked before `split` reads its prompt."""
    msg = split_error(Rows(only=kind))
    row = next(i for i, k in BAD.items() if k == kind)
    assert msg.startswith(f"domain 'rows': bad example at row {row}: ") and msg.endswith(PROBLEM[kind]), msg


def test_a_plugin_loaded_by_impl_is_checked_the_same_way():
    dom = load_domain("rows_plugin", impl=f"{__name__}:Rows", params={"only": "padded"})
    assert "domain 'rows_plugin': bad example" in split_error(dom)


def test_bad_rows_are_reported_with_their_row_numbers():
    """All malformed rows of a generator, each named by its row (the generator's 0-based draw number) and its problem."""
    msg = split_error(Rows())
    assert msg.startswith("domain 'rows': bad example "), msg
    found = {int(n) for n in re.findall(r"\brows? #?(\d+)", msg)}
    assert found == set(BAD), msg
    for row, kind in BAD.items():
        assert re.search(rf"^  row {row}: .*: {re.escape(PROBLEM[kind])}$", msg, re.MULTILINE), (row, msg)


class AllBad(Domain):
    """A plugin whose generator never returns an Example."""

    name, tag = "allbad", "ab"

    def generate(self, rng):
        return None

    def score(self, example, response):
        return 0.0


def test_collecting_bad_rows_is_bounded():
    """A generator that only emits garbage is stopped after MAX_BAD_ROWS draws, each of them reported."""
    msg = split_error(AllBad(), n=1000)
    rows = [int(n) for n in re.findall(r"^  row (\d+): None: generate\(\) returned NoneType, not Example$", msg,
                                       re.MULTILINE)]
    assert rows == list(range(MAX_BAD_ROWS)), msg


def test_a_hostile_dataset_file_gets_a_dataset_error_naming_each_row(tmp_path):
    """Issue 34: a dataset whose rows nest 10,000 deep or weigh more than `dataset.max_row_kb`, and a domain name that
    is a path, are refused when the config and domains load, by row/line and field, never with a RecursionError and
    before any directory is made from the name."""
    import json

    from domains.registry import load_domains
    from infra.config import ConfigError, config_from_dict

    good = [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(200)]
    deep = tmp_path / "deep.jsonl"
    deep.write_text("\n".join(good[:3] + ['{"prompt": ' + "[" * 10_000 + "]" * 10_000 + ', "answer": "1"}'] + good[3:]))
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(good[:9] + [json.dumps({"prompt": "x" * 40_000, "answer": "1"})] + good[9:]))
    small = {"eval": {"n_eval": 5}, "base": {"n_train_per_domain": 20},
             "specialists": {"n_prompts": 20, "val_n": 2}, "distill": {"n_prompts_per_domain": 20, "eval_n": 5}}
    for path, extra, pattern in [
            (deep, {}, r"^domains\.0\.dataset: dataset .*deep\.jsonl: cannot read it as jsonl: row 3 \(line 4\) nests"),
            (big, {"max_row_kb": 32},
             r"^domains\.0\.dataset\.max_row_kb: .*\n  row 9 \(line 10\): the row is 39\.1 KiB")]:
        cfg = config_from_dict({"domains": [{"name": "ds", "dataset": {"path": str(path), **extra}}], **small})
        with pytest.raises(ConfigError, match=pattern):
            load_domains(cfg)
    with pytest.raises(ConfigError, match=r"domains\.0\.name: must be 1 to 64 characters"):
        config_from_dict({"domains": [{"name": "../../../../tmp/x", "dataset": {"path": str(big)}}],
                          "run": {"root": str(tmp_path / "runs")}})
    assert not (tmp_path / "runs").exists()

"""A dataset domain read from S3 (a real moto server on loopback, tests/s3_fixtures.py): the endpoint and
credentials come from the standard AWS environment variables, as for `run.storage`; the object's content keys the
checkpoints like a local file's."""
import json

import pytest

from domains.dataset import DatasetDomain
from domains.registry import load_domains
from infra.config import config_from_dict
from infra.storage import write_bytes
from tasks.prefixes import base_prefix

pytestmark = pytest.mark.integration

SMALL = {"base": {"n_train_per_domain": 20}, "eval": {"n_eval": 5},
         "specialists": {"n_prompts": 20, "val_n": 2}, "distill": {"n_prompts_per_domain": 20, "eval_n": 5}}


def jsonl(n: int, changed: int | None = None) -> bytes:
    rows = [{"question": f"Zoë has {i} €.\nHow many € does she have?", "answer": "x" if i == changed else i}
            for i in range(n)]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def test_a_dataset_domain_reads_from_s3(s3_bucket, tmp_path):
    url = f"{s3_bucket}/data/wordmath.jsonl"
    write_bytes(url, jsonl(300))
    (tmp_path / "local.jsonl").write_bytes(jsonl(300))
    data = {"domains": [{"name": "wordmath", "dataset": {"path": url, "prompt": "question"}, "verifier": "numeric"}],
            **SMALL}
    cfg = config_from_dict(data)  # an s3:// path is not checked at config time
    dom = load_domains(cfg)["wordmath"]
    local = DatasetDomain("wordmath", tmp_path / "local.jsonl", prompt="question", verifier="numeric")
    assert [(e.prompt, e.answer) for e in dom.examples] == [(e.prompt, e.answer) for e in local.examples]
    assert dom.sha256 == local.sha256 and len(dom.split("eval", 5, 0)) == 5
    before = base_prefix(cfg, "s3://b/p")
    write_bytes(url, jsonl(300, changed=3))  # the object changes on S3: the checkpoints built on it move
    assert base_prefix(config_from_dict(data), "s3://b/p") != before

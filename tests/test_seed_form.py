"""``PUT /config`` with the form the seed's editor page sends (field ``config``: the JSON text)."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlencode

from tests.http_util import HttpResult, call, get_json, history, live
from tests.procs import ProcessPool

FORM = "application/x-www-form-urlencoded"
TOKEN = "s3cret"


def put_form(url: str, text: str, path: str = "config", token: str | None = TOKEN, **kw: str) -> HttpResult:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = urlencode({"config": text, **kw}).encode()
    return call(url, "PUT", path, raw=body, headers=headers, content_type=FORM)


def test_form_put_is_stored_in_the_history_and_redirects_to_the_editor(procs: ProcessPool) -> None:
    lh = procs.lighthouse(extra=["--admin-token", TOKEN])
    res = put_form(lh.url, json.dumps({"lr": 0.00001, "名前": "ラン"}, ensure_ascii=False))
    assert res.status == 303, res.body
    assert res.headers["location"] == "/config"
    assert res.json["version"] == 1 and res.json["effective_step"] is None
    assert live(lh.url)["config"] == {"lr": 0.00001, "名前": "ラン"}
    newest = history(lh.url)[0]
    assert (newest["version"], newest["op"], newest["author"]) == (1, "put", "admin token")
    # a job's own editor page takes it too
    res = put_form(lh.url, '{"bs": 64}', path="jobs/j1/config")
    assert (res.status, res.headers["location"]) == (303, "/jobs/j1/config")
    assert get_json(lh.url, "api/jobs/j1/config")["config"] == {"bs": 64}


def test_form_put_needs_the_token(procs: ProcessPool) -> None:
    lh = procs.lighthouse(extra=["--admin-token", TOKEN])
    res = put_form(lh.url, '{"lr": 1}', token=None)
    assert res.status == 401 and "Bearer" in res.error
    assert put_form(lh.url, '{"lr": 1}', token="wrong").status == 401
    assert live(lh.url)["version"] == 0


def test_form_put_is_checked_against_the_schema(procs: ProcessPool, tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"lr": {"type": "number", "maximum": 1}}}))
    lh = procs.lighthouse(extra=["--schema", str(schema)])
    res = put_form(lh.url, '{"lr": 5}', token=None)
    assert res.status == 422 and res.json["violations"], res.body
    assert live(lh.url)["version"] == 0
    assert put_form(lh.url, '{"lr": 0.5}', token=None).status == 303


def test_form_put_refuses_what_is_not_a_config(procs: ProcessPool) -> None:
    lh = procs.lighthouse()
    res = put_form(lh.url, '{"lr": 0.001,', token=None)
    assert res.status == 400 and res.error.startswith("config is not valid JSON"), res.body
    res = call(lh.url, "PUT", "config", raw=b"lr=1", content_type=FORM)
    assert res.status == 400 and "'config'" in res.error
    res = call(lh.url, "PUT", "config", raw=b'{"lr": 1}', content_type="application/json")
    assert res.status == 415 and FORM in res.error
    assert live(lh.url)["version"] == 0

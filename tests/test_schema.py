"""The schema module and the store's planned commits, in process (the HTTP paths are in test_safe_edits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lighthouse.config.schema import SchemaInvalid, SchemaViolation, load_schema, pointer
from lighthouse.jobs.state import LighthouseState
from lighthouse.jobs.versions import ConfigStore, Edit
from lighthouse.store.sqlite import SqliteBackend
from tests.store_edits import commit

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "lr": {"type": "number", "maximum": 1},
        "mode": {"enum": ["a", "b"]},
        "a/b": {"type": "integer"},
        "nested": {"type": "object", "properties": {"depth": {"type": "integer"}}, "required": ["depth"]},
    },
    "patternProperties": {"^x_": {"type": "string"}},
    "required": ["lr"],
    "additionalProperties": False,
}


def test_violations_name_the_key_they_are_about() -> None:
    schema = load_schema(SCHEMA)
    assert schema.violations({"lr": 0.5}) == []
    found = schema.violations(
        {"mode": "c", "a/b": 1.5, "extra": 1, "x_ok": "s", "x_bad": 1, "nested": {"other": 1}}
    )
    assert [v["path"] for v in found] == ["/a~1b", "/extra", "/lr", "/mode", "/nested/depth", "/x_bad"]
    by_path = {v["path"]: v["message"] for v in found}
    assert by_path["/lr"] == "required key is missing"
    assert by_path["/extra"] == "key is not allowed by the schema"
    assert "is not one of" in by_path["/mode"]


def test_pointer_escapes() -> None:
    assert pointer([]) == ""
    assert pointer(["a/b", "c~d", 0]) == "/a~1b/c~0d/0"


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ([1], "must be a JSON object"),
        ({"type": "nonsense"}, "not a valid JSON Schema"),
        ({"properties": {"lr": {"maximum": "one"}}}, "/properties/lr/maximum"),
        ({"$schema": "http://json-schema.org/draft-07/schema#"}, "only JSON Schema draft 2020-12"),
    ],
)
def test_bad_schemas_are_refused_saying_where(document: Any, expected: str) -> None:
    with pytest.raises(SchemaInvalid, match=expected.replace("/", ".")):
        load_schema(document)


def test_declared_2020_12_and_boolean_schemas_load() -> None:
    assert (
        load_schema({"$schema": "https://json-schema.org/draft/2020-12/schema#"}).violations({"k": 1}) == []
    )
    assert load_schema(False).violations({})[0]["path"] == ""


def test_a_dry_run_plan_is_what_the_commit_stores(tmp_path: Path) -> None:
    backend = SqliteBackend(tmp_path / "db")
    store = ConfigStore(backend)
    commit(store, "put", {"lr": 0.1, "mode": "a"}, source="t")
    edit = Edit("patch", {"lr": 0.2, "mode": None, "new": [1]}, "api", "bob", "tune")
    planned = store.apply([edit], dry_run=True)
    assert store.head == 1 and store.live() == {"lr": 0.1, "mode": "a"}
    assert planned.changes() == {
        "lr": {"before": 0.1, "after": 0.2},
        "mode": {"before": "a"},
        "new": {"after": [1]},
    }
    committed = store.apply([edit])
    assert (committed.version, committed.live, committed.changes()) == (
        planned.version,
        planned.live,
        planned.changes(),
    )
    assert store.get(2).config == planned.row.config == {"lr": 0.2, "new": [1]}
    store.close()
    backend.close()
    assert ConfigStore(SqliteBackend(tmp_path / "db")).head == 2  # durable


def test_a_refused_check_writes_nothing_of_a_multi_edit_commit() -> None:
    store = ConfigStore(SqliteBackend())
    commit(store, "put", {"lr": 0.1}, source="t")
    pending = commit(store, "patch", {"lr": 0.2}, source="t", effective_step=50).version

    def refuse(plan: Any) -> None:
        raise SchemaViolation([{"path": "/lr", "message": "no"}])

    edits = [Edit("cancel", {"version": pending}, "api"), Edit("put", {"lr": 9}, "rollback")]
    with pytest.raises(SchemaViolation):
        store.apply(edits, check=refuse)
    assert store.head == pending
    assert [s["status"] for s in store.scheduled()] == ["pending"]
    plan = store.apply(edits)
    assert [r.op for r in plan.rows] == ["cancel", "put"] and plan.version == pending + 2
    assert [s["status"] for s in store.scheduled()] == ["cancelled"]


def test_a_refused_rollback_keeps_the_scheduled_changes_it_would_cancel() -> None:
    store = ConfigStore(SqliteBackend())
    state = LighthouseState(store)
    state.change("put", {"lr": 5}, source="t")
    state.change("put", {"lr": 0.5}, source="t")
    state.schema.set(SCHEMA, source="t")
    state.change("patch", {"mode": "b"}, source="t", effective_step=100)
    head = store.head
    with pytest.raises(SchemaViolation) as refused:
        state.rollback(1)
    assert [v["path"] for v in refused.value.violations] == ["/lr"]
    assert store.head == head and [s["status"] for s in store.scheduled()] == ["pending"]


def test_a_schema_is_kept_per_store_with_its_history(tmp_path: Path) -> None:
    backend = SqliteBackend(tmp_path / "db")
    store = ConfigStore(backend)
    state = LighthouseState(store)
    state.change("put", {"lr": 0.5}, source="t")
    with pytest.raises(SchemaViolation):
        state.schema.set({"properties": {"lr": {"maximum": 0.1}}}, source="api", author="eve")
    assert store.schema() is None
    state.schema.set(SCHEMA, source="api", author="ann", comment="first")
    state.schema.set(None, source="api", author="bob")
    state.schema.set(SCHEMA, source="api", author="cy")
    store.close()
    backend.close()
    reopened = LighthouseState(ConfigStore(SqliteBackend(tmp_path / "db")))
    assert reopened.schema.schema is not None and reopened.schema.schema.document == SCHEMA
    history = reopened.store.schema_history()
    assert [(h["author"], h["schema"] is None) for h in history] == [
        ("cy", False),
        ("bob", True),
        ("ann", False),
    ]
    with pytest.raises(SchemaViolation):
        reopened.change("patch", {"lr": 2}, source="t")

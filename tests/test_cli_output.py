"""The CLI output helpers: relative times, step numbers, ISO twins, aligned tables."""

from __future__ import annotations

from datetime import datetime

from protos.cli_output import Styled, ago, duration, steps, table, with_iso_times


def test_relative_times() -> None:
    now = 1_800_000_000.0
    assert ago(now - 0.4, now) == "just now" and ago(now + 0.4, now) == "just now"
    assert ago(now - 7.6, now) == "8 s ago" and ago(now - 59, now) == "59 s ago"
    assert ago(now - 200, now) == "3 min ago" and ago(now - 3 * 3600 - 5, now) == "3 h ago"
    assert ago(now - 3 * 86400, now) == "3 d ago" and ago(now + 90, now) == "in 1 min"
    assert ago(None, now) == "-"
    assert duration(0.44) == "0.4 s" and duration(12.2) == "12 s"


def test_steps_have_thousands_separators() -> None:
    assert steps(12345) == "12,345" and steps(0) == "0" and steps(-1) == "-" and steps(None) == "-"


def test_iso_twins_sit_next_to_every_epoch_field() -> None:
    value = {"created_at": 1_800_000_000.25, "nested": [{"updated_at": 1_800_000_001}], "flag_at": True}
    out = with_iso_times(value)
    assert list(out) == ["created_at", "created_at_iso", "nested", "flag_at"]
    assert out["created_at_iso"] == "2027-01-15T08:00:00.250Z"
    assert datetime.fromisoformat(out["nested"][0]["updated_at_iso"]).timestamp() == 1_800_000_001
    assert "created_at_iso" not in value  # a copy: the API's answer is left as it was


def test_tables_align_columns_without_trailing_spaces() -> None:
    lines = table(["KEY", "VALUE"], [["lr", "0.1"], ["warmup_steps", Styled("100", fg="red")]])
    assert lines == ["KEY           VALUE", "lr            0.1", "warmup_steps  100"]
    assert table(None, [["1", "", "x"], ["22", "b", ""]]) == ["1      x", "22  b"]

"""``--store`` URLs: endpoints, prefix (with its default) and TLS from the scheme."""

from __future__ import annotations

import pytest

from lighthouse.store_url import DEFAULT_PREFIX, parse_store_url


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        ("etcd://127.0.0.1:2379", (["127.0.0.1:2379"], DEFAULT_PREFIX, False)),
        ("etcd://a:1,b:2/", (["a:1", "b:2"], DEFAULT_PREFIX, False)),
        ("ETCD://a:1, [::1]:2/team/lh/", (["a:1", "[::1]:2"], "/team/lh", False)),
        ("etcds://a:1/p", (["a:1"], "/p", True)),
    ],
)
def test_parses(url: str, parsed: tuple[list[str], str, bool]) -> None:
    assert parse_store_url(url) == parsed


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://a:1", "expected etcd://"),
        ("a:1", "expected etcd://"),
        ("etcd:///p", "names no etcd endpoint"),
        ("etcd://a/p", "invalid address 'a'"),
    ],
)
def test_refuses(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_store_url(url)

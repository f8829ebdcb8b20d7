"""core.storage.conditional on local disk and on the S3 server alike: one winner among concurrent exclusive creates,
and a compare-and-swap that writes only over the object its token names."""

from __future__ import annotations

import threading

from core import storage
from core.storage import conditional


def test_an_exclusive_create_has_one_winner_among_concurrent_writers(root):
    url = storage.join(root, "claims", "v1.json")
    barrier = threading.Barrier(4)
    won: list[bytes] = []

    def claim(data: bytes) -> None:
        barrier.wait()
        if conditional.create_exclusive(url, data):
            won.append(data)

    writers = [threading.Thread(target=claim, args=(f"writer {i}".encode(),)) for i in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert len(won) == 1 and storage.read_bytes(url) == won[0]
    assert conditional.create_exclusive(url, b"late") is False and storage.read_bytes(url) == won[0]


def test_compare_and_swap_writes_only_over_the_object_its_token_names(root):
    url = storage.join(root, "models", "latest.json")
    assert conditional.read_with_token(url) == (None, None)
    assert conditional.compare_and_swap(url, None, b"v1") is True  # None: only while absent
    assert conditional.compare_and_swap(url, None, b"v1 again") is False
    data, token = conditional.read_with_token(url)
    assert data == b"v1" and token
    assert conditional.compare_and_swap(url, token, b"v2") is True
    assert conditional.compare_and_swap(url, token, b"v3 from a stale read") is False
    assert storage.read_bytes(url) == b"v2"
    storage.remove_tree(url)
    assert conditional.compare_and_swap(url, token, b"v4 over a removed object") is False
    assert not storage.exists(url)

"""Stored Responses: what `store: true` keeps (OpenAI's default) so a later request can
continue the conversation by `previous_response_id`, and GET / DELETE
/v1/responses/{id} can read or drop it.

A record is the response object and the conversation so far as Responses input items
(the request's input after its own chain, then the response's output items); chaining
puts those items in front of the new request's `input`, so the prompt starts with the
previous prompt and answer token for token and the prefix cache serves it. As OpenAI
does, `instructions` and `tools` are not carried over: each request sends its own.

The store lives in the server's memory, bounded by count and bytes (each record's JSON
size): the oldest records go first when either bound is passed. A restart loses every
record. An id that is unknown, deleted or evicted is a 404 that names it and says which
(the last EVICTED_KEPT evicted ids are remembered for that).
"""

from __future__ import annotations

import collections
import dataclasses
import json

from prometheus_client import Counter, Gauge

from jlco.server.protocol import ApiError

DEFAULT_MAX_COUNT = 1024
DEFAULT_MAX_BYTES = 256 << 20
EVICTED_KEPT = 4096


@dataclasses.dataclass(frozen=True)
class Record:
    response: dict
    items: list
    nbytes: int


class ResponseStore:
    """Stored responses by id, oldest first out. `registry`: the server's Prometheus
    registry (jlco_response_store_{entries,bytes}, jlco_response_store_evictions)."""

    def __init__(self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES,
                 registry=None):
        if max_count < 1 or max_bytes < 1:
            raise ValueError(f"response store bounds max_count={max_count}, "
                             f"max_bytes={max_bytes}: allowed integers >= 1")
        self.max_count, self.max_bytes = max_count, max_bytes
        self._records: collections.OrderedDict[str, Record] = collections.OrderedDict()
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.nbytes = 0
        self.evictions = Counter("jlco_response_store_evictions",
                                 "Stored responses evicted (oldest first) by the count or "
                                 "byte bound", registry=registry)
        entries = Gauge("jlco_response_store_entries", "Stored responses", registry=registry)
        entries.set_function(lambda: len(self._records))
        size = Gauge("jlco_response_store_bytes", "JSON bytes of the stored responses",
                     registry=registry)
        size.set_function(lambda: self.nbytes)

    def __len__(self) -> int:
        return len(self._records)

    def put(self, rid: str, response: dict, items: list) -> None:
        """Keep `response` and its conversation `items`; evict the oldest past a bound."""
        nbytes = len(json.dumps(response)) + len(json.dumps(items))
        self._records[rid] = Record(response, items, nbytes)
        self.nbytes += nbytes
        while len(self._records) > self.max_count or self.nbytes > self.max_bytes:
            old, rec = self._records.popitem(last=False)
            self.nbytes -= rec.nbytes
            self.evictions.inc()
            self._forget(old, "was evicted from the in-memory response store (oldest first; "
                              f"it keeps at most {self.max_count} responses and "
                              f"{self.max_bytes} bytes)")

    def _forget(self, rid: str, why: str) -> None:
        self._gone[rid] = why
        while len(self._gone) > EVICTED_KEPT:
            self._gone.popitem(last=False)

    def get(self, rid: str, field: str = "response_id") -> Record:
        """The record of `rid`, or a 404 naming it and why it is not here."""
        rec = self._records.get(rid)
        if rec is None:
            why = self._gone.get(rid, "is not stored on this server (never stored, stored "
                                      "with store: false, or lost in a restart)")
            raise ApiError(404, f"{field}: response '{rid}' {why}", field)
        return rec

    def delete(self, rid: str) -> None:
        rec = self.get(rid)
        del self._records[rid]
        self.nbytes -= rec.nbytes
        self._forget(rid, "was deleted")

    def chain(self, body: dict) -> dict:
        """A Responses body with `previous_response_id`: the stored conversation put in
        front of its input."""
        prev = body["previous_response_id"]
        if not isinstance(prev, str):
            raise ApiError(400, "previous_response_id: allowed a response id (a string)",
                           "previous_response_id")
        items = self.get(prev, "previous_response_id").items
        return {**body, "input": [*items, *as_items(body.get("input"))]}


def as_items(inp) -> list:
    """A Responses `input` as a list of items (a string is one user message)."""
    if isinstance(inp, str):
        return [{"type": "message", "role": "user", "content": inp}]
    return list(inp) if isinstance(inp, list) else []

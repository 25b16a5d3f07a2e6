"""Stored `/v1/responses`, per user, for `previous_response_id` and `GET`."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class Stored:
    """A stored response: its object (for GET) and the conversation it ended (chat form,
    without instructions) for a request that continues it."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """Stored responses, per user, the least recently used first to go beyond `per_user`
    (server.max_stored_responses). One user's ids are invisible to another's."""

    def __init__(self, per_user: int):
        self.per_user = per_user
        self.users: dict[str, OrderedDict[str, Stored]] = {}

    def get(self, user: str, response_id: str) -> Stored | None:
        entries = self.users.get(user)
        if entries is None or response_id not in entries:
            return None
        entries.move_to_end(response_id)
        return entries[response_id]

    def put(self, user: str, response_id: str, stored: Stored) -> None:
        entries = self.users.setdefault(user, OrderedDict())
        entries[response_id] = stored
        while len(entries) > self.per_user:
            entries.popitem(last=False)

    def delete(self, user: str, response_id: str) -> bool:
        return self.users.get(user, {}).pop(response_id, None) is not None

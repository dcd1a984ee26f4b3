"""The Responses API's stored responses (`store`, the default): what `previous_response_id`
continues and `GET /v1/responses/{id}` returns.

In memory, within a byte budget (the least recently used go first), lost at a restart. Each
response keeps its own input items and output, and the id of the one it continued: a
conversation is the chain's items, oldest first (the earlier instructions are not carried
over, as OpenAI's are not).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass

from fastserve.server.responses_schemas import (
    InputItem,
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    ResponseObject,
)

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}


@dataclass
class StoredResponse:
    response: ResponseObject  # as last returned
    input_items: list[InputItem]  # the request's own input (not what it continued)
    previous_id: str | None
    num_bytes: int  # what it counts against the budget
    # A background response's stream events (SSE text), replayed by GET ?stream=true.
    events: list[str] | None = None


class ResponseStore:
    """Stored responses by id, least recently used first; `max_bytes` 0 keeps none."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def is_enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, input_items: list[InputItem], previous_id: str | None,
            events: list[str] | None = None) -> None:
        """Keep `response` (a larger one than the whole budget is not kept; its `events` are
        dropped first). Input items without an id get one (`GET .../input_items` lists them
        by id)."""
        input_items = [item if item.id is not None else
                       item.model_copy(update={"id": f"{_ID_PREFIX[item.type or 'message']}_{uuid.uuid4().hex}"})
                       for item in input_items]
        size = len(response.model_dump_json()) + sum(len(i.model_dump_json()) for i in input_items)
        num_event_bytes = sum(len(line) for line in events) if events is not None else 0
        if size + num_event_bytes > self.max_bytes:
            events, num_event_bytes = None, 0
        size += num_event_bytes
        self.delete(response.id)
        if size > self.max_bytes:
            return
        self._entries[response.id] = StoredResponse(response, input_items, previous_id, size, events)
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.num_bytes -= old.num_bytes

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes
        return entry is not None

    def history(self, response_id: str) -> list[InputItem]:
        """The conversation up to and with `response_id`'s output, as input items. Raises
        LookupError naming a response of the chain that is not (or no longer) stored."""
        chain: list[StoredResponse] = []
        rid: str | None = response_id
        while rid is not None:
            entry = self.get(rid)
            if entry is None:
                where = "" if rid == response_id else f" (which {response_id!r} continues)"
                raise LookupError(f"response {rid!r}{where} is not stored on this server")
            chain.append(entry)
            rid = entry.previous_id
        items: list[InputItem] = []
        for entry in reversed(chain):
            items += entry.input_items
            items += [_as_input(item) for item in entry.response.output
                      if not isinstance(item, OutputReasoning)]  # thinking is not shown again
        return items


def _as_input(item: OutputMessage | OutputFunctionCall) -> InputItem:
    """An output item as the next request's input. NOTE: not validated again: a call the
    model named freely (auto) may not fit the request's name pattern, but it was said."""
    if isinstance(item, OutputMessage):
        return InputItem.model_construct(type="message", role="assistant",
                                         content="".join(p.text for p in item.content))
    return InputItem.model_construct(type="function_call", call_id=item.call_id, name=item.name,
                                     arguments=item.arguments)

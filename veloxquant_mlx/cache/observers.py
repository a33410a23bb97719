"""``QuantizationObserver``: optional diagnostic callbacks a cache fires on notable events, outside the hot
path only (construction, calibration, prefill eviction), never per decode step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class QuantizationEvent:
    kind: str  # "created", "calibrated", "evicted", "reset", ...
    method: str
    details: dict[str, Any] = field(default_factory=dict)


class QuantizationObserver:
    """Subclass and override ``on_event``; the default records events in ``self.events``."""

    def __init__(self):
        self.events: list[QuantizationEvent] = []

    def on_event(self, event: QuantizationEvent) -> None:
        self.events.append(event)


def notify(observers, kind: str, method: str, **details) -> None:
    for obs in observers or ():
        obs.on_event(QuantizationEvent(kind, method, details))

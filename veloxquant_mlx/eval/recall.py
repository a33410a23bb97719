"""The ``recall`` prompt: can the model still copy a passage it read long ago?

The cache compresses ``[filler][passage][distractor][the passage's first cue tokens]``; the rest of the passage
is then fed as decode steps and scored. With the whole context a small model copies the repeat almost perfectly
(induction: SmolLM2-135M ~96% at 2048 tokens); a cache that dropped the first copy cannot. So the task separates
eviction methods that keep the rows later queries need from recency-only ones, which NIAH on a 135M model cannot
(the uncompressed model itself fails most needles).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["RecallPrompt", "build_recall_prompt"]

PASSAGE_TOKENS = 128
CUE_TOKENS = 16
FAR_TOKENS = 30_000  # where the default passage is taken from in the essays: far from the filler


@dataclass
class RecallPrompt:
    """``ids`` = prompt (``n_context`` tokens, ending with the cue) + the scored rest of the passage."""

    ids: list[int]
    n_context: int
    n_score: int
    passage_index: int  # where the first copy starts
    distance: int  # tokens between the end of the first copy and the start of the repeat
    depth: float  # passage_index / (passage_index + distance): the share of the other text before the copy


def build_recall_prompt(text_ids: Sequence[int], context: int, *, depth: Optional[float] = None,
                        distance: Optional[int] = None, passage: int = PASSAGE_TOKENS,
                        cue: int = CUE_TOKENS) -> RecallPrompt:
    """A ``context``-token prompt with the passage placed by ``depth`` (share of the other text before it) or
    ``distance`` (tokens from its end to the repeat), exactly one. The filler is the first tokens of
    ``text_ids`` (at least ``context + passage``), the passage its last ones (in the essays, another essay)."""
    if (depth is None) == (distance is None):
        raise ValueError("give exactly one of depth and distance")
    if not 1 <= cue < passage:
        raise ValueError(f"need 1 <= cue < passage, got cue={cue}, passage={passage}")
    room = context - passage - cue  # filler + distractor tokens
    if room < 0:
        raise ValueError(f"context={context} is too small for a {passage}-token passage and a {cue}-token cue")
    if len(text_ids) < context + passage:
        raise ValueError(f"the text has {len(text_ids)} tokens; {context + passage} are needed")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if distance is not None and not 0 <= distance <= room:
        raise ValueError(f"distance must be in 0..{room} for context={context}, got {distance}")
    before = int(round(depth * room)) if depth is not None else room - distance
    filler = [int(t) for t in text_ids[:room]]
    copy = [int(t) for t in text_ids[len(text_ids) - passage:]]
    prompt = filler[:before] + copy + filler[before:] + copy[:cue]
    return RecallPrompt(ids=prompt + copy[cue:], n_context=len(prompt), n_score=passage - cue,
                        passage_index=before, distance=room - before, depth=before / room if room else 0.0)

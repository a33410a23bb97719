"""The ``recall`` task: can the model still copy a passage it read long ago?

A real passage (``passage`` tokens) appears early in the context and again at its end, after
distractor text: ``[filler][passage][distractor][first cue tokens of the passage]`` is the prompt that
the cache compresses; then the rest of the passage is fed token by token (decode steps) and scored.
With the whole context in its cache a small model copies the repeat almost perfectly (induction:
SmolLM2-135M predicts ~96% of its tokens at 2048 tokens); a cache that dropped the first copy
cannot, whatever its quality elsewhere. So the task separates eviction methods that keep the rows
later queries need (the cue's queries point at the first copy) from recency-only ones, which the NIAH
task on a 135M model cannot (the uncompressed model itself fails most needles).

Where the first copy sits: ``depth`` (fraction of the context before it) or ``distance`` (tokens from
its end to the repeat). Scores per trial: ``copy_acc`` (fraction of scored steps whose greedy token
is the passage's next token), the next-token KL against the uncompressed model and its top-1
agreement (as the ``kld`` task), and the passage perplexity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .fidelity import next_token_fidelity, reference_logprobs

__all__ = ["RecallPrompt", "build_recall_prompt", "recall_trial"]

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
    """A ``context``-token prompt with the passage placed by ``depth`` or ``distance`` (exactly one).

    ``text_ids``: real text token ids, at least ``context + passage`` of them; the filler is its first
    tokens and the passage its last ``passage`` tokens, so the passage occurs nowhere else in the prompt
    (given a long text, it comes from far away -- another essay -- and reads as unrelated to the filler).
    """
    if (depth is None) == (distance is None):
        raise ValueError("give exactly one of depth and distance")
    if not 1 <= cue < passage:
        raise ValueError(f"need 1 <= cue < passage, got cue={cue}, passage={passage}")
    room = context - passage - cue  # filler + distractor tokens
    if room < 0:
        raise ValueError(f"context={context} is too small for a {passage}-token passage and a {cue}-token cue")
    if len(text_ids) < context + passage:
        raise ValueError(f"the text has {len(text_ids)} tokens; {context + passage} are needed")
    if depth is not None:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        before = int(round(depth * room))
    else:
        if not 0 <= distance <= room:
            raise ValueError(f"distance must be in 0..{room} for context={context}, got {distance}")
        before = room - distance
    filler = [int(t) for t in text_ids[:room]]
    copy = [int(t) for t in text_ids[len(text_ids) - passage:]]
    prompt = filler[:before] + copy + filler[before:] + copy[:cue]
    return RecallPrompt(ids=prompt + copy[cue:], n_context=len(prompt), n_score=passage - cue,
                        passage_index=before, distance=room - before, depth=before / room if room else 0.0)


def recall_trial(model, prompt: RecallPrompt, config, ref_logp=None, on_chunk=None, after_prefill=None):
    """One trial: :class:`~.fidelity.FidelityResult` of the scored passage tokens (``top1_target`` is the
    copy accuracy). ``ref_logp``: :func:`~.fidelity.reference_logprobs` of ``prompt``, if computed."""
    if ref_logp is None:
        ref_logp = reference_logprobs(model, prompt.ids, prompt.n_context, prompt.n_score)
    return next_token_fidelity(model, prompt.ids, prompt.n_context, prompt.n_score, config, ref_logp=ref_logp,
                               on_chunk=on_chunk, after_prefill=after_prefill)

"""Quality tasks on a real model, one function per task, each returning one row dict per method.

* :func:`eval_ppl` — perplexity of ``n_score`` real-text tokens that follow a ``context``-token prefix
  prefilled through the cache (teacher forcing, one decode step per token), and its change against
  the uncompressed cache on the same tokens (``ppl_delta = ppl - ppl_ref``).
* :func:`eval_kld` — on the same steps: mean KL(P_uncompressed || P_compressed) of the next-token
  distributions in nats, and top-1 agreement (see :mod:`.fidelity`).
* :func:`eval_niah` — needle in a haystack, kvpress's query-agnostic protocol: a passcode sentence is
  planted at each of several depths of a ``context``-token real-text prompt (:func:`build_niah_prompt`),
  the context is prefilled through the cache (so compression sees no question), then the question is
  fed token by token as decode steps, and the greedy answer is scored by exact match of the number
  (:func:`extract_answer`). The ``none`` row is the uncompressed model's own accuracy.
* :func:`eval_recall` — a real passage read early in the context is repeated at its end; the cache
  compresses the context, then the repeat is scored (:mod:`.recall`): ``copy_acc`` is how much of it
  the model still copies, the uncompressed model's ``copy_acc_ref`` its ceiling.

Every row has the keys :data:`ROW_KEYS` (``None`` where a value does not apply). ``compression`` is
``kv_bytes_fp16 / kv_bytes``: how many times smaller the cache is than mlx_lm's plain cache at fp16 for
the same tokens (above 1 = smaller; the ``none`` row is below 1 on the CPU, where mlx_lm stores the
model's float32 and allocates in 256-row steps). Task functions share work through ``memo`` (a dict):
``eval_ppl`` and ``eval_kld`` on the same tokens run each cache once.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import mlx.core as mx

from ..measure import cache_tokens, fp16_kv_bytes, kv_bytes, kv_fraction_of_fp16
from .fidelity import make_caches, next_token_fidelity, prefill, reconstruct, reference_logprobs
from .recall import FAR_TOKENS, PASSAGE_TOKENS, RecallPrompt, build_recall_prompt, recall_trial
from .specs import NONE, MethodSpec

__all__ = [
    "ROW_KEYS", "TASKS", "DEFAULT_TASKS", "NEEDLE_TEMPLATE", "QUESTION", "DEFAULT_DEPTHS",
    "NiahPrompt", "build_niah_prompt", "extract_answer", "passcodes", "text_tokens",
    "eval_ppl", "eval_kld", "eval_niah", "eval_recall", "run_eval", "count_units",
]

TASKS = ("ppl", "kld", "niah", "recall")
DEFAULT_TASKS = ("ppl", "kld", "niah")  # what ``veloxquant eval`` runs without --task

ROW_KEYS = ("method", "settings", "label", "task", "model", "context", "n_scored",
            "ppl", "ppl_ref", "ppl_delta", "kld", "top1_agree",
            "niah_acc", "niah_hits", "niah_trials", "niah_detail",
            "copy_acc", "copy_acc_ref", "recall_detail",
            "kv_tokens", "kv_bytes", "kv_bytes_fp16", "kv_fraction_of_fp16", "seconds", "error")

DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
NEEDLE_TEMPLATE = "The secret passcode for the blue vault is {code}."
QUESTION = "What is the secret passcode for the blue vault? Answer with the number only."
INSTRUCTION = "Read the text below, then answer the question after it."
_SENTENCE_END = (".", "!", "?", "\n")

Progress = Optional[Callable[[str], None]]


# --------------------------------------------------------------------------- #
# rows
# --------------------------------------------------------------------------- #


def _row(spec: MethodSpec, task: str, context: int, model_name: Optional[str], **values) -> dict:
    row = dict.fromkeys(ROW_KEYS)
    row.update(method=spec.method, settings=dict(spec.settings), label=spec.label, task=task,
               model=model_name, context=context)
    row.update(values)
    row["kv_fraction_of_fp16"] = kv_fraction_of_fp16(row.get("kv_bytes"), row.get("kv_bytes_fp16"))
    return row


def _specs(methods: Iterable, include_none: bool) -> list[MethodSpec]:
    specs = [MethodSpec.coerce(m) for m in methods]
    specs = list({s.key: s for s in specs}.values())
    if include_none and not any(s.method == NONE for s in specs):
        specs.insert(0, MethodSpec(NONE))
    return specs


def _chunks(progress: Progress):
    """The progress object's prefill-chunk callback (``chunk(done, total)``), if it has one."""
    return getattr(progress, "chunk", None)


def _tick(progress: Progress, msg: str) -> None:
    if progress is not None:
        progress(msg)


# --------------------------------------------------------------------------- #
# text
# --------------------------------------------------------------------------- #


def text_tokens(tokenizer, n_tokens: int, text: Optional[str] = None, repeat: bool = False) -> list[int]:
    """The first ``n_tokens`` token ids of ``text`` (default: the Paul Graham essays), no special tokens.

    Too short a text raises ``ValueError``, or is repeated (blank-line separated) when ``repeat``.
    """
    if text is None:
        from ..assets import essays_text

        text = essays_text(max_chars=max(n_tokens, 64) * 8)
    ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    if len(ids) < n_tokens:
        if not repeat or not ids:
            raise ValueError(f"the text has {len(ids)} tokens; {n_tokens} are needed")
        sep = [int(i) for i in tokenizer.encode("\n\n", add_special_tokens=False)]
        unit = ids + sep
        ids = (unit * (n_tokens // len(unit) + 1))
    return ids[:n_tokens]


# --------------------------------------------------------------------------- #
# perplexity and KL divergence
# --------------------------------------------------------------------------- #


def _fidelity_rows(task, model, tokenizer, methods, *, context, n_score, text, model_name, progress, memo,
                   include_none, reconstruct_context=False):
    if context < 2 or n_score < 1:
        raise ValueError(f"need context >= 2 and n_score >= 1, got {context}, {n_score}")
    memo = {} if memo is None else memo
    specs = _specs(methods, include_none)
    ids_key = ("ids", context + n_score, hash(text) if text is not None else None)
    if ids_key not in memo:
        memo[ids_key] = text_tokens(tokenizer, context + n_score, text)
    ids = memo[ids_key]
    ref_key = ("ref", tuple(ids), context, n_score)
    _tick(progress, f"{task}: uncompressed reference ({context}+{n_score} tokens)")
    if ref_key not in memo:
        memo[ref_key] = reference_logprobs(model, ids, context, n_score)
    rows = []
    for spec in specs:
        _tick(progress, f"{task}: {spec.label}")
        key = ("fid", spec.key, ref_key, reconstruct_context)
        if key not in memo:
            t0 = time.perf_counter()
            try:
                memo[key] = (next_token_fidelity(model, ids, context, n_score, spec.config(),
                                                 ref_logp=memo[ref_key], on_chunk=_chunks(progress),
                                                 after_prefill=reconstruct(model, tokenizer)
                                                 if reconstruct_context else None),
                             time.perf_counter() - t0, None)
            except Exception as exc:  # one broken method must not end a sweep
                memo[key] = (None, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
        r, seconds, error = memo[key]
        if r is None:
            rows.append(_row(spec, task, context, model_name, n_scored=n_score, seconds=seconds, error=error))
            continue
        rows.append(_row(spec, task, context, model_name, n_scored=r.n_scored, ppl=r.ppl, ppl_ref=r.ppl_ref,
                         ppl_delta=r.ppl - r.ppl_ref, kld=r.kld, top1_agree=r.top1_agree,
                         kv_tokens=context + n_score - 1, kv_bytes=r.kv_bytes, kv_bytes_fp16=r.kv_bytes_fp16,
                         seconds=seconds))
    return rows


def eval_ppl(model, tokenizer, methods: Sequence, *, context: int = 1024, n_score: int = 64,
             text: Optional[str] = None, model_name: Optional[str] = None, progress: Progress = None,
             memo: Optional[dict] = None, include_none: bool = True, reconstruct_context: bool = False) -> list[dict]:
    """Perplexity rows (task ``ppl``): ``ppl``, ``ppl_ref`` (uncompressed), ``ppl_delta``; the KL
    divergence and top-1 agreement of the same run are filled in too.

    ``methods``: names, ``(name, settings)`` pairs or :class:`MethodSpec` s; ``none`` is added first
    unless ``include_none=False``. ``text``: the real text (default: the essays); it needs
    ``context + n_score`` tokens. ``reconstruct_context``: run each cache's context-reconstruction pass
    after the prefill (:func:`.fidelity.reconstruct`; KVzip's paper setting).
    """
    return _fidelity_rows("ppl", model, tokenizer, methods, context=context, n_score=n_score, text=text,
                          model_name=model_name, progress=progress, memo=memo, include_none=include_none,
                          reconstruct_context=reconstruct_context)


def eval_kld(model, tokenizer, methods: Sequence, *, context: int = 1024, n_score: int = 64,
             text: Optional[str] = None, model_name: Optional[str] = None, progress: Progress = None,
             memo: Optional[dict] = None, include_none: bool = True, reconstruct_context: bool = False) -> list[dict]:
    """KL-divergence rows (task ``kld``): ``kld`` (nats, mean over the ``n_score`` steps), ``top1_agree``
    (and the same run's perplexities). Arguments as :func:`eval_ppl`."""
    return _fidelity_rows("kld", model, tokenizer, methods, context=context, n_score=n_score, text=text,
                          model_name=model_name, progress=progress, memo=memo, include_none=include_none,
                          reconstruct_context=reconstruct_context)


# --------------------------------------------------------------------------- #
# needle in a haystack
# --------------------------------------------------------------------------- #


@dataclass
class NiahPrompt:
    """A query-agnostic NIAH prompt: ``context_ids`` (compressed) then ``question_ids`` (fed after)."""

    context_ids: list[int]
    question_ids: list[int]
    answer: str
    depth: float  # requested depth (fraction of the haystack before the needle)
    needle_index: int  # index in context_ids of the needle's first token
    needle_ids: list[int] = field(default_factory=list)

    @property
    def needle_depth(self) -> float:
        """Where the needle really starts, as a fraction of the context."""
        return self.needle_index / len(self.context_ids)


def _template_parts(tokenizer) -> tuple[list[int], list[int]]:
    """Token ids before the document and after it (the question, end of turn, assistant header)."""
    marker = "\x00DOCUMENT\x00"
    content = f"{INSTRUCTION}\n\n{marker}\n\nQuestion: {QUESTION}"
    rendered = None
    if getattr(tokenizer, "chat_template", None) or getattr(tokenizer, "has_chat_template", False):
        try:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                     add_generation_prompt=True)
        except Exception:
            rendered = None
    if not isinstance(rendered, str) or marker not in rendered:
        rendered = content + "\nAnswer:"
    head, tail = rendered.split(marker, 1)
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and head.startswith(bos))
    head_ids = [int(i) for i in tokenizer.encode(head, add_special_tokens=add_special)]
    tail_ids = [int(i) for i in tokenizer.encode(tail, add_special_tokens=False)]
    return head_ids, tail_ids


def _encode(tokenizer, text: str) -> list[int]:
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def _snap_to_sentence(tokenizer, hay: list[int], k: int, reach: int = 48) -> int:
    """The insertion index nearest ``k`` right after a token that ends a sentence (else ``k``)."""
    lo, hi = max(1, k - reach), min(len(hay), k + reach)
    best = None
    for j in range(lo, hi + 1):
        piece = tokenizer.decode([hay[j - 1]])
        if piece.rstrip(" ").endswith(_SENTENCE_END) and (best is None or abs(j - k) < abs(best - k)):
            best = j
    return k if best is None else best


def build_niah_prompt(tokenizer, context_tokens: int, depth: float, passcode: str = "4817",
                      haystack_ids: Optional[Sequence[int]] = None, text: Optional[str] = None) -> NiahPrompt:
    """A ``context_tokens``-token context with the passcode sentence at ``depth`` of its real text.

    Layout (chat template when the tokenizer has one): ``[template head + instruction][haystack up to
    the depth][needle sentence][rest of the haystack]`` = exactly ``context_tokens`` tokens, the needle
    inserted at the sentence boundary nearest ``depth``; the question and the assistant header are the
    separate ``question_ids``. ``haystack_ids`` (token ids) or ``text`` (default: the essays; repeated
    if short) provide the haystack.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    head, question = _template_parts(tokenizer)
    sentence = NEEDLE_TEMPLATE.format(code=passcode)
    longest = len(_encode(tokenizer, " " + sentence + " "))  # the needle with both spaces
    budget = context_tokens - len(head) - longest
    if budget < 16:
        raise ValueError(f"context_tokens={context_tokens} is too small: the instruction and the needle alone "
                         f"take {len(head) + longest} tokens")
    need = context_tokens - len(head)  # enough haystack for any needle spacing
    if haystack_ids is None:
        haystack_ids = text_tokens(tokenizer, need, text, repeat=True)
    elif len(haystack_ids) < need:
        raise ValueError(f"haystack_ids has {len(haystack_ids)} tokens; {need} are needed")
    hay = [int(i) for i in haystack_ids[:need]]
    k = int(round(depth * budget))
    if 0.0 < depth < 1.0:
        k = _snap_to_sentence(tokenizer, hay[:budget], k)
    before = tokenizer.decode([hay[k - 1]]) if k > 0 else "\n"
    after = tokenizer.decode([hay[k]]) if k < len(hay) else "\n"
    needle = _encode(tokenizer, ("" if before.endswith((" ", "\n")) else " ") + sentence
                     + ("" if after[:1].isspace() else " "))
    hay = hay[: context_tokens - len(head) - len(needle)]
    context = head + hay[:k] + needle + hay[k:]
    return NiahPrompt(context_ids=context, question_ids=question, answer=str(passcode), depth=depth,
                      needle_index=len(head) + k, needle_ids=needle)


def extract_answer(text: str) -> Optional[str]:
    """The first number in ``text`` with its digits joined (``"It is 4,817."`` -> ``"4817"``), else None."""
    m = re.search(r"\d(?:[\d,]|\s(?=\d))*", text)
    return re.sub(r"\D", "", m.group()) if m else None


def passcodes(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct 4-digit passcodes, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [str(c) for c in rng.sample(range(1000, 10000), n)]


def _eos_ids(tokenizer) -> set[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids:
        return {int(i) for i in ids}
    eos = getattr(tokenizer, "eos_token_id", None)
    return {int(eos)} if eos is not None else set()


def _answer(model, tokenizer, prompt: NiahPrompt, config, max_new_tokens: int,
            on_chunk=None, after_prefill=None) -> tuple[str, list]:
    """Prefill the context, feed the question token by token, decode greedily; (text, caches)."""
    caches = make_caches(model, config)
    prefill(model, prompt.context_ids, caches, on_chunk=on_chunk)
    if after_prefill is not None:
        after_prefill(caches, prompt.context_ids)
    logits = None
    for t in prompt.question_ids:
        logits = model(mx.array([[t]]), cache=caches)
        mx.eval(logits)
    eos = _eos_ids(tokenizer)
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(mx.argmax(logits[0, -1]).item())
        if tok in eos:
            break
        out.append(tok)
        text = tokenizer.decode(out)
        if re.search(r"\d[^\d,\s]", text) or re.search(r"\d\s*\n", text):  # a number, then something else
            break
        logits = model(mx.array([[tok]]), cache=caches)
        mx.eval(logits)
    return tokenizer.decode(out), caches


def eval_niah(model, tokenizer, methods: Sequence, *, context: int = 1024,
              depths: Sequence[float] = DEFAULT_DEPTHS, text: Optional[str] = None, seed: int = 0,
              max_new_tokens: int = 24, model_name: Optional[str] = None, progress: Progress = None,
              memo: Optional[dict] = None, include_none: bool = True, reconstruct_context: bool = False) -> list[dict]:
    """Needle-in-a-haystack rows (task ``niah``): ``niah_acc`` = exact-match accuracy over ``depths``
    (one passcode per depth, from ``seed``), ``niah_detail`` = per depth: passcode, answer, correct.
    ``kv_bytes`` is the mean over the trials, measured after the answer; ``reconstruct_context`` as
    :func:`eval_ppl` (the pass sees the context only, not the question)."""
    specs = _specs(methods, include_none)
    codes = passcodes(len(depths), seed)
    hay_key = ("hay", context, hash(text) if text is not None else None)
    memo = {} if memo is None else memo
    if hay_key not in memo:
        memo[hay_key] = text_tokens(tokenizer, context, text, repeat=True)
    prompts = [build_niah_prompt(tokenizer, context, d, c, haystack_ids=memo[hay_key]) for d, c in zip(depths, codes)]
    rows = []
    for spec in specs:
        t0 = time.perf_counter()
        detail, sizes, error, n_tok = [], [], None, 0
        try:
            config = spec.config()
            for p in prompts:
                _tick(progress, f"niah: {spec.label} depth {p.depth:g}")
                answer, caches = _answer(model, tokenizer, p, config, max_new_tokens, _chunks(progress),
                                         reconstruct(model, tokenizer) if reconstruct_context else None)
                sizes.append(kv_bytes(caches))
                n_tok = cache_tokens(caches)
                del caches
                detail.append({"depth": p.depth, "passcode": p.answer, "answer": answer.strip(),
                               "correct": extract_answer(answer) == p.answer})
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - t0
        if error is not None:
            rows.append(_row(spec, "niah", context, model_name, seconds=seconds, error=error, niah_detail=detail))
            continue
        hits = sum(d["correct"] for d in detail)
        rows.append(_row(spec, "niah", context, model_name, niah_acc=hits / len(detail), niah_hits=hits,
                         niah_trials=len(detail), niah_detail=detail, kv_tokens=n_tok,
                         kv_bytes=int(round(sum(sizes) / len(sizes))), kv_bytes_fp16=fp16_kv_bytes(model, n_tok),
                         seconds=seconds))
    return rows


# --------------------------------------------------------------------------- #
# recall
# --------------------------------------------------------------------------- #


def recall_prompts(tokenizer, context: int, depths: Sequence[float] = (), distances: Sequence[int] = (),
                   text: Optional[str] = None, passage: int = PASSAGE_TOKENS) -> list[RecallPrompt]:
    """One :class:`~.recall.RecallPrompt` per depth and per distance, on ``text`` (default: the essays)."""
    if text is None:  # the essays: the passage from FAR_TOKENS on, another essay than the filler
        ids = text_tokens(tokenizer, max(context, FAR_TOKENS) + passage)
    else:  # a given text: the passage is its last tokens
        ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    return ([build_recall_prompt(ids, context, depth=d, passage=passage) for d in depths]
            + [build_recall_prompt(ids, context, distance=n, passage=passage) for n in distances])


def eval_recall(model, tokenizer, methods: Sequence, *, context: int = 1024,
                depths: Sequence[float] = (0.1,), distances: Sequence[int] = (), passage: int = PASSAGE_TOKENS,
                text: Optional[str] = None, model_name: Optional[str] = None, progress: Progress = None,
                memo: Optional[dict] = None, include_none: bool = True,
                reconstruct_context: bool = False) -> list[dict]:
    """Recall rows (task ``recall``): ``copy_acc`` / ``copy_acc_ref`` = mean over the trials (one per depth
    and per distance) of the greedy copy accuracy with the cache / uncompressed; ``kld``, ``top1_agree``
    and ``ppl`` of the same steps; ``recall_detail`` per trial. ``kv_bytes`` is the trials' mean."""
    memo = {} if memo is None else memo
    specs = _specs(methods, include_none)
    prompts = recall_prompts(tokenizer, context, depths, distances, text, passage)
    refs = []
    for p in prompts:
        key = ("recall_ref", tuple(p.ids), p.n_context)
        if key not in memo:
            memo[key] = reference_logprobs(model, p.ids, p.n_context, p.n_score)
        refs.append(memo[key])
    rows = []
    for spec in specs:
        t0 = time.perf_counter()
        results, error = [], None
        try:
            config = spec.config()
            for p, ref in zip(prompts, refs):
                _tick(progress, f"recall: {spec.label} distance {p.distance}")
                results.append(recall_trial(model, p, config, ref_logp=ref, on_chunk=_chunks(progress),
                                            after_prefill=reconstruct(model, tokenizer) if reconstruct_context
                                            else None))
        except Exception as exc:  # one broken method must not end a sweep
            error = f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - t0
        if error is not None:
            rows.append(_row(spec, "recall", context, model_name, seconds=seconds, error=error))
            continue
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        detail = [{"depth": round(p.depth, 4), "distance": p.distance, "copy_acc": r.top1_target,
                   "copy_acc_ref": r.top1_target_ref, "kld": r.kld} for p, r in zip(prompts, results)]
        rows.append(_row(spec, "recall", context, model_name, n_scored=sum(r.n_scored for r in results),
                         copy_acc=mean([r.top1_target for r in results]),
                         copy_acc_ref=mean([r.top1_target_ref for r in results]), recall_detail=detail,
                         kld=mean([r.kld for r in results]), top1_agree=mean([r.top1_agree for r in results]),
                         ppl=mean([r.ppl for r in results]), ppl_ref=mean([r.ppl_ref for r in results]),
                         kv_tokens=prompts[0].n_context + prompts[0].n_score - 1,
                         kv_bytes=int(round(mean([r.kv_bytes for r in results]))),
                         kv_bytes_fp16=results[0].kv_bytes_fp16, seconds=seconds))
        rows[-1]["ppl_delta"] = rows[-1]["ppl"] - rows[-1]["ppl_ref"]
    return rows


# --------------------------------------------------------------------------- #
# several tasks
# --------------------------------------------------------------------------- #


def count_units(tasks: Sequence[str], n_methods: int, n_depths: int = len(DEFAULT_DEPTHS),
                n_recall: int = 1) -> int:
    """How many ``progress`` calls :func:`run_eval` makes (``n_methods`` including ``none``;
    ``n_recall``: recall trials per method)."""
    total = 0
    for t in tasks:
        total += (n_methods * n_depths if t == "niah" else n_methods * n_recall if t == "recall"
                  else n_methods + 1)
    return total


def run_eval(model, tokenizer, methods: Sequence, tasks: Sequence[str] = DEFAULT_TASKS, *, context: int = 1024,
             n_score: int = 64, depths: Sequence[float] = DEFAULT_DEPTHS, text: Optional[str] = None,
             model_name: Optional[str] = None, progress: Progress = None, include_none: bool = True,
             recall_distances: Sequence[int] = (), recall_passage: int = PASSAGE_TOKENS,
             reconstruct_context: bool = False, **niah_kw: Any) -> list[dict]:
    """Rows of every task in ``tasks`` (in that order), sharing the uncompressed reference and runs.
    ``recall`` runs one trial per depth of ``depths``, or per distance of ``recall_distances`` if given."""
    memo: dict = {}
    rows: list[dict] = []
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}; tasks: {', '.join(TASKS)}")
    if "niah" in tasks:  # fail on a too-short context before any other task runs
        build_niah_prompt(tokenizer, context, 0.5, "0000", text=text)
    for task in dict.fromkeys(tasks):
        common = dict(context=context, text=text, model_name=model_name, progress=progress, memo=memo,
                      include_none=include_none, reconstruct_context=reconstruct_context)
        if task == "ppl":
            rows += eval_ppl(model, tokenizer, methods, n_score=n_score, **common)
        elif task == "kld":
            rows += eval_kld(model, tokenizer, methods, n_score=n_score, **common)
        elif task == "niah":
            rows += eval_niah(model, tokenizer, methods, depths=depths, **common, **niah_kw)
        elif task == "recall":
            rows += eval_recall(model, tokenizer, methods, depths=() if recall_distances else depths,
                                distances=recall_distances, passage=recall_passage, **common)
        else:
            raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    return rows

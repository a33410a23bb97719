"""Quality tasks on a real model (what each figure means: :data:`.plot.DEFINITIONS`): each returns one row
(:data:`ROW_KEYS`, None where a value does not apply) per method, the uncompressed ``none`` first. ``ppl`` and ``kld``
share one run per cache (``memo``, :mod:`.fidelity`); ``niah`` is kvpress's query-agnostic needle in a haystack
(:func:`build_niah_prompt`: the question is fed after the compressed context); ``recall``: :mod:`.recall`."""

from __future__ import annotations

import functools
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import mlx.core as mx

from ..measure import cache_tokens, fp16_kv_bytes, kv_bytes, kv_fraction_of_fp16
from .fidelity import make_caches, next_token_fidelity, prefill, reconstruct, reference_logprobs
from .recall import FAR_TOKENS, PASSAGE_TOKENS, build_recall_prompt
from .specs import NONE, MethodSpec

__all__ = ["ROW_KEYS", "TASKS", "DEFAULT_TASKS", "NEEDLE_TEMPLATE", "QUESTION", "DEFAULT_DEPTHS", "NiahPrompt",
           "build_niah_prompt", "extract_answer", "passcodes", "text_tokens", "eval_ppl", "eval_kld", "eval_niah",
           "eval_recall", "run_eval", "count_units"]

TASKS = ("ppl", "kld", "niah", "recall")
DEFAULT_TASKS = ("ppl", "kld", "niah")  # what ``veloxquant eval`` runs without --task
ROW_KEYS = ("method", "settings", "label", "task", "model", "context", "n_scored", "ppl", "ppl_ref", "ppl_delta",
            "kld", "top1_agree", "niah_acc", "niah_hits", "niah_trials", "niah_detail", "copy_acc", "copy_acc_ref",
            "recall_detail", "kv_tokens", "kv_bytes", "kv_bytes_fp16", "kv_fraction_of_fp16", "seconds", "error")
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
NEEDLE_TEMPLATE = "The secret passcode for the blue vault is {code}."
QUESTION = "What is the secret passcode for the blue vault? Answer with the number only."
INSTRUCTION = "Read the text below, then answer the question after it."

Progress = Optional[Callable[[str], None]]  # called once per unit of work; its ``chunk`` (if any) per prefill chunk


def _measured(spec, task, context, model_name, run: Callable[[], dict], **on_error) -> dict:
    """The row of ``run()``'s values, or an error row: one broken method must not end a sweep."""
    t0 = time.perf_counter()
    try:
        values = run()
    except Exception as exc:  # noqa: BLE001
        values = dict(on_error, error=f"{type(exc).__name__}: {exc}")
    row = dict.fromkeys(ROW_KEYS)
    row.update(method=spec.method, settings=dict(spec.settings), label=spec.label, task=task, model=model_name,
               context=context, seconds=time.perf_counter() - t0, **values)
    row["kv_fraction_of_fp16"] = kv_fraction_of_fp16(row["kv_bytes"], row["kv_bytes_fp16"])
    return row


def _specs(methods: Iterable, include_none: bool) -> list[MethodSpec]:
    specs = list({s.key: s for s in map(MethodSpec.coerce, methods)}.values())
    if include_none and not any(s.method == NONE for s in specs):
        specs.insert(0, MethodSpec(NONE))
    return specs


def _tick(progress: Progress, msg: str) -> None:
    if progress is not None:
        progress(msg)


def _fidelity_values(rs: list, kv_tokens: int) -> dict:
    """Row values of :func:`.fidelity.next_token_fidelity` results: their means (``kv_bytes`` rounded)."""
    mean = lambda k: sum(getattr(r, k) for r in rs) / len(rs)  # noqa: E731
    return dict(n_scored=sum(r.n_scored for r in rs), ppl=mean("ppl"), ppl_ref=mean("ppl_ref"),
                ppl_delta=mean("ppl") - mean("ppl_ref"), kld=mean("kld"), top1_agree=mean("top1_agree"),
                kv_tokens=kv_tokens, kv_bytes=int(round(mean("kv_bytes"))), kv_bytes_fp16=rs[0].kv_bytes_fp16)


def _memo(memo: dict, key, compute: Callable[[], Any]):
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def _hooks(model, tokenizer, progress: Progress, reconstruct_context: bool) -> dict:
    """``on_chunk`` (the progress's prefill report) and ``after_prefill`` (the reconstruction pass) of a run."""
    return dict(on_chunk=getattr(progress, "chunk", None),
                after_prefill=reconstruct(model, tokenizer) if reconstruct_context else None)


def _encode(tokenizer, text: str) -> list[int]:
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def text_tokens(tokenizer, n_tokens: int, text: Optional[str] = None, repeat: bool = False) -> list[int]:
    """The first ``n_tokens`` token ids of ``text`` (default: the essays), no special tokens; too short a
    text raises ``ValueError``, or is repeated (blank-line separated) when ``repeat``."""
    if text is None:
        from ..assets import essays_text
        text = essays_text(max_chars=max(n_tokens, 64) * 8)
    ids = _encode(tokenizer, text)
    if len(ids) < n_tokens:
        if not repeat or not ids:
            raise ValueError(f"the text has {len(ids)} tokens; {n_tokens} are needed")
        unit = ids + _encode(tokenizer, "\n\n")
        ids = unit * (n_tokens // len(unit) + 1)
    return ids[:n_tokens]


def _fidelity_rows(task, model, tokenizer, methods, *, context=1024, n_score=64, text=None, model_name=None,
                   progress: Progress = None, memo=None, include_none=True, reconstruct_context=False) -> list[dict]:
    """``ppl`` or ``kld`` rows of ``methods`` (names, ``(name, settings)`` pairs or :class:`MethodSpec` s; ``none``
    first unless ``include_none=False``); ``text`` (default: the essays) needs ``context + n_score`` tokens;
    ``reconstruct_context``: run each cache's context-reconstruction pass after the prefill (KVzip's setting)."""
    if context < 2 or n_score < 1:
        raise ValueError(f"need context >= 2 and n_score >= 1, got {context}, {n_score}")
    memo = {} if memo is None else memo
    ids = _memo(memo, ("ids", context + n_score, text), lambda: text_tokens(tokenizer, context + n_score, text))
    ref_key = ("ref", tuple(ids), context, n_score)
    _tick(progress, f"{task}: uncompressed reference ({context}+{n_score} tokens)")
    ref = _memo(memo, ref_key, lambda: reference_logprobs(model, ids, context, n_score))
    hooks = _hooks(model, tokenizer, progress, reconstruct_context)

    def run(spec):
        r = next_token_fidelity(model, ids, context, n_score, spec.config(), ref_logp=ref, **hooks)
        return _fidelity_values([r], context + n_score - 1)
    rows = []
    for spec in _specs(methods, include_none):
        _tick(progress, f"{task}: {spec.label}")
        row = _memo(memo, ("fid", spec.key, ref_key, reconstruct_context),
                    lambda: _measured(spec, task, context, model_name, lambda: run(spec), n_scored=n_score))
        rows.append({**row, "task": task, "model": model_name})
    return rows


eval_ppl = functools.partial(_fidelity_rows, "ppl")  # (model, tokenizer, methods, **kw): ppl rows
eval_kld = functools.partial(_fidelity_rows, "kld")  # the same runs' rows under the kld task


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
    def needle_depth(self) -> float:  # where the needle really starts
        return self.needle_index / len(self.context_ids)


def _template_parts(tokenizer) -> tuple[list[int], list[int]]:
    """Token ids before the document and after it (the question, end of turn, assistant header)."""
    from ..generate import _has_template
    marker = "\x00DOCUMENT\x00"
    content = f"{INSTRUCTION}\n\n{marker}\n\nQuestion: {QUESTION}"
    rendered = None
    if _has_template(tokenizer):
        try:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                     add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that refuses: plain text below
            pass
    if not isinstance(rendered, str) or marker not in rendered:
        rendered = content + "\nAnswer:"
    head, tail = rendered.split(marker, 1)
    bos = getattr(tokenizer, "bos_token", None)
    head_ids = [int(i) for i in tokenizer.encode(head, add_special_tokens=not (bos and head.startswith(bos)))]
    return head_ids, _encode(tokenizer, tail)


def _snap_to_sentence(tokenizer, hay: list[int], k: int, reach: int = 48) -> int:
    """The insertion index nearest ``k`` right after a token that ends a sentence (else ``k``)."""
    ends = [j for j in range(max(1, k - reach), min(len(hay), k + reach) + 1)
            if tokenizer.decode([hay[j - 1]]).rstrip(" ").endswith((".", "!", "?", "\n"))]
    return min(ends, key=lambda j: abs(j - k), default=k)


def build_niah_prompt(tokenizer, context_tokens: int, depth: float, passcode: str = "4817",
                      haystack_ids: Optional[Sequence[int]] = None, text: Optional[str] = None) -> NiahPrompt:
    """A ``context_tokens``-token context ``[template head + instruction][haystack][needle][haystack]``, the
    needle at the sentence boundary nearest ``depth``; ``question_ids``: the question and assistant header. The
    haystack: ``haystack_ids``, or ``text`` (default: the essays; repeated if short)."""
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
    return NiahPrompt(context_ids=head + hay[:k] + needle + hay[k:], question_ids=question, answer=str(passcode),
                      depth=depth, needle_index=len(head) + k, needle_ids=needle)


def extract_answer(text: str) -> Optional[str]:
    """The first number in ``text`` with its digits joined (``"It is 4,817."`` -> ``"4817"``), else None."""
    m = re.search(r"\d(?:[\d,]|\s(?=\d))*", text)
    return re.sub(r"\D", "", m.group()) if m else None


def passcodes(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct 4-digit passcodes, reproducible from ``seed``."""
    return [str(c) for c in random.Random(seed).sample(range(1000, 10000), n)]


def _answer(model, tokenizer, prompt: NiahPrompt, config, max_new_tokens: int,
            on_chunk=None, after_prefill=None) -> tuple[str, list]:
    """Prefill the context, feed the question token by token, decode greedily; (text, caches)."""
    caches = make_caches(model, config)
    prefill(model, prompt.context_ids, caches, on_chunk=on_chunk)
    if after_prefill is not None:
        after_prefill(caches, prompt.context_ids)
    for t in prompt.question_ids:
        logits = model(mx.array([[t]]), cache=caches)
        mx.eval(logits)
    eos = getattr(tokenizer, "eos_token_ids", None) or {getattr(tokenizer, "eos_token_id", None)}
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
    """NIAH rows: ``niah_acc`` = exact-match accuracy over ``depths`` (one passcode each, from ``seed``),
    ``niah_detail`` per depth; ``kv_bytes``: the trials' mean after the answer."""
    hay = _memo({} if memo is None else memo, ("hay", context, text),
                lambda: text_tokens(tokenizer, context, text, repeat=True))
    prompts = [build_niah_prompt(tokenizer, context, d, c, haystack_ids=hay)
               for d, c in zip(depths, passcodes(len(depths), seed))]
    hooks = _hooks(model, tokenizer, progress, reconstruct_context)

    def run(spec, detail):
        config, sizes, n_tok = spec.config(), [], 0
        for p in prompts:
            _tick(progress, f"niah: {spec.label} depth {p.depth:g}")
            answer, caches = _answer(model, tokenizer, p, config, max_new_tokens, **hooks)
            sizes.append(kv_bytes(caches))
            n_tok = cache_tokens(caches)
            del caches
            detail.append({"depth": p.depth, "passcode": p.answer, "answer": answer.strip(),
                           "correct": extract_answer(answer) == p.answer})
        hits = sum(d["correct"] for d in detail)
        return dict(niah_acc=hits / len(detail), niah_hits=hits, niah_trials=len(detail), niah_detail=detail,
                    kv_tokens=n_tok, kv_bytes=int(round(sum(sizes) / len(sizes))),
                    kv_bytes_fp16=fp16_kv_bytes(model, n_tok))
    rows = []
    for spec in _specs(methods, include_none):
        detail = []
        rows.append(_measured(spec, "niah", context, model_name, lambda: run(spec, detail), niah_detail=detail))
    return rows


def eval_recall(model, tokenizer, methods: Sequence, *, context: int = 1024,
                depths: Sequence[float] = (0.1,), distances: Sequence[int] = (), passage: int = PASSAGE_TOKENS,
                text: Optional[str] = None, model_name: Optional[str] = None, progress: Progress = None,
                memo: Optional[dict] = None, include_none: bool = True,
                reconstruct_context: bool = False) -> list[dict]:
    """Recall rows: ``copy_acc`` / ``copy_acc_ref`` = mean greedy copy accuracy over the trials (one per depth
    and per distance) with the cache / uncompressed; ``kld``, ``top1_agree``, ``ppl`` of the same steps;
    ``recall_detail`` per trial; ``kv_bytes`` the trials' mean. The passage is the last tokens of ``text``, or
    of the essays from FAR_TOKENS on (another essay than the filler)."""
    memo = {} if memo is None else memo
    ids = text_tokens(tokenizer, max(context, FAR_TOKENS) + passage) if text is None else _encode(tokenizer, text)
    prompts = ([build_recall_prompt(ids, context, depth=d, passage=passage) for d in depths]
               + [build_recall_prompt(ids, context, distance=n, passage=passage) for n in distances])
    refs = [_memo(memo, ("recall_ref", tuple(p.ids), p.n_context),
                  lambda: reference_logprobs(model, p.ids, p.n_context, p.n_score)) for p in prompts]
    hooks = _hooks(model, tokenizer, progress, reconstruct_context)

    def run(spec):
        config, rs = spec.config(), []
        for p, ref in zip(prompts, refs):
            _tick(progress, f"recall: {spec.label} distance {p.distance}")
            rs.append(next_token_fidelity(model, p.ids, p.n_context, p.n_score, config, ref_logp=ref, **hooks))
        detail = [{"depth": round(p.depth, 4), "distance": p.distance, "copy_acc": r.top1_target,
                   "copy_acc_ref": r.top1_target_ref, "kld": r.kld} for p, r in zip(prompts, rs)]
        return dict(_fidelity_values(rs, prompts[0].n_context + prompts[0].n_score - 1), recall_detail=detail,
                    copy_acc=sum(r.top1_target for r in rs) / len(rs),
                    copy_acc_ref=sum(r.top1_target_ref for r in rs) / len(rs))
    return [_measured(spec, "recall", context, model_name, lambda: run(spec)) for spec in _specs(methods, include_none)]


def count_units(tasks: Sequence[str], n_methods: int, n_depths: int = len(DEFAULT_DEPTHS),
                n_recall: int = 1) -> int:
    """How many ``progress`` calls :func:`run_eval` makes (``n_methods`` with ``none``; ``n_recall`` per method)."""
    per_task = {"niah": n_methods * n_depths, "recall": n_methods * n_recall}
    return sum(per_task.get(t, n_methods + 1) for t in tasks)


def run_eval(model, tokenizer, methods: Sequence, tasks: Sequence[str] = DEFAULT_TASKS, *, context: int = 1024,
             n_score: int = 64, depths: Sequence[float] = DEFAULT_DEPTHS, text: Optional[str] = None,
             model_name: Optional[str] = None, progress: Progress = None, include_none: bool = True,
             recall_distances: Sequence[int] = (), recall_passage: int = PASSAGE_TOKENS,
             reconstruct_context: bool = False, **niah_kw: Any) -> list[dict]:
    """Rows of every task in ``tasks`` (in that order), sharing the uncompressed reference and runs;
    ``recall`` runs one trial per depth, or per distance of ``recall_distances`` if given."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}; tasks: {', '.join(TASKS)}")
    if "niah" in tasks:  # fail on a too-short context before any other task runs
        build_niah_prompt(tokenizer, context, 0.5, "0000", text=text)
    common = dict(context=context, text=text, model_name=model_name, progress=progress, memo={},
                  include_none=include_none, reconstruct_context=reconstruct_context)
    run = {"ppl": lambda: eval_ppl(model, tokenizer, methods, n_score=n_score, **common),
           "kld": lambda: eval_kld(model, tokenizer, methods, n_score=n_score, **common),
           "niah": lambda: eval_niah(model, tokenizer, methods, depths=depths, **common, **niah_kw),
           "recall": lambda: eval_recall(model, tokenizer, methods, depths=() if recall_distances else depths,
                                         distances=recall_distances, passage=recall_passage, **common)}
    return [row for task in dict.fromkeys(tasks) for row in run[task]()]

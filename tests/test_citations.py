"""One source for each citation: the registry's paper string (``cache/base.py``, shown by ``veloxquant methods``)
carries the arXiv id that the method's module docstring gives, every id it names is in that docstring, and a
method without a canonical paper (or without an arXiv id) says so in the registry string itself."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from veloxquant_mlx.cache.base import all_methods

ARXIV = re.compile(r"arXiv[ :]*(\d{4}\.\d{4,5})")
ANY_ID = re.compile(r"\b(\d{4}\.\d{4,5})\b")
MARKERS = ("no canonical paper", "library design", "no arXiv id")
METHODS = all_methods()


def _doc(info) -> str:
    return sys.modules[info.cls.__module__].__doc__ or ""


@pytest.mark.parametrize("info", METHODS, ids=[m.name for m in METHODS])
def test_registry_paper_string_and_module_docstring_agree(info):
    assert info.implemented, info.name
    ids = ARXIV.findall(info.paper)
    assert ids or any(m in info.paper for m in MARKERS), \
        f"{info.name}: {info.paper!r} names no arXiv id and does not say it has none"
    doc = _doc(info)
    for i in ids:  # every id of the registry is the module's own citation
        assert i in doc, f"{info.name}: arXiv {i} is in the registry but not in {info.cls.__module__}'s docstring"
    doc_ids = ANY_ID.findall(doc)
    if doc_ids:  # the module's first (primary) citation is in the registry string
        assert doc_ids[0] in ids, f"{info.name}: the docstring cites {doc_ids[0]} first; the registry says {info.paper!r}"


def test_methods_without_a_canonical_paper_say_so_in_the_cli():
    out = subprocess.run([sys.executable, "-m", "veloxquant_mlx", "methods", "--json"], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    rows = {r["name"]: r["paper"] for r in json.loads(out)}
    assert set(rows) == {m.name for m in METHODS}
    for name in ("nestedkv", "amc", "anchorkv", "spectral", "waterfill", "age_tiered"):
        assert any(m in rows[name] for m in MARKERS[:2]), (name, rows[name])
    assert "2402.18096" in rows["adakv"] and "2510.11236" in rows["xquant"]

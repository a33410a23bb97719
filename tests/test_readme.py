"""The README's code blocks run as written.

* Every ```python block runs, in order, in one namespace (later blocks use the model of the first), in a
  temporary directory, with the embedded model (marked ``real_model``; the README keeps its generations
  short so this takes well under two minutes on two cores).
* Every ``veloxquant ...`` command line of a ```bash block parses with the real argument parser (optional
  ``[...]`` parts included), and its ``--method`` / ``--set`` values are checked as the command would check
  them before loading a model. Running the slow ones (demo, eval, bench, serve) is not attempted.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from veloxquant_mlx import cli

README = Path(__file__).resolve().parents[1] / "README.md"
SUBCOMMANDS = ("methods", "generate", "demo", "eval", "bench", "cache", "serve")


def code_blocks(lang: str, text: str | None = None) -> list[str]:
    text = README.read_text(encoding="utf-8") if text is None else text
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def command_lines(text: str | None = None) -> list[str]:
    """``veloxquant ...`` lines of the bash blocks (backslash continuations joined)."""
    out = []
    for block in code_blocks("bash", text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("veloxquant ") or line.startswith("python -m veloxquant_mlx "):
                out.append(line)
    return out


def argv_of(line: str) -> list[str]:
    """The arguments of a documented command line: the words after the program name, with the brackets of
    optional parts dropped (``[--json]`` -> ``--json``) and a trailing ``# comment`` removed."""
    words = shlex.split(line, comments=True)
    words = words[1:] if words[0] == "veloxquant" else words[3:]
    assert "|" not in words, f"README: alternatives ('|') cannot be parsed: {line}"
    out = []
    for w in words:
        w = w.strip("[]")
        if w:
            out.append(w)
    return out


def _option_strings(argv: list[str]) -> set[str]:
    """Every option string of the (sub)parsers that ``argv`` walks through."""
    import argparse

    parser, flags = cli._parser(), set()
    for word in argv:
        flags |= {o for a in parser._actions for o in a.option_strings}
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            continue
        parser = sub.choices[word]
    return flags | {o for a in parser._actions for o in a.option_strings}


def check_command(line: str) -> str:
    """Parse one documented command and validate its method settings; the subcommand's name."""
    argv = argv_of(line)
    try:
        args = cli._parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"README command does not parse (exit {exc.code}): {line}") from None
    flags = _option_strings(argv)
    for word in argv:
        if word.startswith("--") and word.split("=")[0] not in flags:  # argparse would take an abbreviation
            raise AssertionError(f"README command uses {word!r}, not an option of its subcommand: {line}")
    if args.command in ("generate", "serve") and args.method is not None:
        cli.method_config(args.method, args.set)
    elif args.command == "cache" and args.cache_command == "save":
        cli.method_config(args.method, args.set, standalone_ok=False)
    elif args.command in ("eval", "bench"):
        from veloxquant_mlx.eval.specs import implemented_mlx_lm_methods, resolve_methods

        names = list(args.method) + (implemented_mlx_lm_methods() if getattr(args, "all", False) else [])
        resolve_methods(names, args.set, include_none=args.command == "eval", sweeps=getattr(args, "sweep", None))
    elif args.command == "methods" and args.name is not None:
        cli._check_method_name(args.name)
    return args.command


def test_every_documented_command_parses_and_every_subcommand_is_documented():
    lines = command_lines()
    seen = {check_command(line) for line in lines}
    assert seen >= set(SUBCOMMANDS), f"README documents no command line for {set(SUBCOMMANDS) - seen}"


def test_the_command_checker_catches_bad_lines():
    """The checks above can fail: a wrong flag, another method's field, an unknown method."""
    for bad in ("veloxquant generate --method kivi --prompt hi --max-token 5",
                "veloxquant generate --method kivi --set snap_budget=256 --prompt hi",
                "veloxquant eval --method kivvi --task kld",
                "veloxquant bench --method kivi --context 1024 [--repeat 3]"):
        with pytest.raises((AssertionError, cli.UsageError)):
            check_command(bad)
    fenced = "```bash\nveloxquant methods [--json]   # a comment\n```\n```python\nx = 1\n```\n"
    assert command_lines(fenced) == ["veloxquant methods [--json]   # a comment"]
    assert argv_of(command_lines(fenced)[0]) == ["methods", "--json"]
    assert code_blocks("python", fenced) == ["x = 1\n"]


@pytest.mark.real_model
def test_python_blocks_run_in_order(tmp_path, monkeypatch):
    blocks = code_blocks("python")
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text("The blue vault's passcode is 4817. " * 20)
    namespace: dict = {"__name__": "__readme__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, block in enumerate(blocks, 1):
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    assert out.getvalue().strip(), "the README's snippets print what they show"

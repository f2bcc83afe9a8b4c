"""The parser of ``periodic-rl``: configuration errors in a few lines, and a ``--help`` that
lists the options of the default classes.

The model, the data and the strategy are given by ``class_path``, so Lightning's ``fit --help``
shows only ``--model.help CLASS``; :class:`PeriodicRLArgumentParser` appends the options of
the default classes (``RLModule``, ``PromptDataModule``, ``PeriodicAsyncStrategy``), every
choice with its allowed values.

jsonargparse reports a bad value nested in a ``class_path``/``init_args`` block as a union of
every subtype it tried, after a usage block listing every option, and a check that fails while
a class is built as a traceback through the parser's internals. Here both become one
``error:`` line naming the option (``model.init_args.loss_type``) with the library's message
(the allowed values of a choice, :func:`periodic_rl.choices.choice_error`) or, for a misspelt
option, the closest names ("did you mean ``learning_rate``?"), then where to read on. With
``JSONARGPARSE_DEBUG=true`` in the environment the original error and traceback are kept.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import inspect
import os
import re
import sys
from typing import Any, NoReturn

from jsonargparse import ArgumentParser
from lightning.pytorch.cli import LightningArgumentParser

from periodic_rl.choices import choice_error

#: Exceptions a class raises while it is built from the configuration: a refused setting.
CONFIG_ERRORS = (ValueError, TypeError, OSError, ImportError)

_PARSER_KEY = re.compile(r'Parser key "([^"]+)":')
_CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)':")
_LITERAL = re.compile(r"Expected a (?:typing\.)?Literal\[(.*)\]\. Got value: (.*)")
_EXPECTED = re.compile(r"Expected a (.*)\. Got value: (.*)")
_UNKNOWN_OPTION = re.compile(r"Option '([^']+)' is not accepted")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (\S+)")
_NOT_ACCEPTED = re.compile(r"Subcommand '([^']+)' does not accept option '([^']+)'")
#: Lines of a union error that say nothing about the value given.
_NOISE = (
    "Does not validate against",
    "Subtypes:",
    "Errors:",
    "Given value",
    "- Expected a <class 'NoneType'>",
)


def debug() -> bool:
    """Whether jsonargparse's debug mode asks for the original errors and tracebacks."""
    return os.environ.get("JSONARGPARSE_DEBUG", "").lower() == "true"


class PeriodicRLArgumentParser(LightningArgumentParser):
    """Lightning's parser, whose errors are one line with the fix instead of a usage block,
    and whose help ends with the options of :attr:`help_classes`."""

    #: ``{key: class}``: the classes whose options ``--help`` lists under ``key.init_args``.
    help_classes: dict[str, type]

    def format_help(self) -> str:
        text = super().format_help()
        classes = getattr(self, "help_classes", {})
        if not classes:
            return text
        extra = ArgumentParser(usage=argparse.SUPPRESS, add_help=False)
        for key, cls in classes.items():
            extra.add_class_arguments(cls, f"{key}.init_args", fail_untyped=False)
        return (
            f"{text}\nThe options of the default classes (give them as shown, or under "
            "init_args in YAML; --KEY.help CLASS for another class):\n\n" + extra.format_help()
        )

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if debug() or not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        exit_with_error(parser.prog.replace(" [options]", ""), explain(message, parser))


def exit_with_error(prog: str, message: str) -> NoReturn:
    """Print ``message`` and where to read on to stderr, and exit with status 2 (a usage
    error, as argparse does)."""
    sys.stderr.write(
        f"{prog}: error: {message}\n"
        f"(`{prog} --help` lists every option with its allowed values; JSONARGPARSE_DEBUG=true "
        "shows the full error)\n"
    )
    raise SystemExit(2)


def instantiation_error(error: BaseException) -> str:
    """The library's own message behind an error raised while the configuration's classes
    were built: the innermost cause, which names the setting and the fix."""
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error)


def explain(message: str, parser: argparse.ArgumentParser | None = None) -> str:
    """One line for a jsonargparse error ``message``: a refused choice with its allowed
    values, an unknown option with the closest known names, or the message without its
    union noise."""
    path: list[str] = []
    owner: str | None = None
    for line in message.splitlines():
        text = line.strip().removeprefix("- ").strip()
        if match := _PARSER_KEY.match(text):
            path.append(match.group(1))
        elif match := _CLASS_PATH.match(text):
            owner = match.group(1)
            path.append("init_args")
        elif match := _LITERAL.match(text):
            allowed = ast.literal_eval(f"({match.group(1)},)")
            return choice_error(".".join(path), match.group(2), allowed)
        elif match := _EXPECTED.match(text):
            expected = re.sub(r"<class '([\w.]+)'>", r"\1", match.group(1))
            return f"{'.'.join(path)} must be {expected}; got {match.group(2)!r}"
        elif match := _UNKNOWN_OPTION.match(text):
            name = match.group(1)
            known = class_parameters(owner) if owner else []
            where = ".".join([*path, name])
            return f"{where}: {owner} has no option {name!r}" + did_you_mean(name, known)
        elif match := _UNRECOGNIZED.search(text):
            option = match.group(1)
            return f"no option {option}" + did_you_mean(option, _option_strings(parser))
        elif match := _NOT_ACCEPTED.search(text):
            sub, key = match.groups()
            keys = [o.lstrip("-") for o in _option_strings(_subcommand(parser, sub))]
            return f"{sub} has no option {key!r}" + did_you_mean(key, keys)
    kept = [line for line in message.splitlines() if not line.strip().startswith(_NOISE)]
    return "\n".join(kept).strip()


def did_you_mean(name: str, known: list[str]) -> str:
    """``"; did you mean a or b?"`` with the names of ``known`` closest to ``name``, or ``""``."""
    close = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def class_parameters(class_path: str) -> list[str]:
    """The constructor arguments of the class at ``class_path`` (``package.module.Class``),
    following ``**kwargs`` into its bases as jsonargparse does; [] if it cannot be imported."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names += [p.name for p in params if p.name != "self" and p.kind in _NAMED]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return list(dict.fromkeys(names))


_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _option_strings(parser: Any) -> list[str]:
    if parser is None:
        return []
    return [o for action in parser._actions for o in action.option_strings if o.startswith("--")]


def _subcommand(parser: Any, name: str) -> Any:
    for action in getattr(parser, "_actions", []):
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser

"""The command line, generated from the settings table, parsed as pflag parses kube-proxy's.

* No prefix matching: an abbreviated or unknown flag is an error (`--host=node9` does not set
  `--hostname-override`), as in pflag; the message names the nearest real flag.
* Underscores in a flag name are dashes (`--log_dir` is `--log-dir`): kube-proxy's command sets
  cliflag.WordSepNormalizeFunc.
* Booleans: `--flag` alone is true, `--flag=true|false` (and pflag's other ParseBool spellings).
* `parse_flags` returns only the flags the command line gave (every argparse default is
  suppressed), so precedence (defaults < file < command line) needs no second parse.

Every error raises `FlagError` with one line saying what is wrong and what would be right; the
caller prints it and exits with status 2.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Sequence
from typing import Any, NoReturn

from agent.settings.table import GROUPS, SETTINGS, Setting

DESCRIPTION = "ebpf-kube-proxy: a kube-proxy replacement with an eBPF data path."


class FlagError(Exception):
    """A bad command line; the message is one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise FlagError(message)


def _type(setting: Setting, flag: str) -> Any:
    def parse(text: str) -> Any:
        try:
            return setting.kind.flag(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = setting.name  # argparse names the type in some messages
    return parse


def _help(setting: Setting) -> str:
    text = setting.help
    if setting.ignored:
        text = f"accepted and ignored: {setting.ignored}"
    shown = setting.kind.show(setting.default)
    if shown and "default" not in text:
        text += f" (default {shown})"
    return text.replace("%", "%%")


def build_parser(epilog: str = "") -> argparse.ArgumentParser:
    """Every flag of the table, grouped as the README groups them."""
    p = _Parser(
        prog="agent",
        description=DESCRIPTION,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
    )
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    for setting in SETTINGS:
        if not setting.flags:
            continue
        kind = setting.kind
        kwargs: dict[str, Any] = {
            "dest": setting.name,
            "type": _type(setting, setting.flag),
            "metavar": kind.metavar,
            "help": _help(setting),
        }
        if kind.boolean:
            kwargs |= {"nargs": "?", "const": "true"}
        if kind.repeatable:
            kwargs["action"] = "append"
        groups[setting.group].add_argument(*setting.flags, **kwargs)
    return p


_FLAG_NAME = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_-]*")


def normalize(argv: Sequence[str]) -> list[str]:
    """`--log_dir=x` -> `--log-dir=x` (cliflag.WordSepNormalizeFunc); values stay as given."""
    out = []
    for arg in argv:
        m = _FLAG_NAME.match(arg)
        if m and arg.startswith("--") and (len(arg) == m.end() or arg[m.end()] == "="):
            arg = m.group(0).replace("_", "-") + arg[m.end() :]
        out.append(arg)
    return out


def _known_flags() -> list[str]:
    return [f for s in SETTINGS for f in s.flags]


def _unknown(arg: str) -> str:
    name = arg.split("=", 1)[0]
    flags = _known_flags()
    starts = [f for f in flags if f.startswith(name) and name.startswith("--")]
    close = starts or difflib.get_close_matches(name, flags, n=1)
    hint = f" (did you mean {close[0]}?)" if len(close) == 1 else ""
    if len(starts) > 1:
        hint = f" (flags are not abbreviated: did you mean one of {', '.join(sorted(starts)[:4])}?)"
    elif starts:
        hint = f" (flags are not abbreviated: did you mean {starts[0]}?)"
    if not name.startswith("-"):
        return f"unexpected argument {arg!r}: the agent takes flags only (see --help)"
    return f"unknown flag {name}{hint}"


def parse_flags(argv: Sequence[str], parser: argparse.ArgumentParser | None = None) -> dict[str, Any]:
    """The settings the command line gives, by name; raises FlagError."""
    p = parser or build_parser()
    ns, rest = p.parse_known_args(normalize(argv))
    if rest:
        raise FlagError(_unknown(rest[0]))
    given = vars(ns)
    by_name = {s.name: s for s in SETTINGS}
    out: dict[str, Any] = {}
    for name, value in given.items():
        kind = by_name[name].kind
        out[name] = kind.combine(value) if kind.repeatable else value
    return out

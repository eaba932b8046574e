"""Is a grammar's language empty? A check of xgrammar's normalized EBNF, before it is served.

xgrammar compiles a grammar that no text satisfies (an EBNF rule that only recurses, a regex
class that matches nothing, a schema branch with no value) and then masks every token once the
text reaches it: the row could not go on, and the client was told the model failed. A rule
derives text (is productive) when one of its alternatives is a sequence of productive parts;
strings and character classes are, a repetition that may be empty (`*`, `?`, `{0, n}`) is, and
the rest is found by iterating to a fixed point. A grammar with a rule reachable from `root` that
derives no text is refused before any token is sampled: its text could reach that rule.

The parser reads what `str(xgr.Grammar)` prints (xgrammar 0.2.9): `name ::= body`, a body of
alternatives of sequences of strings, classes, rule names and groups with repetition suffixes,
and an optional lookahead `(= ...)`. Anything it does not read (TagDispatch, the structural
tags' dispatcher) is taken to derive text: the check never refuses a grammar it does not
understand, and rows still end with a client error if a mask ever allows nothing.
"""

from __future__ import annotations

import re

_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= ", re.MULTILINE)
_TOKEN = re.compile(
    r'\s*(?:(?P<string>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])|(?P<look>\(=)'
    r"|(?P<repeat>\{\s*(?P<low>\d+)\s*(?:,\s*(?P<high>-?\d*)\s*)?\})|(?P<op>[()|*+?])"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*))"
)


class Unreadable(ValueError):
    """A rule body this parser does not read."""


# A rule body as a tree: ("alt", [sequences]), ("seq", [parts]), ("ref", name), ("text",)
# (a string or a class: derives text), ("maybe", part) (*, ?, {0, n}: derives the empty text)
Node = tuple


def _tokens(text: str) -> list[tuple[str, str]]:
    out, at = [], 0
    while text[at:].strip():
        match = _TOKEN.match(text, at)
        if match is None:
            raise Unreadable(text[at : at + 20])
        kind = "repeat" if match.group("repeat") else (match.lastgroup or "")
        out.append((kind, match.group("low") if kind == "repeat" else match.group(kind)))
        at = match.end()
    return out


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens, self.at = tokens, 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.peek()
        if token is None:
            raise Unreadable("the rule ends early")
        self.at += 1
        return token

    def alternatives(self) -> Node:
        found = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.take()
            found.append(self.sequence())
        return ("alt", found)

    def sequence(self) -> Node:
        parts = []
        while (token := self.peek()) is not None and token not in (("op", "|"), ("op", ")")):
            if token[0] == "look":  # a lookahead asserts and derives nothing: skipped
                self.take()
                self.group()
            else:
                parts.append(self.part())
        return ("seq", parts)

    def group(self) -> Node:
        inner = self.alternatives()
        if self.take() != ("op", ")"):
            raise Unreadable("an unclosed group")
        return inner

    def part(self) -> Node:
        kind, value = self.take()
        node: Node
        if kind in ("string", "cls"):
            node = ("text",)
        elif kind == "name":
            node = ("ref", value)
        elif (kind, value) == ("op", "("):
            node = self.group()
        else:
            raise Unreadable(value)
        suffix = self.peek()
        if suffix in (("op", "*"), ("op", "?")) or (
            suffix is not None and suffix[0] == "repeat" and int(suffix[1]) == 0
        ):
            self.take()
            return ("maybe", node)
        if suffix == ("op", "+") or (suffix is not None and suffix[0] == "repeat"):
            self.take()
        return node


def _derives(node: Node, productive: set[str]) -> bool:
    kind = node[0]
    if kind == "text" or kind == "maybe":
        return True
    if kind == "ref":
        return bool(node[1] in productive)
    if kind == "seq":
        return all(_derives(part, productive) for part in node[1])
    return any(_derives(sequence, productive) for sequence in node[1])


def _names(node: Node) -> set[str]:
    kind = node[0]
    if kind == "ref":
        return {node[1]}
    if kind == "text":
        return set()
    if kind == "maybe":
        return _names(node[1])
    return set().union(*(_names(child) for child in node[1])) if node[1] else set()


def _rules(text: str) -> dict[str, Node | None]:
    """Every rule of a printed grammar: its body's tree, or None where it is not readable."""
    starts = list(_RULE.finditer(text))
    rules: dict[str, Node | None] = {}
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        try:
            parser = _Parser(_tokens(text[match.end() : end]))
            body = parser.alternatives()
            if parser.peek() is not None:
                raise Unreadable("text after the body")
            rules[match.group(1)] = body
        except Unreadable:
            rules[match.group(1)] = None
    return rules


def empty_rule(text: str, root: str = "root") -> str | None:
    """The name of a rule reachable from `root` that derives no text, if the printed grammar
    has one (then a text that follows the grammar may never be completed); else None."""
    rules = _rules(text)
    # unread rules, and names that are no rule here, are taken to derive text
    productive = {name for name, body in rules.items() if body is None}
    mentioned = (
        set().union(*(_names(b) for b in rules.values() if b is not None)) if rules else set()
    )
    productive |= mentioned - set(rules)
    changed = True
    while changed:
        changed = False
        for name, body in rules.items():
            if name not in productive and body is not None and _derives(body, productive):
                productive.add(name)
                changed = True
    seen, stack = set(), [root]
    while stack:
        name = stack.pop()
        if name in seen or name not in rules:
            continue
        seen.add(name)
        if name not in productive:
            return name
        body = rules[name]
        if body is not None:
            stack.extend(_names(body))
    return None

"""Re-wrap the comment and docstring lines that a longer package name pushed past the line length."""

from __future__ import annotations

import io
import re
import tokenize


def prose_lines(source: str) -> tuple[set[int], set[int]]:
    """1-based numbers of whole-line comments and of lines inside docstrings (statement-level triple-quoted strings)."""
    comments: set[int] = set()
    docstrings: set[int] = set()
    statement_start = True
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT and token.line.lstrip().startswith("#"):
                comments.add(token.start[0])
            elif token.type == tokenize.STRING and statement_start and re.match(r"[rRuU]?(\"\"\"|''')", token.string):
                docstrings.update(range(token.start[0], token.end[0] + 1))
            if token.type not in (tokenize.COMMENT, tokenize.NL):
                statement_start = token.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    except (tokenize.TokenError, SyntaxError):
        return set(), set()
    return comments, docstrings


def rewrap(before: str, after: str, limit: int) -> str:
    """``after`` with each prose line that grew past ``limit`` (and was within it in ``before``) split at a space."""
    old_lines, new_lines = before.splitlines(keepends=True), after.splitlines(keepends=True)
    if len(old_lines) != len(new_lines) or not any(len(line.rstrip("\r\n")) > limit for line in new_lines):
        return after
    comments, docstrings = prose_lines(after)
    out = []
    for number, (old, new) in enumerate(zip(old_lines, new_lines, strict=True), start=1):
        body = new.rstrip("\r\n")
        if len(body) <= limit or len(old.rstrip("\r\n")) > limit or number not in comments | docstrings:
            out.append(new)
            continue
        indent = re.match(r"[ \t]*", body).group(0)
        prefix = indent + ("# " if number in comments else "")
        ending = new[len(body) :]
        while len(body) > limit:
            cut = body.rfind(" ", len(prefix) + 4, limit + 1)
            if cut < 0:
                break
            out.append(body[:cut].rstrip() + ending)
            body = prefix + body[cut + 1 :]
        out.append(body + ending)
    return "".join(out)

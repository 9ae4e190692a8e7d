"""Rename the package inside file contents and paths: only module references change, prose stays as written."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import PurePosixPath

# LightningCLI subcommands: `template fit ...` calls the console script, `the template fits` is prose.
_SUBCOMMANDS = "fit|validate|test|predict"


class Renamer:
    """Rewrites references to package ``old`` as ``new``; ``children`` are the names inside the package folder."""

    def __init__(self, old: str, new: str, children: Iterable[str], slug: str | None = None) -> None:
        self.old, self.new, self.slug = old, new, slug or new
        names = sorted({name for name in children if name and not name.startswith(".")}, key=len, reverse=True)
        modules = sorted({PurePosixPath(name).stem for name in names if name.endswith(".py") or "." not in name})
        o = re.escape(old)
        module_alt = "|".join([*map(re.escape, modules), r"__\w+__"])
        path_alt = "|".join(map(re.escape, names)) or "(?!)"
        # Group 1 of every rule is what precedes the name and is kept; all rules are whole-word, so idempotent.
        rules = [
            # `import template`, `from template.cli import x`: at a line start, after `>>> `, a quote or `;`.
            rf"(?m)((?:^[ \t]*(?:>>> |\.\.\. )?|[;\"'(][ \t]*)(?:from|import)[ \t]+){o}(?=[\s.;,)\"']|$)",
            # `template.cli`, `template.nets.MLP` (class_path), `template.__name__`; not `my.template.x`.
            rf"((?<![\w.])){o}(?=\.(?:{module_alt})\b)",
            # `python -m template`, `["-m", "template"]`.
            rf"((?<![\w-])-m[ \t]+){o}(?![\w-])",
            rf"([\"']-m[\"'][ \t]*,[ \t]*[\"']){o}(?=[\"'])",
            # `template/cli.py`, or `template/` at the end of a word.
            rf"((?<![\w.-])){o}(?=/(?:(?:{path_alt})(?![\w.-])|[\"'`\s)]|$))",
            rf"(--cov[= ]){o}(?![\w-])",
            # the `template` package, in Markdown and docstrings.
            rf"(`){o}(?=`)",
            # The console script: `template fit --config ...`.
            rf"(?m)((?:^|(?<=[\s`\"'(]))){o}(?=[ \t]+(?:{_SUBCOMMANDS})(?:[ \t]+-|[ \t]*$))",
        ]
        self._rules = [re.compile(rule) for rule in rules]
        # A string literal that is exactly the package name: `resources.files("template")`, `include = ["template*"]`.
        self._quoted = re.compile(rf"([\"']){o}(\*?)(?=\1)")
        self._toml_name = re.compile(rf"(?m)^([ \t]*name[ \t]*=[ \t]*)([\"']){o}\2")
        self._toml_key = re.compile(rf"(?m)^([ \t]*){o}(?=[ \t]*=)")
        # Shell: `PACKAGE=template`, `#SBATCH --job-name=template`.
        self._shell_value = re.compile(rf"(=){o}(?![\w.-])")

    def text(self, text: str, suffix: str = "") -> str:
        """``text`` with its references to the package renamed; ``suffix`` (".py", ".toml", ".sh") picks extra rules."""
        if self.old not in text:
            return text
        if suffix == ".toml":
            text = self._toml_name.sub(lambda m: f"{m.group(1)}{m.group(2)}{self.slug}{m.group(2)}", text)
            text = self._toml_key.sub(lambda m: m.group(1) + self.new, text)
        if suffix in (".toml", ".py", ".pyi", ".cfg", ".sh"):
            text = self._quoted.sub(lambda m: f"{m.group(1)}{self.new}{m.group(2)}", text)
        if suffix == ".sh":
            text = self._shell_value.sub(lambda m: m.group(1) + self.new, text)
        for pattern in self._rules:
            text = pattern.sub(lambda m: m.group(1) + self.new, text)
        return text

    def path(self, rel: PurePosixPath) -> PurePosixPath:
        """Only the top-level package folder is renamed; ``tests/template_helpers.py`` keeps its name."""
        if rel.parts and rel.parts[0] == self.old:
            return PurePosixPath(self.new, *rel.parts[1:])
        return rel

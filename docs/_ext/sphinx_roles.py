"""A Griffe extension for the docs site: Sphinx roles in docstrings become Markdown.

The package's docstrings are Google style but name other objects with Sphinx roles
(``:class:`EpisodeBatch```, ``:meth:`~asyncsample.Sampler.evaluate```), which Markdown would show
literally. This rewrites each role before the docstring is parsed: into a cross-reference when
the target is documented on the API reference page, else into inline code.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|meth|attr|func|mod|exc|data|obj):`([^`]+)`")
_REFERENCE_PAGE = Path(__file__).resolve().parent.parent / "reference.md"


def _documented() -> set[str]:
    """The top-level names the reference page renders (``::: asyncsample.Name``)."""
    text = _REFERENCE_PAGE.read_text(encoding="utf-8")
    return set(re.findall(r"^::: asyncsample\.(\w+)\s*$", text, flags=re.M))


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles in every docstring of the package."""

    def __init__(self) -> None:
        self._documented = _documented()
        self._package: griffe.Module | None = None

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        self._package = pkg
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = self._rewrite_all(obj.docstring.value, obj)

    def _rewrite_all(self, text: str, obj: griffe.Object) -> str:
        return _ROLE.sub(lambda match: self._rewrite(match.group(1), obj), text)

    def _rewrite(self, target: str, obj: griffe.Object) -> str:
        text, sep, explicit = target.partition(" <")
        if sep:  # :role:`shown text <target>`
            target, shown = explicit.rstrip(">"), text
        else:
            shown_full = target.lstrip("~")
            shown = shown_full.rsplit(".", 1)[-1] if target.startswith("~") else shown_full
            target = shown_full
        path = self._resolve(target.removeprefix("asyncsample."), obj)
        return f"[`{shown}`][{path}]" if path else f"`{shown}`"

    def _resolve(self, target: str, obj: griffe.Object) -> str | None:
        """``asyncsample.Name[.member]`` when that is rendered on the reference page."""
        candidates = [target]
        owner = obj if obj.is_class else obj.parent
        if owner is not None and owner.is_class:
            candidates.append(f"{owner.name}.{target}")  # a method named relative to its class
        for candidate in candidates:
            head, _, rest = candidate.partition(".")
            if head not in self._documented or self._package is None:
                continue
            try:
                member = self._package[candidate]
            except (KeyError, ValueError, griffe.AliasResolutionError):
                continue
            # Members without a docstring are not rendered (no anchor to link to).
            if not rest or (not member.name.startswith("_") and member.docstring is not None):
                return f"asyncsample.{candidate}"
        return None


def _walk(obj: griffe.Object | griffe.Alias) -> list[griffe.Object]:
    """Every object defined in the package (aliases are skipped: their targets are visited)."""
    if not isinstance(obj, griffe.Object):
        return []
    found = [obj]
    for member in obj.members.values():
        found.extend(_walk(member))
    return found

"""Generated code for attribute paths that hold a Python keyword ("heads.global.weight").

[Note: keyword names] torch.fx writes the target of a ``get_attr`` or ``call_module`` node as an attribute path
(``torch.fx.graph._format_target``), and falls back to ``getattr(self, "0-a")`` only for names that are not
identifiers. A keyword is an identifier, so a model holding ``nn.ModuleDict({"global": ..., "local": ...})``
(Gemma-like rotary tables, Hugging Face layers keyed by layer type) got ``self.heads.global.weight``: a
SyntaxError wherever such a graph is compiled (the block programs, the stages, ``ExportedProgram.module()``),
and its capture fell back to module hooks and ended in "invalid syntax". Capture makes fx write keyword names
with ``getattr`` as it writes other non-identifiers (everything else is written as torch writes it); the fix
stays for the process, as programs are compiled again later (stages, copies). Names stay the user's:
parameters keep their FQNs. Where a torch no longer has that function and its code still does not compile,
capture refuses up front, naming the module, the key and the fix.
"""

from __future__ import annotations

import keyword
from collections.abc import Callable

import torch
import torch.fx.graph as fx_graph
from torch import fx, nn

from lightning_autopart.errors import CaptureError

__all__ = ["keyword_names", "keyword_safe_codegen", "refuse_keyword_names"]

_MARK = "_autopart_keywords"


def keyword_safe_codegen() -> bool:
    """Make fx write keyword attribute names with ``getattr`` (see the note); True when its code compiles."""
    if _compiles():  # installed already, or a torch that writes them so itself
        return True
    original = getattr(fx_graph, "_format_target", None)
    if callable(original) and not getattr(original, _MARK, False):
        fx_graph._format_target = _keyword_safe(original)  # type: ignore[assignment]
    return _compiles()


def keyword_names(module: nn.Module) -> list[tuple[str, str]]:
    """The (owner FQN, name) of every submodule, parameter and buffer of ``module`` named by a keyword."""
    found: dict[tuple[str, str], None] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for table in (owner._modules, owner._parameters, owner._buffers):
            found.update(((prefix, name), None) for name in table if keyword.iskeyword(name))
    return list(found)


def refuse_keyword_names(module: nn.Module) -> None:
    """Raise a :class:`CaptureError` naming the first keyword name of ``module``, if it has any."""
    names = keyword_names(module)
    if not names:
        return
    owner, name = names[0]
    where = f"{owner!r} of {type(module).__name__}" if owner else type(module).__name__
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    raise CaptureError(
        f"cannot capture {type(module).__name__}: module {where} holds {name!r}{more}, a Python keyword, "
        f"which torch {torch.__version__}'s fx writes as an attribute (.{name}), code that does not compile; "
        f"rename the key (e.g. {name + '_'!r})"
    )


def _keyword_safe(original: Callable[[str, str], str]) -> Callable[[str, str], str]:
    """``original``, with each keyword of the path written as ``getattr(base, "name")``."""

    def format_target(base: str, target: str) -> str:
        written = base
        for name in target.split("."):
            written = f'getattr({written}, "{name}")' if keyword.iskeyword(name) else original(written, name)
        return written

    setattr(format_target, _MARK, True)
    format_target.__wrapped__ = original  # type: ignore[attr-defined]
    return format_target


def _compiles() -> bool:
    """Whether fx's code for a ``get_attr`` of a keyword name compiles."""
    graph = fx.Graph()
    graph.output(graph.get_attr("holder.global"))
    try:
        compile(graph.python_code("self").src, "<keyword names>", "exec")
    except SyntaxError:
        return False
    return True

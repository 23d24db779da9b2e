"""What a capture error adds when the model comes from a library version autopart is not tested with.

[Note: transformers before 5] autopart's Hugging Face tiers run transformers 5. transformers 4.x registers its
outputs without pytree keys (given them while capture exports: [Note: pytree keys]), and several of its
models build attention masks or route experts in ways torch.export cannot trace, or that need real values on
meta tensors (4.57: Mixtral's expert loop, Qwen2's vmap masks, OPT's and BART's ``.item()``). A capture error
on such a model says which transformers is installed and that upgrading may make it capturable.
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["library_hint"]

#: The oldest transformers major version the suite runs.
TESTED_TRANSFORMERS = 5


def library_hint(module: nn.Module) -> str:
    """A sentence for a capture error on ``module`` ("" where it has nothing to add; see the note)."""
    library = sys.modules.get("transformers")
    if library is None or not any(type(m).__module__.startswith("transformers.") for m in module.modules()):
        return ""
    version = str(getattr(library, "__version__", "0"))
    major = version.split(".")[0]
    if not major.isdigit() or int(major) >= TESTED_TRANSFORMERS:
        return ""
    return (
        f" (transformers {version} is installed; autopart is tested with transformers {TESTED_TRANSFORMERS}, "
        "whose model code torch.export traces where older versions' may not: pip install -U transformers)"
    )

"""The last stage's outputs live only as long as its loss needs them.

[Note: the last stage's outputs] torch.distributed.pipelining keeps each micro-batch's stage output until its
backward (``PipelineStage.fwd_cache``): a stage before the last needs it there, for the gradient the next stage
sends back. The last stage's backward starts from the loss instead, so what it keeps of its output should be
only what the loss saves for backward. Yet the library keeps it all the same: GPipe every micro-batch's until
the backward phase, Interleaved1F1B each one in flight, and every schedule the latest in a local variable
through its backward. The model's outputs are often a step's largest tensors (a GPT's logits: samples x
tokens x vocabulary).

So the last stage returns its outputs as a list (the library keeps a tuple of its own, see
``_normalize_model_output_as_tuple``), and once the micro-batch's loss is computed :func:`release_outputs`
empties both: the list the schedule holds and hands to the loss, and the stage's cached tuple. What the loss
does save (a mean squared error saves its input) autograd keeps; the plan prices it as the loss's own saved
bytes ([Note: the loss] in profile/loss.py), and nothing else of the output ([Note: pipeline buffers] in
partition/cost.py).
"""

from __future__ import annotations

from typing import Any

__all__ = ["release_outputs"]


def release_outputs(stage: Any, output: list[Any]) -> None:
    """Drop the schedule's and ``stage``'s references to ``output`` (the last stage's outputs of one micro-batch,
    whose loss is computed). A cache of another form (another torch) is left as it is: the runtime tier's
    ``test_the_last_stage_keeps_no_output_its_loss_does_not_save`` says so on each torch it runs."""
    held = {id(t) for t in output}
    output.clear()
    cache = getattr(stage, "fwd_cache", None)
    if isinstance(cache, dict):
        for key, entry in list(cache.items()):
            if isinstance(entry, tuple) and len(entry) == 2 and any(id(t) in held for t in entry[0]):
                cache[key] = ((), entry[1])

"""The parts of a training step outside the model's blocks: the optimizer step (and zero_grad).

[Note: optimizer step] After backward, the optimizer reads and writes every trainable parameter, its gradient and
its state: memory-bound work, priced as the bytes it moves over the device's sustained bandwidth plus one
launch per kernel. torch's default (``foreach``) implementations run a handful of multi-tensor kernels per
parameter group, each a pass over some of the tensors; counted from torch.optim's ``_multi_tensor_*`` code, in
parameter-sized passes (each read or write of a parameter, gradient, state or temporary of the same size):

- sgd: ``p -= lr * g`` -- 1 kernel, 3 passes;
- sgd with momentum: ``b *= m; b += g; p -= lr * b`` -- 3 kernels, 8 passes;
- adagrad, rmsprop: about 4 kernels, 9 and 10 passes;
- adam: lerp of the first moment (3), scale and addcmul of the second (2 + 4), its sqrt, bias correction and eps
  on a temporary (2 + 2 + 2), addcdiv into the parameter (4) -- 8 kernels, 19 passes; adamw adds the decay (2).

On a GPU one multi-tensor launch covers many tensors (about ``_TENSORS_PER_LAUNCH``); on a CPU, and in the
``loop`` implementation (``foreach=False``), each tensor is its own kernel call. A ``fused`` step is one kernel
per launch that reads the parameter, gradient and states once and writes the parameter and states once: 7
passes for Adam, 3 for SGD. Lightning's ``zero_grad`` sets gradients to None: free. The temporaries of the step
(Adam's sqrt: one parameter-sized buffer) are in ``optimizers.optimizer_transient_factor``; the tables and the
spec's grammar in [Note: optimizer specs] (optimizers.py).

[Note: gradient accumulation] A step of ``M`` micro-batches runs a stage's backward ``M`` times. The first
finds every gradient None and keeps the one backward made; each later one adds into it, one ``add_`` per
parameter reading both gradients and writing one: 3 gradient-sized passes. In bf16-mixed on an H100 that is
``885 / T`` of a transformer's backward for ``T`` tokens per micro-batch (12 bytes per parameter against 4
FLOPs per parameter and token at 295 FLOPs per byte): a fifth at 4,096 tokens. A profile times each block's
backward with no gradient yet (the first micro-batch's), and estimate mode counts it so too
(``OpCounter.accumulators``); the planner adds ``(M - 1) / M`` of :func:`accumulate_us` to a micro-batch's
backward (all of it when gradients outlive the step: Lightning's ``accumulate_grad_batches``).
"""

from __future__ import annotations

from lightning_autopart.devices import DeviceSpec
from lightning_autopart.profile.optimizers import optimizer_steps

__all__ = ["accumulate_us", "optimizer_step_us"]

#: Tensors one multi-tensor-apply launch covers on a GPU (torch's chunking covers a few dozen).
_TENSORS_PER_LAUNCH = 24


def optimizer_step_us(optimizer: str, param_bytes: int, tensors: int, spec: DeviceSpec, gpu: bool) -> float:
    """Time of the optimizer step (an optimizer spec, [Note: optimizer specs]) over ``tensors`` trainable parameters
    of ``param_bytes`` in all, on ``spec``."""
    if tensors == 0 or param_bytes == 0:
        return 0.0
    kernels, passes, implementation = optimizer_steps(optimizer)
    grouped = gpu and implementation != "loop"
    launches = kernels * (-(-tensors // _TENSORS_PER_LAUNCH) if grouped else tensors)
    return passes * param_bytes / (spec.memory_bw * spec.bw_efficiency) * 1e6 + launches * spec.launch_us


def accumulate_us(grad_bytes: int, tensors: int, spec: DeviceSpec) -> float:
    """Time of adding one micro-batch's gradients into ``tensors`` gradients of ``grad_bytes`` in all, on
    ``spec``: three passes and one launch per tensor (see [Note: gradient accumulation])."""
    if tensors == 0 or grad_bytes == 0:
        return 0.0
    return 3 * grad_bytes / (spec.memory_bw * spec.bw_efficiency) * 1e6 + tensors * spec.launch_us

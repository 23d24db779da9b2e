"""The GPU tier (``make test-gpu``): one CUDA device, tests marked ``gpu`` and skipped without CUDA.

Everything here runs on a single GPU: a 2-stage plan needs two ranks, and one GPU cannot host two NCCL ranks,
so multi-stage pipelines are tested on CPU processes over gloo (``tests/distributed``).
"""

"""Named host ranges in torch's profiler traces, free when no profiler runs.

`benchmarks/trace_gaps.py` puts each stretch where the device sat idle on what the host was doing then. Python
stacks (`with_stack=True`) say that precisely but slow the host so much that they move the gaps (docs/BENCHMARKS.md,
fourteenth session); these ranges cost a few microseconds each under the profiler, so a trace without stacks
still says which part of a step the device waited on. A `record_function` costs ~6 us of host time even with no
profiler running, so they are entered only while one is.
"""

from __future__ import annotations

import contextlib
import functools

import torch

PREFIX = "tandem."  # trace_gaps counts these ranges as project frames


def phase(name: str):
    """A context: the range `tandem.<name>` while a profiler runs, nothing otherwise."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(PREFIX + name)
    return contextlib.nullcontext()


def traced(fn):
    """Decorator: each call of fn is the range `tandem.<its qualified name>` while a profiler runs."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with phase(fn.__qualname__):
            return fn(*args, **kwargs)

    return wrapper

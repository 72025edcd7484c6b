"""The benchmarks' shared timing harness: peers side by side in one process.

- :func:`side_by_side` times callables in rounds. Each round calls every peer once, in the
  listed order on even rounds and in reverse on odd ones, so that a change of machine speed
  (other processes, frequency scaling) hits every peer alike rather than turning into a
  ratio. Optional: warm-up rounds, an untimed call of the same peer just before each timed
  one (so no peer is timed on caches another has just filled), a per-call ``setup`` outside
  the timing (zeroing gradients, switching implementations) and a ``sync`` (device
  synchronisation, a distributed barrier) on both sides of every timed call.
- Every sample holds wall-clock and process CPU time (all threads): on a loaded machine the
  CPU time counts the work done, where the wall time also counts waiting for a core.
- :func:`median_ms` / :func:`best_ms` summarise; the medians are the figures reported.
- :func:`machine_line` names the CPU model and its ISA features, the torch version and the
  thread count; :func:`emit_json` prints the final JSON line.

The benchmarks import it as ``from _timing import ...`` (their own directory is on
``sys.path`` when they run as scripts).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

__all__ = ["Sample", "best_ms", "cpu_summary", "emit_json", "machine_line", "median_ms",
           "side_by_side"]


class Sample(NamedTuple):
    """One timed call: wall-clock and process CPU seconds."""

    wall: float
    cpu: float


def side_by_side(
    fns: Mapping[str, Callable[[], object]],
    repeats: int,
    *,
    warmup: int = 1,
    untimed_first: bool = False,
    setup: Callable[[str], object] | None = None,
    sync: Callable[[], object] | None = None,
) -> dict[str, list[Sample]]:
    """``repeats`` samples of each callable in ``fns``, timed in alternating order.

    ``warmup`` untimed rounds come first (in the listed order). ``setup(name)`` runs before
    every call of peer ``name``, timed or not, outside the timing. With ``untimed_first``,
    each timed call directly follows an untimed call of the same peer.
    """
    if repeats < 1:
        raise ValueError(f"side_by_side: repeats must be >= 1, got {repeats}")
    names = list(fns)

    def call(name: str) -> None:
        if setup is not None:
            setup(name)
        fns[name]()

    for _ in range(warmup):
        for name in names:
            call(name)
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            if untimed_first:
                call(name)
            if setup is not None:
                setup(name)
            if sync is not None:
                sync()
            wall, cpu = time.perf_counter(), time.process_time()
            fns[name]()
            if sync is not None:
                sync()
            samples[name].append(Sample(time.perf_counter() - wall, time.process_time() - cpu))
    return samples


def median_ms(samples: list[Sample], clock: str = "wall") -> float:
    """The median of ``samples`` in milliseconds (``clock``: "wall" or "cpu")."""
    return statistics.median(getattr(s, clock) for s in samples) * 1e3


def best_ms(samples: list[Sample], clock: str = "wall") -> float:
    """The fastest of ``samples`` in milliseconds (``clock``: "wall" or "cpu")."""
    return min(getattr(s, clock) for s in samples) * 1e3


def cpu_summary() -> str:
    """The CPU model, architecture and the ISA features the kernels choose between."""
    from rlx_torch.optim.cpu_features import cpu_features

    return cpu_features().summary()


def machine_line() -> str:
    """One line for a benchmark's header: CPU (model, ISA features), torch, threads."""
    import torch

    return (f"CPU: {cpu_summary()}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def emit_json(record: Mapping[str, Any]) -> None:
    """Prints ``record`` as the benchmark's final JSON line."""
    print(json.dumps(dict(record)), flush=True)

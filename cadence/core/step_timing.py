"""How an engine's steps spend their wall time: the model forward against everything around it.

The engine core records every step: its wall time from ``schedule()`` to the end of
``update_from_output()``, and the worker's forward time (rank 0's, under tensor parallelism). The
rest is engine overhead: scheduling, input preparation, sampling, handing the step to the worker
and back, and turning sampled tokens into outputs. Kept per batch size (requests in the step), so a
benchmark can report the overhead at the batch it cares about.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TimingTotals:
    """Summed over some steps."""

    num_steps: int = 0
    wall_s: float = 0.0
    forward_s: float = 0.0

    def add(self, wall_s: float, forward_s: float, steps: int = 1) -> None:
        self.num_steps += steps
        self.wall_s += wall_s
        self.forward_s += forward_s

    @property
    def overhead_fraction(self) -> float:
        """Share of the steps' wall time spent outside the model forward (0 when nothing ran)."""
        return 1.0 - self.forward_s / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> str:
        if not self.num_steps:
            return "no steps"
        per_step = 1000 / self.num_steps
        return (f"{self.num_steps} steps, {self.wall_s * per_step:.1f} ms per step of which forward "
                f"{self.forward_s * per_step:.1f} ms: engine overhead {100 * self.overhead_fraction:.1f}%")


@dataclass
class StepTiming:
    """Every step's wall and forward time, summed per batch size."""

    by_batch_size: dict[int, TimingTotals] = field(default_factory=dict)
    total: TimingTotals = field(default_factory=TimingTotals)

    def reset(self) -> None:
        """Forget every step so far (a benchmark's warm-up, say)."""
        self.by_batch_size.clear()
        self.total = TimingTotals()

    def record(self, batch_size: int, wall_s: float, forward_s: float) -> None:
        self.by_batch_size.setdefault(batch_size, TimingTotals()).add(wall_s, forward_s)
        self.total.add(wall_s, forward_s)

    def at_least(self, batch_size: int) -> TimingTotals:
        """Totals over the steps that ran ``batch_size`` requests or more."""
        totals = TimingTotals()
        for size, part in self.by_batch_size.items():
            if size >= batch_size:
                totals.add(part.wall_s, part.forward_s, part.num_steps)
        return totals

"""Speculation counters, per request or summed over requests. Plain integers, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Draft and acceptance counts over speculative steps.

    A speculative step is one verification of at least one draft token; steps without
    drafts are plain decoding and are not counted.
    """

    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [max k seen]: number of steps in which the draft at position i was accepted.
    accepted_by_position: list[int] = field(default_factory=list)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Record one step that drafted num_drafted tokens and accepted the first num_accepted."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= num_accepted <= num_drafted, got {num_accepted}, {num_drafted}")
        if num_drafted == 0:
            return
        self.num_spec_steps += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self._grow(num_drafted)
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (0.0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculative step: accepted + one recovered or bonus (0.0 before any)."""
        if not self.num_spec_steps:
            return 0.0
        return (self.num_accepted_tokens + self.num_spec_steps) / self.num_spec_steps

    def merge(self, other: SpecStats) -> None:
        """Add other's counts into self (e.g. a finished request into the global stats)."""
        self.num_spec_steps += other.num_spec_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._grow(len(other.accepted_by_position))
        for i, count in enumerate(other.accepted_by_position):
            self.accepted_by_position[i] += count

    def to_dict(self) -> dict:
        return {
            "num_spec_steps": self.num_spec_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_by_position": list(self.accepted_by_position),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }

    def _grow(self, length: int) -> None:
        if length > len(self.accepted_by_position):
            self.accepted_by_position.extend([0] * (length - len(self.accepted_by_position)))

"""Which kind of checkpoint to write next (Check-N-Run's policies).

``S_i`` is the share of rows in the i-th checkpoint after a full baseline.
- full: always everything.
- one_shot: a baseline, then everything changed since it (restore = baseline + latest).
- incremental: a baseline, then what changed in the last interval (restore = baseline + every one).
- intermittent: one_shot, plus a new baseline when the rule fires: "cumulative" (Check-N-Run's)
  when ``1 + S_1 + ... + S_i <= (i + 1) * S_i``, i.e. keeping the baseline costs more than a new
  one would; "fraction" when ``S_i >= rebaseline_fraction``.
``full_every`` also forces a baseline after that many non-full checkpoints (any policy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recscale.checkpoint.settings import CheckpointSettings


@dataclass
class Policy:
    settings: CheckpointSettings
    has_baseline: bool = False
    fractions: list[float] = field(default_factory=list)  # S_1 .. S_i since the baseline

    @property
    def name(self) -> str:
        return self.settings.policy

    def candidate_kind(self) -> str:
        """The kind to measure before deciding: what a non-full checkpoint would hold."""
        if not self.has_baseline or self.name == "full":
            return "full"
        return "incremental" if self.name == "incremental" else "differential"

    def decide(self, fraction: float) -> str:
        """Kind of the next checkpoint, given the share of cells a non-full one would hold."""
        kind = self.candidate_kind()
        if kind == "full":
            return "full"
        s = self.settings
        if s.full_every and len(self.fractions) >= s.full_every:
            return "full"
        if self.name == "intermittent":
            i = len(self.fractions) + 1
            if s.rebaseline == "cumulative" and 1.0 + sum(self.fractions) + fraction <= (i + 1) * fraction:
                return "full"
            if s.rebaseline == "fraction" and fraction >= s.rebaseline_fraction:
                return "full"
        return kind

    def record(self, kind: str, fraction: float) -> None:
        if kind == "full":
            self.has_baseline = True
            self.fractions = []
        else:
            self.fractions.append(fraction)

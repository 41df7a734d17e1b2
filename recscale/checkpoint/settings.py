"""What a training job's ``[checkpoint]`` config section says: where, how often, which policy,
which quantization. One typed dataclass, read by the config loader and the checkpoint manager."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PolicyName = Literal["full", "one_shot", "incremental", "intermittent"]
QuantMethod = Literal["none", "fp16", "bf16", "uniform", "adaptive", "mixed"]
StatePrecision = Literal["fp32", "fp16", "bf16"]
RebaselineRule = Literal["cumulative", "fraction"]

BITS = (2, 3, 4, 8)


def bits_for_restores(expected_restores: int) -> int:
    """Check-N-Run's rule: error accumulates per restore, so fewer restores allow fewer bits."""
    if expected_restores <= 1:
        return 2
    if expected_restores <= 3:
        return 3
    if expected_restores <= 20:
        return 4
    return 8


@dataclass
class CheckpointSettings:
    # Root directory of this job's checkpoints (one run folder per run in it); empty turns checkpointing off.
    dir: str = ""
    # Checkpoint every this many steps (0: off) and/or every this many minutes (0: off).
    interval_steps: int = 0
    interval_minutes: float = 0.0
    # full | one_shot (baseline + changes since it) | incremental (changes since the last one)
    # | intermittent (one_shot with a new baseline when the rule says so; Check-N-Run's default).
    policy: PolicyName = "intermittent"
    # intermittent: "cumulative" = new baseline when 1 + S_1 + ... + S_i <= (i + 1) * S_i
    # (S_i = share of rows in the i-th differential); "fraction" = when S_i >= rebaseline_fraction.
    rebaseline: RebaselineRule = "cumulative"
    rebaseline_fraction: float = 0.5
    # one_shot / incremental / intermittent: also a new baseline after this many non-full ones (0: never).
    full_every: int = 0
    # Embedding rows on write: none (exact, storage dtype) | fp16 | bf16 | uniform | adaptive
    # | mixed (bits per value on average over the rows a checkpoint writes; per row 2, 3, 4 or 8,
    # the most to the rows of largest range^2 x root of the optimizer state: the most loss).
    quantization: QuantMethod = "none"
    # uniform / adaptive / mixed: 8, 4, 3 or 2 bits per value; 0 = chosen from expected_restores.
    bits: int = 0
    expected_restores: int = 21
    # adaptive: greedy range search in steps of (max - min) / bins, shrinking at most ratio of the range.
    adaptive_bins: int = 25
    adaptive_ratio: float = 0.6
    # Full checkpoints leave out rows still bitwise at their initial values with zero optimizer
    # state (rows no update ever reached); a restore regenerates them exactly from the seed, so
    # they cost no bytes and no quantization error.
    skip_initial_rows: bool = True
    # Precision of the embedding optimizer state in checkpoints.
    optimizer_state: StatePrecision = "fp32"
    # Keep the last this many restorable checkpoints (and whatever baselines they need); 0 keeps all.
    keep_last: int = 2
    # Quantize and write in a background thread (training stalls only for the in-memory snapshot).
    async_write: bool = True
    # At most this many checkpoints being written at once; the next snapshot waits for a slot.
    max_in_flight: int = 1
    # Rows per chunk: the unit of quantization, writing, checksums and resharded reads.
    chunk_rows: int = 65536
    # Also checkpoint when training ends.
    at_end: bool = True
    # Resume from this checkpoint directory, a run folder, or "latest" (the newest run's newest
    # checkpoint under dir); empty: start fresh.
    resume: str = ""
    # Resume by itself from the newest valid checkpoint under dir when there is one (else start
    # fresh, or from resume): a job restarted by torchrun --max-restarts continues where it died.
    auto_resume: bool = False
    # Rank 0 waits this long for every rank's files before it gives up on committing a checkpoint.
    commit_timeout_s: float = 600.0

    @property
    def enabled(self) -> bool:
        return bool(self.dir)

    @property
    def effective_bits(self) -> int:
        return self.bits or bits_for_restores(self.expected_restores)

    def validate(self) -> None:
        """Raise ValueError naming the key and the fix."""

        def bad(key: str, msg: str) -> ValueError:
            return ValueError(f"config key 'checkpoint.{key}': {msg}")

        if self.interval_steps < 0:
            raise bad("interval_steps", f"expected a value >= 0, got {self.interval_steps}")
        if self.interval_minutes < 0:
            raise bad("interval_minutes", f"expected a value >= 0, got {self.interval_minutes}")
        if self.bits and self.bits not in BITS:
            raise bad("bits", f"expected one of {list(BITS)} (or 0 to choose from expected_restores), got {self.bits}")
        if self.expected_restores < 0:
            raise bad("expected_restores", f"expected a value >= 0, got {self.expected_restores}")
        if self.adaptive_bins < 1:
            raise bad("adaptive_bins", f"expected a value >= 1, got {self.adaptive_bins}")
        if not 0.0 <= self.adaptive_ratio < 1.0:
            raise bad("adaptive_ratio", f"expected a value in [0, 1), got {self.adaptive_ratio}")
        if not 0.0 < self.rebaseline_fraction <= 1.0:
            raise bad("rebaseline_fraction", f"expected a value in (0, 1], got {self.rebaseline_fraction}")
        for key in ("full_every", "keep_last"):
            if getattr(self, key) < 0:
                raise bad(key, f"expected a value >= 0, got {getattr(self, key)}")
        if self.max_in_flight < 1:
            raise bad("max_in_flight", f"expected a value >= 1, got {self.max_in_flight}")
        if self.chunk_rows < 1:
            raise bad("chunk_rows", f"expected a value >= 1, got {self.chunk_rows}")
        if self.commit_timeout_s <= 0:
            raise bad("commit_timeout_s", f"expected a value > 0, got {self.commit_timeout_s}")
        if (self.interval_steps or self.interval_minutes) and not self.dir:
            raise bad("dir", "an interval is set but no directory; set checkpoint.dir")
        if self.auto_resume and not self.dir:
            raise bad("auto_resume", "needs checkpoint.dir (where to look for checkpoints and write them)")
        if self.resume == "latest" and not self.dir:
            raise bad("resume", "'latest' needs checkpoint.dir (the directory to look in)")

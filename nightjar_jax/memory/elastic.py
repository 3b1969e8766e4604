"""Nightjar's elastic memory policy (host side, no JAX): when to offload the draft and when to bring it back.

Under memory pressure speculation does not pay (the planner chooses γ = 0 at high load) and the draft's device
bytes (its weights, its KV pool, a feature draft's feature pool) are better spent as KV cache for the target:
the engine moves the draft's weights to host memory, releases its pools, and attaches an extension KV pool of the
bytes they held (``ModelRunner.offload_draft``). When the load falls it detaches the extension (its live pages
migrate into free base pages first) and brings the draft back (``ModelRunner.reload_draft``); the draft then
catches up on the tokens it missed before the planner may choose γ > 0 again.

States: ``DEVICE`` -> (offload) -> ``HOST`` -> (reload) -> ``DEVICE``; each move happens between two engine steps
(the transient OFFLOADING / RELOADING states of ``docs/architecture.md`` last inside that one call).

- Pressure: load forces speculation off (a request waits that the pool cannot admit: its pages are missing, not a
  sequence slot; or a step preempted a request), or speculation is off by the planner's choice (its last decode
  step's γ was 0) and fewer than ``low_watermark`` of the base pages are free. A full pool alone does not move a
  draft the planner still finds worth running (DESIGN.md: offload "when SD is off").
- Offload after ``persist_steps`` consecutive steps under pressure.
- Reload after ``persist_steps`` consecutive steps with no waiting request and at least the extension's pages plus
  ``high_watermark`` of the base pages free (so the live extension pages fit in the base pool with room to spare),
  or at once when the engine is idle (nothing to migrate; an idle engine takes no more steps to count).
A step that breaks the condition resets the count, so one burst does not flip the draft back and forth.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class DraftPlacement(enum.Enum):
    DEVICE = "device"
    HOST = "host"


class MemoryAction(enum.Enum):
    OFFLOAD = "offload"
    RELOAD = "reload"


@dataclass(frozen=True)
class PoolState:
    """What the policy reads after a step."""

    free_pages: int  # free pages now, base and extension together
    base_pages: int  # usable pages of the base pool (page 0 excluded)
    extension_pages: int  # pages of the attached extension (0: none)
    num_waiting: int  # requests in the waiting queue
    blocked_on_pages: bool  # the head of the waiting queue cannot be admitted for lack of pages
    preempted: bool  # this step preempted a request
    num_running: int = 0  # admitted requests (0 and none waiting: the engine is idle)
    speculating: bool = False  # the planner chose γ > 0 for the last decode step


class ElasticPolicy:
    def __init__(self, low_watermark: float = 0.05, high_watermark: float = 0.25, persist_steps: int = 8):
        if not 0.0 <= low_watermark < 1.0:
            raise ValueError(f"offload_low_watermark={low_watermark} must be in [0, 1)")
        if not 0.0 <= high_watermark < 1.0:
            raise ValueError(f"reload_high_watermark={high_watermark} must be in [0, 1)")
        if persist_steps < 1:
            raise ValueError(f"offload_persist_steps={persist_steps} must be >= 1")
        if high_watermark <= low_watermark:  # (allowed: tests reload at once with 0; but under load it thrashes)
            logger.warning("reload_high_watermark=%s is not above offload_low_watermark=%s: under load a reload can "
                           "leave fewer free pages than the offload's threshold, and the draft then moves back and "
                           "forth, each reload paying a page migration and a draft catch-up; keep the reload's "
                           "watermark above the offload's (defaults 0.25 and 0.05)", high_watermark, low_watermark)
        self.low_watermark = low_watermark
        self.high_watermark = high_watermark
        self.persist_steps = persist_steps
        self.placement = DraftPlacement.DEVICE
        self._streak = 0

    def under_pressure(self, s: PoolState) -> bool:
        forced = s.blocked_on_pages or s.preempted
        return forced or (not s.speculating and s.free_pages < self.low_watermark * s.base_pages)

    def calm(self, s: PoolState) -> bool:
        return s.num_waiting == 0 and s.free_pages >= s.extension_pages + self.high_watermark * s.base_pages

    def observe(self, s: PoolState) -> MemoryAction | None:
        """Count this step; the move to make now, if any (the caller makes it, then calls :meth:`moved`)."""
        on_device = self.placement is DraftPlacement.DEVICE
        if not on_device and s.num_running == 0 and s.num_waiting == 0:
            return MemoryAction.RELOAD
        hit = self.under_pressure(s) if on_device else self.calm(s)
        self._streak = self._streak + 1 if hit else 0
        if self._streak < self.persist_steps:
            return None
        return MemoryAction.OFFLOAD if on_device else MemoryAction.RELOAD

    def moved(self, action: MemoryAction) -> None:
        """The caller made ``action``."""
        self.placement = DraftPlacement.HOST if action is MemoryAction.OFFLOAD else DraftPlacement.DEVICE
        self._streak = 0

    def __repr__(self) -> str:
        return (f"ElasticPolicy(low={self.low_watermark}, high={self.high_watermark}, persist={self.persist_steps}, "
                f"draft on {self.placement.value})")

"""Numbers that several packages use, kept in one place so they cannot drift apart."""

from __future__ import annotations

FOREVER = 2**62  # a step later than any real step
EVERY_RECORD = 2**31  # "every record" as the limit of a read that takes one
STEP_WINDOW = 1024  # recent steps a manager keeps pinned (``--step-window``)

# A guarded change (``--guard METRIC:FACTOR``, ``?guard=``): what a guard watches unless told.
GUARD_STEPS = 200  # steps after the change takes effect
GUARD_WINDOW = 10  # steps its metric is smoothed over (a trailing mean)

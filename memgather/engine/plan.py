"""A call's plan: everything memgather will do with it, decided once and then carried out.

``planner.plan`` makes it; ``agreement.settle`` is the one step that may turn
it into another (from what every rank contributed to the agreement round);
``core`` carries it out through one table keyed by ``Plan.strategy``. A plan
is never changed in place: a NamedTuple, immutable and cheap to build on the
hot path of small calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, NamedTuple, Optional

from memgather.engine.reasons import Reason, Strategy

if TYPE_CHECKING:
    from memgather.engine.groups import GroupInfo
    from memgather.engine.routes import Route


class Plan(NamedTuple):
    """What one call does; ``reason`` is set exactly when ``strategy`` is ``FALLBACK``."""

    strategy: Strategy
    reason: Optional[Reason] = None
    route: Optional[Route] = None  # how the bytes travel; also kept by a fallback the ranks agree on
    agree: bool = False  # the ranks run the agreement round first (check mode, or a route every rank shares)
    info: Optional[GroupInfo] = None  # the group, described: None where the call was turned away at once
    gathered: Optional[int] = None  # bytes of the slots; None unless they are a list of world tensors
    watched: bool = False  # a user's mode is active: the agreement round runs outside it

    @property
    def rewires(self) -> bool:
        """Whether memgather carries the call out itself (else torch's all_gather does)."""
        return self.strategy is not Strategy.FALLBACK

    @property
    def leaves_counters(self) -> bool:
        """Whether its writer leaves the slots' version counters as torch's call does (a parked rebind,
        ``slots.rebind``): none are read to be set back."""
        return self.strategy is Strategy.PARKED_REBIND


# The plans of calls that go to torch at once, built once: most calls are small ones.
_AT_ONCE: Dict[Reason, Plan] = {reason: Plan(Strategy.FALLBACK, reason) for reason in Reason}


def turned_away(reason: Reason) -> Plan:
    """The plan of a call turned away at once: torch's all_gather takes it, with nothing to agree on
    (``core.to_torch`` makes that call)."""
    return _AT_ONCE[reason]

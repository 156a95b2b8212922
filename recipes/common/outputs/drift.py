"""A preference run that wins on paper while its answers get worse: the chosen replies' log-probability falling
with the rejected ones' while the reward accuracy saturates (the margin grows by pushing both down). Said once,
in one line, with the settings that change it."""

from __future__ import annotations

from collections import deque

WINDOW = 10  # steps averaged at the start and at each step since
SATURATED = 0.95  # reward accuracy (the share of pairs whose chosen reply wins), averaged over the window


class LikelihoodDrift:
    """`check(step, chosen, rejected, accuracy)` after each step (the step's mean log-probabilities of the chosen
    and rejected replies, and its reward accuracy): the warning, the first time both log-probabilities have
    fallen below their first window's mean by more than 5% (and 1 nat) while the window's accuracy is saturated;
    else None."""

    def __init__(self, window: int = WINDOW):
        self.recent = deque(maxlen=window)
        self.first = None
        self.warned = False

    def check(self, step: int, chosen: float, rejected: float, accuracy: float) -> str | None:
        self.recent.append((chosen, rejected, accuracy))
        if len(self.recent) < self.recent.maxlen or self.warned:
            return None
        now = [sum(values) / len(values) for values in zip(*self.recent)]
        if self.first is None:
            self.first = now
            return None
        fell = [first - value > max(1.0, 0.05 * abs(first)) for first, value in zip(self.first[:2], now[:2])]
        if not (all(fell) and now[2] >= SATURATED):
            return None
        self.warned = True
        return (f"warning: step {step}: reward accuracy {now[2]:.2f}, but the chosen replies' log-probability fell "
                f"too ({self.first[0]:.1f} -> {now[0]:.1f}; rejected {self.first[1]:.1f} -> {now[1]:.1f}): the "
                "margin grows by pushing both down and the answers may get worse; raise --beta, lower --lr, train "
                "fewer steps, or add an SFT term on the chosen replies (--loss orpo has one)")

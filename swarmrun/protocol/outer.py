"""The outer-mode hparams of a spec (``--set outer=diloco``), sans-IO: their names, defaults and checks.

In outer mode a committed step is an outer step: each trainer takes inner optimizer steps on the blocks it claims, a
round averages pseudo-gradients (start-of-step parameters minus local ones) by samples, and every participant
applies one outer optimizer step (``node.peer.outer``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from swarmrun.protocol.errors import UsageError

__all__ = ["OUTERS", "OUTER_DEFAULTS", "check_outer", "outer_hparams"]

#: how a committed step is made (hparam ``outer``): ``none``, one optimizer step on the averaged gradient; ``diloco``,
#: each trainer takes inner optimizer steps on the blocks it claims and the round averages pseudo-gradients (start of
#: step parameters minus local ones) for one outer optimizer step (SGD, Nesterov momentum by default)
OUTERS = ("none", "diloco")
#: the outer mode's hparams and their defaults (the DiLoCo paper's outer SGD). A spec holds them only in outer mode,
#: so a spec of the default mode encodes, and hashes, as it did before they existed; ``inner_steps`` has no default
OUTER_DEFAULTS = {"outer": "none", "inner_steps": 0, "outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_outer(hparams: Mapping[str, Any]) -> None:
    """Check a spec's outer-mode hparams (``Spec.__post_init__``).

    Raises:
        UsageError: an unknown mode, an outer hparam outside outer mode, a missing or out-of-range one.
    """
    outer = hparams.get("outer", "none")
    if outer not in OUTERS:
        raise UsageError(f"hparams['outer'] must be one of {', '.join(OUTERS)}, got {outer!r}")
    others = sorted(k for k in OUTER_DEFAULTS if k != "outer" and k in hparams)
    if outer == "none":
        if others or "outer" in hparams:  # one encoding of the default mode: the one specs had before outer existed
            raise UsageError(f"hparams {', '.join(others or ['outer'])} belong to outer=diloco only")
        return
    missing = sorted(k for k in OUTER_DEFAULTS if k not in hparams)
    if missing:
        raise UsageError(f"outer=diloco needs hparams {', '.join(missing)}")
    steps, lr, momentum = hparams["inner_steps"], hparams["outer_lr"], hparams["outer_momentum"]
    if not _is_int(steps) or steps <= 0:
        raise UsageError(f"hparams['inner_steps'] must be a positive int, got {steps!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise UsageError(f"hparams['outer_lr'] must be a positive number, got {lr!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise UsageError(f"hparams['outer_momentum'] must be a number in [0, 1), got {momentum!r}")
    if not isinstance(hparams["outer_nesterov"], bool) or (hparams["outer_nesterov"] and momentum == 0):
        raise UsageError(f"hparams['outer_nesterov'] must be a bool (and needs outer_momentum > 0), "
                         f"got {hparams['outer_nesterov']!r}")


def outer_hparams(values: Mapping[str, Any], *, given: Collection[str]) -> dict[str, Any]:
    """The outer-mode hparams a new spec holds: none for ``outer=none`` (the default mode's spec is as it was), all of
    ``OUTER_DEFAULTS`` (``values`` over the defaults) for ``outer=diloco``.

    Args:
        values: the outer hparams, typed (the CLI's ``--set`` over ``OUTER_DEFAULTS``).
        given: the keys the user set.
    Raises:
        UsageError: an outer hparam without ``outer=diloco``, or ``outer=diloco`` without ``inner_steps``.
    """
    merged = {**OUTER_DEFAULTS, **{k: v for k, v in values.items() if k in OUTER_DEFAULTS}}
    if merged["outer"] == "none":
        stray = sorted(k for k in given if k != "outer" and k in OUTER_DEFAULTS)
        if stray:
            raise UsageError(f"--set {', '.join(stray)} needs --set outer=diloco")
        return {}
    if "inner_steps" not in given:
        raise UsageError("outer=diloco needs --set inner_steps=H (inner optimizer steps of each trainer per outer step)")
    check_outer(merged)
    return merged

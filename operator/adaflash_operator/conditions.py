"""Standard status conditions (pure helpers)."""

from __future__ import annotations


def set_condition(conds: list[dict] | None, type_: str, status: bool | str, reason: str,
                  message: str, now: str, generation: int | None = None) -> list[dict]:
    """Return `conds` with one condition set; lastTransitionTime moves only when status does."""
    st = status if isinstance(status, str) else ("True" if status else "False")
    out, found = [], False
    for cond in conds or []:
        if cond.get("type") != type_:
            out.append(cond)
            continue
        found = True
        changed = cond.get("status") != st
        new = {"type": type_, "status": st, "reason": reason, "message": message,
               "lastTransitionTime": now if changed else cond.get("lastTransitionTime", now)}
        if generation is not None:
            new["observedGeneration"] = generation
        out.append(new)
    if not found:
        new = {"type": type_, "status": st, "reason": reason, "message": message,
               "lastTransitionTime": now}
        if generation is not None:
            new["observedGeneration"] = generation
        out.append(new)
    return out


def get_condition(conds: list[dict] | None, type_: str) -> dict | None:
    return next((x for x in conds or [] if x.get("type") == type_), None)


def replace_patch(old: dict | None, new: dict) -> dict:
    """A merge patch that turns `old` into exactly `new` (keys absent from `new` are nulled)."""
    patch: dict = {k: None for k in (old or {}) if k not in new}
    patch.update(new)
    return patch


def is_subset(want, have) -> bool:
    """Whether the live object `have` already holds everything in `want` (we never remove what
    the API server or other controllers add)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(is_subset(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(
            is_subset(a, b) for a, b in zip(want, have))
    if isinstance(want, (int, float)) and not isinstance(want, bool) and isinstance(have, str):
        return str(want) == have  # quantities come back as strings
    return want == have

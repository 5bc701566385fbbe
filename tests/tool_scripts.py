"""Scripted policies for tool-episode tests (`domains.tools.Policy`): no model, the turns a test dictates."""
from __future__ import annotations


def replay(text: str):
    """A scripted policy that writes `text` (a trajectory) turn by turn; tool output lines come from the env, so
    the replay only stays on `text` while the env prints what `text` says it printed."""

    async def turn(prompt: str, response: str, budget: int) -> tuple[str, bool]:
        assert text.startswith(response), f"the env's output left the script:\n{response!r}\nvs\n{text!r}"
        rest = text[len(response):]
        end = rest.find("\n")
        return (rest, True) if end < 0 else (rest[: end + 1], False)

    return turn

"""Scripted policies for tool-episode tests: no model, the turns a test dictates, run through the one episode loop
(`domains.episodes`: `EpisodeRun` with `run_token_episode` / `run_episodes`) on the character tokenizer, as the
rollouts, the student and evaluation run their models' turns.

A text policy is `policy(prompt, response so far, max new tokens) → (continuation, ended)`: one turn, up to and
including a newline, or until it ends (`ended`: an EOS follows the text)."""
from __future__ import annotations

from typing import Awaitable, Callable, Sequence

from domains.episodes import EpisodeRun, run_token_episode
from infra.chat import response_text

TextPolicy = Callable[[str, str, int], Awaitable[tuple[str, bool]]]
_TOK = []


def char_tokenizer():
    """The character tokenizer of the tiny test models (built once)."""
    if not _TOK:
        from infra.tokenizer import build_char_tokenizer

        _TOK.append(build_char_tokenizer())
    return _TOK[0]


def replay(text: str):
    """A scripted policy that writes `text` (a trajectory) turn by turn; tool output lines come from the env, so
    the replay only stays on `text` while the env prints what `text` says it printed."""

    async def turn(prompt: str, response: str, budget: int) -> tuple[str, bool]:
        assert text.startswith(response), f"the env's output left the script:\n{response!r}\nvs\n{text!r}"
        rest = text[len(response):]
        end = rest.find("\n")
        return (rest, True) if end < 0 else (rest[: end + 1], False)

    return turn


def _turn_ids(tok, cont: str, ended: bool, budget: int) -> tuple[list[int], str]:
    """A text turn as the engine returns it: its ids (an EOS after an ended turn), cut to `budget`; finish "stop"
    at the EOS or a line end, else "length"."""
    ids = list(tok(cont, add_special_tokens=False).input_ids)
    if ended:
        ids.append(tok.eos_token_id)
    ids = ids[:budget]
    done = ended and len(ids) and ids[-1] == tok.eos_token_id or cont.endswith("\n") and len(ids) == len(cont)
    return ids, "stop" if done else "length"


async def run_episode_async(policy: TextPolicy, env, prompt: str, budget: int, tokenizer=None) -> str:
    """One episode of `policy` in `env` with `budget` new tokens (tool output included); the response text."""
    tok = tokenizer or char_tokenizer()
    prompt_ids = list(tok(prompt, add_special_tokens=False).input_ids)
    text = lambda ids: response_text(tok, ids, [tok.eos_token_id])  # noqa: E731

    async def generate(context: list[int], max_new: int, _turn: int):
        cont, ended = await policy(prompt, tok.decode(context[len(prompt_ids):]), max_new)
        ids, finish = _turn_ids(tok, cont, ended, max_new)
        return ids, [0.0] * len(ids), finish

    run = EpisodeRun(prompt_ids, budget, env=env, tokenizer=tok, text=text)
    return text((await run_token_episode(run, generate)).output_ids)


def run_episode(policy: TextPolicy, env, prompt: str, budget: int, tokenizer=None):
    """`run_episode_async` (a coroutine: `await` it, as the tests' event loops do)."""
    return run_episode_async(policy, env, prompt, budget, tokenizer)


def scripted_model(turns: Callable[[list[str], list[str], list[int]], list[tuple[str, bool]]], examples: Sequence,
                   tokenizer=None):
    """A `domains.evaluate.EpisodeModel` whose tool turns come from the batched text script `turns(prompts,
    responses, budgets) → [(continuation, ended)]` (run index i is `examples[i]`), on the character tokenizer."""
    from domains.evaluate import EpisodeModel
    from infra.chat import PromptRenderer

    tok = tokenizer or char_tokenizer()
    render = PromptRenderer(tok, "none")
    starts: dict[int, int] = {}

    async def generate(batch):
        for i, ctx, _m, t in batch:
            if t == 0:
                starts[i] = len(ctx)
        outs = turns([examples[i].prompt for i, *_ in batch], [tok.decode(c[starts[i]:]) for i, c, *_ in batch],
                     [m for _, _, m, _ in batch])
        if len(outs) != len(batch):
            raise RuntimeError(f"turn function returned {len(outs)} continuations for {len(batch)} texts")
        res = [_turn_ids(tok, cont, ended, m) for (cont, ended), (_, _, m, _) in zip(outs, batch)]
        return [(ids, [0.0] * len(ids), finish) for ids, finish in res]

    return EpisodeModel(tok, render, [tok.eos_token_id], None, generate)



"""The one prompt rendering every stage uses: SFT, specialist rollouts, student sampling, teacher scoring, evaluation.

    render_prompt_ids(tok, prompt, system, mode)   the ids the model sees before its answer
    completion_ids(tok, completion, mode)           an SFT target: the answer's ids + the turn's end token
    stop_token_ids(tok, generation_config)          where generation stops: EOS ids and the template's end of turn

`mode` is `model.chat_template`: "auto" uses the tokenizer's chat template when it has one (a system message when
`system` is non-empty, the prompt as the user message, the assistant turn opened: `add_generation_prompt=True`);
"none", or a tokenizer without a template (the built-in char tokenizer), gives `[BOS] + prompt ids` (no BOS when the
tokenizer has none). The rendered text is tokenized with `add_special_tokens=False`: a template writes its own
special tokens (BOS included where it wants one).

Why one function: a model trained on one rendering and sampled or scored on another sees a different context in each
stage; `tests/unit/test_chat_render.py` checks the ids SFT, rollouts, the student sampler and evaluation produce are
equal. `PromptRenderer` binds (tokenizer, mode) for the places that render many prompts.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable

MODES = ("auto", "none")
_PROBE = "ALLOY_ANSWER_PROBE"  # an assistant message no template alters: what follows it closes the turn


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"model.chat_template: {mode!r} is not one of {list(MODES)}")


def uses_template(tokenizer, mode: str = "auto") -> bool:
    """Whether prompts are rendered with the tokenizer's chat template (mode "auto" and the tokenizer has one)."""
    _check_mode(mode)
    return mode == "auto" and bool(getattr(tokenizer, "chat_template", None))


def _messages(prompt: str, system: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def render_prompt_ids(tokenizer, prompt: str, system: str = "", mode: str = "auto") -> list[int]:
    """The ids of `prompt` (with `system`, for a chat template) as every stage feeds them to the model."""
    if uses_template(tokenizer, mode):
        text = tokenizer.apply_chat_template(_messages(prompt, system), tokenize=False, add_generation_prompt=True)
        return _ids(tokenizer, text)
    bos = getattr(tokenizer, "bos_token_id", None)
    return ([bos] if bos is not None else []) + _ids(tokenizer, prompt)


def end_of_turn_ids(tokenizer, mode: str = "auto") -> list[int]:
    """The token(s) that close the assistant's turn: the first token the template writes after an assistant message
    (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3) when it is a special token, else EOS. Empty when the
    tokenizer has no EOS and no template."""
    return list(_end_of_turn(tokenizer, mode))


@lru_cache(maxsize=32)  # per tokenizer object: SFT asks once per pair, a Jinja render each time otherwise
def _end_of_turn(tokenizer, mode: str) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if uses_template(tokenizer, mode):
        full = tokenizer.apply_chat_template(_messages("q", "") + [{"role": "assistant", "content": _PROBE}],
                                             tokenize=False)
        tail = full.split(_PROBE, 1)[1] if _PROBE in full else ""
        ids = _ids(tokenizer, tail) if tail else []
        if ids and ids[0] in set(getattr(tokenizer, "all_special_ids", ())) | _added_ids(tokenizer):
            return (ids[0],)
    return (eos,) if eos is not None else ()


def _added_ids(tokenizer) -> set[int]:
    try:
        return {int(i) for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", True)}
    except AttributeError:
        return set()


def completion_ids(tokenizer, completion: str, mode: str = "auto") -> list[int]:
    """An SFT target: the completion's ids followed by the end of the assistant's turn (EOS without a template)."""
    return _ids(tokenizer, completion) + end_of_turn_ids(tokenizer, mode)


def _as_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple, set, frozenset)) else [int(v)]


def stop_token_ids(tokenizer, generation_config=None, mode: str = "auto") -> list[int]:
    """Ids generation stops at, in this order without repeats: the tokenizer's EOS, the generation config's EOS
    id(s), the chat template's end-of-turn token."""
    out: list[int] = []
    sources: Iterable[Any] = (getattr(tokenizer, "eos_token_id", None),
                              getattr(generation_config, "eos_token_id", None), end_of_turn_ids(tokenizer, mode))
    for src in sources:
        for t in _as_list(src):
            if t not in out:
                out.append(t)
    return out


def response_text(tokenizer, output_ids, stop_ids) -> str:
    """The response a verifier sees: the tokens before the first stop id (one id or several), special tokens
    removed."""
    stops = {int(stop_ids)} if isinstance(stop_ids, int) else set(stop_ids)
    ids = list(output_ids)
    cut = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return tokenizer.decode(ids[:cut], skip_special_tokens=True)


def system_of(domain, example=None) -> str:
    """The system message of `example`'s domain: `domain.system`, or, for a composite of domains (MixedDomain:
    a `domains` mapping by name), the system message of the example's own domain."""
    inner = getattr(domain, "domains", None)
    if isinstance(inner, dict) and example is not None and getattr(example, "domain", None) in inner:
        domain = inner[example.domain]
    return str(getattr(domain, "system", "") or "")


@dataclass(frozen=True)
class PromptRenderer:
    """`render_prompt_ids` and friends bound to one tokenizer and `model.chat_template` mode."""

    tokenizer: Any
    mode: str = "auto"

    def __post_init__(self) -> None:
        _check_mode(self.mode)

    def prompt_ids(self, prompt: str, system: str = "") -> list[int]:
        return render_prompt_ids(self.tokenizer, prompt, system, self.mode)

    def example_ids(self, domain, example) -> list[int]:
        """The prompt ids of a domain example (its domain's system message included)."""
        return self.prompt_ids(example.prompt, system_of(domain, example))

    def completion_ids(self, completion: str) -> list[int]:
        return completion_ids(self.tokenizer, completion, self.mode)

    def stop_ids(self, generation_config=None) -> list[int]:
        return stop_token_ids(self.tokenizer, generation_config, self.mode)


def token_budget(domain, tokenizer, default: int) -> int:
    """A domain's answer budget in tokens of `tokenizer`: its `token_budget(tokenizer)` (dataset domains derive it
    from their data), for a composite (`domains` mapping) the largest of its parts' and `default`, else `default`."""
    inner = getattr(domain, "domains", None)
    if isinstance(inner, dict):
        return max([default] + [token_budget(d, tokenizer, 0) for d in inner.values()])
    fn = getattr(domain, "token_budget", None)
    own = fn(tokenizer) if callable(fn) else None
    return int(own) if own else default


@lru_cache(maxsize=32)
def token_ids_containing(tokenizer, text: str) -> frozenset[int]:
    """Ids of the vocabulary's tokens whose decoded text contains `text` (the tool protocol's turn end, a newline:
    a BPE tokenizer also has it merged into longer tokens). Decodes the vocabulary once per tokenizer."""
    n = len(tokenizer)
    pieces = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
    return frozenset(i for i, piece in enumerate(pieces) if text in piece)

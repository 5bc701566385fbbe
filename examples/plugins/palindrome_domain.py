"""An example domain plugin, defined outside the Alloy packages: "is this string a palindrome?".

Use it from a config by putting this folder on the Python path (`PYTHONPATH=examples/plugins`) and naming the class:

    domains:
      - name: palindrome
        impl: palindrome_domain:Palindrome
        difficulty: 1
        params: {alphabet: abcdefgh}

Prompt `pal:abcba=` → answer `yes`; `pal:abcda=` → `no`. Half the draws are palindromes; the others are a palindrome
with one off-centre character changed (a near miss of the same length, never a palindrome), so neither length nor a
constant answer gives the task away. Reward: exact match only (partial credit on a yes/no answer rewards guessing).
"""
from __future__ import annotations

import random

from domains.base import Domain, Example


class Palindrome(Domain):
    name = "palindrome"
    tag = "pal"  # prompts start with "pal:", distinct from every built-in tag
    description = "Is a lowercase string of length 3 to d+5 a palindrome? Answer yes or no."
    max_answer_chars = 3  # "yes" / "no": the generation budget
    defaults = {"alphabet": "abcdefghijklmnopqrstuvwxyz"}  # the only accepted param, with its default

    def setup(self) -> None:
        # Called by Domain.__init__ after it validated difficulty and param names: check values, derive sizes.
        alphabet = self.params["alphabet"]
        if not isinstance(alphabet, str) or len(set(alphabet)) < 2 or not alphabet.isalpha() or not alphabet.isascii():
            raise ValueError(f"domain {self.name!r}: param 'alphabet' must be at least 2 distinct ASCII letters, "
                             f"got {alphabet!r}")
        self.alphabet = "".join(sorted(set(alphabet)))
        self.max_len = self.difficulty + 5

    def generate(self, rng: random.Random) -> Example:
        length = rng.randint(3, self.max_len)
        half = [rng.choice(self.alphabet) for _ in range((length + 1) // 2)]
        chars = half + half[: length // 2][::-1]  # a palindrome of the drawn length
        if rng.random() < 0.5:
            i = rng.choice([j for j in range(length) if j != length - 1 - j])  # off-centre: breaks the symmetry
            chars[i] = rng.choice([c for c in self.alphabet if c != chars[i]])
        s = "".join(chars)
        return self.make(s, "yes" if s == s[::-1] else "no")  # make() builds the prompt "pal:<s>="

    def score(self, example: Example, response: str) -> float:
        # `verify` wraps this: it never raises, clamps to [0, 1], and maps non-str input to 0.0.
        return 1.0 if response.strip() == example.answer else 0.0

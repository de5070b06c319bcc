"""The n-gram (prompt lookup) proposer: drafts a sequence's next tokens from its own history.

Copy-heavy work (editing code, summarising, answers that quote their sources) repeats spans of the
prompt; when the sequence's last few tokens occurred before, the tokens that followed them then
are a good guess for what follows now. The draft is checked by the target model in the next step
(docs/speculative_decoding.md), so a wrong guess costs verification time, never correctness.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Drafts up to ``num_tokens`` tokens: those after the latest earlier occurrence of the
    sequence's last ``max_n`` tokens, else of its last ``max_n - 1`` ... down to ``min_n``."""

    def __init__(self, min_n: int, max_n: int, num_tokens: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n, self.num_tokens = min_n, max_n, num_tokens

    def propose(self, token_ids: list[int]) -> list[int]:
        """The draft for what follows ``token_ids`` (empty when no suffix of ``min_n`` or more
        tokens occurred before)."""
        length = len(token_ids)
        # Most steps of text that does not repeat itself end here: the last token never occurred
        # before (a scan in C, a few microseconds, where the array below costs several times that).
        if length <= self.min_n or token_ids.index(token_ids[-1]) == length - 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Where the last token occurred before (followed by a token): the only places a suffix can
        # match. One vectorised compare, then a few candidates: tens of microseconds at 2k tokens.
        ends = np.flatnonzero(tokens[:length - 1] == tokens[-1])
        best_n, best_end = 0, -1
        for end in ends[::-1]:  # latest first: of equally long matches, the nearest context wins
            n = 1
            while n < self.max_n and n <= end and tokens[end - n] == tokens[length - 1 - n]:
                n += 1
            if n > best_n:
                best_n, best_end = n, int(end)
                if n == self.max_n:
                    break
        if best_n < self.min_n:
            return []
        return token_ids[best_end + 1:best_end + 1 + self.num_tokens]

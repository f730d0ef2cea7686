"""The repetition penalty of `sampling.repetition_penalty`, for the local backend's batches.

transformers' own processor penalizes every id in a row's input, left padding included: with
a pad id that is a real token (often the end of sequence), a row padded in its batch would
penalize it and another not, so a row's reply would depend on its batch. This one reads each
row from its first real token on, the rule of transformers' processor on an unpadded row and of
vLLM's (the prompt's and the reply's tokens): the logit of every token seen is divided by the
penalty when positive, multiplied when negative.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class PaddedRepetitionPenalty(LogitsProcessor):
    """Repetition penalty over each row's tokens after its `pads_B` left-padding columns."""

    def __init__(self, penalty: float, pads_B: torch.Tensor) -> None:
        self.penalty = penalty
        self.pads_B = pads_B

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        pads_B1 = self.pads_B[:, None]  # on the scores' device (the backend puts it there)
        # a padding column reads the row's first real token instead: already penalized once
        first_B1 = input_ids.gather(1, pads_B1)
        columns_1X = torch.arange(input_ids.size(1), device=input_ids.device)[None]
        ids_BX = torch.where(columns_1X < pads_B1, first_B1, input_ids)
        seen_BX = scores.gather(1, ids_BX)
        penalized_BX = torch.where(seen_BX < 0, seen_BX * self.penalty, seen_BX / self.penalty)
        return scores.scatter(1, ids_BX, penalized_BX)

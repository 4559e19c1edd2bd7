"""Generation results and the token loop."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens only
    text: str = ""
    finish_reason: str = "length"  # "stop" (an eos token) | "length" (max_new_tokens)
    prompt_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)


def sample(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids; temperature 0 is greedy."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

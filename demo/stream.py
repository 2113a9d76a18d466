"""What the demo sends: its prompts, their order, and one answer's record.

Prompts are token ids (the tiny model has no tokenizer). A stream of `requests` takes
its prompts from `distinct` ones in a seeded shuffle, so every prompt comes several
times, now and then twice in a row: identical prompts in flight together, and again
after the faults.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from .servers import completion_body

# First token id of a prompt: 0, 1 and 2 are the model's pad, BOS and EOS.
FIRST_ID = 3


def make_prompts(lengths: list[int], salt: int, vocab: int = 512) -> list[list[int]]:
    """Deterministic prompts of these lengths, with distinct first blocks."""
    span = vocab - FIRST_ID
    return [[FIRST_ID + (salt * 131 + i * 37 + j * 13 + (j * j) % 7) % span for j in range(n)]
            for i, n in enumerate(lengths)]


def prompt_lengths(distinct: int, shortest: int = 40, longest: int = 200) -> list[int]:
    """`distinct` lengths spread evenly from `shortest` to `longest` tokens."""
    if distinct == 1:
        return [longest]
    step = (longest - shortest) / (distinct - 1)
    return [round(shortest + i * step) for i in range(distinct)]


def stream_order(requests: int, distinct: int, seed: int = 0) -> list[int]:
    """Which prompt each request sends: every prompt equally often (within one), shuffled."""
    if requests < 1 or distinct < 1:
        raise ValueError("requests and distinct prompts must be at least 1.")
    order = [i % distinct for i in range(requests)]
    random.Random(seed).shuffle(order)
    return order


@dataclass(frozen=True)
class Answer:
    """One request of the stream and what came back."""

    index: int  # its place in the stream
    prompt: int  # which distinct prompt it sent
    sent_s: float  # when it was sent, seconds after the stream began
    elapsed_s: float
    status: int | None  # HTTP status; None when no answer came (connection refused, timeout)
    token_ids: list[int] | None  # the generated ids of a 200 answer
    error: str = ""  # why it failed, one line

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.token_ids is not None


def token_ids_of(body: Any) -> list[int] | None:
    """choices[0].token_ids of a completion answer, or None when it has none."""
    try:
        ids = body["choices"][0]["token_ids"]
    except (KeyError, IndexError, TypeError):
        return None
    return ids if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None


def answer_of(index: int, prompt: int, sent_s: float, elapsed_s: float, status: int, body: Any, text: str) -> Answer:
    """The record of an HTTP answer: its token ids if it is a 200 that carries them."""
    if status != 200:
        return Answer(index, prompt, sent_s, elapsed_s, status, None, f"HTTP {status}: {_error_message(body, text)}")
    ids = token_ids_of(body)
    error = "" if ids is not None else f"HTTP 200 without choices[0].token_ids: {text.strip()[:200]}"
    return Answer(index, prompt, sent_s, elapsed_s, status, ids, error)


def _error_message(body: Any, text: str) -> str:
    """An OpenAI-style error body's message, else the start of the text."""
    try:
        message = body["error"]["message"]
    except (KeyError, TypeError):
        message = None
    return (message if isinstance(message, str) else text.strip())[:200]


def send(
    client: httpx.Client, url: str, index: int, prompt_index: int, prompt: list[int], max_tokens: int, t0: float
) -> Answer:
    """POST one completion (no kv_transfer_params: the gateway adds them) and record the answer."""
    sent = time.monotonic()
    try:
        r = client.post(f"{url}/v1/completions", json=completion_body(prompt, max_tokens))
    except httpx.HTTPError as exc:
        return Answer(index, prompt_index, sent - t0, time.monotonic() - sent, None, None,
                      f"{type(exc).__name__}: {exc}"[:200])
    try:
        body = r.json()
    except ValueError:
        body = None
    return answer_of(index, prompt_index, sent - t0, time.monotonic() - sent, r.status_code, body, r.text)

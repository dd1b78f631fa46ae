"""Request validation at the engine's edge: what can never be served is refused with a message naming the field."""

from __future__ import annotations

import torch

from dhisparse.errors import InvalidRequestError
from dhisparse.sampling import SamplingParams


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab: int, max_model_len: int,
                     max_new_tokens_limit: int) -> None:
    """Raise :class:`InvalidRequestError` if a request can never be served by an engine of these limits (the KV
    store's own limit, ``KVStore.never_admissible``, is checked by the engine)."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params must be a SamplingParams")
    if len(prompt_token_ids) == 0:
        raise InvalidRequestError("the prompt is empty: at least one token is required")
    ids = torch.as_tensor(prompt_token_ids)
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise InvalidRequestError("prompt token ids must be integers")
    if bool(((ids < 0) | (ids >= vocab)).any()):
        bad = int(ids[(ids < 0) | (ids >= vocab)][0])
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {len(prompt_token_ids)} tokens; the engine's maximum is {max_model_len - 1}")
    if params.max_tokens > max_new_tokens_limit:
        raise InvalidRequestError(
            f"max_tokens {params.max_tokens} exceeds the engine limit of {max_new_tokens_limit}")
    if len(prompt_token_ids) + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"engine's max_model_len ({max_model_len})")
    bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if bad_stop:
        raise InvalidRequestError(f"stop token id {bad_stop[0]} is outside the vocabulary [0, {vocab})")
    bad_ids = [t for t in params.token_ids_used() if not 0 <= t < vocab]
    if bad_ids:
        raise InvalidRequestError(f"token id {bad_ids[0]} in bad_words / logit_bias is outside the vocabulary "
                                  f"[0, {vocab})")
